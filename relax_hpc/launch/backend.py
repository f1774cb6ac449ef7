"""The launcher's half of a run's backend: what ``relax-submit``, ``relax-status`` and ``relax-cancel`` ask of
the place a run runs, next to the controller's half (:mod:`relax_hpc.controller.backend`: start a step, stop
it, requeue, where it runs), in the same two classes. Callers ask the backend of a run (:func:`launcher_for`,
from ``job.json``'s ``executor`` or relax-submit's choice), never its name. The work itself is in the modules
each method names: the checks of a place (:mod:`.places`), starting a job (:mod:`.jobs`), a job's state
(:mod:`.jobstate`).
"""

from __future__ import annotations

import socket
from abc import abstractmethod
from typing import Any

from relax_hpc.controller.backend import Backend, LocalBackend, SlurmBackend
from relax_hpc.launch import jobs, jobstate, localproc, places, slurm
from relax_hpc.launch.jobs import Plan
from relax_hpc.launch.jobstate import JobState
from relax_hpc.launch.places import Problem
from relax_hpc.recipe import Recipe
from relax_hpc.recipe.errors import _MISSING
from relax_hpc.rundir import RunDir


class CancelError(RuntimeError):
    pass


class Launcher(Backend):
    """What the launcher's commands ask of a backend, besides the controller's half."""

    batch_script: bool  # relax-submit renders a batch script for it (the dry run prints it)
    follows: bool  # relax-submit stays and shows the run until it ends (unless --detach)
    time_limited: bool  # the job has a time limit (relax-status shows the time left)
    queued: bool  # jobs wait in a scheduler's queue: one may be held until another ends (a sweep's throttle)
    needs_pid: bool  # job.json must name the run's process id (it is what relax-status and relax-cancel look at)
    component_nodes: str | None  # the nodes of a component relax-status knows only from the recipe

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


class SlurmLauncher(SlurmBackend, Launcher):
    batch_script = True
    follows = False
    time_limited = True
    queued = True
    needs_pid = False
    component_nodes = None

    def job_label(self, record: dict) -> str:
        return f"Slurm job {record['job_id']}"

    def ended_cleanly(self, job: dict) -> str:
        return "Slurm says the job COMPLETED"

    def component_label(self, job: dict, het_group: int) -> str:
        return f"{job.get('job_id')}+{het_group}"

    def job_id_ok(self, job_id: object) -> bool:
        return str(job_id).split("+")[0].isdigit()

    def cancel(self, rd: RunDir, job: dict, grace_s: float) -> str:
        """``scancel`` the het job (all components at once)."""
        slurm.scancel(job["job_id"])
        return f"scancel {job['job_id']}"

    def place_problems(self, recipe: Recipe, layout: bool) -> list[Problem]:
        """The partition's nodes from ``sinfo`` (:func:`~relax_hpc.launch.places.check_slurm`)."""
        try:
            nodes, default = slurm.sinfo_nodes(), slurm.default_partition()
        except slurm.SlurmError as e:
            return [("<cluster>", _MISSING, f"cannot check the recipe against the "
                     f"cluster: {e}. Fix: check that Slurm answers (sinfo), or run with --local")]
        return places.check_slurm(recipe, nodes, default) if layout else []

    def job_state(self, rd: RunDir, job: dict, ctl: dict) -> JobState:
        """Slurm's rows for the het job (squeue, then sacct); UNKNOWN if Slurm does not answer."""
        try:
            return jobstate.slurm_state(rd, job, ctl)
        except slurm.SlurmError as e:
            return "UNKNOWN", f"cannot ask Slurm: {e}", [], "none"

    def submit(self, p: Plan, rd: RunDir) -> tuple[dict, Any]:
        """The batch script, written to ``RUN_DIR/job.sbatch``, as one het job."""
        return jobs.start_slurm(p, rd)

    def resume(self, rd: RunDir, old: dict, python: str | None) -> tuple[dict, Any]:
        """A continuation job (:func:`~relax_hpc.launch.jobs.resubmit`); nothing to follow."""
        return jobs.resubmit(rd.path, python), None


class LocalLauncher(LocalBackend, Launcher):
    batch_script = False
    follows = True
    time_limited = False
    queued = False
    needs_pid = True
    component_nodes = "localhost"

    def job_label(self, record: dict) -> str:
        return f"local process {record['pid']}"

    def ended_cleanly(self, job: dict) -> str:
        return f"the local process {job['pid']} returned"

    def component_label(self, job: dict, het_group: int) -> str:
        return "local"

    def cancel(self, rd: RunDir, job: dict, grace_s: float) -> str:
        """Stop the run's process group (:func:`~relax_hpc.launch.localproc.stop_group`), on its own host only."""
        if job.get("host") and job["host"] != socket.gethostname():
            raise CancelError(f"run {rd.name} runs on host {job['host']}: run relax-cancel there")
        if not isinstance(job.get("pid"), int):
            raise CancelError(f"{rd.job} names no process id ('pid') of the local run {rd.name}: nothing to signal. "
                              "Fix: relax-cancel --checkpoint asks its controller over its socket")
        outcome = localproc.stop_group(int(job["pid"]), job.get("pid_start"), grace_s=grace_s)
        if outcome == "pid reused":
            raise CancelError(f"process {job['pid']} of run {rd.name} has ended and its PID now belongs to "
                              "another process; nothing was signalled")
        return outcome

    def place_problems(self, recipe: Recipe, layout: bool) -> list[Problem]:
        """This machine's CUDA GPUs (:func:`~relax_hpc.launch.places.check_local`)."""
        return places.check_local(recipe, places.cuda_device_count) if layout else []

    def job_state(self, rd: RunDir, job: dict, ctl: dict) -> JobState:
        """The run's process (alive, or its submitit result), on its own host only."""
        return jobstate.local_state(rd, job, ctl)

    def submit(self, p: Plan, rd: RunDir) -> tuple[dict, Any]:
        """A process group of this machine, under submitit's local runner."""
        return jobs.start_local(p, rd)

    def resume(self, rd: RunDir, old: dict, python: str | None) -> tuple[dict, Any]:
        """A new local process (:func:`~relax_hpc.launch.jobs.resume_local`)."""
        return jobs.resume_local(rd, old, python)


LAUNCHERS: dict[str, type[Launcher]] = {"slurm": SlurmLauncher, "local": LocalLauncher}


def launcher_for(executor: str | None) -> Launcher:
    """The backend named ``executor``; None (a job.json from before the field existed) is Slurm."""
    name = executor or "slurm"
    if name not in LAUNCHERS:
        raise ValueError(f"unknown executor {name!r}; known: {', '.join(LAUNCHERS)}")
    return LAUNCHERS[name]()
