"""End-to-end fixtures: the quickstart's tiny model (made offline), run directories made as relax-submit makes
them, readers for what a run leaves behind (state.json, metrics.jsonl, summary.json, TensorBoard), and the runs
that several test files assert on (session-scoped: one whole run, each file its own checks)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.recipe import dump_recipe, load_recipe
from relax_hpc.rundir import RunDir, create_run_dir
from tests.conftest import locally as _locally
from tests.conftest import make_tiny_model  # noqa: F401 - the e2e tests import it from here

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
ARITH = REPO / "recipes" / "data" / "arith.jsonl"
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The quickstart's model: tools/make-tiny-model --arch llama --hidden 64 --layers 2 --heads 4 --kv-heads 2 --seed 0."""
    return make_tiny_model(tmp_path_factory.mktemp("e2e-model") / "tiny-llama", arch="llama", hidden=64, layers=2,
                           heads=4, kv_heads=2, seed=0)


# The machinery tests (resume, faults, modes, elastic, ...) need a run whose reward moves within a few cheap steps, not
# the quickstart's whole task: 16 prompts x 8 samples at lr 3e-3 with partial credit for near digits, no eval. The
# quickstart as a user runs it (all 55 sums x 32, exact reward, greedy eval) is test_quickstart_solves.py's
# test_the_quickstart_solves_the_sums. Each key is set only where the recipe has the quickstart's value (a recipe
# that sets its own batch, reward or eval, as the vision ones do, keeps it).
MACHINERY = {"rollout.rollout_batch_size": 16, "rollout.n_samples_per_prompt": 8, "train.lr": 0.003,
             "rollout.custom_rm_path": "relax_hpc.tasks.arith.shaped_reward", "rollout.eval_interval": None,
             "data.eval_prompt_data": {}, "rollout.eval_temperature": None, "rollout.n_samples_per_eval_prompt": 1,
             "logging.plot_marks": {}}


def _value(recipe: Any, key: str) -> Any:
    for part in key.split("."):
        recipe = getattr(recipe, part)
    return recipe


@functools.lru_cache(maxsize=None)
def machinery_overrides(recipe: Path = QUICKSTART) -> tuple[str, ...]:
    quickstart, r = load_recipe(QUICKSTART), load_recipe(recipe)
    return tuple(f"{k}={json.dumps(v)}" for k, v in MACHINERY.items() if _value(r, k) == _value(quickstart, k))


def quickstart_overrides(model: Path, runs_root: Path, *extra: str, machinery: bool = True,
                         recipe: Path = QUICKSTART) -> list[str]:
    return [f"model.path={model}", f"data.path={ARITH}", f"run.runs_root={runs_root}",
            *(machinery_overrides(recipe) if machinery else ()), *extra]


def make_run(tmp_path: Path, model: Path, *overrides: str, recipe: Path = QUICKSTART, name: str = "e2e") -> RunDir:
    """A run directory holding the quickstart recipe with ``overrides`` (absolute paths: the roles' cwd differs)."""
    r = load_recipe(recipe, quickstart_overrides(model, tmp_path / "runs", *overrides, recipe=recipe))
    run = create_run_dir(tmp_path / "runs", name)
    run.recipe.write_text(dump_recipe(r))
    return run


