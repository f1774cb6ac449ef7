"""The Slurm backend, both halves (like submitit's ``slurm/slurm.py``): inside the job a role is one job step
(``srun --het-group=K`` in a het job, ``srun --relative=OFFSET`` on its group's nodes in the ``single`` layout,
:func:`slurm_layout`) and an engine one task on one node of rollout's; from outside, a run is one batch job
(submitted, watched through squeue/sacct, scancel-ed), over launch's modules (:class:`~.base.LaunchTools`)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from relax_hpc.backends import container
from relax_hpc.backends.base import Backend, Proc, RequeueJob, Resubmit, log, task_log_pattern
from relax_hpc.recipe import Recipe, RoleStep, role_steps
from relax_hpc.recipe.layout import engine_node, one_component
from relax_hpc.recipe.errors import _MISSING
from relax_hpc.rundir import RunDir

if TYPE_CHECKING:  # the launcher's types, in annotations only
    from relax_hpc.launch.jobs import Plan
    from relax_hpc.launch.jobstate import JobState
    from relax_hpc.launch.places import Problem

LAYOUT_ENV = "RELAX_SLURM_LAYOUT"  # the batch script says the layout it was submitted in (slurm.layout settled)
GROUP_NODES_ENV = "RELAX_GROUP_NODELIST_"  # + K: single layout, group K's nodes (the batch script sets them)


def slurm_layout(recipe: Recipe, env: Mapping[str, str] | None = None) -> str:
    """``hetjob`` or ``single``: the recipe's ``slurm.layout`` (relax-submit settles ``auto`` before the recipe is
    copied into the run), else what the batch script says (:data:`LAYOUT_ENV`), else a het job if Slurm says so
    (``SLURM_HET_SIZE``), else hetjob (a dry run that did not ask the site: ``--render-only``)."""
    if one_component(recipe):
        return "single"
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
    component (het) or of rollout's nodes (single). A run is one het job (or one allocation) of the batch script."""

    name = "slurm"
    preemption_requeues = True
    attaches = True
    engine_places = "new job step(s)"
    no_room_fix = "add spare nodes (roles.rollout.elastic) or use --attach"
    bind_host = "0.0.0.0"
    container_runtimes = ("pyxis", "apptainer")
    batch_script = True
    follows = False
    time_limited = True
    queued = True
    needs_pid = False
    component_nodes = None

    # ---------------------------------------------------------------------------- the in-job half ---
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
            k = engine_node(recipe, name)
            if step.shared and k is not None and not exclude:  # --overlap would put every engine on the first node:
                where.append(f"--relative={k}")  # engine K on its node of the actor's (multi-node colocate)
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

    # ---------------------------------------------------------------------------- the submit half ---
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
        self.tools.slurm.scancel(job["job_id"])
        return f"scancel {job['job_id']}"

    def place_problems(self, recipe: Recipe, layout: bool) -> list[Problem]:
        """The partition's nodes from ``sinfo`` (:func:`~relax_hpc.launch.places.check_slurm`)."""
        slurm = self.tools.slurm
        try:
            nodes, default = slurm.sinfo_nodes(), slurm.default_partition()
        except slurm.SlurmError as e:
            return [("<cluster>", _MISSING, f"cannot check the recipe against the "
                     f"cluster: {e}. Fix: check that Slurm answers (sinfo), or run with --local")]
        return self.tools.places.check_slurm(recipe, nodes, default) if layout else []

    def job_state(self, rd: RunDir, job: dict, ctl: dict) -> JobState:
        """Slurm's rows for the het job (squeue, then sacct); UNKNOWN if Slurm does not answer."""
        try:
            return self.tools.jobstate.slurm_state(rd, job, ctl)
        except self.tools.slurm.SlurmError as e:
            return "UNKNOWN", f"cannot ask Slurm: {e}", [], "none"

    def submit(self, p: Plan, rd: RunDir) -> tuple[dict, Any]:
        """The batch script, written to ``RUN_DIR/job.sbatch``, as one het job."""
        return self.tools.jobs.start_slurm(p, rd)

    def resume(self, rd: RunDir, old: dict, python: str | None) -> tuple[dict, Any]:
        """A continuation job (:func:`~relax_hpc.launch.jobs.resubmit`); nothing to follow."""
        return self.tools.jobs.resubmit(rd.path, python), None
