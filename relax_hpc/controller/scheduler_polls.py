"""How often the controller asks Slurm about its jobs (the attached engine jobs of :mod:`.elastic`)."""

from __future__ import annotations


class SchedulerPolls:
    """When the controller may ask Slurm about its jobs again (squeue/sacct, through the launcher's cache): at
    most every :attr:`every_s` s, sooner only when something changed (:meth:`changed`: a job it submitted or
    cancelled, a step that started or ended, a signal), never twice within :attr:`min_gap_s`. A slow or failed
    answer (slurmctld busy) doubles the wait, up to :attr:`max_s`; a quick one brings it back. Times are the
    caller's clock (``now``), so a simulation can drive it (tests/controller/test_scheduler_polls.py)."""

    every_s = 30.0
    min_gap_s = 5.0
    max_s = 300.0
    slow_s = 5.0  # an answer slower than this: slurmctld is struggling

    def __init__(self) -> None:
        self.wait_s = self.every_s
        self.last: float | None = None  # when it last asked
        self.next_at = float("-inf")  # the first question may go at once
        self.asked = 0  # questions so far (what the docs' figure counts)

    def changed(self) -> None:
        """Something changed: ask at the next turn (once :attr:`min_gap_s` has passed since the last question)."""
        self.next_at = min(self.next_at, (self.last if self.last is not None else float("-inf")) + self.min_gap_s)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def done(self, now: float, took_s: float, ok: bool = True) -> None:
        """A question went at ``now``, answered (``ok``) or not in ``took_s``: when the next one may go."""
        self.asked += 1
        self.wait_s = min(self.max_s, self.wait_s * 2) if not ok or took_s > self.slow_s else self.every_s
        self.last, self.next_at = now, now + self.wait_s
