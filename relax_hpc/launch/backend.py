"""The launcher's half of a run's backend: what ``relax-submit``, ``relax-status`` and ``relax-cancel`` ask of
the place a run runs, next to the controller's half (:mod:`relax_hpc.controller.backend`: start a step, stop
it, requeue, where it runs), in the same two classes. Callers ask the backend of a run (:func:`launcher_for`,
from ``job.json``'s ``executor`` or relax-submit's choice), never its name.
"""

from __future__ import annotations

import socket

from relax_hpc.controller.backend import Backend, LocalBackend, SlurmBackend
from relax_hpc.launch import localproc, slurm
from relax_hpc.rundir import RunDir


class CancelError(RuntimeError):
    pass


class Launcher(Backend):
    """What the launcher's commands ask of a backend, besides the controller's half."""

    batch_script: bool  # relax-submit renders a batch script for it (the dry run prints it)
    follows: bool  # relax-submit stays and shows the run until it ends (unless --detach)
    time_limited: bool  # the job has a time limit (relax-status shows the time left)
    needs_pid: bool  # job.json must name the run's process id (it is what relax-status and relax-cancel look at)
    component_nodes: str | None  # the nodes of a component relax-status knows only from the recipe

    def job_label(self, record: dict) -> str:
        """The submitted job in relax-submit's sentence ("Submitted run X as ...")."""
        raise NotImplementedError

    def ended_cleanly(self, job: dict) -> str:
        """Who says the job ended without an error (relax-status, when state.json is missing)."""
        raise NotImplementedError

    def component_label(self, job: dict, het_group: int) -> str:
        """A het group's label in relax-status when the scheduler has no row for it."""
        raise NotImplementedError

    def job_id_ok(self, job_id: object) -> bool:
        """Whether ``job.json``'s ``job_id`` can be this backend's."""
        return True

    def cancel(self, rd: RunDir, job: dict, grace_s: float) -> str:
        """Stop the whole run at once (relax-cancel); returns what was done. :class:`CancelError` if it cannot."""
        raise NotImplementedError


class SlurmLauncher(SlurmBackend, Launcher):
    batch_script = True
    follows = False
    time_limited = True
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


class LocalLauncher(LocalBackend, Launcher):
    batch_script = False
    follows = True
    time_limited = False
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


LAUNCHERS: dict[str, type[Launcher]] = {"slurm": SlurmLauncher, "local": LocalLauncher}


def launcher_for(executor: str | None) -> Launcher:
    """The backend named ``executor``; None (a job.json from before the field existed) is Slurm."""
    name = executor or "slurm"
    if name not in LAUNCHERS:
        raise ValueError(f"unknown executor {name!r}; known: {', '.join(LAUNCHERS)}")
    return LAUNCHERS[name]()
