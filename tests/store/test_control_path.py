"""bench/control_path.py at a small size against a real master: every step of ours runs as
the engine would run it (the lookup hits every stored block, one load plan and one save plan
cover the prompt: the bench asserts each), and the in-tree side addresses the same blocks."""

from __future__ import annotations

from bench import control_path


def test_the_bench_times_every_step_of_both_connectors():
    out = control_path.run(rounds=1, tokens=(256, 512), layers=4)
    assert [r["blocks"] for r in out["sizes"]] == [16, 32]
    for row in out["sizes"]:
        assert set(row["ours"]) == {"lookup", "plan", "load_prep", "save_plan", "save_prep"}
        assert set(row["in_tree"]) == {"keys", "prepare_values"}
        assert row["ours"]["lookup"]["wall_ms"] > 0  # a master round trip at least
        assert row["ours_end_to_end_ms"] >= row["ours"]["lookup"]["wall_ms"]
