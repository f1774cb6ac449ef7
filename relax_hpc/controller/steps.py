"""The command lines of the role steps and the engine steps: what the controller starts, and what
``relax-submit --dry-run`` prints.

One place builds them so that the dry run shows exactly what will run. Under Slurm a role is one
``srun --het-group=K`` job step (``--overlap`` when it shares another role's component, or, like the rollout
driver, shares its nodes with the engine steps); locally it is ``nodes × tasks_per_node`` processes of the same
module, told their rank by environment variables. A rollout engine is a step of its own
(:func:`start_engine_step`: one task on one node of rollout's component, or a local process), so engines come and
go while the roles' steps stay. Argument lists only: nothing here goes through a shell.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import relax_hpc
from relax_hpc.recipe import Recipe, RoleStep, initial_engines, role_steps

log = logging.getLogger("relax_hpc.controller")

EXECUTORS = ("slurm", "local")
CPU_BIND_ENV = "RELAX_LOCAL_CPUS"  # local executor: "actor=0;rollout=1": each role's processes on those CPUs


def local_cpus(env: dict[str, str] | None = None) -> dict[str, str]:
    """``RELAX_LOCAL_CPUS`` as {role: cpu list for taskset -c}. On a small machine roles that share cores cannot
    overlap (fully async gains nothing), and a benchmark of the modes must pin them apart (tools/bench/run)."""
    spec = (os.environ if env is None else env).get(CPU_BIND_ENV, "")
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        role, eq, cpus = part.partition("=")
        if not eq or not cpus.strip() or not all(c.isdigit() for c in cpus.replace(",", "").replace("-", "")):
            raise ValueError(f"{CPU_BIND_ENV}={spec!r}: expected ROLE=CPUS[;ROLE=CPUS], e.g. actor=0;rollout=1")
        out[role.strip()] = cpus.strip()
    return out
PACKAGE_ROOT = str(Path(relax_hpc.__file__).resolve().parents[1])  # so every step imports this relax_hpc


def executor_from_env(env: dict[str, str] | None = None) -> str:
    """``RELAX_EXECUTOR`` if set, else ``slurm`` inside a het job's batch script, else ``local``."""
    env = os.environ if env is None else env
    chosen = env.get("RELAX_EXECUTOR")
    if chosen:
        if chosen not in EXECUTORS:
            raise ValueError(f"RELAX_EXECUTOR={chosen!r}: must be one of {', '.join(EXECUTORS)}")
        return chosen
    return "slurm" if env.get("SLURM_JOB_ID") and env.get("SLURM_HET_SIZE") else "local"


@dataclass(frozen=True)
class Proc:
    argv: list[str]
    env: dict[str, str]  # added to the controller's environment
    log: Path  # stdout+stderr of this process (for srun: srun's own messages; tasks log via --output)


@dataclass(frozen=True)
class StepCommand:
    step: RoleStep
    launch_id: str  # fresh per start: a rendezvous file from an earlier attempt is never mistaken for ours
    procs: list[Proc] = field(default_factory=list)

    @property
    def role(self) -> str:
        return self.step.role


def role_module(role: str) -> str:
    return f"relax_hpc.roles.{role}"


def task_log_pattern(run_dir: Path, role: str) -> Path:
    """Per-rank log; ``%t`` is the rank (srun expands it; the local launcher substitutes it)."""
    return run_dir / "logs" / f"{role}.%t.log"


def srun_argv(step: RoleStep, recipe: Recipe, run_dir: Path, python: str = sys.executable) -> list[str]:
    argv = ["srun", f"--het-group={step.het_group}"]
    if step.shared or step.overlap:
        argv.append("--overlap")
    argv += [
        f"--nodes={step.nodes}",
        f"--ntasks={step.ntasks}",
        f"--ntasks-per-node={step.tasks_per_node}",
        f"--cpus-per-task={recipe.role(step.role).cpus_per_task}",
        f"--mpi={recipe.slurm.mpi}",
        "--kill-on-bad-exit=1",
        f"--output={task_log_pattern(run_dir, step.role)}",
        *recipe.slurm.srun_args,
        python, "-m", role_module(step.role), str(run_dir),
    ]
    return argv


def pythonpath(path: str | None) -> str:
    """``PYTHONPATH`` ``path`` with this relax_hpc first, so that every step and job imports it."""
    return PACKAGE_ROOT + (os.pathsep + path if path else "")


def _common_env(recipe: Recipe, launch_id: str, rendezvous: str) -> dict[str, str]:
    return {
        **recipe.slurm.env,
        "RELAX_LAUNCH_ID": launch_id,
        "RELAX_RENDEZVOUS": rendezvous,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": pythonpath(os.environ.get("PYTHONPATH")),
    }


