"""Helpers for tests that run real Slurm jobs (see tests/conftest.py::slurm_cluster).

Plain functions, no fixtures: ``from slurm_helpers import slurm_wait_job``.
"""

from __future__ import annotations

import os
import subprocess
import time

# squeue states of a job that is still in the queue (or about to leave it)
_ACTIVE = {
    "PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "REQUEUED",
    "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
    "RESV_DEL_HOLD", "SPECIAL_EXIT",
}
# sacct states that are final
_FINAL = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED",
}


def _run(args: list[str], env: dict | None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=30,
                          env=env if env is not None else os.environ.copy())


def _leader(job_id: str | int) -> str:
    """'12', '12+0' and '12_3'-free ids -> '12' (the het leader / plain job id)."""
    return str(job_id).split("+")[0].strip()


def slurm_job_states(job_id: str | int, env: dict | None = None) -> dict[str, str]:
    """sacct's allocation rows for a job: {'12': 'COMPLETED'} or, for a het job,
    {'12+0': ..., '12+1': ...}. States are the first word ('CANCELLED by 0' ->
    'CANCELLED'). Empty if sacct does not know the job (yet)."""
    jid = _leader(job_id)
    p = _run(["sacct", "-n", "-X", "-P", "-j", jid, "-o", "JobID,State"], env)
    if p.returncode != 0:
        raise RuntimeError(f"sacct failed: {p.stderr.strip()}")
    rows: dict[str, str] = {}
    for line in p.stdout.splitlines():
        if "|" not in line:
            continue
        rid, state = line.split("|", 1)
        if rid == jid or rid.startswith(jid + "+"):
            rows[rid] = (state.split() or ["UNKNOWN"])[0]
    return rows


def slurm_wait_job(job_id: str | int, timeout: float = 60.0, *, env: dict | None = None,
                   poll: float = 0.2, sacct_timeout: float = 30.0) -> str:
    """Wait until the job (plain or het; pass the leader id) has left the queue,
    then return its final state from sacct, e.g. 'COMPLETED'.

    sacct is eventually consistent (right after the end a row may still read
    RUNNING, or a het job may show as a plain id), so it is polled until every
    component squeue showed has a final state. For a het job the result is
    'COMPLETED' only if every component completed; otherwise the first
    component's state that is not COMPLETED. Raises TimeoutError if the job is
    still queued after ``timeout`` s, or sacct has no final state after a
    further ``sacct_timeout`` s. Without accounting (RELAX_DEV_SLURM_ACCOUNTING=none)
    the last state squeue/scontrol showed is returned instead."""
    jid = _leader(job_id)
    end = time.monotonic() + timeout
    components: set[str] = set()
    last_state = "UNKNOWN"
    while True:
        p = _run(["squeue", "-h", "-j", jid, "-o", "%i %T"], env)
        active = []
        if p.returncode == 0:
            for line in p.stdout.split("\n"):
                parts = line.split()
                if len(parts) == 2:
                    components.add(parts[0])
                    last_state = parts[1]
                    if parts[1] in _ACTIVE:
                        active.append(parts[0])
        elif "Invalid job id" not in p.stderr:
            raise RuntimeError(f"squeue failed: {p.stderr.strip()}")
        if not active:
            break
        if time.monotonic() > end:
            raise TimeoutError(f"job {jid} still in the queue after {timeout:.0f} s: {p.stdout.strip()}")
        time.sleep(poll)

    het = {c for c in components if "+" in c}
    end = time.monotonic() + sacct_timeout
    while True:
        try:
            rows = slurm_job_states(jid, env)
        except RuntimeError as e:
            if "accounting storage is disabled" in str(e).lower():
                return _state_without_accounting(jid, env, last_state)
            raise
        # every het component squeue showed (a job that ended before the first
        # poll: any row) must be there, all in a final state
        seen = het <= set(rows) if het else bool(rows)
        if rows and seen and all(rows[k] in _FINAL for k in rows):
            keys = sorted(rows, key=lambda k: int(k.split("+")[1]) if "+" in k else -1)
            bad = [rows[k] for k in keys if rows[k] != "COMPLETED"]
            return bad[0] if bad else "COMPLETED"
        if time.monotonic() > end:
            raise TimeoutError(f"sacct has no final state for job {jid} after {sacct_timeout:.0f} s: {rows}")
        time.sleep(poll)


def _state_without_accounting(jid: str, env: dict | None, fallback: str) -> str:
    p = _run(["scontrol", "-o", "show", "job", jid], env)
    for tok in p.stdout.split():
        if tok.startswith("JobState="):
            return tok.split("=", 1)[1]
    return fallback
