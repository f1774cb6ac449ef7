"""Balanced answers for the toy tasks: items ``n·k`` to ``n·k + n - 1`` of a dataset hold each of its ``n`` answers
once, in an order drawn per block, so on a set of ``n·k`` items any answer that does not look at (listen to,
watch) the item, whatever its distribution over the answers, is right exactly ``1/n`` of the time: the baseline
each task's held-out accuracy is measured against. Shared by :mod:`.shapes`, :mod:`.tones` and :mod:`.dots`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

T = TypeVar("T")


def letter_score(response: str, label: object, letters: Collection[str], partial: float) -> float:
    """A one-letter answer's reward: 1.0 for the label, ``partial`` for another of the task's ``letters``, else 0.0
    (the response's first character). :mod:`.tones` and :mod:`.dots` score so."""
    first = (response or "")[:1]
    if first == str(label).strip():
        return 1.0
    return partial if first and first in letters else 0.0


def balanced_answer(answers: Sequence[T], index: int, order: Callable[[int], Sequence[int]]) -> T:
    """The answer of item ``index``: its block's (``index // len(answers)``) order, ``order(block)`` (a
    permutation of ``range(len(answers))``, drawn from the dataset's seed and the block), at ``index``'s place
    in the block."""
    n = len(answers)
    perm = list(order(index // n))
    if sorted(perm) != list(range(n)):
        raise ValueError(f"order({index // n}) = {perm}: not a permutation of range({n})")
    return answers[perm[index % n]]
