"""The exchange broker: which chunks exist, which fields they have, who consumed what, what is cleared.

The broker runs inside the controller (the socket hookup is the controller's); here it is a plain,
thread-safe object. All of its state is a function of its journal: every change is appended (fsynced) to
the journal *before* it is applied or answered, and construction replays the journal, so a broker that
crashed or was requeued comes back exactly where the last acknowledged call left it.

Lifecycle of a rollout step ``N`` (a *partition*, directory ``<root>/step_N/``):

1. the producer calls :meth:`Broker.start_step` — refused (``False``) while the staleness gate is shut;
2. it writes chunks (:func:`~relax_hpc.exchange.chunk.write_chunk`) and :meth:`announce` s them;
3. roles add fields (:func:`~relax_hpc.exchange.chunk.write_fields`, :meth:`add_fields`);
4. each consuming *task* :meth:`request` s chunks that have all the fields it asks for, and :meth:`ack` s them;
5. the producer calls :meth:`end_step` when it will announce no more chunks to ``N``;
6. the step is *complete* once ended and every chunk is consumed by every task (or quarantined);
   it is then cleared (automatically with ``auto_clear``, else by :meth:`clear`): journaled, then its
   directory deleted.

Delivery guarantee (per task and chunk): a request hands chunks out under a *lease* (journaled before
the reply); :meth:`ack` turns the lease into consumption (journaled), :meth:`release` (or
:meth:`release_holder`, for a consumer that died) gives the chunks back. At any moment a chunk is leased
to at most one consumer of a task, and it is consumed by each task at most once — exactly once if the step
is drained before it is cleared — across broker restarts. A consumer that dies after using a lease but
before acking it gets its chunks handed out again: processing is at least once, consumption (the ack)
exactly once; effects that must not repeat belong after the ack, and field writes are idempotent
(first write wins, see :meth:`add_fields`). A reconnecting consumer first asks :meth:`outstanding` for its
leases (a lease whose reply was lost in a crash is still there).

Damage: the broker checks size and header at announce/add_fields and stats the files at hand-out;
consumers verify the full checksum when they read (:func:`~relax_hpc.exchange.chunk.read_chunk`) and
report failures (:meth:`report_damaged`), which the broker re-verifies itself before it quarantines.
A quarantined chunk is never handed out again; its files move to ``<root>/quarantine/``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from relax_hpc.exchange import staleness
from relax_hpc.exchange.chunk import (
    ChunkRef,
    DamagedChunk,
    SideRef,
    check_field_name,
    check_file,
    load_verified,
    parse_chunk_file,
    partition_dir,
    sweep_tmp,
)
from relax_hpc.exchange.journal import Journal, JournalCorrupt
from relax_hpc.rundir import fsync_dir as _fsync_dir

log = logging.getLogger(__name__)

_ID_RE = re.compile(r"^step_(\d+)/(chunk_[A-Za-z0-9_-]+)$")


class ExchangeError(Exception):
    """A request the broker refuses (the message says why and what to do)."""


class StepNotStarted(ExchangeError):
    pass


class StepCleared(ExchangeError):
    pass


class StepEnded(ExchangeError):
    pass


class StepNotComplete(ExchangeError):
    pass


class UnknownChunk(ExchangeError):
    pass


class UnknownTask(ExchangeError):
    pass


class FieldConflict(ExchangeError):
    """Some of the fields already exist on the chunk, from another file (first write wins)."""


class ChunkQuarantined(ExchangeError):
    pass


class LeaseLost(ExchangeError):
    """The lease was released (or never existed): its chunks may be with another consumer; discard its results."""


@dataclass(frozen=True)
class Lease:
    """Chunks handed to one consumer of one task; :meth:`Broker.ack` or :meth:`Broker.release` it."""

    id: str
    task: str
    holder: str
    chunks: tuple[ChunkRef, ...]
    fields: tuple[str, ...]

    @property
    def n(self) -> int:
        return sum(c.n for c in self.chunks)

    def to_dict(self) -> dict:
        return {"id": self.id, "task": self.task, "holder": self.holder, "fields": list(self.fields),
                "chunks": [c.to_dict() for c in self.chunks]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Lease":
        return cls(id=d["id"], task=d["task"], holder=d["holder"], fields=tuple(d["fields"]),
                   chunks=tuple(ChunkRef.from_dict(c) for c in d["chunks"]))


class _Chunk:
    __slots__ = ("ref", "producer", "seq", "consumed", "leased", "quarantined")

    def __init__(self, ref: ChunkRef, producer: str, seq: int):
        self.ref = ref
        self.producer = producer
        self.seq = seq
        self.consumed: set[str] = set()
        self.leased: dict[str, str] = {}  # task -> lease id
        self.quarantined: str | None = None


class _Step:
    __slots__ = ("ended", "chunks")

    def __init__(self) -> None:
        self.ended = False
        self.chunks: list[str] = []


class _Lease:
    __slots__ = ("task", "holder", "chunks", "fields")

    def __init__(self, task: str, holder: str, chunks: list[str], fields: tuple[str, ...]):
        self.task, self.holder, self.chunks, self.fields = task, holder, chunks, fields


def split_id(chunk_id: str) -> tuple[int, str]:
    m = _ID_RE.match(chunk_id)
    if not m:
        raise ValueError(f"not a chunk id: {chunk_id!r} (expected step_<N>/chunk_<producer>_<seq>)")
    return int(m.group(1)), m.group(2)


class _Reaper:
    """Deletes cleared partitions off the caller's path. A step's files can be many GB, and freeing their blocks
    takes milliseconds per file; the clear that ends a step sits between an ack and the next hand-out. The
    partition is renamed away first (``.trash_step_<N>_<rand>``: the name is free again at once, for a step that
    starts again), then one daemon thread deletes it. A crash before that leaves a ``.trash_*`` directory, which
    :meth:`Broker._gc` removes at the next open."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._pending = 0

    def put(self, path: Path) -> None:
        with self._idle:
            if self._thread is None:  # (if the start fails nothing is counted: drain() never waits for it)
                t = threading.Thread(target=self._run, name="exchange-reaper", daemon=True)
                t.start()
                self._thread = t
            self._pending += 1
        self._q.put(path)

    def _run(self) -> None:
        while True:
            path = self._q.get()
            shutil.rmtree(path, ignore_errors=True)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything put so far is deleted."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)


