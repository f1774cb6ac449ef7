"""DAPO dynamic sampling on the quickstart: with ``check_reward_nonzero_std`` and over-sampling, every group the
actor trains on has rewards that differ (measured on the training side, from the chunks it read:
``rollout/zero_std_group_ratio``), and the filtered share is logged (above 0: the filter had groups to drop); a run
without the filter trains on such groups (the session's uninterrupted run of :data:`interrupt.SHORT`, the resume
tests' reference: no run of its own)."""

from __future__ import annotations

from relax_hpc.controller import run_controller

from . import interrupt
from .conftest import make_run, metrics

STEPS = 3
# two samples per prompt from a model that rarely answers a digit: most groups score 0, 0
SMALL = (f"run.steps={STEPS}", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=2",
         "checkpoint.interval=0")
FILTER = ("rollout.dynamic_sampling_filter_path=relax_hpc.rollout.dynamic.check_reward_nonzero_std",
          "rollout.over_sampling_batch_size=8", "rollout.dynamic_sampling_max_rounds=0")


def test_every_trained_group_has_a_reward_spread(tmp_path, tiny_model, local_executor, uninterrupted):
    without = uninterrupted(*interrupt.SHORT, steps=interrupt.STEPS).values()
    assert max(r["rollout/zero_std_group_ratio"] for r in without) > 0  # measured, and above 0 without the filter

    run = make_run(tmp_path / "dyn", tiny_model, *SMALL, *FILTER, name="dyn")
    assert run_controller(run.path)["state"] == "COMPLETED"
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["rollout/zero_std_group_ratio"] == 0.0, r["step"]
        assert r["train/num_samples"] == 8  # rollout_batch_size groups, however many were drawn
        assert r["rollout/dynamic_sampling_generated_groups"] >= 4
        assert 0.0 <= r["rollout/dynamic_sampling_filtered_ratio"] < 1.0
    assert max(r["rollout/dynamic_sampling_filtered_ratio"] for r in rows) > 0
