"""Periodic eval, wired: ``rollout.eval_interval`` makes the controller send ``eval`` tasks to the rollout role at
Relax's steps, and ``eval/<name>``, ``eval/<name>-pass@k`` land in those steps' rows and in TensorBoard.

Real local runs of the quickstart with an eval set (recipes/quickstart-eval.yaml, shortened): the metrics at
exactly the scheduled steps, TensorBoard's scalars, and training's metrics equal to those of the same run without
eval (eval never changes what training samples or learns). The run without eval is the session's uninterrupted
run of :data:`interrupt.SHORT` (the resume and mini-batch tests' reference: one run for all); the fully-async run
with eval is test_async.py's (``fully_async_run``). The loop's side (when each eval is sent, the rows it lands in,
a resume whose eval was cut off), driven by hand, is tests/controller/test_loop_eval.py.
"""

from __future__ import annotations

import json

import pytest

from relax_hpc.controller import run_controller

from . import interrupt
from .conftest import ASYNC_EVAL_INTERVAL, ASYNC_STEPS, REPO, eval_overrides, make_run, metrics, tensorboard_tags

QUICKSTART_EVAL = REPO / "recipes" / "quickstart-eval.yaml"
PASS = ("pass@1", "pass@2", "pass@4")
KEYS = ("rollout/raw_reward", "train/loss", "train/pg_loss", "train/grad_norm", "rollout/weight_version")
EVAL = eval_overrides(2)


def eval_keys(row: dict) -> list[str]:
    return sorted(k for k in row if k.startswith("eval/"))


def check_eval_rows(rows: list[dict], tb: dict, steps: int, interval: int) -> None:
    evals = sorted({0, *range(interval, steps + 1, interval), steps})  # before training, every interval-th, the last
    assert [r["step"] for r in rows] == list(range(steps + 1))  # one row per step, step 0's the eval before training
    assert {r["step"] for r in rows if eval_keys(r)} == set(evals)  # nowhere else
    for r in rows:
        if r["step"] in evals:
            for k in ("eval/arith", *(f"eval/arith-{p}" for p in PASS)):
                assert 0.0 <= r[k] <= 1.0, (r["step"], k, r[k])
            assert r["eval/arith-pass@1"] <= r["eval/arith-pass@2"] <= r["eval/arith-pass@4"]
            assert r["eval/step"] == r["step"] and r["perf/eval_time"] > 0
            assert r["eval/arith/response_len/max"] == 1.0  # eval_max_response_len: null = the rollout's (1)
    assert [s for s, _ in tb["eval/arith"]] == evals
    assert [v for _, v in tb["eval/arith"]] == pytest.approx([r["eval/arith"] for r in rows if eval_keys(r)], abs=1e-6)
    assert [s for s, _ in tb["eval/arith-pass@4"]] == evals
    assert [s for s, _ in tb["train/loss"]] == list(range(1, steps + 1))


@pytest.mark.slow
def test_quickstart_eval_logs_eval_at_its_steps_and_training_is_unchanged(tmp_path, tiny_model, local_executor,
                                                                          uninterrupted):
    steps = interrupt.STEPS
    evald = make_run(tmp_path, tiny_model, *interrupt.SHORT, *EVAL, recipe=QUICKSTART_EVAL, name="eval")
    assert run_controller(evald.path)["state"] == "COMPLETED"
    rows = metrics(evald)
    check_eval_rows(rows, tensorboard_tags(evald.path / "tensorboard"), steps, 2)
    assert "rollout/raw_reward" not in rows[0] and "train/loss" not in rows[0]
    want = uninterrupted(*interrupt.SHORT, steps=steps)  # the same run without eval
    assert sorted(want) == list(range(1, steps + 1)) and not any(eval_keys(r) for r in want.values())
    for r in rows[1:]:  # eval touches neither the data cursor nor the training requests' seeds
        for k in KEYS:
            assert r[k] == pytest.approx(want[r["step"]][k], abs=1e-6), (r["step"], k, r[k], want[r["step"]][k])
    summary = json.loads((evald.path / "summary.json").read_text())
    assert summary["steps"] == steps and summary["state"] == "COMPLETED"
    assert summary["reward_final"] == pytest.approx(want[steps]["rollout/raw_reward"], abs=1e-6)


@pytest.mark.slow
def test_fully_async_eval_runs_between_generates(fully_async_run):
    # the fully-async quickstart with an eval every 10th step: test_async.py's run (fully_async_run)
    run, final = fully_async_run
    assert final["state"] == "COMPLETED" and final["mode"] == "fully_async"
    check_eval_rows(metrics(run), tensorboard_tags(run.path / "tensorboard"), ASYNC_STEPS, ASYNC_EVAL_INTERVAL)
