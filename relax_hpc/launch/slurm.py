"""What the Slurm cluster says: ``sinfo``/``squeue``/``sacct`` in JSON, ``scancel``, and Slurm's own words for states.

Why one module: every call to a Slurm client goes through :func:`run` (argument lists, never a shell, a
timeout, stderr in the error), and the quirks of Slurm 22.05 are handled once, here:

* ``squeue --json`` ignores ``-j`` and lists every job (recently finished ones too), so we filter ourselves.
* ``sinfo --json`` lists nodes but not partitions; the default partition comes from ``sinfo -o %P``.
* ``sacct`` is eventually consistent (right after a job ends it may not know it yet): callers must poll.
* A het job is one record per component (``123+0``, ``123+1``); its state is :func:`aggregate_state`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                 "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT")
# Finished states, worst first: the state a het job reports when its components ended differently.
FINISHED_BY_SEVERITY = ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "TIMEOUT",
                        "CANCELLED", "PREEMPTED", "REVOKED", "COMPLETED")
FINISHED_STATES = frozenset(FINISHED_BY_SEVERITY)


class SlurmError(RuntimeError):
    """A Slurm client failed or printed something we cannot read; ``returncode``: the client's exit status
    (negative: killed by that signal), None when it never ran or answered."""

    def __init__(self, msg: str, returncode: int | None = None):
        super().__init__(msg)
        self.returncode = returncode


def have_sbatch() -> bool:
    return shutil.which("sbatch") is not None


def run(argv: list[str], timeout: float = 60) -> str:
    """Run a Slurm client; its stdout, or :class:`SlurmError` with its stderr."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]}: not found on PATH (is this a Slurm login node?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)}: no answer in {timeout:.0f} s (is slurmctld up?)") from None
    if p.returncode != 0:
        msg = (p.stderr or p.stdout).strip()
        raise SlurmError(f"{' '.join(argv)} failed (exit {p.returncode}): {msg}", p.returncode)
    return p.stdout


def run_json(argv: list[str], timeout: float = 60) -> dict:
    out = run(argv, timeout)
    try:
        return json.loads(out)
    except json.JSONDecodeError as e:
        raise SlurmError(f"{' '.join(argv)}: output is not JSON ({e}); Slurm ≥ 21.08 is needed") from None


def state_word(state: Any) -> str:
    """Slurm's state as one upper-case word: 'CANCELLED by 0' → CANCELLED, {'current': 'RUNNING'} → RUNNING."""
    if isinstance(state, dict):
        state = state.get("current", "")
    if isinstance(state, list):  # newer Slurm prints ["RUNNING", "COMPLETING"]
        state = state[0] if state else ""
    word = str(state or "UNKNOWN").split()[0].upper()
    return word.rstrip("+")


def aggregate_state(states: list[str]) -> str:
    """The state of a het job from its components' states (leader first).

    While any component is active the job is active: the leader's state if it is, else the first active one.
    Once all have ended, the worst ending wins (one FAILED component makes the job FAILED)."""
    words = [state_word(s) for s in states]
    if not words:
        return "UNKNOWN"
    active = [w for w in words if w not in FINISHED_STATES]
    if active:
        return words[0] if words[0] not in FINISHED_STATES else active[0]
    return min(words, key=FINISHED_BY_SEVERITY.index)


def is_finished(state: str) -> bool:
    return state_word(state) in FINISHED_STATES


# --------------------------------------------------------------------------------------------- time ---

_TIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+))?$")


