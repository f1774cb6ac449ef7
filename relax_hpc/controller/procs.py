"""Started role steps, as processes the controller owns: start, poll, stop (by PID, never by name), log tails.

Under Slurm a step is one ``srun`` process (SIGTERM makes srun signal its tasks; SIGKILL after a grace
period ends srun, and slurmstepd then kills what is left of the step). Locally a step is one process per
rank, forked from the run's fork server where it can be (:mod:`relax_hpc.forkserver`; Popen's interface either
way). Each process gets its own session, so a Ctrl-C at the terminal reaches the controller only, which then
stops the steps in order.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

from relax_hpc import forkserver
from relax_hpc.controller.steps import StepCommand, stop_processes, task_log_pattern


class StepProcess:
    def __init__(self, cmd: StepCommand, run_dir: Path):
        self.cmd, self.run_dir = cmd, run_dir
        self.procs: list[forkserver.Process] = []

    @property
    def role(self) -> str:
        return self.cmd.role

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> None:
        for spec in self.cmd.procs:
            spec.log.parent.mkdir(parents=True, exist_ok=True)
            with open(spec.log, "ab") as log:  # the child keeps its own descriptor
                self.procs.append(forkserver.popen(spec.argv, env={**os.environ, **spec.env}, stdout=log))

    def poll(self) -> int | None:
        """None while running; the first non-zero exit code as soon as any process has one; else 0."""
        codes = [p.poll() for p in self.procs]
        bad = [c for c in codes if c not in (None, 0)]
        if bad:
            return bad[0]
        return None if None in codes else 0

    def live(self) -> list[forkserver.Process]:
        return [p for p in self.procs if p.poll() is None]

    def log_tail(self, rank: int | None, lines: int = 20) -> str:
        """The last ``lines`` of the rank's log (or of every rank's, when the rank is unknown) and srun's."""
        pattern = str(task_log_pattern(self.run_dir, self.role))
        ranks = [rank] if rank is not None else range(self.cmd.step.ntasks)
        paths = [Path(pattern.replace("%t", str(r))) for r in ranks]
        paths += [s.log for s in self.cmd.procs if s.log not in paths]
        out = []
        for path in paths:
            tail = _tail(path, lines)
            if tail:
                out.append(f"--- {path} (last {len(tail)} lines) ---\n" + "".join(tail))
        return "\n".join(out)


    def last_line(self) -> str:
        """The last non-empty line of the most recently written log of this step (a hint for a failed exit)."""
        pattern = str(task_log_pattern(self.run_dir, self.role))
        paths = [Path(pattern.replace("%t", str(r))) for r in range(self.cmd.step.ntasks)]
        paths += [s.log for s in self.cmd.procs]
        paths = sorted((p for p in paths if p.exists()), key=lambda p: p.stat().st_mtime, reverse=True)
        for path in paths:
            for line in reversed(_tail(path, 5)):
                if line.strip():
                    return line.strip()
        return ""


def stop_steps(steps: list[StepProcess], grace_s: float = 10.0) -> None:
    """SIGTERM every live process of every step at once, SIGKILL those alive after ``grace_s``, reap all."""
    stop_processes([p for s in steps for p in s.live()], grace_s, group=False)


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return list(deque(f, maxlen=lines))
    except OSError:
        return []
