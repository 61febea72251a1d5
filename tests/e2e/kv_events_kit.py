"""A router's view of a vLLM KV event stream, for the e2e tests: a ZMQ subscriber that binds
(vLLM's publisher connects to a `tcp://host:port` endpoint) and decodes every batch with vLLM's
own `KVEventBatch`, keeping per topic what a router following the store's events would hold."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from devkit.local_cluster import HOST, free_port
from devkit.vllm_server import BLOCK_SIZE, VllmServer


@dataclass
class Topic:
    """What one engine announced, as a router following it would keep it: by KV cache group
    and hash (the groups of a hybrid model announce the same block hash each). vLLM's
    `AllBlocksCleared` (its prefix cache reset) empties it, as Dynamo and llm-d empty every
    tier of that engine; `clears` holds the index in `stored` at which each came. A
    `BlockStored` of several blocks (a run, each the child of the one before) is kept as one
    single-block `BlockStored` per block, as a router indexes them, and a `BlockRemoved` of
    several blocks (the engine withdraws a sweep's or a trim's blocks in one) likewise;
    `events` counts the `BlockStored` events as they came."""

    stored: list[BlockStored] = field(default_factory=list)
    removed: list[BlockRemoved] = field(default_factory=list)
    live: set = field(default_factory=set)  # (group_idx, block hash) announced and not removed
    max_live: int = 0
    violations: list[str] = field(default_factory=list)
    other_media: Counter = field(default_factory=Counter)
    clears: list[int] = field(default_factory=list)
    events: int = 0  # BlockStored events of this medium, as published

    def before_clear(self) -> list[BlockStored]:
        """The BlockStored events before the first AllBlocksCleared."""
        return self.stored[:self.clears[0]] if self.clears else list(self.stored)


class Subscriber:
    """Binds a SUB socket and decodes every batch with vLLM's schema on its own thread."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://{HOST}:{self.port}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(self.endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._lock = threading.Lock()
        self.topics: dict[str, Topic] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            topic, _seq, payload = self._sock.recv_multipart()
            batch = self._decoder.decode(payload)
            with self._lock:
                self._apply(self.topics.setdefault(topic.decode(), Topic()), batch)

    @staticmethod
    def _apply(t: Topic, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                t.clears.append(len(t.stored))
                t.live.clear()
                continue
            if getattr(ev, "medium", None) != "STORAGE":
                t.other_media[getattr(ev, "medium", type(ev).__name__)] += 1
                continue
            if isinstance(ev, BlockStored):
                t.events += 1
                t.stored += per_block(ev)
                for h in ev.block_hashes:
                    if (ev.group_idx, h) in t.live:
                        t.violations.append(f"BlockStored for {h} (group {ev.group_idx}) "
                                            "while it is live")
                    t.live.add((ev.group_idx, h))
            elif isinstance(ev, BlockRemoved):
                t.removed += [msgspec.structs.replace(ev, block_hashes=[h])
                              for h in ev.block_hashes]
                for h in ev.block_hashes:
                    if (ev.group_idx, h) not in t.live:
                        t.violations.append(f"BlockRemoved for {h} (group {ev.group_idx}), "
                                            "not announced live")
                    t.live.discard((ev.group_idx, h))
            t.max_live = max(t.max_live, len(t.live))

    def engine_args(self, topic: str) -> tuple[str, ...]:
        """`vllm serve` arguments that publish an engine's KV events here, under `topic`."""
        return ("--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
            "topic": topic}))

    def view(self, topic: str) -> Topic:
        with self._lock:
            t = self.topics.get(topic, Topic())
            return Topic(list(t.stored), list(t.removed), set(t.live), t.max_live,
                         list(t.violations), Counter(t.other_media), list(t.clears), t.events)

    def wait(self, topic: str, until, what: str, poke: VllmServer | None,
             timeout: float = 90.0, interval: float = 0.25) -> Topic:
        """Until `until(view)`, poking the engine (with None, leaving it idle: what the
        connector found meanwhile must reach the router all the same)."""
        deadline = time.monotonic() + timeout
        while not until(t := self.view(topic)):
            assert time.monotonic() < deadline, (
                f"{what}: not seen in {timeout:.0f}s; stored {len(t.stored)}, removed "
                f"{len(t.removed)}, live {len(t.live)}, other media {dict(t.other_media)}")
            if poke is not None:
                poked(poke)
            time.sleep(interval)
        return t

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def per_block(ev: BlockStored) -> list[BlockStored]:
    """A run's blocks, each as a BlockStored of its own: its hash, its parent (the run's
    parent for the first, the block before it for the rest), its tokens and extra keys."""
    bs, parents = ev.block_size, [ev.parent_block_hash, *ev.block_hashes[:-1]]
    return [BlockStored(
        block_hashes=[h], parent_block_hash=parent, token_ids=ev.token_ids[k * bs:(k + 1) * bs],
        block_size=bs, lora_id=ev.lora_id, medium=ev.medium, lora_name=ev.lora_name,
        extra_keys=[ev.extra_keys[k]] if ev.extra_keys else None, group_idx=ev.group_idx,
        kv_cache_spec_kind=ev.kv_cache_spec_kind,
        kv_cache_spec_sliding_window=ev.kv_cache_spec_sliding_window, locality=ev.locality)
        for k, (h, parent) in enumerate(zip(ev.block_hashes, parents, strict=True))]


def poked(server: VllmServer) -> None:
    """A request too short to fill a block (nothing saved, nothing looked up): a few engine
    steps, in which vLLM takes the queued events and the stats of the previous ones."""
    server.complete([5, 6, 7], max_tokens=2)


def blocks_of(prompts: list[list[int]], bs: int = BLOCK_SIZE) -> list[tuple[int, ...]]:
    """The tokens of each full block of `prompts`, in blocks of `bs` tokens (what a
    `BlockStored` for it carries in `token_ids`)."""
    return [tuple(p[i * bs:(i + 1) * bs]) for p in prompts for i in range(len(p) // bs)]
