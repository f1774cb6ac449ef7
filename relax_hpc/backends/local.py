"""The local backend, both halves: inside the run a role is ``nodes × tasks_per_node`` processes of this machine,
told their rank by environment variables (on the CPUs ``RELAX_LOCAL_CPUS`` names for the role), and an engine
one more process; from outside, a run is one process group under submitit's local runner (started, watched,
stopped by its PID), over launch's modules (:class:`~.base.LaunchTools`)."""

from __future__ import annotations

import os
import shlex
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from relax_hpc.backends.base import Backend, CancelError, Proc, RequeueJob, Resubmit, log, task_log_pattern
from relax_hpc.recipe import Recipe, RoleStep
from relax_hpc.rundir import RunDir

if TYPE_CHECKING:  # the launcher's types, in annotations only
    from relax_hpc.launch.jobs import Plan
    from relax_hpc.launch.jobstate import JobState
    from relax_hpc.launch.places import Problem

CPU_BIND_ENV = "RELAX_LOCAL_CPUS"  # local executor: "actor=0;rollout=1": each role's processes on those CPUs
LOCAL_REQUEUE_EXIT = 144  # submitit.local.local.LOCAL_REQUEUE_RETURN_CODE
LOCAL_STEPS = 4  # step engines a local run may add when rollout.elastic.max_engines is unset (one machine)


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


class LocalBackend(Backend):
    """A role is ``nodes × tasks_per_node`` processes of this machine, told their rank by environment variables
    (on the CPUs ``RELAX_LOCAL_CPUS`` names for the role); an engine is one more process. A run is one process
    group of this machine."""

    name = "local"
    preemption_requeues = False
    attaches = False
    engine_places = "local process(es)"
    no_room_fix = "lower the target"
    bind_host = "127.0.0.1"
    container_runtimes = ("apptainer",)  # pyxis needs srun
    steps_here = True
    forks = True
    batch_script = False
    follows = True
    time_limited = False
    queued = False
    needs_pid = True
    component_nodes = "localhost"

    # ---------------------------------------------------------------------------- the in-job half ---
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

    # ---------------------------------------------------------------------------- the submit half ---
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
        outcome = self.tools.localproc.stop_group(int(job["pid"]), job.get("pid_start"), grace_s=grace_s)
        if outcome == "pid reused":
            raise CancelError(f"process {job['pid']} of run {rd.name} has ended and its PID now belongs to "
                              "another process; nothing was signalled")
        return outcome

    def place_problems(self, recipe: Recipe, layout: bool) -> list[Problem]:
        """This machine's CUDA GPUs (:func:`~relax_hpc.launch.places.check_local`)."""
        places = self.tools.places
        return places.check_local(recipe, places.cuda_device_count) if layout else []

    def job_state(self, rd: RunDir, job: dict, ctl: dict) -> JobState:
        """The run's process (alive, or its submitit result), on its own host only."""
        return self.tools.jobstate.local_state(rd, job, ctl)

    def submit(self, p: Plan, rd: RunDir) -> tuple[dict, Any]:
        """A process group of this machine, under submitit's local runner."""
        return self.tools.jobs.start_local(p, rd)

    def resume(self, rd: RunDir, old: dict, python: str | None) -> tuple[dict, Any]:
        """A new local process (:func:`~relax_hpc.launch.jobs.resume_local`)."""
        return self.tools.jobs.resume_local(rd, old, python)
