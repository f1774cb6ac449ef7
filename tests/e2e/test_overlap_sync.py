"""train.overlap_sync in a short real run: the fully-async quickstart (max_staleness 1, so auto overlaps), its step-2
push held until step 3's train has begun (``RELAX_TEST_HOLD_PUSH=2``: the overlap shows whatever the timing). The
train of step 3 started before step 2's sync landed (the controller's metric, and the actor's landing came after
train 3 was handed out), and still: every sample consumed exactly once, the staleness bound held in the journal and
in the samples' weight versions, the engines' versions rose one step at a time. (That the overlapped run learns:
test_async.py's ``fully_async_run``, where auto overlaps too.)"""

from __future__ import annotations

import pytest

from relax_hpc.exchange.audit import exactly_once
from relax_hpc.exchange.journal import iter_ops, replay

from .conftest import REPO, locally, make_run, metrics

STEPS, K = 4, 1


@pytest.mark.slow
def test_the_next_train_runs_while_the_push_lands_and_the_bounds_hold(tiny_model, tmp_path):
    from relax_hpc.controller import run_controller

    with locally(RELAX_TEST_HOLD_PUSH="2"):
        run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", recipe=REPO / "recipes" / "quickstart-async.yaml",
                       name="overlap")
        final = run_controller(run.path)
    assert final["state"] == "COMPLETED", final.get("reason")
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[2].get("perf/weight_sync_overlapped") == 1.0, "train 3 began before sync 2 landed"
    # steps 1-3 pushed behind the next train (snapshot, then the landing's metrics); the last one in series
    assert all("perf/weight_pack_ahead_time" in r and "perf/weight_sync_behind_time" in r for r in rows[:3])
    assert "perf/weight_pack_ahead_time" not in rows[3] and rows[3]["perf/weight_sync_bytes"] > 0
    assert all(r["weights/versions_ok"] == 1.0 and r["weights/fingerprint_match"] == 1.0 for r in rows)
    for r in rows:  # samples made with weights no older than N − 1 − k
        assert r["step"] - 1 - K <= r["rollout/weight_version_min"] <= r["rollout/weight_version"] <= r["step"] - 1

    journal = run.path / "exchange" / "journal.jsonl"
    starts = list(iter_ops(replay(journal), "start"))
    assert [s["step"] for s in starts] == list(range(1, STEPS + 1))
    for s in starts:  # the gate moved only when a push landed
        assert s["min_uncleared"] is None or s["step"] - s["min_uncleared"] <= K, s
    assert exactly_once(journal, ["train"]) == []
    assert "step 3: train starts while step 2's weights are pushed" in (run.path / "logs" / "controller.log").read_text()
