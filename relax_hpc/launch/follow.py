"""Follow a run until it ends: a live rich view on a terminal, a line every few steps elsewhere, or JSON lines.

Shared by ``relax-status --watch`` and the foreground mode of ``relax-submit --local``, so both show the same
thing: the step, the reward (the last step's and the mean of the last 10), the time per step and the time left,
each role's phase, the last failure. Polling is all it does: every fact comes from
:func:`relax_hpc.launch.status.collect`. Without a terminal (a log, CI, a pipe) a line is printed when the run's
state, a role's error or the last failure changes, and otherwise every :func:`log_every` steps, or after
:data:`LOG_EVERY_S` seconds with a step done since the last line: a 100-step run writes ~20 lines, not 100.
"""

from __future__ import annotations

import json
import time
from typing import Callable

from rich.console import Console
from rich.live import Live

from relax_hpc.launch.status import collect, is_final, render, signature, summary_line
from relax_hpc.rundir import RunDir

LOG_LINES = 20  # lines a run's progress takes in a log, about
LOG_EVERY_S = 60.0  # and a line at least this often while steps are done


def log_every(total: object) -> int:
    """Steps between two progress lines in a log: about :data:`LOG_LINES` lines over the run."""
    return max(1, total // LOG_LINES) if isinstance(total, int) and not isinstance(total, bool) else 1


def _news(info: dict) -> tuple:
    """What is printed the moment it changes (not the step, not the phases: they change all the time)."""
    errors = tuple((n, r.get("error")) for n, r in info["roles"].items())
    return (info["state"], info.get("reason"), info.get("controller_state"), info.get("last_failure"),
            info.get("error"), errors)


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
    news: tuple | None = None
    last_step, last_t = 0, 0.0
    while True:
        step = info.get("step") if isinstance(info.get("step"), int) else 0
        due = _news(info) != news or step >= last_step + log_every(info.get("total_steps")) or \
            (step > last_step and time.monotonic() - last_t >= LOG_EVERY_S)
        if due:
            console.print(summary_line(info), highlight=False, soft_wrap=True)
            news, last_step, last_t = _news(info), step, time.monotonic()
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
