"""Where a run's steps run: one interface, with a Slurm and a local implementation (like submitit's one
``Executor`` per cluster).

The controller picks its backend once per attempt (:func:`backend_from_env`) and then asks it, never its name:
how a role step and an engine step are started (the command a backend wraps around the role's own), how they
are stopped, where the controller and each het group run, whether a SIGTERM may be a preemption, how engines
may be added, and how a REQUEUED attempt comes back. ``name`` is what ``state.json`` and ``job.json`` record.

This half lives in the controller because the controller starts its own steps (also as
``python -m relax_hpc.controller RUN_DIR``) and the launcher imports the controller, not the other way round.
The launcher's half (submit, the job's state, cancel, the checks before submitting) extends these classes in
:mod:`relax_hpc.launch.backend`; the Slurm commands run from outside a step (``scontrol requeue``, a
continuation job's ``sbatch``) are handed in by the launcher (:mod:`.requeue`).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from relax_hpc.controller import container
from relax_hpc.errors import PermanentError
from relax_hpc.recipe import Recipe, RoleStep, role_steps
from relax_hpc.rundir import RunDir

log = logging.getLogger("relax_hpc.controller")
EXECUTORS = ("slurm", "local")
CPU_BIND_ENV = "RELAX_LOCAL_CPUS"  # local executor: "actor=0;rollout=1": each role's processes on those CPUs
LOCAL_REQUEUE_EXIT = 144  # submitit.local.local.LOCAL_REQUEUE_RETURN_CODE
LOCAL_STEPS = 4  # step engines a local run may add when rollout.elastic.max_engines is unset (one machine)

RequeueJob = Callable[[str], Any]  # ``scontrol requeue JOB_ID``; raises if Slurm refuses
Resubmit = Callable[[Path], dict]  # submit a continuation job for a run directory; returns the new job.json


@dataclass(frozen=True)
class Proc:
    argv: list[str]
    env: dict[str, str]  # added to the controller's environment
    log: Path  # stdout+stderr of this process (for srun: srun's own messages; tasks log via --output)


def task_log_pattern(run_dir: Path, role: str) -> Path:
    """Per-rank log; ``%t`` is the rank (srun expands it; the local launcher substitutes it)."""
    return run_dir / "logs" / f"{role}.%t.log"


def local_cpus(env: Mapping[str, str] | None = None) -> dict[str, str]:
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


class SchedulerPolls:
    """When the controller may ask Slurm about its jobs again (squeue/sacct, through the launcher's cache): at
    most every :attr:`every_s` s, sooner only when something changed (:meth:`changed`: a job it submitted or
    cancelled, a step that started or ended, a signal), never twice within :attr:`min_gap_s`. A slow or failed
    answer (slurmctld busy) doubles the wait, up to :attr:`max_s`; a quick one brings it back. Times are the
    caller's clock (``now``), so a simulation can drive it (tests/controller/test_scheduler_polls.py)."""

    every_s = 30.0
    min_gap_s = 5.0
    max_s = 300.0
    slow_s = 5.0  # an answer slower than this: slurmctld is struggling

    def __init__(self) -> None:
        self.wait_s = self.every_s
        self.last: float | None = None  # when it last asked
        self.next_at = float("-inf")  # the first question may go at once
        self.asked = 0  # questions so far (what the docs' figure counts)

    def changed(self) -> None:
        """Something changed: ask at the next turn (once :attr:`min_gap_s` has passed since the last question)."""
        self.next_at = min(self.next_at, (self.last if self.last is not None else float("-inf")) + self.min_gap_s)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def done(self, now: float, took_s: float, ok: bool = True) -> None:
        """A question went at ``now``, answered (``ok``) or not in ``took_s``: when the next one may go."""
        self.asked += 1
        self.wait_s = min(self.max_s, self.wait_s * 2) if not ok or took_s > self.slow_s else self.every_s
        self.last, self.next_at = now, now + self.wait_s


class Backend(ABC):
    """Where the steps of a run run. Each implementation answers for one place; callers never compare names."""

    name: str  # "slurm" | "local": state.json's and job.json's ``executor``
    preemption_requeues: bool  # a SIGTERM may be the scheduler's preemption, after which it requeues the job
    attaches: bool  # engines may come as jobs of their own (relax-scale --attach)
    engine_places: str  # what a scale-out's engines are started as (the scale event says it)
    no_room_fix: str  # what to do when a scale-out finds no room in the run's allocation
    bind_host: str  # the control socket's bind address
    container_runtimes: tuple[str, ...] = ()  # the slurm.container runtimes its steps can run in
    steps_here = False  # its steps start on this machine (a container's runner must be on this PATH)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- where it runs
    @abstractmethod
    def control_host(self, env: Mapping[str, str]) -> str:
        """The host the roles reach the controller on (``controller.json``)."""

    @abstractmethod
    def nodelist(self, het_group: int, env: Mapping[str, str]) -> str:
        """The nodes of het group ``het_group`` (``state.json``'s ``het_nodelist``)."""

    # -- start a step, stop it
    @abstractmethod
    def role_procs(self, step: RoleStep, recipe: Recipe, run_dir: Path, argv: list[str],
                   env: dict[str, str]) -> list[Proc]:
        """The processes that run role ``step``: ``argv`` (one rank's command) for each rank, with ``env``."""

    @abstractmethod
    def rendezvous(self, recipe: Recipe) -> str:
        """How the ranks of a step find each other (``RELAX_RENDEZVOUS``): ``mpi`` or ``file``."""

    @abstractmethod
    def engine_step_argv(self, recipe: Recipe, run_dir: Path, name: str, argv: list[str],
                         exclude: list[str] = ()) -> list[str]:
        """Engine ``name``'s step around its host's command ``argv`` (off the ``exclude`` nodes)."""

    def in_container(self, recipe: Recipe, run_dir: Path, argv: list[str], pythonpath: str | None = None) -> list[str]:
        """A step's own command as it runs in ``slurm.container`` (:func:`.container.command`); PermanentError
        for a runtime this backend cannot start."""
        why = container.unserved(recipe, self.container_runtimes, self.steps_here)
        if why:
            raise PermanentError(f"slurm.container.runtime: {why}")
        return container.command(recipe, run_dir, argv, pythonpath)

    def describe(self, proc: Proc) -> str:
        """One started process as ``relax-submit --dry-run`` prints it, shell-quoted."""
        return shlex.join(proc.argv)

    def stop(self, ps: list[subprocess.Popen], grace_s: float = 10.0, *, group: bool = True) -> None:
        """Stop started steps (:func:`stop_processes`): srun forwards the signal to its tasks."""
        stop_processes(ps, grace_s, group=group)

    # -- engines added while the run goes
    @abstractmethod
    def spare_engines(self, recipe: Recipe, used: int, count: int) -> int:
        """Room for more step engines: ``used`` step engines live or asked for, ``count`` engines in all."""

    @abstractmethod
    def spares_apart(self, recipe: Recipe) -> bool:
        """Whether scale-out's step engines go off the nodes of the run's own engines."""

    # -- requeue
    @abstractmethod
    def come_back(self, run: RunDir, recipe: Recipe, requeue_job: RequeueJob | None,
                  resubmit: Resubmit | None) -> str:
        """Requeue this attempt or submit its continuation; returns what was done (may not return)."""


LAYOUT_ENV = "RELAX_SLURM_LAYOUT"  # the batch script says the layout it was submitted in (slurm.layout settled)
GROUP_NODES_ENV = "RELAX_GROUP_NODELIST_"  # + K: single layout, group K's nodes (the batch script sets them)


def slurm_layout(recipe: Recipe, env: Mapping[str, str] | None = None) -> str:
    """``hetjob`` or ``single``: the recipe's ``slurm.layout`` (relax-submit settles ``auto`` before the recipe is
    copied into the run), else what the batch script says (:data:`LAYOUT_ENV`), else a het job if Slurm says so
    (``SLURM_HET_SIZE``), else hetjob (a dry run that did not ask the site: ``--render-only``)."""
    if recipe.slurm.layout != "auto":
        return recipe.slurm.layout
    env = os.environ if env is None else env
    told = env.get(LAYOUT_ENV)
    if told in ("hetjob", "single"):
        return told
    return "single" if env.get("SLURM_JOB_ID") and not env.get("SLURM_HET_SIZE") else "hetjob"


class SlurmBackend(Backend):
    """A role is one job step: ``srun --het-group=K`` in a het job, ``srun --relative=OFFSET`` on its group's nodes
    in the ``single`` layout (:func:`slurm_layout`); ``--overlap`` when it shares another role's nodes, or, like
    the rollout driver, shares its nodes with the engine steps. An engine is one task on one node of rollout's
    component (het) or of rollout's nodes (single)."""

    name = "slurm"
    preemption_requeues = True
    attaches = True
    engine_places = "new job step(s)"
    no_room_fix = "add spare nodes (roles.rollout.elastic) or use --attach"
    bind_host = "0.0.0.0"
    container_runtimes = ("pyxis", "apptainer")

    def control_host(self, env: Mapping[str, str]) -> str:
        return env.get("SLURMD_NODENAME") or socket.gethostname()

    def nodelist(self, het_group: int, env: Mapping[str, str]) -> str:
        # a het component's own list; in the single layout the batch script's (the group's slice of the allocation)
        return env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{het_group}") or env.get(f"{GROUP_NODES_ENV}{het_group}") \
            or "localhost"

    def placement(self, step: RoleStep, recipe: Recipe) -> list[str]:
        """Where a step of ``step``'s group goes: its het component, or its group's first node of the one
        allocation (``--relative``; the step's ``--nodes`` are that node and the next ones, its group's)."""
        if slurm_layout(recipe) == "hetjob":
            return [f"--het-group={step.het_group}"]
        return [f"--relative={step.node_offset}"]

    def rendezvous(self, recipe: Recipe) -> str:
        return "mpi" if recipe.slurm.mpi == "pmix" else "file"

    def srun_argv(self, step: RoleStep, recipe: Recipe, run_dir: Path, argv: list[str],
                  pythonpath: str | None = None) -> list[str]:
        """The role's step; in ``slurm.container`` (:mod:`.container`) when the recipe has one."""
        out = ["srun", *self.placement(step, recipe)]
        if step.shared or step.overlap:
            out.append("--overlap")
        return [*out, f"--nodes={step.nodes}", f"--ntasks={step.ntasks}", f"--ntasks-per-node={step.tasks_per_node}",
                f"--cpus-per-task={recipe.role(step.role).cpus_per_task}",
                *([f"--mpi={recipe.slurm.mpi}"] if recipe.slurm.mpi != "none" else []),  # none: no flag at all
                "--kill-on-bad-exit=1", f"--output={task_log_pattern(run_dir, step.role)}",
                *container.srun_options(recipe, run_dir), *recipe.slurm.srun_args,
                *self.in_container(recipe, run_dir, argv, pythonpath)]

    def role_procs(self, step: RoleStep, recipe: Recipe, run_dir: Path, argv: list[str],
                   env: dict[str, str]) -> list[Proc]:
        return [Proc(self.srun_argv(step, recipe, run_dir, argv, env.get("PYTHONPATH")), env,
                     run_dir / "logs" / f"{step.role}.srun.log")]

    def engine_step_argv(self, recipe: Recipe, run_dir: Path, name: str, argv: list[str],
                         exclude: list[str] = ()) -> list[str]:
        step = next(s for s in role_steps(recipe) if s.role == "rollout")
        g = recipe.roles.rollout
        gpus = g.gpus_per_node // max(1, g.tasks_per_node)
        if slurm_layout(recipe) == "hetjob":
            where = [f"--het-group={step.het_group}", *([f"--exclude={','.join(exclude)}"] if exclude else [])]
        else:
            where = self._single_engine_place(step, g.tasks_per_node, name, list(exclude))
        return ["srun", *where, *(["--overlap"] if step.shared else []), "--nodes=1",
                "--ntasks=1", f"--cpus-per-task={g.cpus_per_task}", *([f"--gres=gpu:{gpus}"] if gpus else []),
                "--kill-on-bad-exit=1", f"--job-name=engine-{name}",
                f"--output={Path(run_dir) / 'logs' / (name + '.host.log')}",
                *container.srun_options(recipe, run_dir), *recipe.slurm.srun_args,
                *self.in_container(recipe, run_dir, argv)]

    def _single_engine_place(self, step: RoleStep, tasks_per_node: int, name: str, exclude: list[str],
                             env: Mapping[str, str] | None = None) -> list[str]:
        """Single layout: a run's own engine ``engineK`` on its node of rollout's (``--relative``: the K-th task slot's
        node, as the het job's component fills them); any other (a scale-out's, off ``exclude``) on whichever of
        rollout's nodes Slurm finds room on: ``--exclude`` the allocation's other nodes (named by the batch script,
        :data:`GROUP_NODES_ENV`)."""
        env = os.environ if env is None else env
        if name.startswith("engine") and name[6:].isdigit() and not exclude:
            return [f"--relative={step.node_offset + int(name[6:]) // max(1, tasks_per_node)}"]
        groups = {k[len(GROUP_NODES_ENV):]: v.split(",") for k, v in env.items() if k.startswith(GROUP_NODES_ENV)}
        mine = groups.get(str(step.het_group))
        if not mine:  # no node names (a dry run): rollout's first node
            return [f"--relative={step.node_offset}"]
        others = {n for k, v in groups.items() if k != str(step.het_group) for n in v} - set(mine)
        off = sorted(others | set(exclude))
        return [f"--exclude={','.join(off)}"] if off else []

    def spare_engines(self, recipe: Recipe, used: int, count: int) -> int:
        g = recipe.roles.rollout
        return max(0, (0 if g.elastic is None else (g.nodes - g.elastic.initial) * g.tasks_per_node) - used)

    def spares_apart(self, recipe: Recipe) -> bool:
        return recipe.roles.rollout.elastic is not None

    def come_back(self, run: RunDir, recipe: Recipe, requeue_job: RequeueJob | None,
                  resubmit: Resubmit | None) -> str:
        """``scontrol requeue`` of the het job (same job id; ``SLURM_RESTART_COUNT`` counts); where requeue is
        refused (``slurm.requeue: false``, or the cluster forbids it) a continuation job for the same run
        directory."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if recipe.slurm.requeue and job_id and requeue_job is not None:
            try:
                log.info("requeue: scontrol requeue %s", job_id)
                requeue_job(job_id)  # normally we are killed here
                return f"requeued job {job_id}"
            except Exception as e:  # noqa: BLE001 - refused for whatever reason: the continuation job is the fallback
                log.warning("scontrol requeue %s was refused (%s); submitting a continuation job instead", job_id, e)
        if resubmit is None:
            raise RuntimeError("this controller was started without the launcher's requeue and resubmit "
                               "(python -m relax_hpc.controller), so it cannot come back by itself")
        record = resubmit(run.path)
        log.info("continuation job %s submitted for run %s", record["job_id"], run.name)
        return f"continuation job {record['job_id']}"


class LocalBackend(Backend):
    """A role is ``nodes × tasks_per_node`` processes of this machine, told their rank by environment variables
    (on the CPUs ``RELAX_LOCAL_CPUS`` names for the role); an engine is one more process."""

    name = "local"
    preemption_requeues = False
    attaches = False
    engine_places = "local process(es)"
    no_room_fix = "lower the target"
    bind_host = "127.0.0.1"
    container_runtimes = ("apptainer",)  # pyxis needs srun
    steps_here = True

    def control_host(self, env: Mapping[str, str]) -> str:
        return "127.0.0.1"

    def nodelist(self, het_group: int, env: Mapping[str, str]) -> str:
        return "localhost"

    def rendezvous(self, recipe: Recipe) -> str:
        return "file"

    def role_procs(self, step: RoleStep, recipe: Recipe, run_dir: Path, argv: list[str],
                   env: dict[str, str]) -> list[Proc]:
        bind = local_cpus().get(step.role)
        taskset = ["taskset", "-c", bind] if bind else []  # the engines it starts inherit the binding
        argv = self.in_container(recipe, run_dir, argv, env.get("PYTHONPATH"))  # Apptainer runs here too
        procs = []
        for rank in range(step.ntasks):
            rank_env = {**env, "RELAX_RANK": str(rank), "RELAX_WORLD_SIZE": str(step.ntasks),
                        "RELAX_LOCAL_RANK": str(rank % step.tasks_per_node), "RELAX_NODE": "localhost"}
            rank_log = Path(str(task_log_pattern(run_dir, step.role)).replace("%t", str(rank)))
            procs.append(Proc([*taskset, *argv], rank_env, rank_log))
        return procs

    def describe(self, proc: Proc) -> str:
        """With the rank's ``RELAX_*`` variables (a local rank is told its rank by them)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(proc.env.items())
                       if k.startswith("RELAX_") and k not in ("RELAX_LAUNCH_ID",))
        return f"{env} {shlex.join(proc.argv)}".strip()

    def engine_step_argv(self, recipe: Recipe, run_dir: Path, name: str, argv: list[str],
                         exclude: list[str] = ()) -> list[str]:
        bind = local_cpus().get("rollout")
        return [*(["taskset", "-c", bind] if bind else []), *self.in_container(recipe, run_dir, argv)]

    def spare_engines(self, recipe: Recipe, used: int, count: int) -> int:
        """``rollout.elastic.max_engines`` in all, or :data:`LOCAL_STEPS` step engines (one machine)."""
        cap = recipe.rollout.elastic.max_engines
        return max(0, cap - count if cap is not None else LOCAL_STEPS - used)

    def spares_apart(self, recipe: Recipe) -> bool:
        return False

    def come_back(self, run: RunDir, recipe: Recipe, requeue_job: RequeueJob | None,
                  resubmit: Resubmit | None) -> str:
        """Exit with submitit's requeue code: its local runner starts the controller again."""
        log.info("requeue: exiting with code %d; the local runner starts the controller again", LOCAL_REQUEUE_EXIT)
        raise SystemExit(LOCAL_REQUEUE_EXIT)


BACKENDS: dict[str, type[Backend]] = {"slurm": SlurmBackend, "local": LocalBackend}


def backend_for(executor: str | Backend) -> Backend:
    """The backend named ``executor`` (a Backend is returned as it is)."""
    if isinstance(executor, Backend):
        return executor
    if executor not in BACKENDS:
        raise ValueError(f"unknown executor {executor!r}; known: {', '.join(EXECUTORS)}")
    return BACKENDS[executor]()


def executor_from_env(env: Mapping[str, str] | None = None) -> str:
    """``RELAX_EXECUTOR`` if set, else ``slurm`` inside a het job's batch script, else ``local``."""
    env = os.environ if env is None else env
    chosen = env.get("RELAX_EXECUTOR")
    if chosen:
        if chosen not in EXECUTORS:
            raise ValueError(f"RELAX_EXECUTOR={chosen!r}: must be one of {', '.join(EXECUTORS)}")
        return chosen
    return "slurm" if env.get("SLURM_JOB_ID") and env.get("SLURM_HET_SIZE") else "local"


def backend_from_env(env: Mapping[str, str] | None = None) -> Backend:
    """The backend this controller runs on (:func:`executor_from_env`)."""
    return backend_for(executor_from_env(env))
