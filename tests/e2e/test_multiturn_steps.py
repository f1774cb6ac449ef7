"""An environment with Relax's five-value step, ``(obs, reward, terminated, truncated, info)``, learns in the
multi-turn quickstart: relax_hpc.tasks.arith_steps's env gives each turn its reward, the loop keeps them in
``metadata["step_rewards"]``, and the reward function reads nothing else (their sum). Before, the five-value form
was refused: every sample FAILED with an env error and nothing trained."""

from __future__ import annotations

import json

import pytest

from relax_hpc.controller import run_controller

from .conftest import REPO, make_run, metrics

STEPS = 30


@pytest.mark.slow
def test_an_env_with_the_five_value_step_learns_in_the_multiturn_quickstart(tmp_path, tiny_model, local_executor):
    # as tests/e2e/test_multiturn.py: half the quickstart's prompts per step, the turns of a sample being serial
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", "rollout.rollout_batch_size=8",
                   "rollout.interaction_env_path=relax_hpc.tasks.arith_steps",
                   "rollout.custom_rm_path=relax_hpc.tasks.arith_steps.step_reward_sum",
                   recipe=REPO / "recipes" / "quickstart-multiturn.yaml", name="multiturn-steps")
    assert run_controller(run.path)["state"] == "COMPLETED"
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["rollout/env_failures"] == 0 for r in rows)  # the five-value form was accepted on every sample
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["reward_last10"] > summary["reward_first10"] + 0.15, summary
    turns = [r["rollout/turns"] for r in rows]
    assert sum(turns[-10:]) / 10 < sum(turns[:10]) / 10 - 0.05, turns  # right at once more often: fewer second turns
