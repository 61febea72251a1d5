"""Shared, session-scoped real components: a Mooncake master, a standalone store node (so stored
blocks outlive the engines that wrote them), the tiny model, the prompts' outputs computed from
scratch (`reference_outputs`: salted, tests/engines.py), and a 4-thread engine whose prefixes
come from the store.

vLLM engines take seconds to start here even forked (devkit/vllm_zygote.py), so each is started
once per session and shared where the tests need the same configuration.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import tempfile
import time

import numpy as np
import pytest

from devkit import vllm_server
from devkit.local_cluster import HOST, MooncakeMaster, StoreNode
from devkit.otlp_collector import RotelCollector
from devkit.tiny_model import make_tiny_llama
from devkit.vllm_server import BLOCK_SIZE, REPO, VllmServer, connector_kv_config
from tests import suite_times
from tests.engines import References, salted

vllm_server.IN_PROCESS_TP1 = True  # the tests' TP=1 engines start without a worker process
vllm_server.FORK_API_SERVERS = True  # their API servers fork from one that imported vLLM
# One OpenMP thread per engine process. A TP=1 engine's worker runs inside its EngineCore,
# where vLLM's CPU thread binding (VLLM_CPU_OMP_THREADS_BIND) does not apply, so torch took a
# thread per core: two such engines side by side (or one beside its store node and test)
# kept four spinning OpenMP threads on 2 cores, each engine then several times slower
# (docs/development.md). TP=2 ranks too (unbound: tests/engines.py). Set before
# the zygote starts: its children inherit it.
os.environ["OMP_NUM_THREADS"] = "1"
# Files that start engines: each declares how it may run (TIMING_MARKS), scripts/test.sh runs it so.
ENGINE_FILES = ("tests/e2e/", "tests/deploy/test_helm_smoke.py")
TIMING_MARKS = {
    "timed": "its assertions depend on time (deadlines, bounds, a tuner's rate), or it starts "
             "TP=2 engines, whose ranks spin on both cores: it runs serially, alone on the "
             "machine",
    "side_by_side": "its assertions do not depend on time: it runs beside another such file",
}
POOLED_SERVICE = "pooled-server"  # OTEL_SERVICE_NAME of `pooled_server`'s spans
PREFIX_TOKENS = 320  # 10 blocks of 32
SUFFIX_TOKENS = 48


def pytest_configure(config: pytest.Config) -> None:
    for name, what in TIMING_MARKS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """An engine test file without exactly one timing mark is a usage error naming it: a
    new file must say whether it may run beside another one. On a pytest-xdist worker (whose
    collection order the controller hands out; its own `--dist` reads "no" there) the files
    go longest first."""
    bad = sorted({item.nodeid.split("::", 1)[0] for item in items
                  if item.nodeid.startswith(ENGINE_FILES)
                  and len({m.name for m in item.iter_markers()} & set(TIMING_MARKS)) != 1})
    if bad:
        raise pytest.UsageError(
            f"{', '.join(bad)}: mark the file with exactly one of "
            f"pytestmark = pytest.mark.timed ({TIMING_MARKS['timed']}) or "
            f"pytest.mark.side_by_side ({TIMING_MARKS['side_by_side']})")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        longest_files_first(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the session's processes write to the temporary directory goes under the session's
    pytest base directory, which pytest prunes (it keeps the last three sessions'): engine and
    master logs, vLLM's IPC sockets and rendezvous files (a killed engine removes none), tool
    work directories. Then a session that will start engines starts its vLLM zygote, in the
    background, so its imports overlap the first test's set-up (devkit/vllm_zygote.py); it
    and the engines it forks inherit the directory."""
    scratch = session.config._tmp_path_factory.getbasetemp() / "tmp"  # the fixtures' base
    scratch.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)
    if any(item.nodeid.startswith(ENGINE_FILES) for item in session.items):
        vllm_server.prestart_zygote()


def recorded_seconds() -> dict[str, float]:
    """Each test file's seconds in the recorded run (docs/suite-times.json), or {} without
    one."""
    recorded: dict[str, float] = {}
    try:
        for part in json.loads(suite_times.OUT.read_text())["parts"].values():
            recorded.update(part["seconds_per_file"])
    except (OSError, ValueError, KeyError):
        return {}
    return recorded


def longest_files_first(items: list[pytest.Item]) -> None:
    """Files handed out a file at a time (`--dist loadfile --no-loadscope-reorder`: phases 1
    and 2b) go to the workers in this order: longest first by the recorded run (a file not in
    it first), so no worker is left with a long file after the others have finished."""
    recorded = recorded_seconds()
    if recorded:
        items.sort(key=lambda item: -recorded.get(item.nodeid.split("::", 1)[0], math.inf))


