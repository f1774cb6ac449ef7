"""Fully-async mode learns, with a mixture-of-experts actor, and the exchange's journal shows the staleness bound
held.

``recipes/quickstart-async.yaml`` for a shortened run (with test_eval.py's periodic eval: ``fully_async_run``, one
run for both; eval changes neither what training samples nor its seeds): rollout generates step N+1 while the
actor trains and syncs step N. From the journal: every partition started with ``N − min(uncleared) ≤ max_staleness``
(rollout never more than k steps ahead) and every sample consumed exactly once; from the metrics: every
step's samples were made with weights no older than ``N − 1 − k``, and rollout did run ahead (a sample
made with weights older than the step before: impossible in colocate mode).
"""

from __future__ import annotations

import json

import pytest

from relax_hpc.exchange.audit import exactly_once
from relax_hpc.exchange.journal import iter_ops, replay

from .conftest import ASYNC_STEPS, metrics

STEPS = ASYNC_STEPS
RISE = 0.15


@pytest.mark.slow
def test_fully_async_learns_within_its_staleness_bound(fully_async_run):
    k = 1
    run, final = fully_async_run
    assert final["state"] == "COMPLETED" and final["mode"] == "fully_async"
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["reward_last10"] > summary["reward_first10"] + RISE, summary
    # the actor that learned is a mixture of experts: its checkpoint holds the experts' weights
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(final["last_checkpoint"]["path"]).read_metadata().state_dict_metadata
    assert any(".mlp.experts." in k for k in saved), sorted(saved)[:20]

    journal = run.path / "exchange" / "journal.jsonl"
    starts = list(iter_ops(replay(journal), "start"))
    assert [s["step"] for s in starts] == list(range(1, STEPS + 1))
    for s in starts:
        assert s["min_uncleared"] is None or s["step"] - s["min_uncleared"] <= k, s
    assert exactly_once(journal, ["train"]) == []

    rows = metrics(run)
    assert rows[0]["step"] == 0 and "rollout/raw_reward" not in rows[0]  # step 0's row: the eval before training
    rows = rows[1:]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["step"] - 1 - k <= r["rollout/weight_version_min"] <= r["rollout/weight_version"] <= r["step"] - 1
    ahead = [r["step"] for r in rows if r["rollout/weight_version_min"] < r["step"] - 1]
    assert ahead, "rollout never ran ahead of training"
