"""``staleness_mode: fixed``: step N is generated with exactly the weights of step N−1−k (k: ``max_staleness``).

So ``sync(M)`` waits until rollout has generated step M+k, the last step that needs the weights before M
(:meth:`FixedStaleness.last_on_old`), and a checkpoint of step M carries the steps after M generated on older
weights (:meth:`FixedStaleness.kept`), which a resume no longer has. Where no engine holds the weights a step needs
any more (a resume without them, an engine started again, a step voided for damage) the step is generated on newer
weights and the run goes on, off the fixed trajectory, with an event: ``unfixed_upto`` and ``loose`` are those
steps. The loop's own flag is ``TrainingLoop.fixed``: this object, or None in every other mode.
"""

from __future__ import annotations

from typing import Any

from relax_hpc.recipe import Recipe


class FixedStaleness:
    def __init__(self, k: int, total: int) -> None:
        self.k, self.total = k, total
        self.unfixed_upto = 0  # a resume without the steps generated before its checkpoint: up to here on K's weights
        self.loose: set[int] = set()  # steps generated on newer weights than N-1-k (theirs were gone)
        self.rows: dict[int, dict[str, float]] = {}  # a generated step's metrics, for a checkpoint's kept

    @classmethod
    def of(cls, recipe: Recipe) -> FixedStaleness | None:
        if recipe.mode == "fully_async" and recipe.staleness_mode == "fixed" and recipe.max_staleness > 0:
            return cls(recipe.max_staleness, recipe.run.steps)
        return None

    def last_on_old(self, n: int) -> int:
        """The last step generated with weights older than step ``n``'s."""
        return min(n + self.k, self.total)

    def exact(self, n: int, voided: set[int]) -> bool:
        """Whether step ``n`` must get exactly step n−1−k's weights: not so for a step voided for damage, or one whose
        weights no engine holds any more (they are gone)."""
        return n > self.unfixed_upto and n not in voided and n not in self.loose

    def owed(self, n: int, held: int | None) -> bool:
        """Whether the held sync of step ``held`` waits for step ``n``'s generate."""
        return held is not None and n <= self.last_on_old(held)

    def waits(self, n: int, generated: int) -> bool:
        """Whether ``sync(n)`` waits for rollout (``generated``: the last step whose generate is done), unless the steps
        it waits for were let go."""
        return generated < self.last_on_old(n) and self.last_on_old(n) not in self.loose

    def kept(self, n: int, data_states: dict[int, Any]) -> dict | None:
        """What step ``n``'s checkpoint keeps: steps n+1..G, generated on weights a resume from it no longer has (None:
        none)."""
        g = n
        while g < self.last_on_old(n) and g + 1 in self.rows:
            g += 1
        if g == n:
            return None
        return {"generated": g, "data": data_states.get(g), "metrics": {str(m): self.rows[m] for m in range(n + 1, g + 1)}}