def step_commands(recipe: Recipe, run_dir: str | Path, executor: str,
                  python: str = sys.executable) -> list[StepCommand]:
    """What to start for each role step, in het-group order."""
    run_dir = Path(run_dir).resolve()
    out = []
    for step in role_steps(recipe):
        launch_id = secrets.token_hex(6)
        if executor == "slurm":
            rendezvous = "mpi" if recipe.slurm.mpi == "pmix" else "file"
            env = _common_env(recipe, launch_id, rendezvous)
            procs = [Proc(srun_argv(step, recipe, run_dir, python), env, run_dir / "logs" / f"{step.role}.srun.log")]
        elif executor == "local":
            procs = []
            bind = local_cpus().get(step.role)
            taskset = ["taskset", "-c", bind] if bind else []  # the engines it starts inherit the binding
            for rank in range(step.ntasks):
                env = {**_common_env(recipe, launch_id, "file"), "RELAX_RANK": str(rank),
                       "RELAX_WORLD_SIZE": str(step.ntasks), "RELAX_LOCAL_RANK": str(rank % step.tasks_per_node),
                       "RELAX_NODE": "localhost"}
                rank_log = Path(str(task_log_pattern(run_dir, step.role)).replace("%t", str(rank)))
                procs.append(Proc([*taskset, python, "-m", role_module(step.role), str(run_dir)], env, rank_log))
        else:
            raise ValueError(f"unknown executor {executor!r}; known: {', '.join(EXECUTORS)}")
        out.append(StepCommand(step, launch_id, procs))
    return out


def describe_steps(recipe: Recipe, run_dir: str | Path, python: str = sys.executable) -> list[str]:
    """The Slurm step commands, shell-quoted: one per role, then one per engine the run starts with (for
    ``relax-submit --dry-run``)."""
    run_dir = Path(run_dir).resolve()
    return [*(shlex.join(srun_argv(s, recipe, run_dir, python)) for s in role_steps(recipe)),
            *engine_lines(recipe, run_dir, "slurm", python)]


def engine_lines(recipe: Recipe, run_dir: Path, executor: str, python: str = sys.executable) -> list[str]:
    """The command lines of the run's own engine steps, shell-quoted (the controller starts them itself; none
    without ``model.path``: a launch smoke run has no training loop and starts no engine)."""
    if recipe.model.path is None:
        return []
    return [shlex.join(engine_step_argv(recipe, run_dir, executor, name, "initial", "initial", python=python))
            for name in initial_engines(recipe)]


def engine_argv(run_dir: Path, name: str, origin: str, op: str, python: str = sys.executable) -> list[str]:
    """One engine's host (:mod:`relax_hpc.roles.engine`); an attached job's tasks run it too."""
    return [python, "-m", "relax_hpc.roles.engine", str(run_dir), "--name", name, "--origin", origin, "--op", op]


def engine_step_argv(recipe: Recipe, run_dir: Path, executor: str, name: str, origin: str, op: str,
                     exclude: list[str] = (), python: str = sys.executable) -> list[str]:
    """Engine ``name``'s step: under Slurm one task on one node of rollout's het component (its share of the
    node's GPUs; ``--overlap`` when rollout shares another role's component; off the ``exclude`` nodes), locally
    a process of this machine (on rollout's CPUs of ``RELAX_LOCAL_CPUS``). Its log:
    ``RUN_DIR/logs/<name>.host.log``; the engine's own: ``<name>.log``."""
    argv = engine_argv(run_dir, name, origin, op, python)
    if executor != "slurm":
        bind = local_cpus().get("rollout")
        return [*(["taskset", "-c", bind] if bind else []), *argv]
    step = next(s for s in role_steps(recipe) if s.role == "rollout")
    g = recipe.roles.rollout
    gpus = g.gpus_per_node // max(1, g.tasks_per_node)
    return ["srun", f"--het-group={step.het_group}", *(["--overlap"] if step.shared else []), "--nodes=1",
            "--ntasks=1", f"--cpus-per-task={g.cpus_per_task}", *([f"--gres=gpu:{gpus}"] if gpus else []),
            *([f"--exclude={','.join(exclude)}"] if exclude else []), "--kill-on-bad-exit=1",
            f"--job-name=engine-{name}", f"--output={Path(run_dir) / 'logs' / (name + '.host.log')}",
            *recipe.slurm.srun_args, *argv]


def start_engine_step(recipe: Recipe, run_dir: Path, executor: str, name: str, origin: str, op: str,
                      exclude: list[str] = ()) -> subprocess.Popen:
    """:func:`engine_step_argv`, started (its own session, so it is stopped as a group)."""
    host_log = Path(run_dir) / "logs" / f"{name}.host.log"
    host_log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": pythonpath(os.environ.get("PYTHONPATH")), "PYTHONUNBUFFERED": "1",
           **recipe.slurm.env}
    with open(host_log, "ab") as out:
        return subprocess.Popen(engine_step_argv(recipe, Path(run_dir), executor, name, origin, op, exclude),
                                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_processes(ps: list[subprocess.Popen], grace_s: float = 10.0, *, group: bool = True) -> None:
    """SIGTERM every live process at once, SIGKILL those alive after ``grace_s``, and reap them. ``group``:
    signal each one's process group (an engine step: the engine host and its engine both leave; srun forwards
    it); else the process itself (a role step's srun, or a local rank).
    A process still there 5 s after SIGKILL (stuck in the kernel) is logged and left."""
    live = [p for p in ps if p.poll() is None]
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for p in live:
            try:
                if group:
                    os.killpg(p.pid, sig)
                else:
                    p.send_signal(sig)  # Popen checks the PID is still its unreaped child
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        live = [p for p in live if p.poll() is None]
        if not live:
            return
    log.warning("processes %s did not exit 5 s after SIGKILL; left as they are",
                ", ".join(str(p.pid) for p in live))
