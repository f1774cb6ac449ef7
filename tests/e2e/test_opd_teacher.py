"""On-policy distillation's teacher on the local executor: the quickstart for a few steps with ``roles.teacher``
serving the student's own tiny model (``opd.teacher_model_path``). The teacher engine starts at boot like a judge,
state.json lists it, rollout asks it about every step's responses (``opd/teacher_calls``), and every chunk the
actor trains on carries ``teacher_log_probs`` (one per response token: the trainer's door refuses any other count).
"""

from __future__ import annotations

import pytest

from relax_hpc.controller import run_controller
from relax_hpc.exchange.journal import iter_ops, replay
from relax_hpc.recipe import validate

from .conftest import make_run, metrics, state

STEPS = 3
PROMPTS = 4

pytestmark = [
    pytest.mark.slow,
    # validation refuses every opd: section until the objective is in the training step (issue #32)
    pytest.mark.skipif(hasattr(validate, "opd_not_wired"), reason="opd: is refused until the OPD loss is wired"),
]


def test_the_teacher_engine_scores_every_step_s_responses(tmp_path, tiny_model, local_executor):
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", f"rollout.rollout_batch_size={PROMPTS}",
                   "roles.teacher.enabled=true", f"opd.teacher_model_path={tiny_model}")
    assert run_controller(run.path)["state"] == "COMPLETED"
    ctl = state(run)
    assert list(ctl["teachers"]) == ["teacher0"] and ctl["teachers"]["teacher0"]["url"].startswith("http://127.0.0.1:")
    assert ctl["roles"]["teacher"]["het_group"] not in {ctl["roles"][r]["het_group"] for r in ("actor", "rollout")}
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["opd/teacher_calls"] >= 1 and r["opd/teacher_bad_samples"] == 0, r
        assert r["opd/teacher_latency_mean"] > 0, r
    produced = list(iter_ops(replay(run.path / "exchange" / "journal.jsonl"), "produced"))
    assert sorted({op["step"] for op in produced}) == list(range(1, STEPS + 1))
    assert all("teacher_log_probs" in op["fields"] and op["n"] == PROMPTS * 8 for op in produced), produced
