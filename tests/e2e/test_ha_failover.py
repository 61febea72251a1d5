"""The cache survives a Mooncake master failover: an HA group (etcd, two masters with the oplog,
a store node) behind a real `vllm serve`. Killing the leader during a burst of store hits fails
no request and changes no output, the burst does not wait out the promotion (jobs fail fast to
recompute), and afterwards the same prompts come from the store again, timed against the new
leader serving; killing the standby changes nothing; a promotion that cannot bind its RPC port
(the master exits 255) is served through by recompute, fires the no-leader alert expression in a
real Prometheus, and is recovered by the dev kit's supervisor restarting the master. One HA
group and one engine serve the whole module.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from connector.config import CLUSTER_ID_ENV, ConfigError, load_config
from connector.store.client import StoreUnavailable, check_reachable
from devkit import netns
from devkit.ha_cluster import Etcd, HaCluster, HaMaster
from devkit.ha_timeline import measure_failover, record
from devkit.local_cluster import _wait_segment_mounted
from devkit.vllm_server import VllmServer, connector_kv_config, metric_sum
from tests.conftest import ha_group, in_process_config
from tests.e2e.store_kit import random_prompts, wait_for_cache
from tests.engines import salted

pytestmark = pytest.mark.timed

P = "vllm:mooncake_pool_"
HITS = "vllm:external_prefix_cache_hits_total"
BASE = {"master_server_address": "etcd://10.0.0.1:2379,10.0.0.2:2379",
        "metadata_server": "etcd://10.0.0.1:2379,10.0.0.2:2379"}


# ---- configuration (no processes) ----------------------------------------------------------
@pytest.mark.parametrize("address", ["etcd://127.0.0.1:2379", "etcd://a:2379,b:2379",
                                     "etcd://a:2379;b:2379"])
def test_ha_master_group_is_a_supported_address(address):
    cfg = load_config({**BASE, "master_server_address": address, "cluster_id": "prod-1"}, {})
    assert cfg.store.ha and cfg.store.master_server_address == address
    assert cfg.store.cluster_id == "prod-1"
    # Without the key the client's own variable is used.
    assert load_config(BASE, {CLUSTER_ID_ENV: "from-env"}).store.cluster_id == "from-env"


@pytest.mark.parametrize("extra, environ, expected", [
    ({"master_server_address": "etcd://"}, {}, "master_server_address: expected etcd://host:port"),
    ({"master_server_address": "etcd://a:1,b"}, {}, "master_server_address: expected etcd://"),
    ({"master_server_address": "http://a:1"}, {}, "master_server_address: expected host:port "
                                                  "(one master, port 1..65535) or etcd://"),
    ({"metadata_server": "etcd://a"}, {}, "metadata_server: expected etcd://host:port"),
    ({"cluster_id": "a b"}, {}, "cluster_id: 'a b' is not a cluster id"),
    ({"cluster_id": "a"}, {CLUSTER_ID_ENV: "b"}, f"cluster_id: 'a' differs from {CLUSTER_ID_ENV}"),
    ({"cluster_id": "a", "master_server_address": "127.0.0.1:50051"}, {},
     "cluster_id: only used with an HA master group"),
])
def test_bad_ha_config_names_the_field(extra, environ, expected):
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, **extra}, environ)
    assert str(e.value).startswith("kv_connector_extra_config." + expected), str(e.value)
    assert "\n" not in str(e.value)


# ---- a real HA group -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ha_cluster(ha_etcd):
    cluster = ha_group(ha_etcd, "e2e", segment_size="256MB").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def ha_server(tiny_model, ha_cluster):
    # No MC_STORE_CLUSTER_ID in the engine's environment: the connector exports cluster_id.
    assert CLUSTER_ID_ENV not in os.environ
    server = VllmServer(tiny_model, connector_kv_config(ha_cluster.store_config(
        global_segment_size=0, local_buffer_size="64MB", cache_prefix="ha", load_threads=4,
        lookup_timeout_s=1.0))).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ha_truth(ha_server, prompts) -> list:
    """The prompts computed from scratch on the HA engine (salted: tests/engines.py)."""
    return salted(ha_server, prompts)


def test_wrong_cluster_id_fails_fast_naming_it(ha_cluster, monkeypatch):
    monkeypatch.delenv(CLUSTER_ID_ENV, raising=False)
    cfg = load_config(ha_cluster.store_config(cluster_id="not-this-one"), {})
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as e:
        check_reachable(cfg.store, timeout=1.0)
    assert time.monotonic() - t0 < 5
    assert "cluster id 'not-this-one'" in str(e.value) and "cluster_id" in str(e.value)


def test_dashboard_ha_families_exist_on_live_masters(ha_cluster):
    """Every master family the HA row and alerts use, on both the leader and the standby."""
    from dashboards.promql import MASTER_HA

    for m in (ha_cluster.leader(), ha_cluster.standby()):
        names = {line.split()[0].split("{")[0] for line in m.metrics_text().splitlines()
                 if line and not line.startswith("#")}
        assert set(MASTER_HA) <= names, sorted(set(MASTER_HA) - names)
    assert "ha_standby_state 3" in ha_cluster.standby().metrics_text()
    assert "ha_standby_state 0" in ha_cluster.leader().metrics_text()


def test_prometheus_scrapes_both_masters(ha_cluster):
    """A real Prometheus scraping both masters: the HA row reads one leader and one following
    standby, every HA panel target returns data, and the HA alerts are quiet."""
    import yaml

    from dashboards.generate import master_ha_row
    from dashboards.local_prometheus import LocalPrometheus
    from dashboards.promql import substitute

    targets = [f"{m.host}:{m.metrics_port}" for m in ha_cluster.masters]
    with LocalPrometheus({"mooncake-master": targets}) as prom:
        prom.wait_for_targets()
        time.sleep(4)  # a few scrapes, for the rate and deriv windows
        leader, standby = (prom.query(f"count(ha_standby_state == {s})") for s in (0, 3))
        assert [r["value"][1] for r in leader + standby] == ["1", "1"]
        for panel in master_ha_row().panels:
            for expr, legend in panel.targets:
                if "mooncake_pool" not in expr:  # engine series: tests above, with an engine
                    assert prom.query(substitute(expr, "5s")), f"{panel.title}: {legend}"
        root = Path(__file__).resolve().parents[2]
        groups = yaml.safe_load((root / "dashboards" / "alerts.yaml").read_text())["groups"]
        for rule in next(g for g in groups if g["name"] == "mooncake-master-ha")["rules"]:
            assert prom.query(rule["expr"]) == [], rule["alert"]


def test_failover_timeline_at_the_client(ha_cluster, ha_etcd, monkeypatch):
    """The breaker opens on the first -900, closes once the new leader serves, and every
    object stored before the kill is readable, byte for byte, afterwards."""
    monkeypatch.setenv(CLUSTER_ID_ENV, ha_cluster.cluster_id)  # restored for the engine
    t = measure_failover(ha_cluster, store_config=in_process_config(ha_cluster, ha_etcd))
    print("failover timeline:", t)
    assert t["new_leader"] and t["objects_readable_after"] == t["objects"]
    assert t["objects_identical_after"]
    # The probe spends no more than one blocked call (~4.3 s) after the leader serves.
    assert t["breaker_closed_s"] - t["new_leader_serving_s"] < 6.0, t
    assert t["segment_remounted_s"] >= t["new_leader_serving_s"] > t["new_leader_in_etcd_s"]
    assert t["connector_failovers"] == 1 and t["connector_down_s"] >= t["new_leader_in_etcd_s"]


def store_hits(server: VllmServer, work: list[list[int]]) -> tuple[float, float, list]:
    """Serve `work` one by one from the store (local prefix cache dropped first); returns
    (prompt tokens hit in the store, blocks newly saved, outputs)."""
    server.reset_prefix_cache()
    before = server.metrics()
    outputs = [server.complete(p) for p in work]
    time.sleep(1.0)  # saves drain and the last stats interval reaches /metrics
    after = server.metrics()
    return (metric_sum(after, HITS) - metric_sum(before, HITS),
            metric_sum(after, P + "save_keys_total") - metric_sum(before, P + "save_keys_total"),
            outputs)


def staggered_burst(server: VllmServer, work: list[list[int]], fault, at: int = 3,
                    gap: float = 0.04) -> tuple[list, float, float]:
    """Send `work` concurrently, one request every `gap` s; request `at` runs `fault()` just
    before it is sent, so requests are in flight on both sides of the fault. Returns (outputs,
    seconds from the fault to the last response, seconds from the first request to the
    fault)."""
    marks: dict[str, float] = {}

    def send(i: int) -> list[int]:
        time.sleep(i * gap)
        if i == at:
            fault()
            marks["fault"] = time.monotonic()
        return server.complete(work[i])

    with ThreadPoolExecutor(len(work)) as pool:
        marks["start"] = time.monotonic()
        outputs = list(pool.map(send, range(len(work))))
    return outputs, time.monotonic() - marks["fault"], marks["fault"] - marks["start"]


def serving_watch(cluster: HaCluster, old: HaMaster, t0: float) -> Callable[[], float]:
    """Starts watching for a master other than `old` to serve; the call returned waits for
    the watch and gives the seconds after t0 at which it saw one serve."""
    out: dict[str, float] = {}

    def watch() -> None:
        cluster.wait_serving(120, exclude=old)
        out["serving_s"] = time.monotonic() - t0

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def serving_s() -> float:
        thread.join(130)
        return round(out["serving_s"], 2)

    return serving_s


def first_store_hit(server: VllmServer, prompt: list[int], reference: list[int], t0: float,
                    timeout: float = 90.0) -> tuple[float, float]:
    """Send `prompt` again and again, the local prefix cache dropped each time, until one of
    its loads succeeds (a store hit); every output must equal `reference`. Returns (seconds
    after t0 at which that request was sent, and at which the last one without a hit was
    sent): the hits came back between the two."""
    ok = P + "load_jobs_total"
    sent = last_miss = 0.0
    while True:
        before = metric_sum(server.metrics(), ok, status="ok")
        server.reset_prefix_cache()
        sent = time.monotonic() - t0
        assert server.complete(prompt) == reference
        deadline = time.monotonic() + 0.3  # its load event is on /metrics within a few steps
        while time.monotonic() < deadline:
            if metric_sum(server.metrics(), ok, status="ok") > before:
                return round(sent, 2), round(last_miss, 2)
            time.sleep(0.05)
        assert sent < timeout, "store hits never came back"
        last_miss = sent


def hits_after_failover(cluster: HaCluster, server: VllmServer, old: HaMaster,
                        work: list[list[int]], hits_before: float) -> tuple[HaMaster, tuple]:
    """Wait for the new leader and the store node's remount on it, then `store_hits(work)`,
    retried through the -703/-200 window right after the promotion until it reaches 90 % of
    `hits_before` (or 30 s pass). Returns (new leader, store_hits result)."""
    new = cluster.wait_serving(60, exclude=old)
    t = time.monotonic()
    _wait_segment_mounted(cluster, 60)
    print(f"store node remounted {time.monotonic() - t:.1f}s after the new leader served")
    deadline = time.monotonic() + 30
    while True:
        result = store_hits(server, work)
        if result[0] >= 0.9 * hits_before or time.monotonic() > deadline:
            return new, result
        time.sleep(1.0)


def test_leader_killed_during_store_hit_burst(ha_server, ha_cluster, prompts, ha_truth):
    server = ha_server
    assert [server.complete(p) for p in prompts] == ha_truth  # computed and saved
    time.sleep(1.5)  # saves drain, and the standby applies them (oplog poll: 1 s)
    hits_before, _, outputs = store_hits(server, prompts)
    # The first prompt of each shared prefix loads it; the others load only their own block.
    assert outputs == ha_truth and hits_before >= 2 * (352 + 2 * 32)
    m0 = server.metrics()
    server.reset_prefix_cache()
    leader = ha_cluster.leader()
    work = prompts * 2  # 12 store-hit requests
    marks: dict = {}

    def kill() -> None:
        leader.kill()
        marks["kill"] = time.monotonic()
        marks["watch"] = serving_watch(ha_cluster, leader, marks["kill"])

    outputs, after_kill, before_kill = staggered_burst(server, work, kill)
    print(f"burst: kill {before_kill:.2f}s after the first request, last response "
          f"{after_kill:.2f}s after the kill")
    assert outputs == ha_truth * 2, "a request hit by the failover changed its output"
    assert after_kill > 0, "the burst finished before the kill: nothing was tested"
    assert after_kill < 5.0, f"the burst waited {after_kill:.1f}s for the failover"
    hit_s, miss_s = first_store_hit(server, prompts[0], ha_truth[0], marks["kill"])
    serving_s = marks["watch"]()
    # No order between hit_s and serving_s is asserted: the request's lookup and load come
    # after it is sent, and the watcher sees the leader serve up to a poll late. The burst's
    # -900 failures and the failover counted below show that the kill landed.
    print(f"new leader served {serving_s}s after the kill; store hits back at {hit_s}s "
          f"(a request sent at {miss_s}s had none)")

    new, (hits_after, saved, outputs) = hits_after_failover(ha_cluster, server, leader,
                                                           prompts, hits_before)
    assert outputs == ha_truth
    print(f"store hits: {hits_after:.0f} prompt tokens after the failover, "
          f"{hits_before:.0f} before")
    assert hits_after >= 0.9 * hits_before, "the cache did not survive the failover"
    assert saved == 0, "blocks were saved again: the hits did not come from what survived"
    m1 = server.metrics()
    assert metric_sum(m1, P + "master_failovers_total") - \
        metric_sum(m0, P + "master_failovers_total") == 1
    assert metric_sum(m1, P + "master_down_seconds_total") > \
        metric_sum(m0, P + "master_down_seconds_total")
    assert metric_sum(m1, P + "failures_total", code="-900") > \
        metric_sum(m0, P + "failures_total", code="-900")
    wait_for_cache(server, 1300)  # new prefixes are saved and hit
    record("serve_leader_kill", {
        "what": "vllm serve + connector, 12 store-hit requests, HA leader SIGKILLed mid-burst",
        "requests": len(work), "failed_requests": 0, "outputs_identical": True,
        "burst_done_after_kill_s": round(after_kill, 2),
        "store_hit_tokens_before": hits_before, "store_hit_tokens_after": hits_after,
        "cache_survival": round(hits_after / hits_before, 3),
        "new_leader_serving_s": serving_s, "store_hits_back_s": hit_s,
        "store_hits_after_serving_s": round(hit_s - serving_s, 2),
        "last_request_without_hit_s": miss_s, "loadavg_1m": round(os.getloadavg()[0], 2),
        "master_down_s": round(metric_sum(m1, P + "master_down_seconds_total")
                               - metric_sum(m0, P + "master_down_seconds_total"), 2)})
    ha_cluster.restart(leader)  # back to two masters, the old leader now the standby
    assert ha_cluster.leader() is new


def test_failed_promotion_serves_by_recompute_and_recovers(ha_server, ha_cluster, prompts,
                                                          ha_truth):
    """The standby's RPC port is taken when the leader dies: its promotion fails and it
    exits 255, and nothing serves. Requests are served meanwhile by recompute (same outputs,
    no request waits for the master), a real Prometheus scraping both masters shows the
    MooncakeMasterNoServingLeader expression true, and once the port is free the supervisor's
    restart serves again and store hits come back."""
    import yaml

    from dashboards.local_prometheus import LocalPrometheus

    server, cluster = ha_server, ha_cluster
    root = Path(__file__).resolve().parents[2]
    rules = yaml.safe_load((root / "dashboards" / "alerts.yaml").read_text())["groups"]
    no_leader = next(r["expr"] for g in rules for r in g["rules"]
                     if r["alert"] == "MooncakeMasterNoServingLeader")
    leader, standby = cluster.leader(), cluster.standby()
    # Exits the supervisor saw before this test: an earlier test's kill of whichever master
    # led then (the roles after earlier failovers depend on their timing).
    earlier = len(standby.exits)
    targets = [f"{m.host}:{m.metrics_port}" for m in cluster.masters]
    with LocalPrometheus({"mooncake-master": targets}) as prom, socket.socket() as taken:
        prom.wait_for_targets()
        assert prom.query(no_leader) == []
        taken.bind((standby.host, standby.rpc_port))  # as an outgoing connection would
        leader.kill()
        t_kill = time.monotonic()
        watch = serving_watch(cluster, leader, t_kill)
        slowest, rounds = 0.0, 0
        loaded = metric_sum(server.metrics(), P + "load_jobs_total", status="ok")
        while len(standby.exits) == earlier or not prom.query(no_leader):
            assert time.monotonic() - t_kill < 120, "no failed promotion, or no alert"
            server.reset_prefix_cache()
            t = time.monotonic()
            assert [server.complete(p) for p in prompts] == ha_truth
            slowest = max(slowest, (time.monotonic() - t) / len(prompts))
            rounds += 1
        alert_s = round(time.monotonic() - t_kill, 2)
        # While the port is held no master can serve: the prompts, all in the store, were
        # recomputed, not loaded.
        assert rounds and metric_sum(server.metrics(), P + "load_jobs_total",
                                     status="ok") == loaded
    assert standby.exits[earlier] == 255 and "Failed to start master service" in standby.log()
    print(f"promotion failed, alert expression true {alert_s}s after the kill; slowest "
          f"request meanwhile {slowest:.2f}s")
    assert slowest < 5.0, "requests waited for the master"
    hit_s, miss_s = first_store_hit(server, prompts[0], ha_truth[0], t_kill)
    serving_s = watch()  # no order with hit_s: see the leader-kill test
    assert cluster.leader() is standby
    print(f"restarted master served {serving_s}s after the kill, store hits at {hit_s}s")
    record("serve_failed_promotion", {
        "what": "vllm serve + connector; the standby's RPC port held when the leader is "
                "SIGKILLed: its promotion fails (exit 255) until the port is free and the dev "
                "kit's supervisor restarts it (the chart: restartPolicy); seconds after the kill",
        "failed_requests": 0, "outputs_identical": True,
        "exit_statuses": standby.exits[earlier:],
        "slowest_request_during_outage_s": round(slowest, 2),
        "alert_expression_true_s": alert_s, "new_leader_serving_s": serving_s,
        "store_hits_back_s": hit_s, "last_request_without_hit_s": miss_s,
        "loadavg_1m": round(os.getloadavg()[0], 2)})
    cluster.restart(leader)  # back to two masters, the old leader now the standby


def test_standby_killed_serving_unaffected(ha_server, ha_cluster):
    server = ha_server
    work = random_prompts(1400)
    reference = [server.complete(p) for p in work]
    time.sleep(1.0)
    server.reset_prefix_cache()
    m0 = server.metrics()
    standby = ha_cluster.standby()
    outputs, after_kill, _ = staggered_burst(server, work, standby.kill)
    time.sleep(1.0)
    m1 = server.metrics()
    assert outputs == reference
    assert metric_sum(m1, HITS) - metric_sum(m0, HITS) > 0.9 * sum(len(p) - 7 for p in work)
    assert metric_sum(m1, P + "failures_total") == metric_sum(m0, P + "failures_total")
    assert metric_sum(m1, P + "master_down_seconds_total") == \
        metric_sum(m0, P + "master_down_seconds_total")
    ha_cluster.restart(standby)


# ---- a partitioned leader, in private network namespaces -----------------------------------
@pytest.fixture(scope="module")
def partition_net():
    why = netns.available()
    if why:  # the README quotes this test's figure: it must run, not skip
        pytest.fail(f"{why}; the partition test needs root (CAP_NET_ADMIN) and iproute2 "
                    "(scripts/setup.sh installs it)")
    net = netns.Netns(["core", "m1", "m2"]).create()
    yield net
    net.remove()


@pytest.fixture(scope="module")
def partition_cluster(partition_net):
    """The HA group with each master in its own namespace, etcd and the store node in "core",
    all joined by a bridge; the engine runs in "core" too."""
    net = partition_net
    etcd = Etcd(host=net.address("core"))
    masters = [HaMaster(host=net.address(m), wrap=("ip", "netns", "exec", net.ns(m)),
                        etcd_endpoints=etcd.endpoint, cluster_id="partition")
               for m in ("m1", "m2")]
    cluster = HaCluster(cluster_id="partition", etcd=etcd, masters=masters,
                        segment_size="256MB")
    net.run("core", cluster.start)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def partition_server(tiny_model, partition_net, partition_cluster):
    server = VllmServer(tiny_model, connector_kv_config(partition_cluster.store_config(
        global_segment_size=0, local_buffer_size="64MB", cache_prefix="partition",
        load_threads=4, lookup_timeout_s=1.0, store_timeout_s=2.0)))
    partition_net.run("core", server.start)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def partition_truth(partition_net, partition_server, prompts) -> list:
    """The prompts computed from scratch on the partition test's engine (salted)."""
    return partition_net.run("core", lambda: salted(partition_server, prompts))


