"""The sample exchange: chunk files on the shared filesystem, announced to a broker in the controller.

- :mod:`.refs` — :class:`ChunkRef` and :class:`SideRef`, what tasks carry (plain data: no h5py, no numpy);
- :mod:`.chunk` — the chunk format (the only module that knows it): write, add fields, read, verify;
- :mod:`.journal` — the broker's append-only, fsynced journal;
- :mod:`.broker` — the state machine (partitions, fields, leases and consumption per task, quarantine,
  clearing, the staleness gate), rebuilt from its journal;
- :mod:`.staleness` — the gate rule and its audit from a journal.

Roles write chunks and side files with :mod:`.chunk` (through :mod:`relax_hpc.rollout.write` and
:mod:`relax_hpc.roles.forward`); the controller owns the broker and announces, adds fields, leases and acks.

See ``docs/exchange.md``.
"""

from __future__ import annotations

import importlib

from relax_hpc.exchange.refs import ChunkRef, SideRef

# the rest load on first use (PEP 562): importing a light submodule (refs, fields) loads neither h5py nor numpy
_LAZY = {
    "broker": ("Broker", "ChunkQuarantined", "ExchangeError", "FieldConflict", "Lease", "LeaseLost", "StepCleared",
               "StepEnded", "StepNotComplete", "StepNotStarted", "UnknownChunk", "UnknownTask"),
    "chunk": ("ChunkExists", "DamagedChunk", "Ragged", "columns_to_samples", "read_chunk", "samples_to_columns",
              "write_chunk", "write_fields"),
    "journal": ("JournalCorrupt", "JournalLocked", "replay"),
}
_WHERE = {name: mod for mod, names in _LAZY.items() for name in names}

__all__ = [
    "Broker", "ChunkExists", "ChunkQuarantined", "ChunkRef", "DamagedChunk", "ExchangeError",
    "FieldConflict", "JournalCorrupt", "JournalLocked", "Lease", "LeaseLost", "Ragged",
    "SideRef", "StepCleared", "StepEnded", "StepNotComplete", "StepNotStarted", "UnknownChunk", "UnknownTask",
    "columns_to_samples", "read_chunk", "replay", "samples_to_columns", "write_chunk", "write_fields",
]


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"relax_hpc.exchange.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'relax_hpc.exchange' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
