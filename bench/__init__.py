"""Benchmark and tuner for the pooled Mooncake receive path.

`python -m bench.run` measures the connector's real load path (MooncakeStoreWorker: start_load
-> receive pool -> staged batch_get_into or batch_get_into_multi_buffers) against a local
Mooncake master and store node behind a delay proxy, next to vLLM's in-tree receive pool and a
single-thread reference get. `python -m bench.serve` drives whole `vllm serve` engines with
`vllm bench serve`. `python -m bench.tune` sweeps thread counts against a user's own store and
recommends one. `python -m bench.claims` renders the numbers the README and docs quote.
"""
