"""A custom generate function that returns some rollouts as segments (a list of samples), through the whole loop:
the router under a full step's load, the exchange, the actor's mini-batches. Every segment is trained as a sample,
step 2 too, whose chunk was damaged and generated again (the run is test_damage.py's: ``damaged_segments_run``)."""

from __future__ import annotations

import pytest

from relax_hpc.exchange.audit import audit, exactly_once

from .conftest import SEGMENT_STEPS, metrics

STEPS = SEGMENT_STEPS


def test_segments_train_through_the_whole_loop(damaged_segments_run):
    run, final = damaged_segments_run
    assert final["state"] == "COMPLETED", final["reason"]
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # 128 rollouts a step, the 64 with an odd index in two segments
        assert r["rollout/segments_per_rollout"] == pytest.approx(192 / 128) and r["train/num_steps"] == 2
    journal = run.path / "exchange" / "journal.jsonl"
    assert exactly_once(journal, ["train"]) == []
    assert [(a.samples, a.consumed["train"]) for a in audit(journal).values()] == [(192, 192)] * STEPS  # segments too
