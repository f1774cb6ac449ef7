"""When the periodic eval runs (``rollout.eval_interval``, Relax's schedule) and which evals are still owed.

``eval(N)`` is due after step N's sync every ``eval_interval``-th step and after the last, and ``eval(0)`` before
training unless ``rollout.skip_eval_before_train``. The training loop queues a due eval once the step is synced,
hands the oldest to rollout before its next generate (:meth:`EvalSchedule.take`), and holds a later step's sync
while an earlier step's eval is owed (:meth:`EvalSchedule.owed`): the engines keep the weights it runs on. On a
resume from step K's checkpoint, ``eval(K)`` runs again only when K's row has no ``eval/*`` yet
(:meth:`EvalSchedule.resume`): an eval is never logged twice.
"""

from __future__ import annotations

import logging

from relax_hpc.rollout.eval import should_eval, should_eval_before_train

log = logging.getLogger("relax_hpc.controller")


class EvalSchedule:
    def __init__(self, interval: int | None, skip_before_train: bool, total: int) -> None:
        self.interval, self.skip_before_train, self.total = interval, skip_before_train, total
        self.queue: list[int] = []  # steps whose eval is due, not yet handed to rollout (ascending)
        self.running: int | None = None  # the step whose eval rollout is doing

    def due(self, n: int) -> bool:
        """Whether step ``n`` is evaluated (after its sync; ``n`` = 0: before training). Relax's rule on its 0-based
        rollout id ``n - 1``: every ``rollout.eval_interval`` steps and after the last; before training unless
        ``rollout.skip_eval_before_train``."""
        if n == 0:
            return should_eval_before_train(self.interval, self.skip_before_train)
        return should_eval(n - 1, self.interval, num_steps=self.total)

    def resume(self, k: int, evaluated: set[int]) -> None:
        """The first attempt's step 0, or step ``k``'s eval when a resume from its checkpoint finds it not logged
        (``evaluated``: the steps whose rows have ``eval/*``)."""
        if self.due(k) and k not in evaluated:
            self.queue.append(k)
            if k:
                log.info("eval: step %d's eval did not finish before the attempt ended; it runs again", k)

    def synced(self, n: int) -> None:
        """Step ``n``'s weights are on the engines: its eval, if due, is owed from now on."""
        if self.due(n):
            self.queue.append(n)

    def take(self) -> int | None:
        """The oldest owed eval, now running (None: none owed)."""
        if not self.queue:
            return None
        self.running = self.queue.pop(0)
        return self.running

    def done(self) -> None:
        self.running = None

    def owed(self, before: int | None = None) -> bool:
        """An eval due or running (of a step before ``before``, if given)."""
        steps = self.queue + ([self.running] if self.running is not None else [])
        return any(before is None or s < before for s in steps)
