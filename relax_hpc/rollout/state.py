"""The rollout state after a step (``data_state`` on the wire): the data cursor and, with partial rollout, the
reference of the buffer saved with it. Always together: a step generated again, a restarted rollout role and a
resumed run start from both.

The controller keeps it per step and in the checkpoints as the plain dict :meth:`DataState.to_dict` gives (it never
reads it); the rollout role reads it back with :meth:`DataState.from_dict`, the one place the wire form is known.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


class DataStateError(ValueError):
    """A ``data_state`` that is not one this rollout role wrote (a hand-edited checkpoint, another version)."""


def _int(d: dict, key: str, where: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise DataStateError(f"{where}: {key} = {v!r} is not an integer. Fix: resume from a checkpoint this "
                             "relax_hpc wrote, or restore its meta.json")
    return v


@dataclass(frozen=True)
class BufferRef:
    """Partial rollout's buffer saved after a step (:meth:`~relax_hpc.rollout.dynamic.PartialRollout.save`): the file
    under the run directory (None: an empty buffer, no file), its prompt groups and samples, size and sha256."""

    groups: int = 0
    samples: int = 0
    file: str | None = None
    size: int | None = None
    sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.file is None:  # an empty buffer writes no file
            return {"groups": self.groups, "samples": self.samples}
        return {"file": self.file, "groups": self.groups, "samples": self.samples, "size": self.size,
                "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BufferRef:
        where = "data_state.partial"
        if not isinstance(d, dict):
            raise DataStateError(f"{where} = {d!r} is not a buffer reference")
        file = d.get("file")
        return cls(groups=_int(d, "groups", where, 0), samples=_int(d, "samples", where, 0),
                   file=str(file) if file else None, size=d.get("size"), sha256=d.get("sha256"))


@dataclass(frozen=True)
class DataState:
    """The data cursor (:meth:`~relax_hpc.rollout.data.RolloutDataSource.state_dict`'s fields) and the buffer saved
    with it (``partial``: None when partial rollout is off). ``num_prompts``, ``shuffle`` and ``seed`` are what the
    cursor was saved with (None: not recorded), checked when it is loaded."""

    epoch: int
    offset: int
    sample_group_index: int = 0
    sample_index: int = 0
    num_prompts: int | None = None
    shuffle: bool | None = None
    seed: int | None = None
    version: int = 1
    partial: BufferRef | None = None

    def cursor(self) -> dict[str, Any]:
        """The data source's own encoding (:meth:`~relax_hpc.rollout.data.RolloutDataSource.load_state_dict`)."""
        out: dict[str, Any] = {"version": self.version, "epoch": self.epoch, "offset": self.offset,
                               "sample_group_index": self.sample_group_index, "sample_index": self.sample_index}
        out.update({k: v for k, v in (("num_prompts", self.num_prompts), ("shuffle", self.shuffle),
                                      ("seed", self.seed)) if v is not None})
        return out

    def to_dict(self) -> dict[str, Any]:
        """The wire form: the cursor's keys, and ``partial`` with partial rollout."""
        out = self.cursor()
        if self.partial is not None:
            out["partial"] = self.partial.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataState:
        where = "data_state"
        if not isinstance(d, dict):
            raise DataStateError(f"{where} = {d!r} is not the rollout state (a dict with the data cursor)")
        partial = d.get("partial")
        return cls(epoch=_int(d, "epoch", where), offset=_int(d, "offset", where),
                   sample_group_index=_int(d, "sample_group_index", where, 0),
                   sample_index=_int(d, "sample_index", where, 0),
                   num_prompts=d.get("num_prompts"), shuffle=d.get("shuffle"), seed=d.get("seed"),
                   version=_int(d, "version", where, 1),
                   partial=BufferRef.from_dict(partial) if partial is not None else None)

    @classmethod
    def of(cls, cursor: dict[str, Any], partial: BufferRef | None = None) -> DataState:
        """From the data source's :meth:`~relax_hpc.rollout.data.RolloutDataSource.state_dict` and a buffer."""
        state = cls.from_dict(cursor)
        return state if partial is None else replace(state, partial=partial)


def buffer_files(extra: Any) -> list[str]:
    """The saved buffers a checkpoint's extra state names: every ``partial`` file in it (its ``data`` and, with
    staleness_mode fixed, ``kept.data``), wherever the controller nests a data_state."""
    if isinstance(extra, dict):
        ref = extra.get("partial")
        own = [ref["file"]] if isinstance(ref, dict) and ref.get("file") else []
        return own + [f for v in extra.values() if isinstance(v, dict) for f in buffer_files(v)]
    return []
