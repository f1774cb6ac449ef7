"""Cancel a run: ``scancel`` its het job (all components at once), or stop a local run's process group.

The request is recorded in ``RUN_DIR/cancel.json`` first, so that a run that dies of the cancellation is
reported CANCELLED (not FAILED) by ``relax-status`` even when nothing else could say why it ended.
"""

from __future__ import annotations

import socket
import time

from relax_hpc.launch import localproc, slurm
from relax_hpc.launch.runs import load_job
from relax_hpc.rundir import RunDir, write_json


class CancelError(RuntimeError):
    pass


def cancel(rd: RunDir, grace_s: float = 30.0) -> dict:
    """Cancel the run in ``rd``; returns what was done (for printing or --json)."""
    job = load_job(rd)
    executor = job.get("executor", "slurm")
    write_json(rd.path / "cancel.json", {"requested_at": time.time(), "by": "relax-cancel"})
    if executor == "slurm":
        slurm.scancel(job["job_id"])
        outcome = f"scancel {job['job_id']}"
    else:
        if job.get("host") and job["host"] != socket.gethostname():
            raise CancelError(f"run {rd.name} runs on host {job['host']}: run relax-cancel there")
        outcome = localproc.stop_group(int(job["pid"]), job.get("pid_start"), grace_s=grace_s)
        if outcome == "pid reused":
            raise CancelError(f"process {job['pid']} of run {rd.name} has ended and its PID now belongs to "
                              "another process; nothing was signalled")
    return {"run": rd.name, "run_dir": str(rd.path), "job_id": str(job.get("job_id")), "executor": executor,
            "action": outcome}
