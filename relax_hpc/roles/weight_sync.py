"""The actor's weight sync to the rollout engines, as the actor role uses it.

:func:`make_sender` returns ``relax_hpc.weights.WeightSender`` when that module provides it (the real one:
gather across TP/PP, HF names, buckets, NCCL), and otherwise :class:`StandInSender`, a minimal sender with
the same two calls, so colocate runs work while ``relax_hpc/weights`` is being written:

- ``connect(engines, master_address)``: a weight-sync group of actor rank 0 (rank 0, hosting the store
  on a port the kernel chose) and one rank per engine, which joins through ``/init_weights_update_group``.
  Calling it again with another engine set (an engine died) builds a new group under a new name.
- ``push(named_weights, version)``: ``/begin_weight_update``, then per bucket
  (:func:`relax_hpc.weights.buckets.iter_buckets`) one ``/update_weights_from_distributed`` per engine
  with ``load_format: flattened_bucket`` and one ``dist.broadcast`` of the flat buffer, then
  ``/update_weight_version`` and ``/end_weight_update``. In colocate mode generation is idle during a
  sync, so no pause/continue is needed.

:func:`fingerprint_check` compares what an engine serves (``/get_weights_by_name``) with the actor's
tensors: the check that a sync landed.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterable

import torch

log = logging.getLogger(__name__)
_groups = itertools.count(1)


def make_sender(backend: str, bucket_bytes: int | None = None) -> Any:
    try:
        from relax_hpc.weights import WeightSender  # type: ignore[attr-defined]
    except ImportError:
        WeightSender = None
    if WeightSender is not None and hasattr(WeightSender, "connect") and hasattr(WeightSender, "push"):
        try:
            return WeightSender(backend=backend) if bucket_bytes is None else \
                WeightSender(backend=backend, bucket_bytes=bucket_bytes)
        except TypeError:
            return WeightSender()
    return StandInSender(backend=backend, bucket_bytes=bucket_bytes)


class StandInSender:
    def __init__(self, backend: str = "gloo", bucket_bytes: int | None = None, timeout_s: float = 600.0):
        from relax_hpc.weights.buckets import DEFAULT_BUCKET_BYTES

        self.backend = backend
        self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        self.timeout_s = timeout_s
        self.engines: dict[str, Any] = {}  # name -> EngineClient
        self.group = None
        self.group_name: str | None = None

    def connect(self, engines: dict[str, str], master_address: str) -> None:
        from relax_hpc.rollout.client import EngineClient
        from relax_hpc.rollout.cpu_engine import init_weight_update_group
        from relax_hpc.rollout.engines import free_port

        self.close_clients()
        self.engines = {name: EngineClient(url) for name, url in engines.items()}
        self.group_name = f"relax_weight_sync_{next(_groups)}"
        port = free_port(master_address if master_address not in ("localhost",) else "127.0.0.1")
        world = 1 + len(self.engines)
        futs = [c.submit(c.init_weights_update_group, master_address, port, rank_offset=1 + i, world_size=world,
                         group_name=self.group_name, backend=self.backend)
                for i, c in enumerate(self.engines.values())]
        self.group = init_weight_update_group(master_address, port, 0, world, self.group_name, backend=self.backend,
                                              timeout_s=self.timeout_s)
        for f in futs:
            f.result()

    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: str) -> dict[str, float]:
        import torch.distributed as dist

        from relax_hpc.weights.buckets import iter_buckets

        clients = list(self.engines.values())
        for c in clients:
            c.begin_weight_update()
        nbytes, nbuckets = 0, 0
        try:
            for bucket in iter_buckets(named_weights, self.bucket_bytes):
                futs = [c.submit(c.update_weights_from_distributed, bucket.names, bucket.dtypes, bucket.shapes,
                                 self.group_name, load_format="flattened_bucket") for c in clients]
                dist.broadcast(bucket.flat.contiguous(), src=0, group=self.group)
                for f in futs:
                    f.result()
                nbytes += bucket.nbytes
                nbuckets += 1
            for c in clients:
                c.update_weight_version(str(version))
        finally:
            for c in clients:
                try:
                    c.end_weight_update()
                except Exception as e:  # the push's own error matters more
                    log.warning("end_weight_update on %s failed: %s", c.url, e)
        return {"bytes": float(nbytes), "buckets": float(nbuckets)}

    def close_clients(self) -> None:
        for c in self.engines.values():
            c.close()

    def close(self) -> None:
        self.close_clients()
        self.engines = {}


def fingerprint_check(engines: dict[str, str], named: dict[str, torch.Tensor], rows: int = 4) -> dict[str, Any]:
    """Max |engine − actor| over the first ``rows`` rows of each tensor in ``named``, per engine, and overall."""
    from relax_hpc.rollout.client import EngineClient

    per_engine: dict[str, float] = {}
    for name, url in engines.items():
        with EngineClient(url) as c:
            worst = 0.0
            for pname, t in named.items():
                got = torch.as_tensor(c.get_weights_by_name(pname, truncate_size=rows), dtype=torch.float32)
                want = t.detach().float()[:rows].reshape(got.shape)
                worst = max(worst, float((got - want).abs().max()))
            per_engine[name] = worst
    return {"max_abs_diff": max(per_engine.values(), default=0.0), "per_engine": per_engine}
