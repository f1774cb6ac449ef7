"""recipes/quickstart-multiturn.yaml learns from scratch: the arithmetic with a second chance, through a Relax-form
environment (recipes/examples/env_arith.py). The mean reward rises and the model needs the second turn less."""

from __future__ import annotations

import json

import pytest

from relax_hpc.controller import run_controller

from .conftest import REPO, make_run, metrics

STEPS = 30


@pytest.mark.slow
def test_the_multiturn_quickstart_learns(tmp_path, tiny_model, local_executor):
    # half the quickstart's prompts per step: a multi-turn step sends each sample's turns one after the other,
    # which the CPU engine batches less well (about 2 s a step here instead of 5)
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", "rollout.rollout_batch_size=8",
                   f"rollout.interaction_env_path={REPO / 'recipes' / 'examples' / 'env_arith.py'}",
                   recipe=REPO / "recipes" / "quickstart-multiturn.yaml", name="multiturn")
    assert run_controller(run.path)["state"] == "COMPLETED"
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["reward_last10"] > summary["reward_first10"] + 0.15, summary
    rows = metrics(run)
    turns = [r["rollout/turns"] for r in rows]
    assert sum(turns[-10:]) / 10 < sum(turns[:10]) / 10 - 0.05, turns
    assert all(r["rollout/env_failures"] == 0 for r in rows)
