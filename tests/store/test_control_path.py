"""bench/control_path.py at a small size against a real master: every step of ours runs as
the engine would run it (the lookup hits every stored block, one load plan and one save plan
cover the prompt, with KV events every block is announced once on each path, and a sweep
round finds every live block stored: the bench asserts each), the master's CPU is read over
the steps that ask it, and the in-tree side addresses the same blocks."""

from __future__ import annotations

import pytest

from bench import control_path


def test_the_bench_times_every_step_of_both_connectors():
    out = control_path.run(rounds=1, tokens=(256, 512), layers=4)
    assert [r["blocks"] for r in out["sizes"]] == [16, 32]
    for row in out["sizes"]:
        steps = {"lookup", "plan", "load_prep", "save_plan", "save_prep"}
        events = {"events_load", "events_save"}
        # The sweep round (per kv_events_sweep_s, not per request) is in neither total; the
        # bench asserts it asked the master and found every live block. Nor is a load into a
        # full live set (a state: the bench asserts the hit's blocks replaced the live ones).
        assert set(row["ours"]) == steps | events | {"load_prep_first", "events_sweep",
                                                     "events_load_full"}
        assert set(row["in_tree"]) == {"keys", "prepare_values"}
        assert set(row["store"]) == {"exist_call", "exist_absent"}
        assert row["ours"]["lookup"]["wall_ms"] > 0  # a master round trip at least
        assert row["store"]["exist_call"]["wall_ms"] > 0
        assert row["store"]["exist_absent"]["wall_ms"] > 0
        # The master's CPU over each step that asks it (it answered, so it worked), and no other.
        asking = {"lookup", "events_sweep"}
        assert all(row["ours"][s]["master_cpu_ms"] > 0 for s in asking)
        assert all("master_cpu_ms" not in v for s, v in row["ours"].items() if s not in asking)
        assert all(row["store"][s]["master_cpu_ms"] > 0 for s in row["store"])
        # End to end: an engine that has run a while (the lists kept), the first use apart.
        assert row["ours_end_to_end_ms"] == pytest.approx(
            sum(row["ours"][s]["wall_ms"] for s in steps), abs=2e-3)
        assert row["ours_with_kv_events_ms"] == pytest.approx(
            sum(row["ours"][s]["wall_ms"] for s in steps | events), abs=2e-3)
        assert row["ours_comparable_ms"] == row["ours"]["load_prep_first"]["wall_ms"]
