"""Engine level: time to first token of a prompt whose prefix is in the store, against the same
prompt recomputed, through a real `vllm serve` with the connector.

Model: a locally made Llama (`devkit.tiny_model`, default 8 layers, hidden 1024, 4 heads ->
head size 256, which the CPU attention backend supports; 2 KV heads), large enough that
prefill costs real time on CPU. Per engine (one per receive-thread count, each with its own
cache_prefix so they cannot hit each other's blocks):

1. warm-up: an unrelated prompt, then the same prompt again as a store hit (so connection
   setup to the store node is not in the first timed hit);
2. for each test prompt: POST /reset_prefix_cache, then a streamed completion: a store miss,
   so the whole prompt is prefilled (and its blocks are saved to the store): **recompute**;
3. wait for the saves to land; for each test prompt again: reset the local prefix cache, then
   the same streamed completion: every full block but the last comes from the store:
   **store hit**.

TTFT = time from sending the request to the first streamed token. The engines run bfloat16,
as served (`SERVING_DTYPE`): whether the greedy tokens of the two passes agree is recorded
(`outputs_match`), not asserted, since a bfloat16 near-tie may flip on CPUs with AMX-BF16;
the tests assert exact outputs in float32 only.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from devkit.local_cluster import HOST
from devkit.vllm_server import (
    BLOCK_SIZE,
    SERVING_DTYPE,
    VllmServer,
    connector_kv_config,
    metric_sum,
)

SAVE_SETTLE_S = 3.0


def stream_ttft(server: VllmServer, prompt: list[int], max_tokens: int = 2
                ) -> tuple[float, list[str]]:
    """Seconds to the first streamed token of a greedy completion, and the streamed texts."""
    body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "stream": True, "ignore_eos": True})
    conn = http.client.HTTPConnection(HOST, server.port, timeout=300)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"completion failed: {resp.status} {resp.read()[:300]!r}")
        first, texts = 0.0, []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            if not first:
                first = time.perf_counter() - t0
            texts.append(choice.get("text", ""))
        return first, texts
    finally:
        conn.close()


def make_prompts(n: int, tokens: int, seed: int, vocab: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(tokens)] for _ in range(n)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ttft_for_threads(model: str, extra: dict[str, Any], threads: int, prompts: list[list[int]],
                     log_dir: Path) -> dict[str, Any]:
    server = VllmServer(model, connector_kv_config(
        {**extra, "load_threads": threads, "cache_prefix": f"ttft-t{threads}"}),
        log_path=str(log_dir / f"vllm-ttft-t{threads}.log"), dtype=SERVING_DTYPE)
    server.start(timeout=400)
    try:
        # Warm-up: compile/allocate, then the same prompt again as a store hit, so the first
        # timed hit does not pay the load path's connection setup to the store node.
        warm = make_prompts(1, 4 * BLOCK_SIZE + 1, seed=999)[0]
        stream_ttft(server, warm)
        time.sleep(SAVE_SETTLE_S)
        server.reset_prefix_cache()
        stream_ttft(server, warm)
        recompute, hit, match = [], [], []
        first_tokens = []
        for p in prompts:
            server.reset_prefix_cache()
            t, texts = stream_ttft(server, p)
            recompute.append(t)
            first_tokens.append(texts)
        time.sleep(SAVE_SETTLE_S)  # let the save thread write the last prompt's blocks
        for p, ref in zip(prompts, first_tokens, strict=True):
            server.reset_prefix_cache()
            t, texts = stream_ttft(server, p)
            hit.append(t)
            match.append(texts == ref)
        metrics = server.metrics()
    finally:
        server.stop()
    hit_tokens = metric_sum(metrics, "vllm:prompt_tokens_cached_by_source_total", source="host")
    return {
        "threads": threads,
        "recompute_ttft_ms": [round(x * 1e3, 1) for x in recompute],
        "hit_ttft_ms": [round(x * 1e3, 1) for x in hit],
        "recompute_p50_ms": round(_median(recompute) * 1e3, 1),
        "hit_p50_ms": round(_median(hit) * 1e3, 1),
        "hit_over_recompute": round(_median(hit) / _median(recompute), 3),
        "outputs_match": all(match),
        "host_cached_prompt_tokens": hit_tokens,
    }


def engine_ttft(master_extra: dict[str, Any], model_dir: Path, layers: int, hidden: int,
                threads: list[int], n_prompts: int, prompt_tokens: int, log_dir: Path
                ) -> dict[str, Any]:
    from devkit.tiny_model import make_tiny_llama

    model = str(make_tiny_llama(model_dir, layers=layers, hidden=hidden))
    prompts = make_prompts(n_prompts, prompt_tokens, seed=7)
    kv_block = layers * 2 * BLOCK_SIZE * 2 * (hidden // 4) * 2  # 2 KV heads, bf16, K+V
    results = [ttft_for_threads(model, master_extra, t, prompts, log_dir) for t in threads]
    return {
        "model": {"layers": layers, "hidden": hidden, "heads": 4, "kv_heads": 2,
                  "head_size": hidden // 4, "dtype": SERVING_DTYPE, "block_tokens": BLOCK_SIZE,
                  "kv_bytes_per_block": kv_block},
        "prompt_tokens": prompt_tokens, "prompts": n_prompts,
        "hit_blocks_per_prompt": (prompt_tokens - 1) // BLOCK_SIZE,
        "by_threads": results,
    }
