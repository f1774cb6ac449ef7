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
    samples: int = 0  # produced (announced) in the partition's current life
    consumed: dict[str, int] = field(default_factory=dict)  # task -> samples consumed
    chunks_consumed: dict[str, list[str]] = field(default_factory=dict)  # task -> chunk ids, in order
    cleared: bool = False
    forced: bool = False  # cleared with unconsumed samples dropped
    rewinds: int = 0  # how many earlier lives of this partition were voided


def audit(journal: str | os.PathLike) -> dict[int, StepAudit]:
    """Per rollout step, from the journal at ``journal``."""
    steps: dict[int, StepAudit] = {}
    chunk_step: dict[str, int] = {}
    chunk_n: dict[str, int] = {}
    leases: dict[str, tuple[str, list[str]]] = {}
    rewinds: dict[int, int] = {}
    for r in replay(journal):
        op = r.get("op")
        if op == "start":
            steps.setdefault(int(r["step"]), StepAudit(rewinds=rewinds.get(int(r["step"]), 0)))
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
        elif op == "cleared":
            a = steps.setdefault(int(r["step"]), StepAudit())
            a.cleared, a.forced = True, bool(r.get("forced"))
        elif op == "rewound":
            for s in r["steps"]:
                steps.pop(int(s), None)
                rewinds[int(s)] = rewinds.get(int(s), 0) + 1
                for cid in [c for c, st in chunk_step.items() if st == int(s)]:
                    del chunk_step[cid]
    return steps


def exactly_once(journal: str | os.PathLike, tasks: list[str]) -> list[str]:
    """Violations of "every produced sample consumed exactly once by each task" (empty: none)."""
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
    return out
