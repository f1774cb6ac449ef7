"""How an attempt that ended to come back (state REQUEUED) comes back, per executor.

* Slurm: ``scontrol requeue`` of the het job (same job id; ``SLURM_RESTART_COUNT`` counts). Slurm kills the
  batch script at once, so the caller has written everything before. Where requeue is refused (the job
  was submitted with ``slurm.requeue: false``, or the cluster forbids it) a continuation job is submitted
  for the same run directory instead (:func:`relax_hpc.launch.submit.resubmit`).
* Local: submitit's local controller starts the task again when it exits with its requeue code.

Either way the next controller finds ``checkpoints/latest`` and resumes from it.
"""

from __future__ import annotations

import logging
import os

from relax_hpc.recipe import Recipe
from relax_hpc.rundir import RunDir

log = logging.getLogger("relax_hpc.controller")
LOCAL_REQUEUE_EXIT = 144  # submitit.local.local.LOCAL_REQUEUE_RETURN_CODE


def come_back(run: RunDir, recipe: Recipe, executor: str) -> str:
    """Requeue this job or submit its continuation; returns what was done. Locally it does not return."""
    if executor == "local":
        log.info("requeue: exiting with code %d; the local runner starts the controller again", LOCAL_REQUEUE_EXIT)
        raise SystemExit(LOCAL_REQUEUE_EXIT)
    from relax_hpc.launch import slurm

    job_id = os.environ.get("SLURM_JOB_ID")
    if recipe.slurm.requeue and job_id:
        try:
            log.info("requeue: scontrol requeue %s", job_id)
            slurm.scontrol_requeue(job_id)  # normally we are killed here
            return f"requeued job {job_id}"
        except slurm.SlurmError as e:
            log.warning("scontrol requeue %s was refused (%s); submitting a continuation job instead", job_id, e)
    from relax_hpc.launch.submit import resubmit

    record = resubmit(run.path)
    log.info("continuation job %s submitted for run %s", record["job_id"], run.name)
    return f"continuation job {record['job_id']}"
