"""A submitted job's state as relax-status reports it, in Slurm's words, from what its backend can ask: Slurm's
rows for a het job (:func:`slurm_state`), the process for a local run (:func:`local_state`), each joined with the
controller's ``state.json``. Each returns (state, reason, components, source); the backends' ``job_state``
(:mod:`relax_hpc.backends`) pick one.
"""

from __future__ import annotations

import socket

from relax_hpc.launch import localproc, slurm
from relax_hpc.launch.executors import read_result
from relax_hpc.rundir import FULL_BYTES, RunDir, free_bytes, no_space_message

JobState = tuple[str, str | None, list[dict], str]  # (state, reason, components, source)


def failure_reason(rd: RunDir, job: dict, state: dict) -> str | None:
    if state.get("reason"):
        return str(state["reason"])
    full = full_disk(rd)  # the controller could not even write its end: the disk is the likely news
    res = read_result(job.get("submitit_folder") or rd.path / "submitit", str(job.get("job_id")))
    if res and res[0] == "error":
        lines = [ln for ln in str(res[1]).strip().splitlines() if ln.strip()]
        return (lines[-1] if lines else "the controller raised an error") + (f"; {full}" if full else "")
    return full


def full_disk(rd: RunDir) -> str | None:
    """"no space left on <mount> ..." if the run directory's filesystem is full now, else None."""
    free = free_bytes(rd.path)
    if free is None or free >= FULL_BYTES:
        return None
    return f"the run directory's filesystem is full: {no_space_message(rd, what=f'{free} bytes free')}"


def slurm_state(rd: RunDir, job: dict, ctl: dict) -> JobState:
    comps = slurm.job_components(job["job_id"], job.get("job_name"), job.get("submitted_at"))
    ctl_state = slurm.state_word(ctl["state"]) if ctl.get("state") else None
    slurm_reason = next((c.reason for c in comps if c.reason), None)
    if comps:
        overall, source = slurm.aggregate_state([c.state for c in comps]), comps[0].source
    elif ctl_state and slurm.is_finished(ctl_state):
        overall, source = ctl_state, "state.json"
    else:
        overall, source = "UNKNOWN", "none"
        slurm_reason = (f"Slurm no longer lists job {job['job_id']} and accounting has no record of it (yet); "
                        "sacct lags a few seconds behind the end of a job")
    if overall == "COMPLETED" and ctl_state and slurm.is_finished(ctl_state) and ctl_state != "COMPLETED":
        overall = ctl_state  # the job ended cleanly but the controller says the run did not
    if overall == "FAILED" and ctl_state == "CANCELLED":  # relax-cancel --checkpoint: the controller saved, then
        overall = "CANCELLED"  # ended the attempt with a non-zero exit, which is all Slurm saw
    if overall == "COMPLETED":
        reason = None
    elif slurm.is_finished(overall):  # why it ended; a pending reason left over from the queue is no answer
        if overall == "CANCELLED" and (rd.path / "cancel.json").exists():
            reason = "cancelled by relax-cancel"
        else:
            reason = failure_reason(rd, job, ctl) or slurm_reason
    else:
        reason = slurm_reason if overall != "RUNNING" else None
    components = [dict(c.as_dict(), time_left=slurm.format_seconds(c.time_left_s())) for c in comps]
    return overall, reason, components, source


def local_state(rd: RunDir, job: dict, ctl: dict) -> JobState:
    ctl_state = slurm.state_word(ctl["state"]) if ctl.get("state") else None
    cancelled = (rd.path / "cancel.json").exists()
    host = job.get("host")
    if host and host != socket.gethostname():
        return "UNKNOWN", f"a local run on host {host}: run relax-status there", [], "none"
    if localproc.alive(int(job["pid"]), job.get("pid_start")):
        if cancelled:
            return "RUNNING", "cancel requested; stopping", [], "process"
        active = ctl_state if ctl_state and not slurm.is_finished(ctl_state) and ctl_state != "PENDING" else None
        return active or "RUNNING", None, [], "process"
    if ctl_state == "COMPLETED":
        return "COMPLETED", None, [], "state.json"
    if cancelled:
        return "CANCELLED", "cancelled by relax-cancel", [], "process"
    res = read_result(job.get("submitit_folder") or rd.path / "submitit", str(job["job_id"]))
    if ctl_state and slurm.is_finished(ctl_state):
        return ctl_state, failure_reason(rd, job, ctl), [], "state.json"
    if res and res[0] == "success":
        return "COMPLETED", None, [], "process"
    reason = failure_reason(rd, job, ctl) or (
        f"the local process {job['pid']} ended without a result; see {rd.logs}")
    return "FAILED", reason, [], "process"
