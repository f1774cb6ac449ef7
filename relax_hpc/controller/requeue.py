"""How an attempt that ended to come back (state REQUEUED) comes back, per backend (:mod:`relax_hpc.backends`).

* Slurm: ``scontrol requeue`` of the het job (same job id; ``SLURM_RESTART_COUNT`` counts). Slurm kills the
  batch script at once, so the caller has written everything before. Where requeue is refused (the job
  was submitted with ``slurm.requeue: false``, or the cluster forbids it) a continuation job is submitted
  for the same run directory instead.
* Local: submitit's local controller starts the task again when it exits with its requeue code.

Either way the next controller finds ``checkpoints/latest`` and resumes from it.

The Slurm mechanisms are the launcher's (``scontrol``, rendering and submitting a job script), and the launcher
imports the controller, not the other way round: whoever starts the controller hands them in
(:class:`relax_hpc.launch.executors.ControllerTask` passes ``launch.slurm.scontrol_requeue`` and
``launch.submit.resubmit``). A controller started without them (``python -m relax_hpc.controller RUN_DIR``
under Slurm) cannot come back by itself: the attempt ends with the fix, ``relax-submit --resume RUN_DIR``.
"""

from __future__ import annotations

from relax_hpc.backends import Backend, RequeueJob, Resubmit
from relax_hpc.recipe import Recipe
from relax_hpc.rundir import RunDir


def come_back(run: RunDir, recipe: Recipe, backend: Backend, requeue_job: RequeueJob | None = None,
              resubmit: Resubmit | None = None) -> str:
    """Requeue this job or submit its continuation (:meth:`~relax_hpc.backends.Backend.come_back`); returns what
    was done. Locally it does not return."""
    return backend.come_back(run, recipe, requeue_job, resubmit)
