"""No block computed on a failed in-step load reaches the store (connector.worker.save_guard), with
a real master and store node. A step loads request "a"'s prefix in-step while its forward
computes the rest of "a" and request "b" (which may have taken "a"'s blocks as a local prefix
hit). The load fails: neither request's save of that step, nor any later one, is made, and
each is counted as lost with code `unsafe`. A step whose in-step load succeeds saves as usual.
"""

from __future__ import annotations

from connector.metadata import BlockTransfer, StepMetadata
from tests.store import test_deadlines
from tests.store.test_deadlines import stored
from tests.store.test_step_loads import SYNC
from tests.worker_kit import hashes, run_step, settled_saves

cluster = test_deadlines.cluster  # a master and store node of this module's own


def step(load_hashes, saves: dict[str, tuple[bytes, ...]], first_block: int) -> StepMetadata:
    """An in-step load of "a" into blocks 40.., and saves of each request's new blocks."""
    ids = iter(range(first_block, first_block + 64))
    return StepMetadata(
        sync_loads=(BlockTransfer("a", tuple(range(40, 40 + len(load_hashes))), load_hashes),),
        saves=tuple(BlockTransfer(r, tuple(next(ids) for _ in hs), hs)
                    for r, hs in saves.items()),
        free_after_jobs=tuple(saves), in_step_peers=("a", "b"))


def test_a_failed_in_step_load_saves_nothing_of_its_step_or_later(make_worker_on, cluster):
    master, _ = cluster
    hs = stored(make_worker_on, master, "guard-fail", n=4)
    w = make_worker_on(master, prefix="guard-fail", **SYNC)
    missing = (hs[0], hs[1], hashes("guard-absent", 1)[0], hs[3])  # the load fails at block 42
    new = {"a": hashes("guard-a", 2), "b": hashes("guard-b", 3)}
    run_step(w, step(missing, new, 0))
    later = {"b": hashes("guard-b-later", 2)}  # b's next chunk attends to its tainted blocks
    run_step(w, StepMetadata(saves=(BlockTransfer("b", (10, 11), later["b"]),),
                             free_after_jobs=("b",)))
    c = settled_saves(w, 7)
    assert c["save_error_keys|0"] == 7 and c["save_keys|0"] == 0, dict(c)
    assert c["failures|0|save|unsafe"] == 3, dict(c)  # a's and b's, then b's later one
    client = w._store.require()
    keys = [k for r, hs_ in (*new.items(), *later.items())
            for k in w._keys.object_keys(hs_, w._io[0].save.shards, 0)]
    assert client.batch_is_exist(keys) == [0] * len(keys), "a tainted block reached the store"
    # Once vLLM reports them finished their ids are free again (ids never come back in vLLM).
    w.get_transfer_results({"a", "b"})
    assert not w.save_guard.split([BlockTransfer("b", (1,), hashes("x", 1))])[1]


def test_a_step_whose_in_step_load_succeeds_saves(make_worker_on, cluster):
    master, _ = cluster
    hs = stored(make_worker_on, master, "guard-ok", n=4)
    w = make_worker_on(master, prefix="guard-ok", **SYNC)
    new = {"a": hashes("guard-ok-a", 2), "b": hashes("guard-ok-b", 3)}
    run_step(w, step(hs, new, 0))
    c = settled_saves(w, 5)
    assert c["save_keys|0"] == 5 and c["save_error_keys|0"] == 0, dict(c)
