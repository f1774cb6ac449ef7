"""Weight fingerprints: one string that says "these are exactly the same weights", on the actor and on an engine.

``fingerprint(named)`` hashes, in name order, each name, shape and the tensor's values converted to float64
(exact for bf16/fp16/fp32, so a bf16 engine and a bf16 actor agree bit for bit). ``engine_fingerprint(client,
names)`` computes the same hash from ``/get_weights_by_name`` with a ``truncate_size`` large enough to return
the whole tensor (the endpoint returns ``param[:truncate_size]`` as nested float lists; JSON keeps every
float32 exactly). That holds for relax_hpc's CPU engine; on SGLang it depends on the model class's
``get_weights_by_name`` (fused QKV / gate-up and TP shards may not come back as the HF tensor), so use it
there only for names it returns whole.

Meant for tests and debugging (``--check-weight-update-equal`` in Relax): reading a large model through JSON
is slow. Pass a subset of names for a spot check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

FULL = 1 << 62  # truncate_size that never truncates


def _update(h, name: str, t: torch.Tensor) -> None:
    t = t.detach().to("cpu", torch.float64).contiguous()
    h.update(name.encode())
    h.update(b"\0")
    h.update(repr(tuple(t.shape)).encode())
    h.update(b"\0")
    h.update(t.numpy().tobytes())


def fingerprint(named: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> str:
    """sha256 (hex) over names (sorted), shapes and float64 values."""
    items = named.items() if isinstance(named, dict) else named
    h = hashlib.sha256()
    for name, t in sorted(items, key=lambda kv: kv[0]):
        _update(h, name, t)
    return h.hexdigest()


def engine_tensor(client, name: str) -> torch.Tensor:
    """The whole parameter ``name`` as the engine holds it (float64), via ``/get_weights_by_name``."""
    return torch.tensor(client.get_weights_by_name(name, truncate_size=FULL), dtype=torch.float64)


def engine_fingerprint(client, names: Sequence[str]) -> str:
    """:func:`fingerprint` of the engine's parameters ``names``."""
    return fingerprint([(n, engine_tensor(client, n)) for n in names])
