"""Helpers shared by the exchange tests."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from relax_hpc.exchange.chunk import ChunkRef, write_chunk, write_fields

SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def fresh_dir(prefix: str = "relax-xchg-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=SHM))


def tokens_for(sid: int, length: int) -> np.ndarray:
    """Deterministic per-sample content, so a reader can tell whose data it got."""
    return (np.arange(length, dtype=np.int32) * 7 + sid) % 50021


def sample_fields(sids: list[int], lengths: list[int]) -> dict:
    return {
        "sid": np.asarray(sids, dtype=np.int64),
        "tokens": [tokens_for(s, n) for s, n in zip(sids, lengths)],
        "reward": np.asarray([s * 0.5 for s in sids], dtype=np.float32),
    }


def flip_byte(path: Path, offset: int, mask: int = 0x5A) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


def bump_byte(path: Path, offset: int) -> None:
    """Add 1 to a byte: repeated bumps never restore the original (as two equal XORs would)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([(b[0] + 1) % 256]))


# ------------------------------------------------------------------ the run's way of using the broker ---
# In a run the controller owns the broker: it hands the rollout role ``next_seq(producer)`` with its ``generate``
# task, the role writes the chunk (``rollout.write.write_step`` → ``write_chunk``) and the controller announces
# it; a forward role writes side files (``roles.forward.compute_and_write`` → ``write_fields``) for the chunks
# whose lease does not list the field yet, and the controller adds them. These helpers do the same in one process.


def produce(broker, root, producer: str, step: int, fields: dict, attrs: dict | None = None) -> ChunkRef:
    """Write a chunk at the broker's next seq for ``producer`` and announce it."""
    ref = write_chunk(root, step, producer, broker.next_seq(producer), fields, attrs)
    broker.announce(ref)
    return ref


def add_fields(broker, ref: ChunkRef, writer: str, fields: dict) -> bool:
    """Add ``fields`` to the chunk of ``ref`` as ``writer``; False (nothing written) if ``ref`` has them already,
    else what ``Broker.add_fields`` says."""
    if set(fields) <= ref.all_fields:
        return False
    return broker.add_fields(write_fields(ref, writer, fields))
