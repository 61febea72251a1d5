"""Worker side (each TP rank): moves KV blocks between this rank's cache and the store
(`worker`), on a pool of job threads with deadlines (`recv_pool`, sized by `autotune`), through
the rank's memory regions (`kv_regions`) and staging buffers (`staging`); request lifetimes
(`ledger`) and the guard that keeps failed in-step loads out of the store (`save_guard`)."""
