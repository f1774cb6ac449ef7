"""Trainer offload (``train.offload``, Relax's ``--offload-train``): in colocate mode the actor's parameters,
gradients and optimizer state leave the device while the engines generate on it, and come back before the next
train step or weight sync.

How: every device storage behind them (Megatron DDP's contiguous param and grad buffers, which the parameters and
``main_grad`` are views of; the optimizer's fp32 main params and Adam state) is found, deduplicated (many views,
one storage) and freed in place with ``untyped_storage().resize_(0)``. Every tensor viewing it stays the same Python
object with the same shape, so nothing holding a reference (DDP buckets, the distributed optimizer's shard views,
the bridge's mappings) needs to know; ``resize_(nbytes)`` and a copy back restore them byte for byte. Device-agnostic
on purpose: on a GPU the bytes wait in pinned host memory (allocated at the first offload, reused every cycle) and
the freed blocks go back to the driver (``empty_cache``) for the engines; on the CPU "the device" is the CPU, so the
mechanism (and its exactness) is what the CPU tests check, not a saving.

Gradients are not copied: every train step zeroes the grad buffers before its first backward (Megatron's
``zero_grad_buffer``; :func:`relax_hpc.train.step.train_step`), so their bytes between steps are dead. They are
freed and come back as zeros. Storages not on the device (an optimizer that keeps its state on the CPU,
``optimizer_cpu_offload``) are left alone: they take no device memory.

Two stages (:meth:`TrainOffload.offload` takes the kinds): after a train step only the gradients and optimizer
state go (the weight sync needs the parameters and nothing else), after the sync the parameters; a reload brings
back what the next task needs (all of it to train, the parameters to sync or save).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

KINDS = ("params", "grads", "optimizer")  # a storage shared by two kinds counts as the first (fp32 main params are
# views of DDP's param buffer: params)
KEPT = ("params", "optimizer")  # copied to host and back; grads come back as zeros (see the module docstring)


@dataclass
class _Out:
    """One freed storage: its bytes, and the host copy they wait in (None: a gradient, back as zeros)."""

    storage: torch.UntypedStorage
    nbytes: int
    kind: str
    host: torch.Tensor | None


class TrainOffload:
    """The actor's offload cycle over ``model`` (Megatron DDP chunks) and ``optimizer`` (Megatron's, possibly
    chained). ``device``: the device whose memory is freed (default: the device of the first parameter)."""

    def __init__(self, model: list, optimizer, device: torch.device | str | None = None):
        self.model, self.optimizer = model, optimizer
        self.device = torch.device(device) if device is not None else next(model[0].parameters()).device
        if self.device.type == "cuda" and self.device.index is None:  # compared with tensors' devices, which say it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.out: dict[int, _Out] = {}  # storage id (_cdata) -> what is freed now
        self._hosts: dict[int, torch.Tensor] = {}  # storage id -> its host buffer, reused every cycle
        self.freed_bytes = 0.0  # device bytes freed since the last reload (what a step's cycle freed)
        self.offload_s = 0.0  # seconds the offloads since the last reload took

    # -- what there is
    def storages(self) -> dict[str, list[torch.UntypedStorage]]:
        """The distinct device storages of each kind (:data:`KINDS`) held now, freed ones included. Found afresh each
        time: the optimizer makes its Adam state at its first step."""
        seen: set[int] = set()
        out: dict[str, list[torch.UntypedStorage]] = {k: [] for k in KINDS}
        for kind, tensors in (("params", self._params()), ("grads", self._grads()),
                              ("optimizer", self._optimizer_state())):
            for t in tensors:
                if not isinstance(t, torch.Tensor) or t.device != self.device:
                    continue
                s = t.untyped_storage()
                if s._cdata not in seen:
                    seen.add(s._cdata)
                    out[kind].append(s)
        return out

    def _params(self) -> Iterator[torch.Tensor]:
        for m in self.model:
            for buf in _ddp_buffers(m):
                if buf.param_data is not None:
                    yield buf.param_data
            yield from m.parameters()

    def _grads(self) -> Iterator[torch.Tensor]:
        for m in self.model:
            for buf in _ddp_buffers(m):
                if buf.grad_data is not None:
                    yield buf.grad_data
            for p in m.parameters():
                yield getattr(p, "main_grad", None)
                yield p.grad
        for opt in self._inner_optimizers():
            for g in opt.param_groups:
                for p in g["params"]:
                    yield p.grad  # the main params' grads (views of the grad buffer, or their own fp32 copies)

    def _optimizer_state(self) -> Iterator[torch.Tensor]:
        for opt in self._inner_optimizers():
            for g in opt.param_groups:
                yield from g["params"]  # fp32 main params (bf16 training); fp32 training: views of the param buffer
            for st in opt.state.values():
                yield from (v for v in st.values() if isinstance(v, torch.Tensor))

    def _inner_optimizers(self) -> Iterator[torch.optim.Optimizer]:
        """The torch optimizers inside Megatron's wrappers (chained, distributed, hybrid-device ones)."""
        if self.optimizer is None:
            return
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            subs = getattr(inner, "sub_optimizers", None)  # megatron's HybridDeviceOptimizer
            yield from (subs if subs else [inner])

    def device_bytes(self) -> dict[str, int]:
        """Bytes held on the device now, per kind (0 for a freed storage)."""
        return {k: sum(s.nbytes() for s in ss) for k, ss in self.storages().items()}

    @property
    def offloaded(self) -> bool:
        return bool(self.out)

    # -- the cycle
    def offload(self, kinds: Iterable[str] = KINDS) -> tuple[int, float]:
        """Free the device storages of ``kinds`` (those not freed yet): copy what is kept to host memory, then
        ``resize_(0)``. Returns (bytes freed, seconds)."""
        kinds = set(kinds)
        if not kinds <= set(KINDS):
            raise ValueError(f"offload kinds {sorted(kinds)}: only {KINDS}")
        t0 = time.monotonic()
        held = self.storages()
        live = {s._cdata for ss in held.values() for s in ss}
        for cid in [c for c in self._hosts if c not in live]:  # a storage gone (state loaded anew): its buffer too
            del self._hosts[cid]
        todo = [(k, s) for k, ss in held.items() if k in kinds for s in ss
                if s._cdata not in self.out and s.nbytes() > 0]
        stuck = [k for k, s in todo if not s.resizable()]
        if stuck:  # before anything is freed: a half-offloaded model would be worse than none
            raise RuntimeError(f"train.offload: {len(stuck)} {stuck[0]} storage(s) of the actor cannot be freed in "
                               "place (not resizable: memory torch does not own). Fix: train.offload: false")
        cuda = self.device.type == "cuda"
        for kind, s in todo:
            host = None
            if kind in KEPT:
                host = self._hosts.get(s._cdata)
                if host is None or host.numel() != s.nbytes():
                    host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=cuda)
                    self._hosts[s._cdata] = host
                host.copy_(_bytes(s), non_blocking=cuda)
            self.out[s._cdata] = _Out(s, s.nbytes(), kind, host)
        if cuda:
            torch.cuda.current_stream().synchronize()  # the copies are done before their memory is freed
        freed = 0
        for _, s in todo:
            freed += s.nbytes()
            s.resize_(0)
        if cuda:
            torch.cuda.empty_cache()  # to the driver: the engines allocate outside torch's cache
        dt = time.monotonic() - t0
        self.freed_bytes += freed
        self.offload_s += dt
        return freed, dt

    def reload(self, kinds: Iterable[str] = KINDS) -> float:
        """Bring the freed storages of ``kinds`` back, byte for byte (gradients as zeros). Returns seconds."""
        kinds = set(kinds)
        t0 = time.monotonic()
        back = [(cid, o) for cid, o in self.out.items() if o.kind in kinds]
        cuda = self.device.type == "cuda"
        for cid, o in back:
            o.storage.resize_(o.nbytes)
            view = _bytes(o.storage)
            if o.host is None:
                view.zero_()
            else:
                view.copy_(o.host, non_blocking=cuda)
            del self.out[cid]
        if cuda:
            torch.cuda.current_stream().synchronize()
        if not self.out:  # a cycle ends: the next offload's bytes are the next step's
            self.freed_bytes, self.offload_s = 0.0, 0.0
        return time.monotonic() - t0

    def cycle_metrics(self) -> dict[str, float]:
        """``perf/train_offload_bytes`` and ``perf/train_offload_time``: what the offloads since the last reload
        freed, and took."""
        return {"perf/train_offload_bytes": float(self.freed_bytes), "perf/train_offload_time": self.offload_s}


def _ddp_buffers(m) -> list:
    """Megatron DDP's contiguous param/grad buffers of one chunk (none for a bare module)."""
    bufs = getattr(m, "buffers", None)  # DDP's list shadows nn.Module.buffers(), the method a bare module has
    if bufs is None or callable(bufs):
        return []
    return [*bufs, *(getattr(m, "expert_parallel_buffers", None) or [])]


def _bytes(s: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``s``."""
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