def make_prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts with long shared prefixes: two groups of three share a 320-token prefix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(PREFIX_TOKENS)] for _ in range(2)]
    return [prefixes[i % 2] + [rng.randrange(3, 1000) for _ in range(SUFFIX_TOKENS)]
            for i in range(n)]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


@pytest.fixture(scope="session")
def store_node(master):
    node = StoreNode(master, segment_size="512MB").start()
    yield node
    node.stop()


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts()


def engine_extra(master: MooncakeMaster, **kw) -> dict:
    """Connector config for an engine that keeps no bytes itself (the store node does)."""
    return master.store_config(global_segment_size=0, local_buffer_size="64MB", **kw)


@pytest.fixture(scope="session")
def references():
    """Engines without the connector (float32), their outputs cached for the session:
    `references.outputs(model, prompts, max_tokens=8, tp=1)`. Only for what is about such an
    engine; references for a store hit come from the engine under test (`salted`)."""
    refs = References()
    yield refs
    refs.close()


@pytest.fixture(scope="session")
def session_fill(tiny_model, master, store_node, prompts) -> tuple[str, list]:
    """Engine A (1 receive thread) computes the prompts from scratch (salted: the ground
    truth), then serves them, saving their blocks, and exits: (its cache prefix, the truth)."""
    prefix = "e2e"
    server = VllmServer(tiny_model, connector_kv_config(
        engine_extra(master, cache_prefix=prefix, load_threads=1))).start()
    try:
        truth = salted(server, prompts)
        outputs = [server.complete(p) for p in prompts]
    finally:
        server.stop()
    assert outputs == truth
    return prefix, truth


@pytest.fixture(scope="session")
def filled_store(session_fill) -> str:
    """The cache prefix under which the session's store holds the prompts' blocks."""
    return session_fill[0]


@pytest.fixture(scope="session")
def reference_outputs(session_fill) -> list[list[int]]:
    """Greedy outputs of the prompts computed from scratch: the ground truth."""
    return session_fill[1]


@pytest.fixture(scope="module")
def sub():
    """A ZMQ subscriber to the engines' KV events, decoding them as a router would
    (tests/e2e/kv_events_kit.py)."""
    from tests.e2e.kv_events_kit import Subscriber

    s = Subscriber()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def otlp_collector():
    collector = RotelCollector().start()
    yield collector
    collector.stop()


@pytest.fixture(scope="session")
def pooled_server(tiny_model, master, filled_store, otlp_collector):
    """A fresh engine with 4 receive threads over the filled store; every load's master lookup
    is timed and every job is traced (OTEL_TRACES_SAMPLER=always_on) to a real OTLP collector.
    Its master RPCs take a 10 ms round trip (as across a datacenter), so a burst of loads
    really queues: on loopback a load takes about a millisecond and the queue drains within
    one engine step."""
    from bench.proxy import DelayProxy

    proxy = DelayProxy(master.address, rtt_ms=10.0).start()
    extra = engine_extra(master, cache_prefix=filled_store, load_threads=4,
                         master_lookup_sample_ratio=1.0)
    extra["master_server_address"] = proxy.address
    env = {**otlp_collector.otel_env(), "OTEL_TRACES_SAMPLER": "always_on",
           "OTEL_SERVICE_NAME": POOLED_SERVICE}
    server = VllmServer(tiny_model, connector_kv_config(extra), env=env).start()
    yield server
    server.stop()
    proxy.stop()


@pytest.fixture(scope="session")
def ha_etcd():
    """One etcd for every HA master group of the session, and a proxy in front of it whose
    address is the etcd endpoint of every HA client made in this process: Mooncake keeps one
    etcd client per process ("Etcd client already connected to A, while trying to connect to
    B"), so each such client must name the same endpoint. Groups on it are told apart by their
    cluster ids (`ha_group`); engines and store nodes, in their own processes, use etcd itself.
    The proxy can also answer garbage (`bench.proxy` modes)."""
    from bench.proxy import DelayProxy
    from devkit.ha_cluster import Etcd

    etcd = Etcd().start()
    proxy = DelayProxy(etcd.endpoint, rtt_ms=0.0).start()
    yield etcd, proxy
    proxy.stop()
    etcd.stop()


def ha_group(ha_etcd, name: str, **kw):
    """An HA master group (not started) on the session's etcd, under a cluster id of its own
    (an id reused on the same etcd would replay the oplog an earlier group left there)."""
    import uuid

    from devkit.ha_cluster import HaCluster

    return HaCluster(etcd=ha_etcd[0], cluster_id=f"{name}-{uuid.uuid4().hex[:8]}", **kw)


