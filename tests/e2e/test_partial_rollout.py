"""Partial rollout in a fully-async run: each step keeps the first rollout_batch_size groups to finish, aborts the
rest and continues them the next step. The run completes, every step is logged once, and the exchange's journal
shows every trained sample consumed exactly once (partial samples never enter the exchange until finished)."""

from __future__ import annotations

from relax_hpc.controller import run_controller
from relax_hpc.exchange.audit import audit, exactly_once

from .conftest import REPO, make_run, metrics

STEPS = 4


def test_a_fully_async_run_with_partial_rollout_is_exactly_once(tmp_path, tiny_model, local_executor):
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", "rollout.rollout_batch_size=4",
                   "rollout.n_samples_per_prompt=4", "rollout.max_response_len=6", "rollout.partial_rollout=true",
                   "rollout.over_sampling_batch_size=8", "rollout.mask_offpolicy_in_partial_rollout=true",
                   recipe=REPO / "recipes" / "quickstart-async.yaml", name="partial")
    final = run_controller(run.path)
    assert final["state"] == "COMPLETED", final.get("reason")
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["train/num_samples"] == 16  # rollout_batch_size groups, however many were in flight
        assert r["rollout/partial_buffer_groups"] == 4  # over_sampling − rollout_batch_size kept back each step
    journal = run.path / "exchange" / "journal.jsonl"
    assert exactly_once(journal, ["train"]) == []
    assert sorted(a for a, s in audit(journal).items() if s.cleared) == list(range(1, STEPS + 1))
