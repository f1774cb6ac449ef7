"""Role-side helpers over a broker: produce chunks, add fields, consume batches.

``broker`` is anything with the :class:`~relax_hpc.exchange.broker.Broker` methods: the object itself (one
process, tests, the local executor) or, once the controller exposes the broker on its socket, a proxy
with the same method names. These helpers own the retry rules, so that roles do not:

- :class:`Producer` resumes at the broker's ``next_seq`` and skips names a crashed run left behind;
- :class:`FieldWriter` treats "those fields exist already" as done (first write wins) and removes its
  own losing file;
- :class:`Consumer` reads and verifies every chunk of a lease, reports damaged ones (which the broker
  re-verifies and quarantines) and drops them from the batch; :meth:`Consumer.resume` returns the leases
  a previous incarnation of the same holder left unacked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from relax_hpc.exchange.broker import FieldConflict, Lease
from relax_hpc.exchange.chunk import (
    ChunkExists,
    ChunkRef,
    DamagedChunk,
    check_name,
    columns_to_samples,
    read_chunk,
    write_chunk,
    write_fields,
)


class Producer:
    """Writes and announces chunks as ``name`` (a rollout driver, one per process)."""

    def __init__(self, broker: Any, root: str | os.PathLike, name: str):
        check_name(name, "producer")
        self.broker, self.root, self.name = broker, Path(root), name
        self.seq = broker.next_seq(name)

    def start_step(self, step: int, timeout: float = 0.0) -> bool:
        return self.broker.start_step(step, timeout=timeout)

    def put(self, step: int, fields: Mapping[str, Any], attrs: Mapping[str, Any] | None = None) -> ChunkRef:
        for _ in range(10_000):
            try:
                ref = write_chunk(self.root, step, self.name, self.seq, fields, attrs)
            except ChunkExists:  # an unannounced file from a crashed incarnation: never replace it
                self.seq += 1
                continue
            self.seq += 1
            self.broker.announce(ref)
            return ref
        raise RuntimeError(f"no free chunk name for {self.name} in step {step}")

    def end_step(self, step: int) -> None:
        self.broker.end_step(step)


class FieldWriter:
    """Adds fields to chunks as ``writer`` (e.g. ``actor_fwd``, ``reference``, ``advantages``)."""

    def __init__(self, broker: Any, writer: str):
        check_name(writer, "writer")
        self.broker, self.writer = broker, writer

    def add(self, ref: ChunkRef, fields: Mapping[str, Any]) -> bool:
        """True if these fields are now the chunk's; False if it had them already (ours discarded)."""
        if set(fields) <= ref.all_fields:
            return False
        side = write_fields(ref, self.writer, fields)
        try:
            return self.broker.add_fields(side)
        except FieldConflict:
            try:
                os.unlink(ref.dir / side.file)
            except OSError:
                pass
            return False


@dataclass
class Batch:
    """A lease's readable chunks, read and verified: ``data[i]`` is ``{field: column}`` of ``chunks[i]``."""

    lease: Lease
    chunks: list[ChunkRef]
    data: list[dict[str, Any]]

    @property
    def n(self) -> int:
        return sum(c.n for c in self.chunks)

    def samples(self) -> list[dict[str, Any]]:
        return [s for d in self.data for s in columns_to_samples(d)]


class Consumer:
    """One consumer (``holder``) of ``task``: :meth:`get` a batch, use it, :meth:`ack` it."""

    def __init__(self, broker: Any, task: str, holder: str, fields: Iterable[str] | None = None, ragged: str = "list"):
        self.broker, self.task, self.holder = broker, task, holder
        self.fields = None if fields is None else tuple(fields)
        self.ragged = ragged

    def resume(self) -> list[Batch]:
        """Batches for the leases this holder has outstanding (after a restart of it or of the broker)."""
        out = []
        for lease in self.broker.outstanding(holder=self.holder, task=self.task):
            b = self._read(lease)
            if b is not None:
                out.append(b)
        return out

    def get(self, batch_size: int, *, step: int | None = None, min_samples: int = 1, timeout: float = 0.0) -> Batch | None:
        while True:
            lease = self.broker.request(self.task, self.fields, batch_size, step=step, holder=self.holder,
                                        min_samples=min_samples, timeout=timeout)
            if lease is None:
                return None
            b = self._read(lease)
            if b is not None:
                return b

    def _read(self, lease: Lease) -> Batch | None:
        good, data = [], []
        for ref in lease.chunks:
            try:
                data.append(read_chunk(ref, lease.fields, ragged=self.ragged))
            except DamagedChunk as e:
                if self.broker.report_damaged(ref.id, e.reason):
                    continue  # quarantined; the rest of the lease is fine
                self.broker.release(lease.id, f"{self.holder} cannot read {ref.id}: {e.reason}")
                raise
            good.append(ref)
        if not good:
            self.broker.ack(lease.id)  # every chunk was damaged: nothing to use
            return None
        return Batch(lease, good, data)

    def ack(self, batch: Batch) -> None:
        self.broker.ack(batch.lease.id)

    def release(self, batch: Batch, reason: str = "released") -> None:
        self.broker.release(batch.lease.id, reason)
