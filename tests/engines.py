"""Reference outputs: what an engine computes from scratch, to compare a store hit against.

A `vllm serve` start costs about twenty seconds here (a TP=2 one more), so the tests take their
references from the engine under test: `salted` sends each prompt with a `cache_salt` of its
own (vLLM's per-request field), which changes every block hash of the request, so neither
vLLM's prefix cache nor the store has a block for it and the engine computes it all; `salted`
checks on /metrics that it did (no local and no store hit). That such an output is the output
of an engine without the connector is shown once per layout (GQA, hybrid, MLA, TP=2) by
`tests/e2e/test_cross_tp.py`, against `References`: engines without the connector, which only
that check and the tests about an engine without the connector start.

A salted request is still saved, under its salted hashes: a test that counts saves or events
takes its references where they cannot be counted (before its baseline, or after its checks).
All engines here run float32, so their `Completion`s compare exactly.
"""

from __future__ import annotations

import os
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from devkit.vllm_server import Completion, VllmServer, metric_sum, start_together

# TP=2 on a 2-core host: no thread binding. vLLM's binding ("0|1": one core per rank) pins
# every thread of a rank to its core, the receive threads and Mooncake's transfer threads
# beside the rank's main thread, which busy-waits on vLLM's step queue; unbound, the kernel
# runs them on whichever core is free. Each rank computes on one OpenMP thread either way
# (tests/conftest.py). See tests/e2e/test_cross_tp.py.
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
TP_START_TIMEOUT_S = 600  # two ranks' processes start slowly on a shared 2-core host
HIT_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")


def tp_args(tp: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(tp)) if tp > 1 else ()


def tp_env(tp: int) -> dict[str, str]:
    return dict(TP2_ENV) if tp > 1 else {}


def bound_threads(server: VllmServer) -> dict[str, list[int]]:
    """Threads of the engine's processes that may not run on every CPU this process may
    (name: CPUs), none where its ranks are unbound (TP2_ENV)."""
    host = sorted(os.sched_getaffinity(0))
    out = {}
    root = psutil.Process(server.proc.pid)
    for proc in [root, *root.children(recursive=True)]:
        for t in proc.threads():
            try:
                cpus = sorted(os.sched_getaffinity(t.id))
            except OSError:  # the thread ended meanwhile
                continue
            if cpus != host:
                out[f"{proc.pid}/{t.id} {proc.name()}"] = cpus
    return out


def salt() -> str:
    """A cache salt no other request has."""
    return f"ref-{uuid.uuid4().hex}"


@contextmanager
def from_scratch(server: VllmServer) -> Iterator[None]:
    """The requests sent to `server` inside take no cached token (vLLM's prefix cache, the
    store): AssertionError at the end if one did (then they are no reference)."""
    before = server.metrics()
    yield
    after = server.metrics()
    hits = {c: metric_sum(after, c) - metric_sum(before, c) for c in HIT_COUNTERS}
    assert not any(hits.values()), f"a salted reference took cached tokens: {hits}"


def salted(server: VllmServer, prompts: list[list[int]], max_tokens: int = 8
           ) -> list[Completion]:
    """Greedy outputs `server` computes from scratch, one prompt after another, each under a
    cache salt of its own (`from_scratch` checks it)."""
    with from_scratch(server):
        return [server.complete(p, max_tokens, cache_salt=salt()) for p in prompts]


class References:
    """Greedy outputs of engines without the connector, cached for the session.

    At most `max_ranks` engine ranks stay live (a TP=2 engine counts two: by default a model's
    TP=1 and TP=2 engines together); asking for another engine stops the least recently used
    first. `start(model, tps)` starts several at once; `release(model)` stops a model's engines
    when a test knows it needs no more of them (the cache stays).
    """

    def __init__(self, max_ranks: int = 3) -> None:
        self.max_ranks = max_ranks
        self._live: OrderedDict[tuple[str, int], VllmServer] = OrderedDict()
        self._cache: dict[tuple[str, int, tuple[int, ...], int], Completion] = {}
        self.computed = 0  # outputs computed (the rest came from the cache)

    def outputs(self, model: str, prompts: list[list[int]], max_tokens: int = 8, tp: int = 1
                ) -> list[Completion]:
        keys = [(model, tp, tuple(p), max_tokens) for p in prompts]
        missing = [k for k in dict.fromkeys(keys) if k not in self._cache]
        if missing:
            server = self._engine(model, tp)
            for k in missing:
                self._cache[k] = server.complete(list(k[2]), max_tokens)
                self.computed += 1
        return [Completion(list(self._cache[k]), self._cache[k].dtype) for k in keys]

    def start(self, model: str, tps: list[int]) -> None:
        """Start `model`'s engines of these TP sizes that are not live, together
        (`start_together`): the outputs asked for next wait for one start, not one per size."""
        tps = [tp for tp in dict.fromkeys(tps) if (model, tp) not in self._live]
        self._make_room(sum(tps))
        servers = [VllmServer(model, env=tp_env(tp), extra_args=tp_args(tp)) for tp in tps]
        start_together(servers, TP_START_TIMEOUT_S)
        self._live.update(((model, tp), s) for tp, s in zip(tps, servers, strict=True))

    def _engine(self, model: str, tp: int) -> VllmServer:
        if (model, tp) not in self._live:
            self.start(model, [tp])
        self._live.move_to_end((model, tp))
        return self._live[(model, tp)]

    def _make_room(self, ranks: int) -> None:
        """Stop the least recently used engines until `ranks` more fit in `max_ranks`."""
        while self._live and sum(t for _, t in self._live) + ranks > self.max_ranks:
            self._live.popitem(last=False)[1].stop()

    def release(self, model: str) -> None:
        for key in [k for k in self._live if k[0] == model]:
            self._live.pop(key).stop()

    def close(self) -> None:
        while self._live:
            self._live.popitem()[1].stop()
