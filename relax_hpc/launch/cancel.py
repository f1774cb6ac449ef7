"""Cancel a run: ``scancel`` its het job (all components at once), or stop a local run's process group;
or ask its controller, over the run's control socket, to checkpoint first (``--checkpoint``/``--requeue``).

The request is recorded in ``RUN_DIR/cancel.json`` first, so that a run that dies of the cancellation is
reported CANCELLED (not FAILED) by ``relax-status`` even when nothing else could say why it ended.
"""

from __future__ import annotations

import time

from relax_hpc.controller.protocol import Client, ProtocolError

from relax_hpc.backends import CancelError
from relax_hpc.launch.tools import launcher_for
from relax_hpc.launch.runs import RunUnreadable, load_job
from relax_hpc.launch.status import collect, is_final
from relax_hpc.rundir import RunDir, write_json


def cancel(rd: RunDir, grace_s: float = 30.0) -> dict:
    """Cancel the run in ``rd``; returns what was done (for printing or --json)."""
    job = load_job(rd)
    executor = job.get("executor", "slurm")
    write_json(rd.path / "cancel.json", {"requested_at": time.time(), "by": "relax-cancel"})
    outcome = launcher_for(executor).cancel(rd, job, grace_s)
    return {"run": rd.name, "run_dir": str(rd.path), "job_id": str(job.get("job_id")), "executor": executor,
            "action": outcome}


def checkpoint_then_stop(rd: RunDir, action: str, wait_s: float = 600.0) -> dict:
    """Ask the controller to finish the step in flight, checkpoint, then cancel or requeue (``action`` is a
    ``CONTROL_ACTIONS`` name); wait up to ``wait_s`` for the attempt to end (a cancel: for the job to end, so that
    ``relax-submit --resume`` can follow at once). Returns what happened."""
    job = load_job(rd)
    addr = rd.read_json(rd.controller_addr, {}) or {}
    state = (rd.read_json(rd.state, {}) or {}).get("state")
    if not addr or state != "RUNNING":
        raise CancelError(f"run {rd.name} has no running controller (state {state or 'unknown'}): nothing to "
                          "checkpoint. Fix: relax-cancel without --checkpoint")
    if action == "checkpoint_cancel":
        write_json(rd.path / "cancel.json", {"requested_at": time.time(), "by": "relax-cancel --checkpoint"})
    try:
        client = Client(addr["host"], int(addr["port"]), rd.token(), timeout_s=10.0)
        try:
            client.control(action)
        finally:
            client.close()
    except (OSError, ProtocolError) as e:
        raise CancelError(f"cannot reach the controller of run {rd.name} at {addr['host']}:{addr['port']}: {e}. "
                          "Fix: relax-cancel without --checkpoint (the last periodic checkpoint is kept)") from None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        doc = rd.read_json(rd.state, {}) or {}
        # cancel: done once the job itself has ended, not when state.json says so (the controller still stops its
        # steps and writes the summary): a `relax-submit --resume` straight after must find the run ended
        if doc.get("state") not in (None, "RUNNING") and (doc["state"] == "REQUEUED" or _job_ended(rd)):
            ck = doc.get("last_checkpoint") or {}
            return {"run": rd.name, "run_dir": str(rd.path), "job_id": str(job.get("job_id")),
                    "executor": job.get("executor", "slurm"),
                    "action": "requeue" if doc.get("state") == "REQUEUED" else "checkpoint, then cancel",
                    "state": doc.get("state"), "checkpoint": ck.get("path"), "step": ck.get("step")}
        time.sleep(0.5 if doc.get("state") in (None, "RUNNING") else 2.0)  # asking Slurm: not twice a second
    raise CancelError(f"run {rd.name} did not end within {wait_s:g} s (the step in flight or the checkpoint is "
                      "slow); it will still stop after them. relax-status shows when")


def _job_ended(rd: RunDir) -> bool:
    """Has the run's job (Slurm's, or the local process) ended? Where job.json cannot say (a damaged file),
    state.json, already final, is the only word there is."""
    try:
        return is_final(collect(rd))
    except RunUnreadable:
        return True
