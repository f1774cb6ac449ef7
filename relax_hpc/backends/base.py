"""The one interface of a place a run runs (like submitit's abstract ``Executor`` and ``JobEnvironment`` in its
core): :class:`Backend`, whose two halves are one class. The in-job half is what the controller asks: how a role
step and an engine step are started (the command a backend wraps around the role's own), how they are stopped,
where the controller and each het group run, whether a SIGTERM may be a preemption, how engines may be added,
and how a REQUEUED attempt comes back. The submit half is what ``relax-submit``, ``relax-status`` and
``relax-cancel`` ask: submit, resume, a job's state, cancel, the checks of a place. ``name`` is what
``state.json`` and ``job.json`` record; callers ask a backend, never its name.

The backends sit below the controller and the launcher. The submit half's work is done by launch's modules
(starting a job imports the controller it starts), so the launcher hands them in (:class:`LaunchTools`), as it
hands the controller ``scontrol requeue`` and the continuation job (:meth:`Backend.come_back`).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Mapping

from relax_hpc.backends import container
from relax_hpc.errors import PermanentError
from relax_hpc.recipe import Recipe, RoleStep
from relax_hpc.rundir import RunDir

if TYPE_CHECKING:  # the launcher's types, in annotations only
    from relax_hpc.launch.jobs import Plan
    from relax_hpc.launch.jobstate import JobState
    from relax_hpc.launch.places import Problem

log = logging.getLogger("relax_hpc.controller")

RequeueJob = Callable[[str], Any]  # ``scontrol requeue JOB_ID``; raises if Slurm refuses
Resubmit = Callable[[Path], dict]  # submit a continuation job for a run directory; returns the new job.json


class CancelError(RuntimeError):
    pass


@dataclass(frozen=True)
class Proc:
    argv: list[str]
    env: dict[str, str]  # added to the controller's environment
    log: Path  # stdout+stderr of this process (for srun: srun's own messages; tasks log via --output)


@dataclass(frozen=True)
class LaunchTools:
    """The launcher's modules a backend's submit half works with (modules, not their functions: a test's
    monkeypatch of one is seen). Handed in by :func:`relax_hpc.launch.tools.launcher_for`."""

    jobs: ModuleType  # starting a job, a continuation, a local process (relax_hpc.launch.jobs)
    jobstate: ModuleType  # a job's state as relax-status reports it (relax_hpc.launch.jobstate)
    places: ModuleType  # the checks of a place (relax_hpc.launch.places)
    slurm: ModuleType  # Slurm's commands (relax_hpc.launch.slurm)
    localproc: ModuleType  # a local run's process group (relax_hpc.launch.localproc)


def task_log_pattern(run_dir: Path, role: str) -> Path:
    """Per-rank log; ``%t`` is the rank (srun expands it; the local launcher substitutes it)."""
    return run_dir / "logs" / f"{role}.%t.log"


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


class Backend(ABC):
    """Where the steps of a run run. Each implementation answers for one place; callers never compare names."""

    name: str  # "slurm" | "local": state.json's and job.json's ``executor``
    # -- the in-job half
    preemption_requeues: bool  # a SIGTERM may be the scheduler's preemption, after which it requeues the job
    attaches: bool  # engines may come as jobs of their own (relax-scale --attach)
    engine_places: str  # what a scale-out's engines are started as (the scale event says it)
    no_room_fix: str  # what to do when a scale-out finds no room in the run's allocation
    bind_host: str  # the control socket's bind address
    container_runtimes: tuple[str, ...] = ()  # the slurm.container runtimes its steps can run in
    steps_here = False  # its steps start on this machine (a container's runner must be on this PATH)
    forks = False  # its steps and engines may be forked from a server of the run's (relax_hpc.forkserver): a
    # scheduler would not count, signal or end what such a server starts
    # -- the submit half
    batch_script: bool  # relax-submit renders a batch script for it (the dry run prints it)
    follows: bool  # relax-submit stays and shows the run until it ends (unless --detach)
    time_limited: bool  # the job has a time limit (relax-status shows the time left)
    queued: bool  # jobs wait in a scheduler's queue: one may be held until another ends (a sweep's throttle)
    needs_pid: bool  # job.json must name the run's process id (it is what relax-status and relax-cancel look at)
    component_nodes: str | None  # the nodes of a component relax-status knows only from the recipe

    def __init__(self, launch: LaunchTools | None = None) -> None:
        self.launch = launch

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @property
    def tools(self) -> LaunchTools:
        """The launcher's modules (the submit half's work); a clear error for a backend made without them."""
        if self.launch is None:
            raise RuntimeError(f"{type(self).__name__} was made without the launcher's tools, which submit, resume, "
                               "job_state, cancel and place_problems need. Fix: get the backend with "
                               "relax_hpc.launch.tools.launcher_for(executor)")
        return self.launch

    # ---------------------------------------------------------------------------- the in-job half ---
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

    # ---------------------------------------------------------------------------- the submit half ---
    @abstractmethod
    def job_label(self, record: dict) -> str:
        """The submitted job in relax-submit's sentence ("Submitted run X as ...")."""

    @abstractmethod
    def ended_cleanly(self, job: dict) -> str:
        """Who says the job ended without an error (relax-status, when state.json is missing)."""

    @abstractmethod
    def component_label(self, job: dict, het_group: int) -> str:
        """A het group's label in relax-status when the scheduler has no row for it."""

    def job_id_ok(self, job_id: object) -> bool:
        """Whether ``job.json``'s ``job_id`` can be this backend's."""
        return True

    @abstractmethod
    def cancel(self, rd: RunDir, job: dict, grace_s: float) -> str:
        """Stop the whole run at once (relax-cancel); returns what was done. :class:`CancelError` if it cannot."""

    @abstractmethod
    def place_problems(self, recipe: Recipe, layout: bool) -> list[Problem]:
        """What keeps ``recipe`` from running here (relax-submit's checks); ``layout``: check the roles' layout
        against the place too (not when a ``share_with`` was refused)."""

    @abstractmethod
    def job_state(self, rd: RunDir, job: dict, ctl: dict) -> JobState:
        """The job of ``job.json`` (``job``) as relax-status reports it, joined with ``state.json`` (``ctl``)."""

    @abstractmethod
    def submit(self, p: Plan, rd: RunDir) -> tuple[dict, Any]:
        """Start the run of ``p`` in ``rd``; (job.json's fields for it, the submitit job).
        :class:`~relax_hpc.launch.jobs.SubmitError` if it could not be started."""

    @abstractmethod
    def resume(self, rd: RunDir, old: dict, python: str | None) -> tuple[dict, Any]:
        """Start the ended run ``rd`` (whose job.json was ``old``) again; (the new job.json, the submitit job to
        follow, or None)."""
