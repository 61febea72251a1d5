"""Benchmark and tuner for the pooled Mooncake receive path.

`python -m bench.run` measures the connector's real load path (MooncakeStoreWorker: start_load
-> receive pool -> batch_get_into_multi_buffers) against a local Mooncake master and store node
behind a delay proxy, next to vLLM's in-tree receive pool and the raw store ceiling.
`python -m bench.tune` sweeps thread counts against a user's own store and recommends one.
"""