class Broker:
    """The exchange's state machine, rebuilt from ``journal_path`` (default ``<root>/journal.jsonl``).

    ``tasks`` maps each consuming task to the fields it needs (its default request); every chunk must be
    consumed by every task before its step is complete. ``max_staleness`` is the gate's ``k``.
    ``auto_clear`` clears a step as soon as it is complete. ``check_files`` turns the broker's own cheap
    file checks on (announce, add_fields, hand-out). ``fsync`` is for benchmarks of its cost only.
    """

    def __init__(self, root: str | os.PathLike, journal_path: str | os.PathLike | None = None,
                 tasks: Mapping[str, Iterable[str]] | None = None, max_staleness: int = 0, *,
                 auto_clear: bool = True, check_files: bool = True, fsync: bool = True):
        if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, not {max_staleness!r}")
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.tasks: dict[str, tuple[str, ...]] = {}
        for task, fields in (tasks or {}).items():
            fields = tuple(sorted(set(fields)))
            for f in fields:
                check_field_name(f)
            self.tasks[str(task)] = fields
        self.max_staleness = max_staleness
        self.auto_clear = auto_clear
        self.check_files = check_files
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._reaper = _Reaper()

        self._steps: dict[int, _Step] = {}  # started, not cleared (the uncleared partitions)
        self._cleared: set[int] = set()
        self._chunks: dict[str, _Chunk] = {}  # chunks of uncleared steps, in announce order
        self._leases: dict[str, _Lease] = {}  # outstanding
        self._lease_end: dict[str, str] = {}  # lease id -> "consumed" | "released: <reason>" | "dropped"
        self._lease_seq = 0
        self._next_seq: dict[str, int] = {}
        self._damaged: list[dict] = []
        self._life: dict[int, int] = {}  # step -> index in _damaged where its partition's current life began
        self._voided: set[int] = set()  # voided (to be produced again), not started since
        self._config: dict | None = None
        self.samples_in = 0

        self._journal = Journal(Path(journal_path) if journal_path else self.root / "journal.jsonl", fsync=fsync)
        self.journal_path = self._journal.path
        self.torn_tail = self._journal.torn_tail
        self.replayed = len(self._journal.records)
        for i, rec in enumerate(self._journal.records):
            try:
                self._apply(rec)
            except (KeyError, ValueError, TypeError, IndexError) as e:
                self._journal.close()
                raise JournalCorrupt(f"{self._journal.path}: record {i + 1} ({rec.get('op')}) does not fit the "
                                     f"records before it: {type(e).__name__}: {e}") from None
        self._journal.records = []
        config = {"tasks": {t: list(f) for t, f in self.tasks.items()}, "max_staleness": max_staleness}
        with self._lock:
            if self._config != config:
                self._log({"op": "config", **config})
            self._gc()
            self._auto_clear(list(self._steps))

    # ---------------------------------------------------------------------------------- journal ---

    def _log(self, rec: dict) -> dict:
        rec = self._journal.append(rec)
        self._apply(rec)
        self._cond.notify_all()
        return rec

    def _apply(self, r: dict) -> None:  # noqa: C901 - one branch per record type, kept side by side
        op = r["op"]
        if op == "config":
            self._config = {"tasks": r["tasks"], "max_staleness": r["max_staleness"]}
        elif op == "start":
            self._steps[int(r["step"])] = _Step()
            self._life[int(r["step"])] = len(self._damaged)
            self._voided.discard(int(r["step"]))
        elif op == "produced":
            step = int(r["step"])
            path = partition_dir(self.root, step) / (split_id(r["chunk"])[1] + ".h5")
            ref = ChunkRef(path=str(path), step=step, n=int(r["n"]), fields=tuple(r["fields"]),
                           checksum=r["checksum"], size=int(r["size"]), attrs=r.get("attrs") or {})
            self._chunks[r["chunk"]] = _Chunk(ref, r["producer"], int(r["seq"]))
            self._steps[step].chunks.append(r["chunk"])
            self._next_seq[r["producer"]] = max(self._next_seq.get(r["producer"], 0), int(r["seq"]) + 1)
            self.samples_in += int(r["n"])
        elif op == "fields_added":
            c = self._chunks[r["chunk"]]
            c.ref = c.ref.with_side(SideRef(chunk=r["chunk"], writer=r["writer"], file=r["file"],
                                            fields=tuple(r["fields"]), checksum=r["checksum"], size=int(r["size"])))
        elif op == "end":
            self._steps[int(r["step"])].ended = True
        elif op == "leased":
            self._lease_seq = max(self._lease_seq, int(r["lease"][1:]) + 1)
            self._leases[r["lease"]] = _Lease(r["task"], r["holder"], list(r["chunks"]), tuple(r["fields"]))
            for cid in r["chunks"]:
                self._chunks[cid].leased[r["task"]] = r["lease"]
        elif op == "consumed":
            lease = self._leases.pop(r["lease"])
            for cid in lease.chunks:
                c = self._chunks[cid]
                c.leased.pop(lease.task, None)
                c.consumed.add(lease.task)
            self._lease_end[r["lease"]] = "consumed"
        elif op == "released":
            lease = self._leases.pop(r["lease"])
            for cid in lease.chunks:
                self._chunks[cid].leased.pop(lease.task, None)
            self._lease_end[r["lease"]] = f"released: {r.get('reason', '')}"
        elif op == "quarantined":
            c = self._chunks[r["chunk"]]
            c.quarantined = r["reason"]
            self._damaged.append({"chunk": r["chunk"], "step": c.ref.step, "n": c.ref.n, "reason": r["reason"], "t": r["t"]})
        elif op == "cleared":
            step = int(r["step"])
            gone = set(self._steps.pop(step).chunks)
            for cid in gone:
                del self._chunks[cid]
            for lid, lease in list(self._leases.items()):
                if gone.intersection(lease.chunks):
                    lease.chunks = [c for c in lease.chunks if c not in gone]
                    if not lease.chunks:
                        del self._leases[lid]
                        self._lease_end[lid] = "dropped"
            self._cleared.add(step)
        elif op == "rewound":
            for step in r["steps"]:
                self._forget(int(step), "rewound")
        elif op == "voided":
            self._forget(int(r["step"]), "voided")
            self._voided.add(int(r["step"]))
            self._life[int(r["step"])] = len(self._damaged)
        elif op != "journal":
            raise ValueError(f"unknown journal record {op!r}")

    def _forget(self, step: int, why: str) -> None:
        """Drop partition ``step`` (rewound or voided): its chunks, the leases on them; it may start again."""
        st = self._steps.pop(step, None)
        gone = set(st.chunks) if st else set()
        for cid in gone:
            del self._chunks[cid]
        for lid, lease in list(self._leases.items()):
            if gone.intersection(lease.chunks):
                del self._leases[lid]
                self._lease_end[lid] = why
        self._cleared.discard(step)

    def _gc(self) -> None:
        """Finish what a crash may have interrupted after a journal record: deletions and moves."""
        for e in os.scandir(self.root):
            m = re.fullmatch(r"step_(\d+)", e.name)
            if (m and e.is_dir() and int(m.group(1)) in self._cleared | self._voided) or e.name.startswith(".trash_step_"):
                shutil.rmtree(e.path, ignore_errors=True)
        for step in self._steps:
            partition_dir(self.root, step).mkdir(exist_ok=True)
        for c in self._chunks.values():
            if c.quarantined:
                self._move_to_quarantine(c)

    # ----------------------------------------------------------------------------------- gate ---

    def uncleared(self) -> list[int]:
        with self._lock:
            return sorted(self._steps)

    def may_start(self, step: int) -> bool:
        """The staleness gate for ``step`` (True for a step already started and not cleared)."""
        with self._lock:
            if step in self._steps:
                return True
            return staleness.satisfies(step, self._steps, self.max_staleness)

    def start_step(self, step: int, timeout: float = 0.0) -> bool:
        """Start partition ``step`` if the gate allows (waiting up to ``timeout`` s for it); False if shut."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, not {step!r}")
        with self._cond:
            deadline = time.monotonic() + timeout
            while True:
                if step in self._cleared:
                    raise StepCleared(f"step {step} was already cleared; rollout steps do not restart")
                if step in self._steps:
                    return True
                if staleness.satisfies(step, self._steps, self.max_staleness):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            d = partition_dir(self.root, step)
            d.mkdir(exist_ok=True)
            _fsync_dir(self.root)
            self._log({"op": "start", "step": step, "min_uncleared": min(self._steps) if self._steps else None,
                       "max_staleness": self.max_staleness})
            return True

    def end_step(self, step: int) -> None:
        """The producer will announce no more chunks to ``step``."""
        with self._lock:
            st = self._step(step)
            if not st.ended:
                self._log({"op": "end", "step": step})
                self._auto_clear([step])

    def _step(self, step: int) -> _Step:
        st = self._steps.get(step)
        if st is None:
            if step in self._cleared:
                raise StepCleared(f"step {step} is cleared")
            raise StepNotStarted(f"step {step} has not been started (start_step first)")
        return st

    # --------------------------------------------------------------------------------- produce ---

    def next_seq(self, producer: str) -> int:
        """A seq ``producer`` has not announced (1 + the highest announced): where a restarted producer resumes."""
        with self._lock:
            return self._next_seq.get(producer, 0)

    def set_aside_unannounced(self, step: int, producer: str) -> list[str]:
        """Move ``producer``'s chunk files in partition ``step`` that were written but never announced (their writer
        died between writing and reporting) to ``<root>/quarantine/step_<N>/``, so that the step generated again
        takes their names afresh instead of failing on them. Nothing reads an unannounced chunk, so nothing is
        lost. Call only while no task of ``producer`` writes to the step. The names moved, for the log."""
        with self._lock:
            d = partition_dir(self.root, step)
            moved = []
            for path in sorted(d.glob(f"chunk_{producer}_*.h5")) if d.is_dir() else ():
                parsed = parse_chunk_file(path.name)
                if parsed is None or parsed[0] != producer or f"step_{int(step)}/{path.stem}" in self._chunks:
                    continue
                dest = self.root / "quarantine" / f"step_{int(step)}"
                dest.mkdir(parents=True, exist_ok=True)
                k = 0
                while (dest / f"{path.name}.unannounced{k or ''}").exists():
                    k += 1
                os.replace(path, dest / f"{path.name}.unannounced{k or ''}")
                moved.append(path.name)
            if moved:
                _fsync_dir(d)
            return moved

    def announce(self, ref: ChunkRef) -> bool:
        """Register a written chunk. False if it was already announced (same checksum): announces are idempotent."""
        with self._lock:
            step, name = split_id(ref.id)
            parsed = parse_chunk_file(name + ".h5")
            if parsed is None:
                raise ValueError(f"not a chunk name: {name!r}")
            st = self._step(step)
            old = self._chunks.get(ref.id)
            if old is not None:
                if old.ref.checksum == ref.checksum and old.ref.size == ref.size:
                    return False
                raise ExchangeError(f"{ref.id} was announced with checksum {old.ref.checksum}, now {ref.checksum}")
            if st.ended:
                raise StepEnded(f"step {step} was ended; {ref.id} comes too late")
            if ref.sides:
                raise ValueError("announce a chunk without sides; add side files with add_fields")
            if ref.n < 1:
                raise ValueError(f"{ref.id}: a chunk needs samples")
            path = partition_dir(self.root, step) / (name + ".h5")
            if self.check_files:
                meta = check_file(path, ref.checksum, ref.size)
                if meta.get("kind") != "chunk" or meta.get("n") != ref.n:
                    raise DamagedChunk(path, f"header says kind={meta.get('kind')} n={meta.get('n')}, announced n={ref.n}")
            for f in ref.fields:
                check_field_name(f)
            self._log({"op": "produced", "step": step, "chunk": ref.id, "producer": parsed[0], "seq": parsed[1],
                       "n": ref.n, "fields": list(ref.fields), "checksum": ref.checksum, "size": ref.size,
                       "attrs": ref.attrs})
            return True

    def add_fields(self, side: SideRef) -> bool:
        """Register a side file. False if this very file was registered already; :class:`FieldConflict` if
        any of its fields exists on the chunk from another file (the caller may delete its file)."""
        with self._lock:
            c = self._chunk(side.chunk)
            if c.quarantined:
                raise ChunkQuarantined(f"{side.chunk} is quarantined: {c.quarantined}")
            clash = set(side.fields) & c.ref.all_fields
            if clash:
                if any(s.file == side.file and s.checksum == side.checksum for s in c.ref.sides):
                    return False
                raise FieldConflict(f"{side.chunk} already has {sorted(clash)} (first write wins)")
            if not side.fields:
                raise ValueError("a side file needs fields")
            for f in side.fields:
                check_field_name(f)
            if "/" in side.file or not side.file.startswith(c.ref.name + ".") or not side.file.endswith(".h5"):
                raise ValueError(f"side file name {side.file!r} does not belong to {side.chunk}")
            if self.check_files:
                path = c.ref.dir / side.file
                meta = check_file(path, side.checksum, side.size)
                if meta.get("kind") != "side" or meta.get("n") != c.ref.n or meta.get("base") != c.ref.checksum:
                    raise DamagedChunk(path, f"header kind={meta.get('kind')} n={meta.get('n')} does not belong to {side.chunk}")
            self._log({"op": "fields_added", **side.to_dict(), "fields": list(side.fields)})
            return True

    def _chunk(self, chunk_id: str) -> _Chunk:
        c = self._chunks.get(chunk_id)
        if c is None:
            step, _ = split_id(chunk_id)
            if step in self._cleared:
                raise StepCleared(f"{chunk_id}: step {step} is cleared")
            raise UnknownChunk(f"{chunk_id} was never announced")
        return c

    # --------------------------------------------------------------------------------- consume ---

    def request(self, task: str, fields: Iterable[str] | None = None, batch_size: int = 1, *, step: int | None = None,
                holder: str = "", min_samples: int = 1, timeout: float = 0.0) -> Lease | None:
        """Lease chunks for ``task`` that have all ``fields`` (default: the task's) and that ``task`` has not
        consumed or leased, oldest step first, in announce order: the longest such prefix with at most
        ``batch_size`` samples (or the first chunk alone if it is larger). None if fewer than ``min_samples``
        samples are ready after waiting up to ``timeout`` s. ``step`` limits the search to one partition.
        ``holder`` names the consumer (see :meth:`release_holder`, :meth:`outstanding`)."""
        if task not in self.tasks:
            raise UnknownTask(f"unknown task {task!r}; the broker knows {sorted(self.tasks)}")
        want = frozenset(self.tasks[task] if fields is None else fields)
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        with self._cond:
            deadline = time.monotonic() + timeout
            while True:
                picked = self._pick(task, want, batch_size, step, max(1, min_samples))
                if picked:
                    lid = f"L{self._lease_seq}"
                    self._log({"op": "leased", "lease": lid, "task": task, "holder": holder,
                               "chunks": [c.ref.id for c in picked], "fields": sorted(want)})
                    return self._lease(lid)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def _pick(self, task: str, want: frozenset, batch_size: int, step: int | None, min_samples: int) -> list[_Chunk]:
        steps = [step] if step is not None else sorted(self._steps)
        picked: list[_Chunk] = []
        bad: list[tuple[_Chunk, str]] = []
        total = 0
        for s in steps:
            st = self._steps.get(s)
            if st is None:
                continue
            for cid in st.chunks:
                c = self._chunks[cid]
                if c.quarantined or task in c.consumed or task in c.leased or not want <= c.ref.all_fields:
                    continue
                problem = self._file_problem(c, want) if self.check_files else None
                if problem:
                    bad.append((c, problem))
                    continue
                if picked and total + c.ref.n > batch_size:
                    break
                picked.append(c)
                total += c.ref.n
                if total >= batch_size:
                    break
            else:
                continue
            break
        for c, problem in bad:  # after the scan: quarantining may clear a step
            self._quarantine(c, problem)
        return picked if total >= min_samples else []

    @staticmethod
    def _file_problem(c: _Chunk, want: frozenset) -> str | None:
        """One stat per file the consumer will read: a file gone or resized is damage."""
        files = {c.ref.file_of(f) for f in want} | {c.ref.file_of(c.ref.fields[0])}
        for path, _checksum, size in files:
            try:
                actual = os.stat(path).st_size
            except OSError as e:
                return f"{Path(path).name}: missing ({e.strerror})"
            if actual != size:
                return f"{Path(path).name}: size {actual}, expected {size}"
        return None

    def _lease(self, lid: str) -> Lease:
        lease = self._leases[lid]
        return Lease(id=lid, task=lease.task, holder=lease.holder, fields=lease.fields,
                     chunks=tuple(self._chunks[cid].ref for cid in lease.chunks))

    def ack(self, lease_id: str) -> None:
        """The consumer used the lease: its chunks are consumed by its task. Idempotent."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                end = self._lease_end.get(lease_id)
                if end in ("consumed", "dropped"):
                    return
                raise LeaseLost(f"lease {lease_id} is {end or 'unknown'}: its chunks may have gone to another "
                                "consumer; discard what was computed from them")
            steps = {self._chunks[cid].ref.step for cid in lease.chunks}
            self._log({"op": "consumed", "lease": lease_id, "task": lease.task, "chunks": list(lease.chunks)})
            self._auto_clear(steps)

    def release(self, lease_id: str, reason: str = "released") -> bool:
        """Give a lease back unconsumed (its chunks will be handed out again). False if not outstanding."""
        with self._lock:
            if lease_id not in self._leases:
                return False
            self._log({"op": "released", "lease": lease_id, "reason": reason})
            return True

    def release_holder(self, holder: str, reason: str = "holder gone") -> list[str]:
        """Release every outstanding lease of ``holder`` (a consumer the controller saw die)."""
        with self._lock:
            ids = [lid for lid, lease in self._leases.items() if lease.holder == holder]
            for lid in ids:
                self._log({"op": "released", "lease": lid, "reason": reason})
            return ids

    def outstanding(self, holder: str | None = None, task: str | None = None) -> list[Lease]:
        """Leases handed out and neither acked nor released (a reconnecting consumer resumes these)."""
        with self._lock:
            return [self._lease(lid) for lid, lease in self._leases.items()
                    if (holder is None or lease.holder == holder) and (task is None or lease.task == task)]

    # ---------------------------------------------------------------------------------- damage ---

    def _quarantine(self, c: _Chunk, reason: str) -> None:
        if c.quarantined:
            return
        self._log({"op": "quarantined", "chunk": c.ref.id, "reason": reason})
        self._move_to_quarantine(c)
        self._auto_clear([c.ref.step])

    def _move_to_quarantine(self, c: _Chunk) -> None:
        self._journal.flush()  # the record on disk before the files move (inside a group too)
        dest = self.root / "quarantine" / f"step_{c.ref.step}"
        for path, _, _ in c.ref.files():
            if path.exists():
                dest.mkdir(parents=True, exist_ok=True)
                try:
                    os.replace(path, dest / path.name)
                except OSError:
                    pass

    def quarantine(self, chunk_id: str, reason: str) -> bool:
        """Quarantine a chunk (never handed out again). False if it already was."""
        with self._lock:
            c = self._chunk(chunk_id)
            if c.quarantined:
                return False
            self._quarantine(c, reason)
            return True

    def verify(self, chunk_id: str) -> bool:
        """Read every file of the chunk and check it; quarantine the chunk if one fails. True if sound.
        :class:`StepCleared` (or :class:`UnknownChunk`) if its step is gone, also when it went during the read."""
        with self._lock:
            c = self._chunk(chunk_id)
            if c.quarantined:
                return False
            ref = c.ref
        try:
            for path, checksum, size in ref.files():  # full reads, outside the lock
                load_verified(path, checksum, size)
        except DamagedChunk as e:
            with self._lock:
                if self._chunks.get(chunk_id) is not c:  # cleared or voided while read: its files went with it
                    self._chunk(chunk_id)  # StepCleared / UnknownChunk
                    raise UnknownChunk(f"{chunk_id} was forgotten while it was verified") from None
                self._quarantine(c, f"{Path(e.path).name}: {e.reason}")
            return False
        return True

    def verify_all(self) -> list[str]:
        """:meth:`verify` every chunk not quarantined; the ids found damaged. A quarantine may complete and clear
        its step: the chunks of that step still on the list were consumed by every task, and are skipped."""
        with self._lock:
            ids = [cid for cid, c in self._chunks.items() if not c.quarantined]
        bad = []
        for cid in ids:
            try:
                if not self.verify(cid):
                    bad.append(cid)
            except (StepCleared, UnknownChunk):
                continue
        return bad

    def report_damaged(self, chunk_id: str, reason: str = "") -> bool:
        """A consumer could not read a chunk. The broker checks for itself; True if the chunk is (now) quarantined,
        also when that quarantine completed its step and the step is cleared since (a consumer that held a lease
        on it reads it again after a restart, and finds its file in ``quarantine/``). False for a sound chunk,
        and for one whose step was cleared or voided without it being quarantined."""
        try:
            ok = self.verify(chunk_id)
        except (StepCleared, UnknownChunk):
            with self._lock:
                return any(d["chunk"] == chunk_id for d in self._damaged)
        return not ok

    def damaged(self) -> list[dict]:
        """Every chunk quarantined in this run: chunk, step, n, reason, t."""
        with self._lock:
            return list(self._damaged)

    def quarantined(self, step: int) -> list[dict]:
        """The chunks of partition ``step``'s current life (since its last start) that were quarantined, even
        if that emptied and cleared it: as in :meth:`damaged`."""
        with self._lock:
            return [d for d in self._damaged[self._life.get(step, 0):] if d["step"] == step]

    # ---------------------------------------------------------------------------------- clear ---

    def complete(self, step: int) -> bool:
        """Ended, and every chunk consumed by every task or quarantined."""
        with self._lock:
            st = self._steps.get(step)
            if st is None:
                return step in self._cleared
            return st.ended and all(self._chunks[cid].quarantined or self._done(self._chunks[cid]) for cid in st.chunks)

    def _done(self, c: _Chunk) -> bool:
        return all(t in c.consumed for t in self.tasks)

    def clear(self, step: int, force: bool = False) -> bool:
        """Clear partition ``step`` (journal, then delete its files). Refused unless complete or ``force``
        (forcing drops whatever is unconsumed, and voids leases on it). False if already cleared."""
        with self._lock:
            if step in self._cleared:
                return False
            st = self._step(step)
            if not force and not self.complete(step):
                left = [cid for cid in st.chunks if not (self._chunks[cid].quarantined or self._done(self._chunks[cid]))]
                raise StepNotComplete(f"step {step} is not complete ({'ended' if st.ended else 'not ended'}, "
                                      f"{len(left)} chunks not consumed by every task); clear(force=True) drops them")
            self._clear(step, forced=force)
            return True

    def _clear(self, step: int, forced: bool) -> None:
        st = self._steps[step]
        unconsumed = sum(self._chunks[cid].ref.n for cid in st.chunks
                         if not self._chunks[cid].quarantined and not self._done(self._chunks[cid]))
        self._log({"op": "cleared", "step": step, "forced": forced, "unconsumed": unconsumed})
        self._journal.when_durable(lambda: self._trash(step))  # the record on disk before the files go

    def _trash(self, step: int) -> None:
        """Move a cleared partition away and let the reaper delete it. No directory fsync: a rename lost in a
        crash brings back a step the journal says is cleared, which _gc deletes at the next open."""
        if step not in self._cleared:  # started again (a rewind) before the group that cleared it ended
            return
        trash = self.root / f".trash_step_{step}_{secrets.token_hex(4)}"
        try:
            os.rename(partition_dir(self.root, step), trash)
            self._reaper.put(trash)
        except FileNotFoundError:
            return
        except (OSError, RuntimeError) as e:  # the record is durable: the next open's _gc deletes what is left
            log.warning("could not remove cleared step %d now (%s); it goes when the exchange is opened next", step, e)

    def rewind(self, step: int) -> list[int]:
        """Forget every partition after ``step``, cleared or not: a run resumed from the checkpoint of ``step``
        produces them again (the same samples: generation is seeded by step). Journaled, then their directories
        are deleted (also ones a crash left unannounced). Returns the steps forgotten."""
        with self._lock:
            on_disk = {int(m.group(1)) for e in os.scandir(self.root)
                       if (m := re.fullmatch(r"step_(\d+)", e.name)) and e.is_dir()}
            later = sorted(s for s in set(self._steps) | self._cleared | on_disk if s > step)
            if not later:
                return []
            self._log({"op": "rewound", "step": step, "steps": later})
            self._journal.flush()
            for s in later:
                shutil.rmtree(partition_dir(self.root, s), ignore_errors=True)
            _fsync_dir(self.root)
            return later

    def regenerate(self, step: int, reason: str) -> list[str]:
        """Void partition ``step`` so that it is produced again, because chunks of it were quarantined: journal
        ``voided``, then delete its directory (the quarantined files stay in ``quarantine/``). Every chunk and
        lease of it is forgotten (a late ack raises :class:`LeaseLost`); the audit counts none of its samples as
        produced or consumed, and the step may :meth:`start_step` again (the gate lets the oldest step start).
        Returns the quarantined chunk ids of the life that ended. Refused (:class:`ExchangeError`) for a step not
        started, or with no chunk quarantined in its current life (a sound step is never produced twice)."""
        with self._lock:
            if step not in self._steps and step not in self._cleared:
                raise StepNotStarted(f"step {step} has not been started: nothing to regenerate")
            bad = [d["chunk"] for d in self.quarantined(step)]
            if not bad:
                raise ExchangeError(f"step {step} has no quarantined chunk; regenerate voids a damaged step only")
            self._log({"op": "voided", "step": step, "reason": reason, "quarantined": bad})
            self._journal.flush()
            shutil.rmtree(partition_dir(self.root, step), ignore_errors=True)
            _fsync_dir(self.root)
            return bad

    def _auto_clear(self, steps: Iterable[int]) -> None:
        if self.auto_clear:
            for s in sorted(set(steps)):
                if s in self._steps and self.complete(s):
                    self._clear(s, forced=False)

    # ---------------------------------------------------------------------------------- status ---

    def progress(self, task: str, step: int) -> dict:
        """How far ``task`` is with ``step``: chunks/samples total, consumed, leased, ready, waiting for fields."""
        with self._lock:
            if step in self._cleared:
                return {"step": step, "cleared": True}
            st = self._step(step)
            want = frozenset(self.tasks.get(task, ()))
            out = {"step": step, "cleared": False, "ended": st.ended, "chunks": 0, "samples": 0, "consumed": 0,
                   "leased": 0, "ready": 0, "waiting": 0, "quarantined": 0}
            for cid in st.chunks:
                c = self._chunks[cid]
                out["chunks"] += 1
                out["samples"] += c.ref.n
                key = ("quarantined" if c.quarantined else "consumed" if task in c.consumed else
                       "leased" if task in c.leased else "ready" if want <= c.ref.all_fields else "waiting")
                out[key] += c.ref.n
            out["drained"] = st.ended and out["ready"] == out["waiting"] == out["leased"] == 0
            return out

    def chunks(self, step: int | None = None) -> list[ChunkRef]:
        with self._lock:
            return [c.ref for c in self._chunks.values() if step is None or c.ref.step == step]

    def stats(self) -> dict:
        """For ``state.json``/``relax-status``."""
        with self._lock:
            steps = {}
            for s, st in sorted(self._steps.items()):
                cs = [self._chunks[cid] for cid in st.chunks]
                steps[str(s)] = {"ended": st.ended, "chunks": len(cs), "samples": sum(c.ref.n for c in cs),
                                 "consumed": {t: sum(c.ref.n for c in cs if t in c.consumed) for t in self.tasks},
                                 "quarantined": sum(1 for c in cs if c.quarantined)}
            return {"uncleared": sorted(self._steps), "min_uncleared": min(self._steps) if self._steps else None,
                    "max_staleness": self.max_staleness, "cleared": len(self._cleared),
                    "last_cleared": max(self._cleared) if self._cleared else None, "steps": steps,
                    "leases": len(self._leases), "damaged": len(self._damaged), "samples_in": self.samples_in}

    def orphans(self) -> list[Path]:
        """Complete chunk files in uncleared partitions that were never announced (a producer died between
        its rename and its announce). Left alone; they go with their partition."""
        with self._lock:
            known = {c.ref.path for c in self._chunks.values()}
            steps = list(self._steps)
        out = []
        for s in steps:
            d = partition_dir(self.root, s)
            if d.is_dir():
                out += [Path(e.path) for e in os.scandir(d) if parse_chunk_file(e.name) and e.path not in known]
        return sorted(out)

    def sweep(self, older_than_s: float = 3600.0) -> list[Path]:
        """Remove temporary files of killed writers older than ``older_than_s``."""
        return sweep_tmp(self.root, older_than_s)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """The journal records of the calls inside become durable together at the end, with one fdatasync (see
        :meth:`Journal.group`). Holds the broker for the block, so no other thread's record waits on it. The
        controller wraps each report it handles in one, and sends the tasks it produced only after."""
        with self._lock, self._journal.group():
            yield

    @property
    def journal_syncs(self) -> int:
        return self._journal.syncs

    def close(self) -> None:
        with self._lock:
            self._journal.close()
        self._reaper.drain()  # a closed broker has deleted what it cleared

    def __enter__(self) -> "Broker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