def parse_time(text: str) -> int:
    """Slurm time syntax → seconds: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(f"not a Slurm time: {text!r}")
    d, a, b, c = (int(x) if x is not None else None for x in m.group("d", "a", "b", "c"))
    if d is not None:
        return d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + b * 60 + c
    if b is not None:
        return a * 60 + b
    return a * 60


def format_seconds(s: float | None) -> str:
    if s is None:
        return "UNLIMITED"
    s = max(0, int(s))
    d, rest = divmod(s, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{d}-{text}" if d else text


# -------------------------------------------------------------------------------------------- sinfo ---

@dataclass(frozen=True)
class Node:
    name: str
    partitions: tuple[str, ...]
    cpus: int
    gpus: int
    memory_mb: int
    state: str


def parse_gres_gpus(gres: str | None) -> int:
    """GPU count in a node's GRES string: 'gpu:4', 'gpu:a100:4(S:0-1)', 'gpu:a100:2,gpu:v100:2' → 4, 4, 4."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres or ""):
        item = re.sub(r"\(.*\)$", "", item.strip())
        parts = item.split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        try:
            total += int(parts[-1])
        except ValueError:
            total += 1  # 'gpu:a100' with no count means one
    return total


def sinfo_nodes() -> list[Node]:
    data = run_json(["sinfo", "--json"])
    nodes = []
    for n in data.get("nodes", []):
        nodes.append(Node(
            name=n.get("name", "?"),
            partitions=tuple(n.get("partitions") or ()),
            cpus=int(n.get("cpus") or 0),
            gpus=parse_gres_gpus(n.get("gres")),
            memory_mb=int(n.get("real_memory") or 0),
            state=str(n.get("state", "")).lower(),
        ))
    return nodes


def default_partition() -> str | None:
    """The cluster's default partition (``sinfo`` marks it with '*')."""
    for line in run(["sinfo", "-h", "-o", "%P"]).splitlines():
        if line.strip().endswith("*"):
            return line.strip()[:-1]
    return None


# -------------------------------------------------------------------------------------- squeue/sacct ---

@dataclass
class Component:
    """One het component (or a plain job) as squeue or sacct sees it."""

    het_job_id: int
    het_offset: int
    job_id: int  # the component's own id (what squeue -s / %j in srun patterns show)
    state: str
    reason: str | None
    nodes: str | None
    node_count: int | None
    partition: str | None
    name: str | None
    submit_time: int | None
    start_time: int | None
    end_time: int | None
    time_limit_s: int | None  # None: UNLIMITED
    restarts: int | None = None
    source: str = "squeue"
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.het_job_id}+{self.het_offset}"

    def time_left_s(self, now: float | None = None) -> int | None:
        now = time.time() if now is None else now
        if self.time_limit_s is None:
            return None
        if self.state == "RUNNING" and self.start_time:
            return max(0, int(self.start_time + self.time_limit_s - now))
        if self.state in FINISHED_STATES:
            return 0
        return self.time_limit_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["label"] = self.label
        d["time_left_s"] = self.time_left_s()
        return d


def _int(v: Any) -> int | None:
    if isinstance(v, dict):  # newer Slurm: {"set": true, "infinite": false, "number": 5}
        if not v.get("set", True) or v.get("infinite"):
            return None
        v = v.get("number")
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _reason(r: Any) -> str | None:
    r = str(r or "")
    return None if r in ("", "None", "none") else r


def _select(comps: list[Component], job_id: int, name: str | None) -> list[Component]:
    mine = [c for c in comps if c.het_job_id == job_id or (c.het_job_id == 0 and c.job_id == job_id)]
    if name is not None:  # job ids restart after a cluster reset: a foreign job may hold ours
        mine = [c for c in mine if c.name in (None, name)]
    for c in mine:
        if c.het_job_id == 0:
            c.het_job_id = c.job_id
    return sorted(mine, key=lambda c: c.het_offset)


