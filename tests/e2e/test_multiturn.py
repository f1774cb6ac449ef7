"""recipes/quickstart-multiturn.yaml learns from scratch: the arithmetic with a second chance, through a Relax-form
environment. The environment here is the one a user would write (tests/e2e/env_long_feedback.py): its feedback is a
sentence of 58 tokens, where the recipe's own env says " no=" and train.max_seq_len is 16. Such feedback failed the
run at step 1 ("a sample has 25 tokens, more than train.max_seq_len = 16"); now the context bound
(rollout.max_context_len unset: train.max_seq_len) cuts it (turn_truncation: continue), every sample fits what the
trainer accepts, and the mean reward still rises while the model needs the second turn less."""

from __future__ import annotations

import json

import pytest

from relax_hpc.controller import run_controller
from relax_hpc.recipe import load_recipe

from .conftest import HERE, REPO, make_run, metrics

STEPS = 30


@pytest.mark.slow
def test_the_multiturn_quickstart_learns_with_feedback_longer_than_max_seq_len(tmp_path, tiny_model, local_executor):
    # half the quickstart's prompts per step: a multi-turn step sends each sample's turns one after the other,
    # which the CPU engine batches less well (about 2 s a step here instead of 5)
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", "rollout.rollout_batch_size=8",
                   f"rollout.interaction_env_path={HERE / 'env_long_feedback.py'}",
                   recipe=REPO / "recipes" / "quickstart-multiturn.yaml", name="multiturn")
    r = load_recipe(run.recipe)
    assert (r.train.max_seq_len, r.rollout.max_context_len, r.rollout.turn_truncation) == (16, None, "continue")
    # COMPLETED: the actor refuses a sample longer than train.max_seq_len (train/batch.py), which is how it failed
    assert run_controller(run.path)["state"] == "COMPLETED"
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["reward_last10"] > summary["reward_first10"] + 0.15, summary
    rows = metrics(run)
    turns = [r["rollout/turns"] for r in rows]
    assert sum(turns[-10:]) / 10 < sum(turns[:10]) / 10 - 0.05, turns
    assert all(r["rollout/env_failures"] == 0 for r in rows)
    # the feedback was cut for every wrong first answer: 4 + 1 + 10 of its 58 tokens + 1 = 16, the bound
    assert all(r["rollout/truncated_by/context"] == pytest.approx(r["rollout/turns"] - 1) for r in rows), rows
    assert rows[0]["rollout/truncated_by/context"] > 0
