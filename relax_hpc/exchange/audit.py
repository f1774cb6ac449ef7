"""What the journal says happened to every sample: produced once, consumed once by each task; and to every
prompt: trained at most once per epoch of the dataset.

Read-only and independent of the broker's code path (it replays the records itself), so a test or an
operator can check the broker's promise after any number of crashes, requeues and resumes. A ``rewound``
record (a resume from an earlier checkpoint) voids what was produced and consumed after its step: those
samples are produced again and count from then on.

Prompts: the rollout role puts the prompt groups of each chunk in its attrs (:func:`prompt_attrs`), which the
``produced`` record carries, so the count outlives the chunk files. A group's ``group_index`` is the data
source's draw count (:class:`~relax_hpc.rollout.data.RolloutDataSource`: epoch ``e`` hands out its prompts
as group indices ``e·N … e·N+N−1``, N the dataset's prompts, each once), so ``group_index // N`` is the
epoch and distinct group indices of one epoch are distinct prompts.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

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
    prompts: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # chunk -> (N, its groups), current life


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
            a = steps.setdefault(s, StepAudit())
            a.samples += int(r["n"])
            groups = chunk_prompts(r.get("attrs") or {})
            if groups is not None:
                a.prompts[r["chunk"]] = groups
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
                a.prompts.pop(cid, None)
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


# ----------------------------------------------------------------------------------------- prompts ---

def prompt_attrs(group_indices: Iterable[int | None], num_prompts: int) -> dict:
    """The chunk attrs that say which prompts a chunk holds: ``{"prompts": {"per_epoch": N, "groups": [[a, b],
    ...]}}``, the distinct group indices as half-open runs (a step's groups are mostly consecutive). Samples
    without a group index are left out."""
    runs: list[list[int]] = []
    for g in sorted({int(g) for g in group_indices if g is not None and g >= 0}):
        if runs and runs[-1][1] == g:
            runs[-1][1] = g + 1
        else:
            runs.append([g, g + 1])
    return {"prompts": {"per_epoch": int(num_prompts), "groups": runs}}


def chunk_prompts(attrs: dict) -> tuple[int, list[int]] | None:
    """(N, group indices) from a chunk's attrs; None for a chunk written without them (an older run)."""
    p = attrs.get("prompts")
    if not p:
        return None
    return int(p["per_epoch"]), [g for a, b in p["groups"] for g in range(int(a), int(b))]


@dataclass
class EpochAudit:
    epoch: int
    prompts: int  # in the dataset (N)
    trained: int = 0  # distinct prompts of this epoch trained
    twice: list[int] = field(default_factory=list)  # group indices trained more than once (none expected)


def epochs(journal: str | os.PathLike, task: str = "train") -> tuple[dict[int, EpochAudit], int]:
    """Per epoch of the dataset, the prompts trained (consumed by ``task``, in the partitions' current lives,
    quarantined chunks left out), and those trained twice; and how many consumed chunks carry no prompt record
    (an older run: their prompts are not counted). A prompt a dynamic sampling filter dropped, or that is still
    in partial rollout's buffer at the end, is drawn and not trained: ``trained`` may be below ``prompts``."""
    seen: Counter[int] = Counter()
    per_epoch: dict[int, int] = {}
    unknown = 0
    for a in audit(journal).values():
        for cid in a.chunks_consumed.get(task, []):
            if cid not in a.prompts:
                unknown += 1
                continue
            n, groups = a.prompts[cid]
            for g in groups:
                seen[g] += 1
                per_epoch[g] = n
    out: dict[int, EpochAudit] = {}
    for g, k in sorted(seen.items()):
        n = per_epoch[g]
        e = out.setdefault(g // n, EpochAudit(epoch=g // n, prompts=n))
        e.trained += 1
        if k > 1:
            e.twice.append(g)
    return out, unknown


def prompt_violations(per_epoch: dict[int, EpochAudit]) -> list[str]:
    """Violations of "no prompt trained twice in one epoch" in :func:`epochs`' count (empty: none)."""
    return [f"epoch {e}: {len(a.twice)} prompt(s) trained more than once (group indices {a.twice[:10]})"
            for e, a in sorted(per_epoch.items()) if a.twice]
