"""Chunk and side-file refs: where a step's samples lie and how to check them, as the broker journals them and
the controller's tasks carry them (:mod:`relax_hpc.controller.messages`).

Plain data with no h5py or numpy: the control messages that carry refs load only this module, and the
format itself stays in :mod:`relax_hpc.exchange.chunk` (which writes and reads the files these refs name).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

__all__ = ["ChunkRef", "SideRef"]


@dataclass(frozen=True)
class SideRef:
    """A side file: fields ``writer`` added to ``chunk`` (a chunk id, ``step_<N>/chunk_<producer>_<seq>``)."""

    chunk: str
    writer: str
    file: str  # file name inside the partition directory
    fields: tuple[str, ...]
    checksum: str
    size: int

    def to_dict(self) -> dict:
        return {"chunk": self.chunk, "writer": self.writer, "file": self.file, "fields": list(self.fields),
                "checksum": self.checksum, "size": self.size}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SideRef":
        return cls(chunk=d["chunk"], writer=d["writer"], file=d["file"], fields=tuple(d["fields"]),
                   checksum=d["checksum"], size=int(d["size"]))


@dataclass(frozen=True)
class ChunkRef:
    """Where a chunk is and how to check it: what the broker journals and hands to consumers."""

    path: str  # absolute path of the main file
    step: int
    n: int  # samples
    fields: tuple[str, ...]  # fields in the main file
    checksum: str
    size: int
    attrs: dict = field(default_factory=dict, compare=False, hash=False)
    sides: tuple[SideRef, ...] = ()

    @property
    def name(self) -> str:  # chunk_<producer>_<seq>
        return Path(self.path).name[: -len(".h5")]

    @property
    def id(self) -> str:  # step_<N>/chunk_<producer>_<seq>: unique in the exchange
        return f"step_{self.step}/{self.name}"

    @property
    def dir(self) -> Path:
        return Path(self.path).parent

    @property
    def all_fields(self) -> frozenset[str]:
        return frozenset(self.fields).union(*(s.fields for s in self.sides))

    def file_of(self, name: str) -> tuple[Path, str, int]:
        """(path, checksum, size) of the file holding field ``name``."""
        if name in self.fields:
            return Path(self.path), self.checksum, self.size
        for s in self.sides:
            if name in s.fields:
                return self.dir / s.file, s.checksum, s.size
        raise KeyError(f"{self.id} has no field {name!r} (it has {sorted(self.all_fields)})")

    def files(self) -> list[tuple[Path, str, int]]:
        return [(Path(self.path), self.checksum, self.size)] + [(self.dir / s.file, s.checksum, s.size) for s in self.sides]

    def to_dict(self) -> dict:
        return {"path": self.path, "step": self.step, "n": self.n, "fields": list(self.fields),
                "checksum": self.checksum, "size": self.size, "attrs": self.attrs,
                "sides": [s.to_dict() for s in self.sides]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ChunkRef":
        return cls(path=d["path"], step=int(d["step"]), n=int(d["n"]), fields=tuple(d["fields"]),
                   checksum=d["checksum"], size=int(d["size"]), attrs=dict(d.get("attrs") or {}),
                   sides=tuple(SideRef.from_dict(s) for s in d.get("sides", ())))

    def with_side(self, side: SideRef) -> "ChunkRef":
        return replace(self, sides=self.sides + (side,))
