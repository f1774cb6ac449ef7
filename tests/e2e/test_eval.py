"""Periodic eval, wired: ``rollout.eval_interval`` makes the controller send ``eval`` tasks to the rollout role at
Relax's steps, and ``eval/<name>``, ``eval/<name>-pass@k`` land in those steps' rows and in TensorBoard.

Two kinds of tests:

- the training loop driven by hand (no processes: a fake channel, every task answered in the order it was
  handed out), in both modes: when each eval is sent (before the next generate; in fully_async the next sync
  waits for it), the rows it lands in, and a resume from a checkpoint whose eval was cut off (run again,
  once) or was done (not run again);
- real local runs of the quickstart with an eval set (recipes/quickstart-eval.yaml, shortened): the metrics at
  exactly the scheduled steps, TensorBoard's scalars, and training's metrics equal to those of the same run
  without eval (eval never changes what training samples or learns).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_hpc.controller import messages as M
from relax_hpc.controller import run_controller
from relax_hpc.controller.state import RunState
from relax_hpc.controller.training import TrainingLoop
from relax_hpc.exchange.fields import PRODUCER, task_fields
from relax_hpc.recipe import dump_recipe, load_recipe, role_steps
from relax_hpc.rundir import RunDir, create_run_dir

from .conftest import ARITH, QUICKSTART, REPO, make_run, metrics, quickstart_overrides, tensorboard_tags

QUICKSTART_EVAL = REPO / "recipes" / "quickstart-eval.yaml"
PASS = ("pass@1", "pass@2", "pass@4")


def eval_keys(row: dict) -> list[str]:
    return sorted(k for k in row if k.startswith("eval/"))


# ------------------------------------------------------------------------------ the loop, by hand ---


def what(task: dict) -> tuple[str, str]:
    return task["kind"], str(task.get("step", task.get("version", task.get("extra", {}).get("step", ""))))


class FakeChannel:
    def __init__(self) -> None:
        self.queue: list[tuple[str, dict]] = []  # (role, task) in the order handed out
        self.events: list[tuple[str, str, str]] = []  # ("+", kind, step) handed out, ("-", kind, step) done
        self.joins: list[dict] = []  # engine_join messages of the engine steps started, not yet delivered

    def assign(self, role: str, task: dict) -> None:
        self.queue.append((role, task))
        self.events.append(("+", *what(task)))


def sim_recipe(tmp_path: Path, *overrides: str):
    return load_recipe(QUICKSTART, quickstart_overrides(Path("/no/model"), tmp_path / "runs", *overrides))


def sim_loop(recipe, run: RunDir) -> tuple[TrainingLoop, FakeChannel]:
    state = RunState(run, recipe, role_steps(recipe), "local")
    ch = FakeChannel()
    loop = TrainingLoop(recipe, run, state, ch)
    loop.broker.check_files = False  # the chunks below are only announced, never written
    ports = iter(range(9000, 10000))  # an engine started again comes back under a new URL

    def start(recipe, run_dir, executor, name, origin, op, exclude=()):  # an engine step: it joins (drive delivers)
        ch.joins.append({"type": "engine_join", "name": name, "op": op, "origin": origin, "node": "localhost",
                         "url": f"http://127.0.0.1:{next(ports)}", "pid": 0, "slurm_step": ""})
        return FakeStep()

    loop.elastic.start_step = start
    loop.elastic.stop_steps = lambda ps, grace_s=0.0: [p.stop() for p in ps]
    loop.tick()  # the first tick starts the run's engines
    return loop, ch


class FakeStep:
    """An engine step of the simulation: it runs until stopped."""

    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def stop(self) -> None:
        self.returncode = -15


def deliver_joins(loop: TrainingLoop, ch: FakeChannel) -> None:
    """The engines started since the last call join (as their hosts would), and the loop takes its turn."""
    while ch.joins:
        loop.on_message(ch.joins.pop(0))
        loop.tick()


def sim_run(tmp_path: Path, recipe) -> RunDir:
    run = create_run_dir(tmp_path / "runs", "sim")
    run.recipe.write_text(dump_recipe(recipe))
    return run


def answer(loop: TrainingLoop, task: dict) -> M.ResultMessage:
    """What a role would report, with made-up numbers: train/loss = the step, eval/arith = 0.01 * the step."""
    kind, n = task["kind"], task.get("step")
    if kind == "start_engines":  # the driver's cursor (its engines are steps of their own: they join)
        return M.StartEnginesResult(engines={}, data_state={"offset": 0})
    if kind == "connect":
        return M.ConnectResult(engines=["engine0"])
    if kind == "generate":
        chunk = {"path": str(loop.broker.root / f"step_{n}" / f"chunk_{PRODUCER}_{task['seq']}.h5"), "step": n,
                 "n": 4, "fields": list(task_fields("train", (PRODUCER,))), "checksum": "0", "size": 1,
                 "attrs": {}, "sides": []}
        return M.GenerateResult(chunks=[chunk], metrics={"rollout/raw_reward": 0.1 * n}, n=4,
                                weight_versions=[str(loop.step)], data_state={"offset": n})
    if kind == "train":
        return M.TrainResult(metrics={"train/loss": float(n)})
    if kind == "sync":
        return M.SyncResult(engine_versions={"engine0": task["version"]})
    if kind == "checkpoint":
        return M.CheckpointResult(path=str(loop.run.path / "checkpoints" / f"step_{task['extra']['step']:08d}"))
    if kind == "eval":
        return M.EvalResult(metrics={"eval/arith": 0.01 * n, **{f"eval/arith-{p}": 0.5 for p in PASS},
                                     "eval/step": float(n), "perf/eval_time": 0.1})
    if kind == "stop":
        return M.StopResult()
    raise AssertionError(task)


def drive(loop: TrainingLoop, ch: FakeChannel, after=None) -> list[tuple[str, str]]:
    """Answer every task in the order handed out (each role does its own in order; any interleaving across roles
    is one a real run may take) until none is left; ``after(kind, step)`` is called after each. Returns what was
    done, as (kind, step or version)."""
    done = []
    deliver_joins(loop, ch)
    while ch.queue and loop.outcome is None:
        role, task = ch.queue.pop(0)
        done.append(what(task))
        ch.events.append(("-", *what(task)))
        loop.on_message({"type": "task_done", "task_id": task["id"], "rank": 0,
                         "result": answer(loop, task).to_dict()})
        assert loop.state.running or task["kind"] == "stop", loop.state.doc["reason"]
        deliver_joins(loop, ch)
        if after is not None:
            after(*what(task))
    return done


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


def write_rows(run, rows: list[dict]) -> None:
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def fake_checkpoint(run, step: int) -> None:
    root = run.path / "checkpoints"
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": step, "extra_state": {"step": step, "data": {"offset": step}}}))
    (root / "latest").write_text(d.name)


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
    assert loop.evals == ([4] if cut_off else [])
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


# -------------------------------------------------------------------------------- real local runs ---


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
