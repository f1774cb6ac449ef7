"""Periodic eval in the training loop, driven by hand (:mod:`loop_sim`), in both modes: when each eval is sent
(before the next generate; in fully_async the next sync waits for it), the rows it lands in, a stop with a
checkpoint while an eval holds a sync, and a resume from a checkpoint whose eval was cut off (run again, once) or
was done (not run again). The real runs are in tests/e2e/test_eval.py."""

from __future__ import annotations

import pytest

from loop_sim import (ARITH, PASS, drive, fake_checkpoint, metrics, sim_loop, sim_recipe, sim_run,
                      write_rows)


def eval_keys(row: dict) -> list[str]:
    return sorted(k for k in row if k.startswith("eval/"))


@pytest.mark.parametrize("mode", ["colocate", "fully_async"])
def test_the_loop_sends_eval_at_relax_steps_and_logs_it_with_the_step(tmp_path, mode):
    over = ["run.steps=4", "rollout.eval_interval=2", f"data.eval_prompt_data={{arith: {ARITH}}}", f"mode={mode}"]
    if mode == "fully_async":
        over.append("max_staleness=1")
    recipe = sim_recipe(tmp_path, *over)
    run = sim_run(tmp_path, recipe)
    loop, ch = sim_loop(recipe, run)
    done = drive(loop, ch)
    ev = ch.events.index
    assert [s for k, s in done if k == "eval"] == ["0", "2", "4"]  # before training, every 2nd step, the last
    assert ev(("-", "eval", "0")) < ev(("+", "generate", "1"))  # before any training
    for n in (2, 4):
        assert ev(("-", "sync", str(n))) < ev(("+", "eval", str(n)))  # on the weights of step n
    # the engines keep step 2's weights until its eval is done
    assert ev(("-", "eval", "2")) < ev(("+", "sync", "3"))
    if mode == "colocate":  # rollout evaluates before it generates the next step
        assert ev(("-", "eval", "2")) < ev(("+", "generate", "3"))
    else:  # the actor trained step 3 meanwhile; only its sync waited for the eval (Relax's _wait_for_previous_eval)
        assert ev(("-", "train", "3")) < ev(("-", "eval", "2"))
    assert ev(("-", "eval", "4")) < ev(("+", "stop", ""))  # the run ends after the last step's eval
    summary = loop.finish()
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # one row per step; step 0's has the eval only
    assert {r["step"] for r in rows if eval_keys(r)} == {0, 2, 4}
    assert eval_keys(rows[0]) == sorted(["eval/arith", "eval/step", *(f"eval/arith-{p}" for p in PASS)])
    assert "rollout/raw_reward" not in rows[0] and "train/loss" not in rows[0]
    for r in rows[1:]:
        assert r["train/loss"] == r["step"]  # the step's own row, amended
    for r in (rows[2], rows[4]):
        assert r["eval/arith"] == pytest.approx(0.01 * r["step"]) and r["eval/step"] == r["step"]
    assert summary["steps"] == 4  # step 0's row is no step of training


def test_a_stop_with_checkpoint_while_an_eval_holds_the_next_sync(tmp_path):
    """fully_async: relax-cancel --requeue lands while step 3's sync waits for eval(2): the eval finishes, the
    sync goes out, the actor checkpoints step 3 and the attempt ends (nothing waits for ever)."""
    over = ["run.steps=6", "rollout.eval_interval=2", f"data.eval_prompt_data={{arith: {ARITH}}}", "mode=fully_async",
            "max_staleness=1"]
    recipe = sim_recipe(tmp_path, *over)
    run = sim_run(tmp_path, recipe)
    loop, ch = sim_loop(recipe, run)

    def stop_when_held(kind: str, step: str) -> None:
        if loop.held_sync is not None and loop.stop_request is None:
            loop.request_stop("requeue", "test")

    done = drive(loop, ch, after=stop_when_held)
    assert loop.stop_request is not None and loop.outcome == "requeue"
    assert done[-3:] == [("eval", "2"), ("sync", "3"), ("checkpoint", "3")]
    loop.finish()
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and {r["step"] for r in rows if eval_keys(r)} == {0, 2}


@pytest.mark.parametrize("cut_off", [True, False])
def test_a_resume_runs_the_checkpoint_steps_eval_again_only_if_it_was_cut_off(tmp_path, cut_off):
    """The checkpoint of step 4 may be saved before eval(4) is done: the resumed attempt evaluates step 4 again
    (the resume sync puts step 4's weights on the engines), adding it to step 4's row; when step 4's row has its
    eval, nothing is evaluated twice. Rows after the checkpoint are dropped and done again, eval included."""
    over = ["run.steps=6", "rollout.eval_interval=2", f"data.eval_prompt_data={{arith: {ARITH}}}"]
    recipe = sim_recipe(tmp_path, *over)
    run = sim_run(tmp_path, recipe)
    old = [{"step": 0, "eval/arith": 0.0}, *({"step": s, "train/loss": 10.0 * s} for s in range(1, 6))]
    old[2]["eval/arith"] = 0.02
    if not cut_off:
        old[4]["eval/arith"] = 0.77
    old[5]["eval/arith"] = 0.5  # after the checkpoint: dropped
    write_rows(run, old)
    fake_checkpoint(run, 4)
    loop, ch = sim_loop(recipe, run)
    assert loop.evals.queue == ([4] if cut_off else [])
    done = drive(loop, ch)
    evals = [s for k, s in done if k == "eval"]
    assert evals == (["4", "6"] if cut_off else ["6"])
    if cut_off:  # on the resumed weights, before step 5 is generated
        ev = ch.events.index
        assert ev(("-", "sync", "4")) < ev(("+", "eval", "4")) and ev(("-", "eval", "4")) < ev(("+", "generate", "5"))
    loop.finish()
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(7))
    assert {r["step"] for r in rows if eval_keys(r)} == {0, 2, 4, 6}
    assert rows[4]["train/loss"] == 40.0  # the earlier attempt's row, kept (and amended when cut off)
    assert rows[4]["eval/arith"] == (pytest.approx(0.04) if cut_off else 0.77)
    assert rows[5]["train/loss"] == 5.0 and "eval/arith" not in rows[5]  # done again, without the dropped eval
