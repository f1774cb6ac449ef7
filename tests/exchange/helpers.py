"""Helpers shared by the exchange tests."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

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
