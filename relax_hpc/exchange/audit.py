"""What the journal says happened to every sample: produced once, consumed once by each task.

Read-only and independent of the broker's code path (it replays the records itself), so a test or an
operator can check the broker's promise after any number of crashes, requeues and resumes. A ``rewound``
record (a resume from an earlier checkpoint) voids what was produced and consumed after its step: those
samples are produced again and count from then on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from relax_hpc.exchange.journal import replay


@dataclass
class StepAudit:
    samples: int = 0  # produced (announced) in the partition's current life, quarantined chunks left out
    consumed: dict[str, int] = field(default_factory=dict)  # task -> samples consumed (not of quarantined chunks)
    chunks_consumed: dict[str, list[str]] = field(default_factory=dict)  # task -> chunk ids, in order
    cleared: bool = False
    forced: bool = False  # cleared with unconsumed samples dropped
    rewinds: int = 0  # how many earlier lives of this partition were voided by a resume
    quarantined: list[str] = field(default_factory=list)  # chunk ids quarantined, in every life of the partition
    regenerated: int = 0  # how many lives were voided because of quarantined chunks (then produced again)
    lost: int = 0  # samples of chunks quarantined in the current life (a life not voided and produced again)


def audit(journal: str | os.PathLike) -> dict[int, StepAudit]:
    """Per rollout step, from the journal at ``journal``.

    A quarantined chunk's samples count neither as produced nor as consumed (by any task, also one that
    consumed the chunk before it was found damaged): they count as ``lost`` until the partition is voided
    (``voided``: produced again, :meth:`~relax_hpc.exchange.broker.Broker.regenerate`), which starts it
    afresh, like a ``rewound`` record does for a resume.
    """
    steps: dict[int, StepAudit] = {}
    chunk_step: dict[str, int] = {}  # chunks of the partitions' current lives
    chunk_n: dict[str, int] = {}
    chunk_tasks: dict[str, list[str]] = {}  # chunk -> tasks that consumed it
    leases: dict[str, tuple[str, list[str]]] = {}
    rewinds: dict[int, int] = {}
    history: dict[int, tuple[list[str], int]] = {}  # a rewound step's quarantines and regenerations

    def forget(s: int) -> None:
        for cid in [c for c, st in chunk_step.items() if st == s]:
            del chunk_step[cid]

    for r in replay(journal):
        op = r.get("op")
        if op == "start":
            s = int(r["step"])
            if s not in steps:
                q, g = history.pop(s, ([], 0))
                steps[s] = StepAudit(rewinds=rewinds.get(s, 0), quarantined=q, regenerated=g)
        elif op == "produced":
            s = int(r["step"])
            chunk_step[r["chunk"]], chunk_n[r["chunk"]] = s, int(r["n"])
            steps.setdefault(s, StepAudit()).samples += int(r["n"])
        elif op == "leased":
            leases[r["lease"]] = (r["task"], list(r["chunks"]))
        elif op == "consumed":
            task, chunks = leases.pop(r["lease"], (r["task"], list(r["chunks"])))
            for cid in chunks:
                if cid in chunk_step:
                    a = steps[chunk_step[cid]]
                    a.consumed[task] = a.consumed.get(task, 0) + chunk_n[cid]
                    a.chunks_consumed.setdefault(task, []).append(cid)
                    chunk_tasks.setdefault(cid, []).append(task)
        elif op == "quarantined":
            cid = r["chunk"]
            if cid in chunk_step:
                a, n = steps[chunk_step.pop(cid)], chunk_n[cid]
                a.quarantined.append(cid)
                a.samples -= n
                a.lost += n
                for task in chunk_tasks.pop(cid, []):
                    a.consumed[task] -= n
                    a.chunks_consumed[task].remove(cid)
        elif op == "voided":
            s = int(r["step"])
            old = steps.setdefault(s, StepAudit())
            steps[s] = StepAudit(rewinds=old.rewinds, quarantined=old.quarantined, regenerated=old.regenerated + 1)
            forget(s)
        elif op == "cleared":
            a = steps.setdefault(int(r["step"]), StepAudit())
            a.cleared, a.forced = True, bool(r.get("forced"))
        elif op == "rewound":
            for s in map(int, r["steps"]):
                old = steps.pop(s, None)
                if old is not None and (old.quarantined or old.regenerated):
                    history[s] = (old.quarantined, old.regenerated)
                rewinds[s] = rewinds.get(s, 0) + 1
                forget(s)
    return steps


def exactly_once(journal: str | os.PathLike, tasks: list[str]) -> list[str]:
    """Violations of "every produced sample consumed exactly once by each task" (empty: none). Samples of a
    quarantined chunk must have been produced again (its partition voided and regenerated)."""
    out = []
    for step, a in sorted(audit(journal).items()):
        for task in tasks:
            ids = a.chunks_consumed.get(task, [])
            if len(ids) != len(set(ids)):
                out.append(f"step {step}: a chunk consumed more than once by {task}")
            if a.consumed.get(task, 0) != a.samples:
                out.append(f"step {step}: {a.samples} samples produced, {a.consumed.get(task, 0)} consumed by {task}")
        if a.forced:
            out.append(f"step {step}: cleared with unconsumed samples dropped")
        if a.lost:
            out.append(f"step {step}: {a.lost} samples of quarantined chunks were never produced again")
    return out
