"""A custom generate function that returns some rollouts as segments (a list of samples), through the whole loop:
the router under a full step's load, the exchange, the actor's mini-batches. Every segment is trained as a sample."""

from __future__ import annotations

import pytest

from relax_hpc.controller import run_controller
from relax_hpc.exchange.audit import audit, exactly_once

from .conftest import make_run, metrics

STEPS = 3


@pytest.mark.slow
def test_segments_train_through_the_whole_loop(tmp_path, tiny_model, local_executor):
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", "train.num_steps_per_rollout=2",
                   "rollout.custom_generate_function_path=e2e_rewards.generate_in_segments", name="segments")
    assert run_controller(run.path)["state"] == "COMPLETED"
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # 128 rollouts a step, the 64 with an odd index in two segments
        assert r["rollout/segments_per_rollout"] == pytest.approx(192 / 128) and r["train/num_steps"] == 2
    journal = run.path / "exchange" / "journal.jsonl"
    assert exactly_once(journal, ["train"]) == []
    assert [(a.samples, a.consumed["train"]) for a in audit(journal).values()] == [(192, 192)] * STEPS  # segments too
