"""Is a local run's process still there, and how to stop its whole process group.

Why not ``kill -0 PID``: PIDs are reused, and on machines whose PID 1 reaps orphans lazily a finished run
stays a zombie for a while (``kill -0`` succeeds on zombies). So a run is identified by PID *and* its start
time (``/proc/PID/stat`` field 22), and zombies count as gone. Linux ``/proc`` only; elsewhere we fall back to
``os.kill(pid, 0)``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    return text[text.rindex(")") + 2:].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it does not exist."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None  # field 22 overall; fields[0] is field 3 (state)


def alive(pid: int, ticks: int | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when ``ticks`` is given, is the same process as recorded."""
    if not Path("/proc").is_dir():  # pragma: no cover - non-Linux
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    fields = _stat(pid)
    if not fields or fields[0] in ("Z", "X"):
        return False
    return ticks is None or int(fields[19]) == ticks


def _table() -> dict[int, tuple[str, int, int, int]]:
    """pid → (state, ppid, pgrp, start ticks) for every process we can see."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            f = _stat(int(entry.name))
            if f:
                out[int(entry.name)] = (f[0], int(f[1]), int(f[2]), int(f[19]))
    return out


def run_processes(pgid: int) -> dict[int, int]:
    """Live processes of a run: its process group ``pgid`` and all their descendants (pid → start ticks).

    Descendants count because the controller starts each role in a session of its own (so a terminal's
    Ctrl-C reaches the controller only); they are found through parent links, which is why they must be
    collected while the controller is still alive."""
    table = _table()
    live = {pid: t for pid, t in table.items() if t[0] not in ("Z", "X")}
    found = {pid for pid, t in live.items() if t[2] == pgid}
    frontier = set(found)
    while frontier:
        frontier = {pid for pid, t in live.items() if t[1] in frontier and pid not in found}
        found |= frontier
    return {pid: live[pid][3] for pid in found}


def _kill(procs: dict[int, int], sig: int) -> None:
    for pid, ticks in procs.items():
        if start_ticks(pid) == ticks:  # still the same process
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def stop_group(pid: int, ticks: int | None, grace_s: float = 30.0) -> str:
    """SIGTERM the run's process group (its leader is ``pid``); SIGKILL the group and its descendants if any
    are left after ``grace_s``. The controller handles SIGTERM by stopping its roles (it gives them 10 s), so
    the grace must be longer than that.

    Returns what happened: 'terminated', 'killed', 'not running', or 'pid reused' (then nothing is signalled:
    a different process holds the recorded PID, so the group id may no longer be ours)."""
    if ticks is not None and start_ticks(pid) not in (None, ticks):
        return "pid reused"
    procs = run_processes(pid)
    if not procs:
        return "not running"
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        procs.update(run_processes(pid))  # roles started meanwhile
        procs = {p: t for p, t in procs.items() if start_ticks(p) == t and alive(p)}
        if not procs:
            return "terminated"
        time.sleep(0.2)
    procs.update(run_processes(pid))
    _kill(procs, signal.SIGKILL)
    for _ in range(50):
        if not any(alive(p, t) for p, t in procs.items()):
            break
        time.sleep(0.1)
    return "killed"
