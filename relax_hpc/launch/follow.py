"""Follow a run until it ends: a live rich view on a terminal, one line per change elsewhere, or JSON lines.

Shared by ``relax-status --watch`` and the foreground mode of ``relax-submit --local``, so both show the same
thing. Polling is all it does: every fact comes from :func:`relax_hpc.launch.status.collect`.
"""

from __future__ import annotations

import json
import time
from typing import Callable

from rich.console import Console
from rich.live import Live

from relax_hpc.launch.status import collect, is_final, render, signature, summary_line
from relax_hpc.rundir import RunDir


def follow(rd: RunDir, console: Console, interval: float = 2.0, json_lines: bool = False,
           stop: Callable[[dict], bool] = is_final, settle_s: float = 0.0) -> dict:
    """Show ``rd``'s status every ``interval`` seconds until ``stop(info)``; returns the last status.

    ``settle_s``: after ``stop`` first holds, keep polling this long while the state is not final yet (sacct
    and state.json can lag the end of a process by a moment). A run file that cannot be used (``info["error"]``)
    ends it at once: it returns that status for the caller to report. KeyboardInterrupt propagates to the caller."""
    info = collect(rd)
    if info["error"]:
        return info
    if json_lines:
        last = None
        while True:
            sig = signature(info)
            if sig != last:
                print(json.dumps(info, sort_keys=True, default=str), flush=True)
                last = sig
            if stop(info) or info["error"]:
                return _settle(rd, info, settle_s)
            time.sleep(interval)
            info = collect(rd)
    if console.is_terminal:
        with Live(render(info), console=console, refresh_per_second=4, transient=False) as live:
            while not stop(info) and not info["error"]:
                time.sleep(interval)
                info = collect(rd)
                live.update(render(info))
            info = _settle(rd, info, settle_s)
            live.update(render(info))
        return info
    last_line = None
    while True:
        line = summary_line(info)
        if line != last_line:
            console.print(line, highlight=False, soft_wrap=True)
            last_line = line
        if info["error"]:
            return info
        if stop(info):
            info = _settle(rd, info, settle_s)
            console.print(render(info))
            return info
        time.sleep(interval)
        info = collect(rd)


def _settle(rd: RunDir, info: dict, settle_s: float) -> dict:
    deadline = time.monotonic() + settle_s
    while not is_final(info) and not info["error"] and time.monotonic() < deadline:
        time.sleep(0.3)
        info = collect(rd)
    return info
