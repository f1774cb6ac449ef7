"""The training loop driven by hand, in process: no role or engine processes, a fake channel, every task answered
in the order it was handed out with made-up numbers (train/loss = the step, eval/arith = 0.01 * the step, ...).
Any interleaving across roles this gives is one a real run may take. The engines are steps the loop starts; they
join as their hosts would (:func:`deliver_joins`), under a new URL each time one is started again."""

from __future__ import annotations

import json
from pathlib import Path

from relax_hpc.backends import LocalBackend
from relax_hpc.controller import messages as M
from relax_hpc.controller.state import RunState
from relax_hpc.controller.training import TrainingLoop
from relax_hpc.exchange.fields import PRODUCER, task_fields
from relax_hpc.recipe import dump_recipe, load_recipe, role_steps
from relax_hpc.rundir import RunDir, create_run_dir

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
ARITH = REPO / "recipes" / "data" / "arith.jsonl"
PASS = ("pass@1", "pass@2", "pass@4")


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


class FakeStep:
    """An engine step of the simulation: it runs until stopped."""

    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def stop(self) -> None:
        self.returncode = -15


def sim_recipe(tmp_path: Path, *overrides: str):
    """The quickstart recipe with ``overrides`` (the model is never loaded), without its greedy eval unless an
    override asks for one (the loop's steps are what these tests follow)."""
    return load_recipe(QUICKSTART, [f"model.path={Path('/no/model')}", f"data.path={ARITH}",
                                    f"run.runs_root={tmp_path / 'runs'}", "rollout.eval_interval=null", *overrides])


def sim_run(tmp_path: Path, recipe) -> RunDir:
    run = create_run_dir(tmp_path / "runs", "sim")
    run.recipe.write_text(dump_recipe(recipe))
    return run


def sim_loop(recipe, run: RunDir) -> tuple[TrainingLoop, FakeChannel]:
    """A training loop on ``run`` (an attempt: it resumes from the run's checkpoint, if any) after its first tick."""
    state = RunState(run, recipe, role_steps(recipe), LocalBackend())
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


def deliver_joins(loop: TrainingLoop, ch: FakeChannel) -> None:
    """The engines started since the last call join (as their hosts would), and the loop takes its turn."""
    while ch.joins:
        loop.on_message(ch.joins.pop(0))
        loop.tick()


FROZEN = {"genrm": ("judge", 7000), "teacher": ("teacher", 7100)}  # a frozen-engine role: its engine names, ports


def answer(loop: TrainingLoop, task: dict, role: str | None = None) -> M.ResultMessage:
    """What a role would report, with made-up numbers: train/loss = the step, eval/arith = 0.01 * the step."""
    kind, n = task["kind"], task.get("step")
    if kind == "start_engines" and role in FROZEN:  # one judge / teacher engine on node n9
        name, port = FROZEN[role][0] + "0", FROZEN[role][1]
        return M.StartEnginesResult(engines={name: f"http://10.0.0.9:{port}"}, pids={name: 42}, nodes={name: "n9"})
    if kind == "start_engines":  # the driver's cursor (its engines are steps of their own: they join)
        return M.StartEnginesResult(engines={}, data_state={"offset": 0})
    if kind == "connect":
        return M.ConnectResult(engines=["engine0"])
    if kind == "generate":
        chunk = {"path": str(loop.broker.root / f"step_{n}" / f"chunk_{PRODUCER}_{task['seq']}.h5"), "step": n,
                 "n": 4, "fields": [*task_fields("train", (PRODUCER,)), *(["teacher_log_probs"] if task["teachers"]
                                                                          else [])], "checksum": "0", "size": 1,
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


def drive(loop: TrainingLoop, ch: FakeChannel, after=None, special=None) -> list[tuple[str, str]]:
    """Answer every task in the order handed out (each role does its own in order) until none is left; ``special(task)``
    may answer a task instead (None: the usual answer), ``after(kind, step)`` is called after each. Returns what was
    done, as (kind, step or version)."""
    done = []
    deliver_joins(loop, ch)
    while ch.queue and loop.outcome is None:
        role, task = ch.queue.pop(0)
        done.append(what(task))
        res = (special(task) if special is not None else None) or answer(loop, task, role)
        ch.events.append(("-", *what(task)))
        loop.on_message({"type": "task_done", "task_id": task["id"], "rank": 0, "result": res.to_dict()})
        assert loop.state.running or task["kind"] == "stop", loop.state.doc["reason"]
        deliver_joins(loop, ch)
        if after is not None:
            after(*what(task))
    return done


def metrics(run: RunDir) -> list[dict]:
    path = run.path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_rows(run: RunDir, rows: list[dict]) -> None:
    (run.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def fake_checkpoint(run: RunDir, step: int, extra: dict | None = None) -> None:
    """What the actor would have saved at ``step`` (its ``extra_state``: by default the step and the data cursor)."""
    root = run.path / "checkpoints"
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    extra = extra if extra is not None else {"step": step, "data": {"offset": step}}
    (d / "meta.json").write_text(json.dumps({"step": step, "extra_state": extra}))
    (root / "latest").write_text(d.name)
