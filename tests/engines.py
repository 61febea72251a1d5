"""Engines shared by the tests: reference outputs from engines without the connector, computed
once per session.

A `vllm serve` start costs about twenty seconds here (a TP=2 one more), and most test files
compared their engines with one of their own without the connector. `References` keeps one
reference engine per model and TP size while it is in use, and caches every output by model,
TP size, prompt and max_tokens: a prompt asked for twice in a session is computed once, and a
file that needs a model's references after another one did starts nothing. Reference engines
run float32 (the default dtype), so their `Completion`s compare exactly.
"""

from __future__ import annotations

from collections import OrderedDict

from devkit.vllm_server import Completion, VllmServer

# TP=2 on a 2-core host: one core per rank (see tests/e2e/test_cross_tp.py).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
TP_START_TIMEOUT_S = 600  # two ranks' processes start slowly on a shared 2-core host


def tp_args(tp: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(tp)) if tp > 1 else ()


def tp_env(tp: int) -> dict[str, str]:
    return dict(TP2_ENV) if tp > 1 else {}


class References:
    """Greedy outputs of engines without the connector, cached for the session.

    At most `max_ranks` engine ranks stay live (a TP=2 engine counts two); asking for another
    engine stops the least recently used first. `release(model)` stops a model's engines when
    a test knows it needs no more of them (the cache stays).
    """

    def __init__(self, max_ranks: int = 2) -> None:
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

    def _engine(self, model: str, tp: int) -> VllmServer:
        key = (model, tp)
        if key in self._live:
            self._live.move_to_end(key)
            return self._live[key]
        while self._live and sum(t for _, t in self._live) + tp > self.max_ranks:
            self._live.popitem(last=False)[1].stop()
        server = VllmServer(model, env=tp_env(tp), extra_args=tp_args(tp))
        self._live[key] = server.start(timeout=TP_START_TIMEOUT_S if tp > 1 else 240.0)
        return server

    def release(self, model: str) -> None:
        for key in [k for k in self._live if k[0] == model]:
            self._live.pop(key).stop()

    def close(self) -> None:
        while self._live:
            self._live.popitem()[1].stop()