def squeue_job(job_id: int | str, name: str | None = None) -> list[Component]:
    """The components of ``job_id`` that squeue still knows (running, pending, or ended < MinJobAge ago)."""
    try:
        data = run_json(["squeue", "--json", "--jobs", str(job_id)])
    except SlurmError as e:
        if "Invalid job id" in str(e):  # a Slurm that honours --jobs with --json, after the job is purged
            return []
        raise
    comps = []
    for j in data.get("jobs", []):
        limit = _int(j.get("time_limit"))
        comps.append(Component(
            het_job_id=_int(j.get("het_job_id")) or 0,
            het_offset=_int(j.get("het_job_offset")) or 0,
            job_id=_int(j.get("job_id")) or 0,
            state=state_word(j.get("job_state")),
            reason=_reason(j.get("state_reason")),
            nodes=j.get("nodes") or None,
            node_count=_int(j.get("node_count")),
            partition=j.get("partition"),
            name=j.get("name"),
            submit_time=_int(j.get("submit_time")),
            start_time=_int(j.get("start_time")),
            end_time=_int(j.get("end_time")),
            time_limit_s=None if limit is None else limit * 60,
            restarts=_int(j.get("restart_cnt")),
            source="squeue",
        ))
    return _select(comps, int(job_id), name)


def sacct_job(job_id: int | str, name: str | None = None) -> list[Component]:
    """The components of ``job_id`` in accounting (may lag behind the end of the job: poll)."""
    try:
        data = run_json(["sacct", "--json", "-j", str(job_id)])
    except SlurmError as e:
        if "Nothing found" in str(e):
            return []
        raise
    comps = []
    for j in data.get("jobs", []):
        het = j.get("het") or {}
        t = j.get("time") or {}
        limit = _int(t.get("limit"))
        state = j.get("state") or {}
        comps.append(Component(
            het_job_id=_int(het.get("job_id")) or 0,
            het_offset=_int(het.get("job_offset")) or 0,
            job_id=_int(j.get("job_id")) or 0,
            state=state_word(state),
            reason=_reason(state.get("reason") if isinstance(state, dict) else None),
            nodes=None if j.get("nodes") in (None, "", "None assigned") else j.get("nodes"),
            node_count=_int(j.get("allocation_nodes")),
            partition=j.get("partition"),
            name=j.get("name"),
            submit_time=_int(t.get("submission")),
            start_time=_int(t.get("start")),
            end_time=_int(t.get("end")),
            time_limit_s=None if limit is None else limit * 60,
            source="sacct",
            extra={"exit_code": (j.get("exit_code") or {}).get("return_code")},
        ))
    return _select(comps, int(job_id), name)


def job_components(job_id: int | str, name: str | None = None) -> list[Component]:
    """squeue first (live, and knows pending reasons), then sacct for jobs squeue has forgotten."""
    comps = squeue_job(job_id, name)
    if comps:
        return comps
    try:
        return sacct_job(job_id, name)
    except SlurmError:
        return []  # no accounting on this cluster: the caller falls back to the run's state.json


def scancel(job_id: int | str, signal: str | None = None) -> None:
    argv = ["scancel"] + ([f"--signal={signal}"] if signal else []) + [str(job_id)]
    run(argv)


def scontrol_requeue(job_id: int | str, restart_count: int | None = None) -> None:
    """Requeue a job (a het job: all its components, same id). Slurm kills the calling batch script at once.

    Called from inside the job, scontrol can be killed by the very teardown its request started (it is a
    process of the job) and then reports failure for a requeue Slurm accepted; a continuation job submitted
    on that report would run the run twice. So a failure counts only if the job's ``Restarts`` did not grow
    past ``restart_count`` (default: this job's ``SLURM_RESTART_COUNT``)."""
    try:
        run(["scontrol", "requeue", str(job_id)])
    except SlurmError:
        before = int(os.environ.get("SLURM_RESTART_COUNT") or 0) if restart_count is None else restart_count
        if job_restarts(job_id) > before:
            return
        raise


def job_restarts(job_id: int | str) -> int:
    """How many times Slurm requeued ``job_id`` (``scontrol show job``'s ``Restarts``; -1 if unknown)."""
    try:
        out = run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30)
    except SlurmError:
        return -1
    counts = [int(m) for m in re.findall(r"\bRestarts=(\d+)", out)]
    return max(counts) if counts else -1