def in_process_config(cluster, ha_etcd, **overrides) -> dict:
    """`cluster.store_config()` for a client in this process: etcd through the session proxy."""
    address = f"etcd://{ha_etcd[1].address}"
    return cluster.store_config(master_server_address=address, metadata_server=address,
                                **overrides)


def plain_client(master: MooncakeMaster):
    """A plain Mooncake client of `master`'s store (close it when done)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup(HOST, master.metadata_server, 0, 64 * 2**20, "tcp", "",
                        master.address) == 0
    return client


@pytest.fixture(scope="session")
def store_client(master):
    """A plain Mooncake client, for tests that inspect or tamper with the store."""
    client = plain_client(master)
    yield client
    client.close()


def block_hashes(tokens: list[int]) -> list[bytes]:
    """vLLM's own chained block hashes (sha256, the default) for a plain token prompt."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu

    kcu.init_none_hash(sha256)
    out, parent = [], None
    for i in range(len(tokens) // BLOCK_SIZE):
        parent = kcu.hash_block_tokens(sha256, parent or kcu.NONE_HASH,
                                       tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        out.append(parent)
    return out


_JUNK = np.full(1 << 20, 0x5A, dtype=np.uint8)  # bigger than any block: a get returns -600


def layout_fingerprint(server: VllmServer) -> str:
    """The key-namespace fingerprint `server` reports on /metrics (layout_info)."""
    text = "\n".join(server.metrics())
    return re.search(r'mooncake_pool_layout_info\{[^}]*fingerprint="([0-9a-f]+)"',
                     text).group(1)


def store_keys(server: VllmServer, prefix: str, prompt: list[int], group: int = 0,
               shard: int = 0, shards: int = 1, fingerprint: str = "") -> list[str]:
    """The store keys `server` saves `prompt`'s full blocks under (KV cache group `group`, store
    shard `shard` of `shards`), with its layout fingerprint (asked of it unless given)."""
    from connector.store.keys import _slug

    fp = fingerprint or layout_fingerprint(server)
    return [f"{prefix}/{_slug(server.model)}/{fp}/g{group}s{shard}of{shards}/{h.hex()}"
            for h in block_hashes(prompt)]


def stored_block_keys(server: VllmServer, client, prefix: str, prompt: list[int],
                      group: int = 0, shard: int = 0, shards: int = 1) -> list[str]:
    """The store keys of `prompt`'s full blocks as `server` saved them in KV cache group
    `group` (a full-attention one), store shard `shard` of `shards` (store_tp_size), once all
    exist (the save thread writes after the response returns)."""
    keys = store_keys(server, prefix, prompt, group, shard, shards)
    deadline = time.monotonic() + 120  # the saves of a busy 2-core host
    while (exist := client.batch_is_exist(keys)) != [1] * len(keys):
        assert time.monotonic() < deadline, (
            f"the engine stored {sum(e == 1 for e in exist)} of {len(keys)} blocks in 120 s; "
            f"missing: {[k for k, e in zip(keys, exist, strict=True) if e != 1]}")
        time.sleep(0.1)
    return keys


def corrupt_stored_block(server: VllmServer, client, prefix: str, prompt: list[int],
                         index: int, group: int = 0, shard: int = 0, shards: int = 1) -> str:
    """Replace the stored object of one block of `prompt` (store shard `shard` of `shards`)
    with one of the wrong size, so the scheduler's lookup still hits but the load of the
    rank that reads that shard fails with -600."""
    key = stored_block_keys(server, client, prefix, prompt, group, shard, shards)[index]
    assert client.remove(key, True) == 0
    client.register_buffer(_JUNK.ctypes.data, _JUNK.nbytes)  # idempotent across calls
    assert client.batch_put_from([key], [_JUNK.ctypes.data], [_JUNK.nbytes]) == [0]
    return key


@pytest.fixture(scope="session")
def connector_site(tmp_path_factory) -> str:
    """The connector installed from its wheel into a directory of its own: its dist-info carries
    the `vllm.general_plugins` entry point, so engines with it on PYTHONPATH register the
    connector by name (see `by_name_env`)."""
    from devkit.wheel import install_wheel

    return str(install_wheel(tmp_path_factory.mktemp("wheel")))


def by_name_env(site: str) -> dict[str, str]:
    """Engine env in which vLLM registers the connector by name through the installed wheel's
    entry point, while the code itself runs from this checkout (first on the path)."""
    return {"PYTHONPATH": f"{REPO}:{site}"}
