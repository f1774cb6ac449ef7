"""The command lines of the role steps and the engine steps: what the controller starts, and what
``relax-submit --dry-run`` prints.

One place builds them so that the dry run shows exactly what will run: a role's or an engine's own command,
wrapped by the run's backend (:mod:`relax_hpc.backends`). Under Slurm a role is one
``srun --het-group=K`` job step (``--overlap`` when it shares another role's component, or, like the rollout
driver, shares its nodes with the engine steps); locally it is ``nodes × tasks_per_node`` processes of the same
module, told their rank by environment variables. A rollout engine is a step of its own
(:func:`start_engine_step`: one task on one node of rollout's component, or a local process), so engines come and
go while the roles' steps stay. Argument lists only: nothing here goes through a shell.
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import relax_hpc
from relax_hpc import forkserver
from relax_hpc.backends import (Backend, Proc, SlurmBackend, container, executor_from_env,  # noqa: F401
                                stop_processes, task_log_pattern)
from relax_hpc.recipe import Recipe, RoleStep, initial_engines, role_steps

PACKAGE_ROOT = str(Path(relax_hpc.__file__).resolve().parents[1])  # so every step imports this relax_hpc


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


def role_argv(role: str, run_dir: Path, python: str = sys.executable) -> list[str]:
    """One rank of a role, as the backend starts it (under srun, or as a local process)."""
    return [python, "-m", role_module(role), str(run_dir)]


def pythonpath(path: str | None) -> str:
    """``PYTHONPATH`` ``path`` with this relax_hpc first, so that every step and job imports it."""
    return PACKAGE_ROOT + (os.pathsep + path if path else "")


RESTARTED_ALONE = "RELAX_RESTARTED_ALONE"  # set in a role step started again alone (the role tier of recovery)


def _common_env(recipe: Recipe, launch_id: str, rendezvous: str) -> dict[str, str]:
    """A role step's environment beyond the controller's: ``slurm.env`` and the container's variables travel here,
    never on a command line (their values may be secrets)."""
    return {
        **recipe.slurm.env,
        **container.step_env(recipe),
        "RELAX_LAUNCH_ID": launch_id,
        "RELAX_RENDEZVOUS": rendezvous,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": pythonpath(os.environ.get("PYTHONPATH")),
    }


def step_commands(recipe: Recipe, run_dir: str | Path, backend: Backend,
                  python: str = sys.executable) -> list[StepCommand]:
    """What to start for each role step, in het-group order, on ``backend``."""
    run_dir = Path(run_dir).resolve()
    out = []
    for step in role_steps(recipe):
        launch_id = secrets.token_hex(6)
        env = _common_env(recipe, launch_id, backend.rendezvous(recipe))
        procs = backend.role_procs(step, recipe, run_dir, role_argv(step.role, run_dir, python), env)
        out.append(StepCommand(step, launch_id, procs))
    return out


def step_command(recipe: Recipe, run_dir: str | Path, backend: Backend, role: str, *, restarted: bool = False,
                 python: str = sys.executable) -> StepCommand:
    """What to start for ``role``'s step alone (with ``restarted``: started again alone, the role tier of recovery:
    its ranks then skip the cross-role check, which needs every role's rank 0)."""
    run_dir = Path(run_dir).resolve()
    step = next(s for s in role_steps(recipe) if s.role == role)
    launch_id = secrets.token_hex(6)
    env = _common_env(recipe, launch_id, backend.rendezvous(recipe))
    if restarted:
        env[RESTARTED_ALONE] = "1"
    return StepCommand(step, launch_id, backend.role_procs(step, recipe, run_dir, role_argv(role, run_dir, python), env))


def describe_steps(recipe: Recipe, run_dir: str | Path, python: str = sys.executable,
                   backend: Backend = SlurmBackend()) -> list[str]:
    """The step commands as ``backend`` prints them (:meth:`~relax_hpc.backends.Backend.describe`): one per role
    (per rank locally), then one per engine the run starts with (for ``relax-submit --dry-run``)."""
    run_dir = Path(run_dir).resolve()
    return [*(backend.describe(proc) for sc in step_commands(recipe, run_dir, backend, python) for proc in sc.procs),
            *engine_lines(recipe, run_dir, backend, python)]


def engine_lines(recipe: Recipe, run_dir: Path, backend: Backend, python: str = sys.executable) -> list[str]:
    """The command lines of the run's own engine steps, shell-quoted (the controller starts them itself; none
    without ``model.path``: a launch smoke run has no training loop and starts no engine)."""
    if recipe.model.path is None:
        return []
    return [shlex.join(engine_step_argv(recipe, run_dir, backend, name, "initial", "initial", python=python))
            for name in initial_engines(recipe)]


def engine_argv(run_dir: Path, name: str, origin: str, op: str, python: str = sys.executable) -> list[str]:
    """One engine's host (:mod:`relax_hpc.roles.engine`); an attached job's tasks run it too."""
    return [python, "-m", "relax_hpc.roles.engine", str(run_dir), "--name", name, "--origin", origin, "--op", op]


def engine_step_argv(recipe: Recipe, run_dir: Path, backend: Backend, name: str, origin: str, op: str,
                     exclude: list[str] = (), python: str = sys.executable) -> list[str]:
    """Engine ``name``'s step: under Slurm one task on one node of rollout's het component (its share of the
    node's GPUs; ``--overlap`` when rollout shares another role's component; off the ``exclude`` nodes), locally
    a process of this machine (on rollout's CPUs of ``RELAX_LOCAL_CPUS``). Its log:
    ``RUN_DIR/logs/<name>.host.log``; the engine's own: ``<name>.log``."""
    return backend.engine_step_argv(recipe, Path(run_dir), name, engine_argv(run_dir, name, origin, op, python),
                                    list(exclude))


def start_engine_step(recipe: Recipe, run_dir: Path, backend: Backend, name: str, origin: str, op: str,
                      exclude: list[str] = ()) -> forkserver.Process:
    """:func:`engine_step_argv`, started (its own session, so it is stopped as a group)."""
    host_log = Path(run_dir) / "logs" / f"{name}.host.log"
    host_log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": pythonpath(os.environ.get("PYTHONPATH")), "PYTHONUNBUFFERED": "1",
           **recipe.slurm.env, **container.step_env(recipe)}
    with open(host_log, "ab") as out:
        return forkserver.popen(engine_step_argv(recipe, Path(run_dir), backend, name, origin, op, exclude),
                                env=env, stdout=out)
