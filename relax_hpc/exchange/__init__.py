"""The sample exchange: chunk files on the shared filesystem, announced to a broker in the controller.

- :mod:`.chunk` — the chunk format (the only module that knows it): write, add fields, read, verify;
- :mod:`.journal` — the broker's append-only, fsynced journal;
- :mod:`.broker` — the state machine (partitions, fields, leases and consumption per task, quarantine,
  clearing, the staleness gate), rebuilt from its journal;
- :mod:`.staleness` — the gate rule and its audit from a journal.

Roles write chunks and side files with :mod:`.chunk` (through :mod:`relax_hpc.train.samples` and
:mod:`relax_hpc.roles.forward`); the controller owns the broker and announces, adds fields, leases and acks.

See ``docs/exchange.md``.
"""

from relax_hpc.exchange.broker import (
    Broker,
    ChunkQuarantined,
    ExchangeError,
    FieldConflict,
    Lease,
    LeaseLost,
    StepCleared,
    StepEnded,
    StepNotComplete,
    StepNotStarted,
    UnknownChunk,
    UnknownTask,
)
from relax_hpc.exchange.chunk import (
    ChunkExists,
    ChunkRef,
    DamagedChunk,
    Ragged,
    SideRef,
    columns_to_samples,
    read_chunk,
    samples_to_columns,
    write_chunk,
    write_fields,
)
from relax_hpc.exchange.journal import JournalCorrupt, JournalLocked, replay

__all__ = [
    "Broker", "ChunkExists", "ChunkQuarantined", "ChunkRef", "DamagedChunk", "ExchangeError",
    "FieldConflict", "JournalCorrupt", "JournalLocked", "Lease", "LeaseLost", "Ragged",
    "SideRef", "StepCleared", "StepEnded", "StepNotComplete", "StepNotStarted", "UnknownChunk", "UnknownTask",
    "columns_to_samples", "read_chunk", "replay", "samples_to_columns", "write_chunk", "write_fields",
]
