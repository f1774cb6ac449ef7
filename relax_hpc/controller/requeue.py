"""How an attempt that ended to come back (state REQUEUED) comes back, per executor.

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

import logging
import os
from pathlib import Path
from typing import Any, Callable

from relax_hpc.recipe import Recipe
from relax_hpc.rundir import RunDir

log = logging.getLogger("relax_hpc.controller")
LOCAL_REQUEUE_EXIT = 144  # submitit.local.local.LOCAL_REQUEUE_RETURN_CODE

RequeueJob = Callable[[str], Any]  # ``scontrol requeue JOB_ID``; raises if Slurm refuses
Resubmit = Callable[[Path], dict]  # submit a continuation job for a run directory; returns the new job.json


def come_back(run: RunDir, recipe: Recipe, executor: str, requeue_job: RequeueJob | None = None,
              resubmit: Resubmit | None = None) -> str:
    """Requeue this job or submit its continuation; returns what was done. Locally it does not return."""
    if executor == "local":
        log.info("requeue: exiting with code %d; the local runner starts the controller again", LOCAL_REQUEUE_EXIT)
        raise SystemExit(LOCAL_REQUEUE_EXIT)
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
