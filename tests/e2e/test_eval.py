"""Periodic eval, wired: ``rollout.eval_interval`` makes the controller send ``eval`` tasks to the rollout role at
Relax's steps, and ``eval/<name>``, ``eval/<name>-pass@k`` land in those steps' rows and in TensorBoard.

Real local runs of the quickstart with an eval set (recipes/quickstart-eval.yaml, shortened): the metrics at
exactly the scheduled steps, TensorBoard's scalars, and training's metrics equal to those of the same run without
eval (eval never changes what training samples or learns). The loop's side (when each eval is sent, the rows it
lands in, a resume whose eval was cut off), driven by hand, is tests/controller/test_loop_eval.py.
"""

from __future__ import annotations

import json

import pytest

from relax_hpc.controller import run_controller

from .conftest import ARITH, REPO, make_run, metrics, tensorboard_tags

QUICKSTART_EVAL = REPO / "recipes" / "quickstart-eval.yaml"
PASS = ("pass@1", "pass@2", "pass@4")


def eval_keys(row: dict) -> list[str]:
    return sorted(k for k in row if k.startswith("eval/"))

STEPS = 4
KEYS = ("rollout/raw_reward", "train/loss", "train/pg_loss", "train/grad_norm", "rollout/weight_version")
SMALL = (f"run.steps={STEPS}", "rollout.rollout_batch_size=4")
EVAL = ("rollout.eval_interval=2", "rollout.n_samples_per_eval_prompt=4", f"data.eval_prompt_data={{arith: {ARITH}}}")


def check_eval_rows(rows: list[dict], tb: dict) -> None:
    assert [r["step"] for r in rows] == list(range(STEPS + 1))  # one row per step, step 0's the eval before training
    assert {r["step"] for r in rows if eval_keys(r)} == {0, 2, 4}  # every 2nd step and the last, nowhere else
    for r in rows:
        if r["step"] in (0, 2, 4):
            for k in ("eval/arith", *(f"eval/arith-{p}" for p in PASS)):
                assert 0.0 <= r[k] <= 1.0, (r["step"], k, r[k])
            assert r["eval/arith-pass@1"] <= r["eval/arith-pass@2"] <= r["eval/arith-pass@4"]
            assert r["eval/step"] == r["step"] and r["perf/eval_time"] > 0
            assert r["eval/arith/response_len/max"] == 1.0  # eval_max_response_len: null = the rollout's (1)
    assert [s for s, _ in tb["eval/arith"]] == [0, 2, 4]
    assert [v for _, v in tb["eval/arith"]] == pytest.approx([r["eval/arith"] for r in rows if eval_keys(r)], abs=1e-6)
    assert [s for s, _ in tb["eval/arith-pass@4"]] == [0, 2, 4]
    assert [s for s, _ in tb["train/loss"]] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_quickstart_eval_logs_eval_at_its_steps_and_training_is_unchanged(tmp_path, tiny_model, local_executor):
    plain = make_run(tmp_path, tiny_model, *SMALL, name="plain")
    evald = make_run(tmp_path, tiny_model, *SMALL, *EVAL, recipe=QUICKSTART_EVAL, name="eval")
    assert run_controller(evald.path)["state"] == "COMPLETED"
    assert run_controller(plain.path)["state"] == "COMPLETED"
    rows = metrics(evald)
    check_eval_rows(rows, tensorboard_tags(evald.path / "tensorboard"))
    assert "rollout/raw_reward" not in rows[0] and "train/loss" not in rows[0]
    want = {r["step"]: r for r in metrics(plain)}
    assert sorted(want) == list(range(1, STEPS + 1)) and not any(eval_keys(r) for r in want.values())
    for r in rows[1:]:  # eval touches neither the data cursor nor the training requests' seeds
        for k in KEYS:
            assert r[k] == pytest.approx(want[r["step"]][k], abs=1e-6), (r["step"], k, r[k], want[r["step"]][k])
    summary = json.loads((evald.path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["state"] == "COMPLETED"
    assert summary["reward_final"] == pytest.approx(want[STEPS]["rollout/raw_reward"], abs=1e-6)


@pytest.mark.slow
def test_fully_async_eval_runs_between_generates(tmp_path, tiny_model, local_executor):
    run = make_run(tmp_path, tiny_model, *SMALL, *EVAL, "mode=fully_async", "max_staleness=1",
                   recipe=QUICKSTART_EVAL, name="async-eval")
    assert run_controller(run.path)["state"] == "COMPLETED"
    check_eval_rows(metrics(run), tensorboard_tags(run.path / "tensorboard"))
