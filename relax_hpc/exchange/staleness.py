"""The staleness gate (Relax's ``satisfy_staleness``) and its audit from the journal.

Rollout may start step ``s`` only if no partition is uncleared, or ``s − min(uncleared steps) ≤ max_staleness``.
A partition is *uncleared* from its ``start`` record to its ``cleared`` record. With ``max_staleness = 0``
rollout starts step N+1 only once step N is cleared (strictly on-policy); with ``k`` it runs at most ``k``
steps ahead of the oldest partition training has not finished.
"""

from __future__ import annotations

from typing import Iterable


def satisfies(step: int, uncleared: Iterable[int], max_staleness: int) -> bool:
    """The gate: may rollout start ``step`` while ``uncleared`` partitions exist?"""
    u = list(uncleared)
    return not u or step - min(u) <= max_staleness


def audit(records: Iterable[dict], max_staleness: int | None = None) -> dict:
    """Replay ``start``/``cleared`` records and check the gate held at every ``start``.

    ``max_staleness`` defaults to the value each ``start`` record carries. Returns
    ``{"violations": [...], "max_lead": int, "starts": int}`` where ``max_lead`` is the largest
    ``step − min(uncleared)`` seen at a start (−1 if every start found nothing uncleared; the
    ``start`` of a step is checked against the partitions uncleared just before it).
    """
    uncleared: set[int] = set()
    violations = []
    max_lead = -1
    starts = 0
    for r in records:
        op = r.get("op")
        if op == "start":
            step = int(r["step"])
            s = r.get("max_staleness") if max_staleness is None else max_staleness
            if uncleared:
                lead = step - min(uncleared)
                max_lead = max(max_lead, lead)
                if s is not None and lead > s:
                    violations.append({"step": step, "min_uncleared": min(uncleared), "lead": lead, "max_staleness": s})
            uncleared.add(step)
            starts += 1
        elif op == "cleared":
            uncleared.discard(int(r["step"]))
    return {"violations": violations, "max_lead": max_lead, "starts": starts}
