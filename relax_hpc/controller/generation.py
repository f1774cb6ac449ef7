"""Rollout's side of the steps: how far generation got, the data cursor each step starts from, and the steps
voided for damaged chunks (``docs/exchange.md``, "Damage"), which are generated again first.

A voided step's partition starts a new life: results of tasks on an earlier life are dropped. Step N's ``generate``
carries the cursor after step N−1 (:meth:`Generation.cursor`), so a step generated again gets the same prompts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_hpc.controller.resume_plan import ResumePlan


class Generation:
    def __init__(self, k: int, g: int, data: dict | None, kept_data: dict | None = None) -> None:
        """Resumed at step ``k`` (cursor ``data``) with steps up to ``g`` generated (cursor after them: ``kept_data``)."""
        self.generated = g  # steps generated (handed out; the highest)
        self.done = g  # the last step whose generate is done
        self.data: dict[int, dict | None] = {k: data}  # step -> the data cursor after it
        if g > k:
            self.data[g] = kept_data
        self.regen: set[int] = set()  # steps voided for damaged chunks, to be generated again
        self.lives: dict[int, int] = {}  # step -> how often its partition was voided for damaged chunks

    @classmethod
    def of(cls, plan: ResumePlan) -> Generation:
        """Where the attempt's generation starts: after the checkpoint's step, or after the steps it kept."""
        return cls(plan.step, plan.generated, plan.data, (plan.kept or {}).get("data"))

    def next(self) -> int:
        """The step rollout generates next: a step voided for damage comes first."""
        return min(self.regen) if self.regen else self.generated + 1

    def started(self, n: int) -> None:
        self.regen.discard(n)
        self.generated = max(self.generated, n)

    def finished(self, n: int) -> None:
        self.done = max(self.done, n)

    def cursor(self, n: int) -> dict | None:
        """The data cursor step ``n`` starts from (the one after step n−1)."""
        return self.data.get(n - 1)

    def life(self, n: int) -> int:
        return self.lives.get(n, 0)

    def void(self, n: int) -> int:
        """Step ``n``'s partition was voided: its new life's number."""
        self.lives[n] = self.lives.get(n, 0) + 1
        return self.lives[n]

    def forget(self, n: int, keep: int) -> None:
        """Cursors no generate needs any more once step ``n`` is synced (``keep``: the checkpoint's step's)."""
        for old in [s for s in self.data if s < n - 1 and s != keep]:
            del self.data[old]