def submit_slurm(recipe: Path, cwd: Path, env: dict, overrides: list[str]) -> dict:
    """``relax-submit --json RECIPE OVERRIDES`` on the dev cluster; its JSON record (job_id, run_dir, run, ...)."""
    p = subprocess.run([str(REPO / ".venv" / "bin" / "relax-submit"), "--json", str(recipe), *overrides],
                       capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def follow_slurm(sub: dict, cwd: Path, env: dict, components: int, timeout_s: float) -> tuple[dict, set[str]]:
    """Poll a submitted run until it ends: (its last ``relax-status --json``, the ids ``J+K`` of its components if
    all ``components`` were once seen RUNNING together, else an empty set). squeue and the controller's state.json
    are polled while it goes; relax-status (a Python process of its own) once either says the run is over, until
    it says so too."""
    run = RunDir(Path(sub["run_dir"]))
    deadline = time.monotonic() + timeout_s
    st: dict = {}
    seen: set[str] = set()

    def status() -> dict:
        q = subprocess.run([str(REPO / ".venv" / "bin" / "relax-status"), "--json", sub["run"]], capture_output=True,
                           text=True, cwd=cwd, env=env)
        return json.loads(q.stdout) if q.returncode == 0 else {}

    while time.monotonic() < deadline:
        rows = [line.split() for line in subprocess.run(["squeue", "-h", "-j", sub["job_id"], "-o", "%i %T"],
                                                        capture_output=True, text=True, env=env).stdout.splitlines()]
        running = [i for i, t in rows if t == "RUNNING"]
        if len(running) == components:
            seen = set(running)
        ctl = state(run)
        if not rows or ended_state(ctl):
            st = status()
            if st.get("state") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                break
        time.sleep(1)
    return st or status(), seen


def ended_state(ctl: dict) -> bool:
    """The controller's state.json says its run is over (its final event written)."""
    return ctl.get("state") in ("COMPLETED", "FAILED", "CANCELLED") and \
        (ctl.get("events") or [{}])[-1].get("event") in ("finished", "failed", "cancelled")


def locally(**env: str):
    """tests/conftest.py's :func:`~tests.conftest.locally` with this folder's rewards and generate functions
    (tests/e2e/e2e_rewards.py) importable by the rollout role (the tests' ``local_executor`` fixture is the same)."""
    return _locally(HERE, **env)


def metrics(run: RunDir) -> list[dict]:
    path = run.path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def state(run: RunDir) -> dict:
    return run.read_json(run.state, {}) or {}


def wait_until(pred, timeout: float, every: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"{what} not reached within {timeout:.0f} s")


def tensorboard_tags(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalar tags in a TensorBoard log directory, read with TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def reference_run(tmp_dir: Path, model: Path, *overrides: str, name: str, steps: int,
                  recipe: Path = QUICKSTART) -> RunDir:
    """The quickstart with ``overrides`` run straight through locally, every step logged: what an interrupted run
    must end equal to. For session- and module-scoped fixtures (pytest's ``monkeypatch`` is function-scoped)."""
    from relax_hpc.controller import run_controller

    with locally():
        run = make_run(tmp_dir, model, *overrides, name=name, recipe=recipe)
        assert run_controller(run.path)["state"] == "COMPLETED"
    assert [r["step"] for r in metrics(run)] == list(range(1, steps + 1))
    return run


def hold(run: RunDir, step: int) -> None:
    """RUN_DIR/pause: no rollout step after ``step`` starts (the controller's pause file), so a fault lands at a
    known point instead of racing the run."""
    (run.path / "pause").write_text(f"{step}\n")


def held_at(run: RunDir, step: int) -> bool:
    st = state(run)
    return st.get("state") == "RUNNING" and st.get("step") == step and st.get("phase") == "paused"


def submit_detached(tmp_path: Path, model: Path, *overrides: str, recipe: Path = QUICKSTART) -> RunDir:
    """``relax-submit --local --detach`` of the quickstart with ``overrides``: the real local path, whose runner
    starts the controller again when it asks to be requeued. The run directory."""
    out = subprocess.run(
        [sys.executable, "-m", "relax_hpc.launch.cli", "--local", "--detach", "--json", str(recipe),
         *quickstart_overrides(model, tmp_path / "runs", *overrides, recipe=recipe)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return RunDir(Path(json.loads(out.stdout)["run_dir"]))


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory, tiny_model):
    """``uninterrupted_run(*overrides, steps=, recipe=)``: :func:`reference_run` of that recipe, run once per session,
    so the tests comparing against the same recipe share one run (tests/e2e/interrupt.py). Read it, never write."""
    import hashlib
    import os
    import shutil

    from filelock import FileLock

    # once per session, not once per xdist worker: the files using it land on either worker, and on two cores a
    # second copy of the same run only slows the other tests. The workers' base temps share a parent (this
    # session's); without xdist the session's own base temp.
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "uninterrupted-runs"
    shared.mkdir(exist_ok=True)
    runs: dict[tuple, RunDir] = {}

    def run(*overrides: str, steps: int, recipe: Path = QUICKSTART) -> RunDir:
        key = (str(recipe), overrides, steps)
        if key not in runs:
            where = shared / hashlib.sha256(repr(key).encode()).hexdigest()[:16]
            with FileLock(f"{where}.lock"):  # a worker that finds the other one running it waits for it
                if not (where / "done").exists():
                    shutil.rmtree(where, ignore_errors=True)  # a failed try's run: not the reference
                    where.mkdir()
                    reference_run(where, tiny_model, *overrides, name="ref", steps=steps, recipe=recipe)
                    (where / "done").write_text(repr(key))
            [runs[key]] = [RunDir(p) for p in (where / "runs").glob("ref-*")]
        return runs[key]

    return run


@pytest.fixture(scope="session")
def uninterrupted(uninterrupted_run):
    """``uninterrupted(*overrides, steps=, recipe=)``: the per-step metrics of :func:`uninterrupted_run`'s run."""

    def rows(*overrides: str, steps: int, recipe: Path = QUICKSTART) -> dict[int, dict]:
        return {r["step"]: r for r in metrics(uninterrupted_run(*overrides, steps=steps, recipe=recipe))}

    return rows


def eval_overrides(interval: int) -> tuple[str, ...]:
    """A periodic eval of the arithmetic prompts: every ``interval`` steps, the last and before training, pass@1..4."""
    return (f"rollout.eval_interval={interval}", "rollout.n_samples_per_eval_prompt=4",
            f"data.eval_prompt_data={{arith: {ARITH}}}")


ASYNC_STEPS = 25
ASYNC_EVAL_INTERVAL = 10


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory) -> Path:
    """The quickstart's shape as a mixture of experts: tools/make-tiny-model --arch qwen3_moe (4 experts, top-2)."""
    return make_tiny_model(tmp_path_factory.mktemp("e2e-moe") / "tiny-moe", arch="qwen3_moe", hidden=64, layers=2,
                           heads=4, kv_heads=2, seed=0)


@pytest.fixture(scope="session")
def fully_async_run(tmp_path_factory, tiny_moe_model) -> tuple[RunDir, dict]:
    """recipes/quickstart-async.yaml for :data:`ASYNC_STEPS` steps with a periodic eval, its actor a mixture of
    experts (docs/moe.md; the dense actor learns in test_quickstart.py): one run (its directory and the controller's
    final state) for test_async.py (it learns within its staleness bound) and test_eval.py (eval runs between
    generates). Eval changes neither what training samples nor its seeds."""
    from relax_hpc.controller import run_controller

    with locally():
        run = make_run(tmp_path_factory.mktemp("fully-async"), tiny_moe_model, f"run.steps={ASYNC_STEPS}",
                       *eval_overrides(ASYNC_EVAL_INTERVAL), recipe=REPO / "recipes" / "quickstart-async.yaml",
                       name="async")
        return run, run_controller(run.path)


SEGMENT_STEPS = 3


@pytest.fixture(scope="session")
def damaged_segments_run(tmp_path_factory, tiny_model) -> tuple[RunDir, dict]:
    """The quickstart with a custom generate function that returns some rollouts as segments
    (e2e_rewards.generate_in_segments), 2 optimizer steps per rollout step, and step 2's chunk cut in half right
    after its announce (the controller's hook ``RELAX_TEST_DAMAGE_CHUNK``): one run (its directory and the final
    state) for test_segments.py and test_damage.py."""
    from relax_hpc.controller import run_controller

    with locally(RELAX_TEST_DAMAGE_CHUNK="2:truncate"):
        run = make_run(tmp_path_factory.mktemp("segments"), tiny_model, f"run.steps={SEGMENT_STEPS}",
                       "train.num_steps_per_rollout=2",
                       "rollout.custom_generate_function_path=e2e_rewards.generate_in_segments", name="segments")
        return run, run_controller(run.path)