def test_leader_partitioned_during_store_hit_burst(partition_net, partition_cluster,
                                                   partition_server, prompts,
                                                   partition_truth):
    """The leader stays alive but its packets vanish (no RST): a store call in flight to it
    waits for its RPC timeout (store_timeout_s, exported as MC_RPC_TIMEOUT_MS; Mooncake's own
    default is 30 s), later jobs fail fast, and the cache is back once the standby serves."""
    net, cluster, server = partition_net, partition_cluster, partition_server

    def body() -> None:
        assert [server.complete(p) for p in prompts] == partition_truth
        time.sleep(1.5)
        hits_before, _, _ = store_hits(server, prompts)
        server.reset_prefix_cache()
        old = cluster.leader()
        member = "m1" if old is cluster.masters[0] else "m2"
        outputs, after, _ = staggered_burst(server, prompts * 2,
                                            lambda: net.partition(member))
        print(f"burst: last response {after:.2f}s after the partition")
        assert outputs == partition_truth * 2
        assert 0 < after < 2.0 + 5.0, f"the burst waited {after:.1f}s for the partition"
        _, (hits_after, saved, outputs) = hits_after_failover(cluster, server, old, prompts,
                                                              hits_before)
        assert outputs == partition_truth
        assert hits_after >= 0.9 * hits_before and saved == 0
        record("serve_leader_partition", {
            "what": "as serve_leader_kill, but the leader's link is cut (network namespaces); "
                    "store_timeout_s=2", "burst_done_after_partition_s": round(after, 2),
            "cache_survival": round(hits_after / hits_before, 3)})
        net.heal(member)  # the old leader rejoins as a standby
        cluster.wait_following(old, 60)

    net.run("core", body)
