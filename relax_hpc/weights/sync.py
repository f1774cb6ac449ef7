"""Actor → engines weight sync over a torch.distributed group, driven through SGLang's HTTP API.

:class:`WeightSender` lives on the actor's rank 0 (the bridge's TP/PP gather gives every rank full HF-named
weights); with engines on several actor nodes (multi-node colocate) each node's first actor rank holds one too, for
the engines on its node (:func:`relax_hpc.weights.push.plan_nodes`). One sync looks like this (``docs/weights.md`` has the why of each step)::

    sender = WeightSender(bucket_bytes=512 * MiB, pause_mode="retract")
    sender.connect([EngineClient(u, api_key=key) for u in urls], master_address=socket.gethostname())   # once
    metrics = sender.push(actor.named_hf_weights(), version="12", in_place=actor.in_place())  # every step

* ``connect``: a ``TCPStore`` on a kernel-chosen port (port 0) hosted here, then one group of
  ``1 + Σ engine TP sizes`` ranks: this process is rank 0, engine *i*'s TP ranks are
  ``rank_offset_i + tp_rank``. Every engine is asked to join with ``/init_weights_update_group`` from its
  own thread while this process builds its side; group creation is collective, so nothing returns until
  all ranks are in, and an engine that fails is reported by URL at once.
* ``push``: ``/pause_generation`` (all engines) → ``/flush_cache`` (not after ``in_place``) →
  ``/begin_weight_update`` → per bucket: ``/update_weights_from_distributed`` (names, dtypes, shapes,
  ``load_format="flattened_bucket"``) on every engine from threads, while this process
  ``dist.broadcast``s the bucket's flat buffer → ``/update_weight_version`` once every bucket arrived →
  ``/end_weight_update`` → ``/continue_generation``. Packing bucket *i+1* overlaps the broadcast of bucket
  *i*; runs of the actor's param buffer that lie end to end are not packed at all (``in_place``). The
  end/continue calls run even when a step fails, so engines never stay paused or in a session.
  The session calls (begin/end) go only to engines whose ``/server_info`` version needs them
  (:func:`update_protocol`: SGLang >= 0.5.23 and the CPU engine); SGLang 0.5.15-0.5.22 take the updates alone.

Before any of that, ``connect`` settles from each member's ``/server_info`` how the weights travel (``_choose``):
the **backend** is one every member serves (:func:`agree_backend`; none in common is :class:`WeightSyncRefused` at
once, naming both sides), and engines on this process's GPU, which cannot join an NCCL group with it, get the
**tensor path** instead of a group: per bucket, one ``/update_weights_from_tensor`` with the bucket's tensors as
CUDA IPC handles (shared memory on CPU; :mod:`relax_hpc.engines.tensor_wire`), inside the same pause … continue.

Every wait has a deadline; every failure is a :class:`WeightSyncError` that names the engine(s).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from relax_hpc.engines import bucket_wire
from relax_hpc.engines.client import EngineClient, EngineError, update_protocol
from relax_hpc.engines.tensor_wire import serialize_named
from relax_hpc.errors import PermanentError
from relax_hpc.stores import master_store
from relax_hpc.threads import daemon_call
from relax_hpc.weights.buckets import (DEFAULT_BUCKET_BYTES, IN_PLACE_MIN_BYTES, Bucket, BufferRing, PackedBuckets,
                                      iter_buckets)

log = logging.getLogger("relax_hpc.weights")

PAUSE_MODES = ("retract", "abort", "in_place")
MODES = ("bucketed", "per_tensor")
PATHS = ("distributed", "tensor")
_group_seq = itertools.count()


class WeightSyncError(RuntimeError):
    """A weight-sync step failed. ``engines`` lists the URLs of the engines that failed (may be empty)."""

    restartable = True  # engines or the group broke, not the recipe: a restart from the checkpoint may succeed

    def __init__(self, message: str, engines: Sequence[str] = ()):
        super().__init__(message)
        self.engines = list(engines)


class WeightSyncRefused(WeightSyncError, PermanentError):
    """The members cannot form the group asked for (no backend or update path they all serve): refused at connect,
    before anything waits; a restart would meet the same members."""

    restartable = False


# what SGLang serves, which its /server_info does not say: it receives on its GPUs (NCCL), by every update path
SGLANG_BACKENDS = ("nccl",)
SGLANG_PATHS = ("distributed", "tensor", "disk")


def served(info: dict) -> tuple[list[str], list[str]]:
    """(weight-sync backends, update paths) a member serves, from its ``/server_info`` (SGLang's when unsaid)."""
    return (list(info.get("weight_sync_backends") or SGLANG_BACKENDS),
            list(info.get("weight_update_paths") or SGLANG_PATHS))


def my_gpu() -> str | None:
    """This process's GPU (its UUID, as the engines report theirs in ``gpu_uuids``), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def agree_backend(asked: str | None, members: dict[str, dict], *, cuda: bool, shared_gpu: Sequence[str] = ()) -> str:
    """The weight-sync group's backend: ``asked`` when given (strict), else the first of nccl (with CUDA here) and
    gloo (from host memory) that every member serves (``/server_info``'s ``weight_sync_backends``). NCCL is left out
    when a member (``shared_gpu``: their URLs) is on this process's GPU: NCCL refuses two ranks on one device.
    Raises :class:`WeightSyncRefused` naming each member that serves none of ours, the backends of both sides, and
    the fix; nothing waits for a group that cannot form."""
    mine = [asked] if asked else ["nccl", "gloo"] if cuda and not shared_gpu else ["gloo"]
    for b in mine:
        if all(b in served(i)[0] for i in members.values()):
            return b
    odd = {u: served(i)[0] for u, i in members.items() if not set(mine) & set(served(i)[0])} or \
        {u: served(i)[0] for u, i in members.items()}
    theirs = "; ".join(f"engine {u} serves {' or '.join(b)}" for u, b in odd.items())
    if asked:
        why, fix = f"this actor asked for {asked}", ("leave the backend to the sender (it picks one every member "
                                                     "serves)")
    elif shared_gpu:
        why = f"engine(s) {', '.join(shared_gpu)} share this actor's GPU, where NCCL cannot take two ranks, so it asks gloo"
        fix = "rollout.engine.offload: true (the weights go by CUDA IPC), or give the engines GPUs of their own"
    elif not cuda:
        why, fix = "this actor has no GPU, so it asks gloo", ("run the actor on GPU nodes (NCCL needs a GPU at both "
                                                               "ends), or rollout.engine.kind: reference (it serves gloo)")
    else:
        why, fix = "this actor asks nccl or gloo", "run every engine with one backend in common (docs/weights.md)"
    raise WeightSyncRefused(f"no weight-sync backend that every member serves: {why}; {theirs}. Fix: {fix}",
                            list(odd))


# ----------------------------------------------------------------------------------------- helpers

def _wait_engines(futs: dict[Future, EngineClient], timeout: float, what: str,
                  extra: Callable[[], None] | None = None) -> list[Any]:
    """Wait for one call per engine; the first failure raises at once (naming the engine), so a dead engine
    never makes us sit out the deadline. ``extra`` is polled too (e.g. our own side of a collective)."""
    deadline = time.monotonic() + timeout
    pending = set(futs)
    while pending:
        done = {f for f in pending if f.done()}
        for f in done:
            e = f.exception()
            if e is not None:
                url = futs[f].url
                cause = str(e) if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"
                raise WeightSyncError(f"{what} failed on engine {url}: {cause}", [url]) from e
        pending -= done
        if extra is not None:
            extra()
        if not pending:
            break
        if time.monotonic() > deadline:
            urls = [futs[f].url for f in pending]
            raise WeightSyncError(f"{what}: no answer within {timeout:.0f} s from engine(s) {', '.join(urls)}", urls)
        cf.wait(pending, timeout=min(0.1, max(0.0, deadline - time.monotonic())), return_when=cf.FIRST_COMPLETED)
    return [f.result() for f in futs]


def new_group(store: dist.Store, rank: int, world_size: int, group_name: str, backend: str,
              timeout: timedelta) -> dist.ProcessGroup:
    """Our side of the weight-sync group, built exactly as SGLang's ``init_custom_process_group`` builds the
    engines' side: keys under ``PrefixStore(group_name)`` of the rendezvous store, a group beside the default
    one (which may or may not exist) registered with identity rank mapping so ``dist.broadcast(..., group=pg)``
    works. Private torch API, as in SGLang/OpenRLHF/verl; checked with torch 2.13."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


# ----------------------------------------------------------------------------------------- transfer

def send_buckets(named: Iterable[tuple[str, torch.Tensor]] | PackedBuckets, pg: dist.ProcessGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 *, mode: str = "bucketed", device: torch.device | str | None = None,
                 announce: Callable[[Bucket], Any] | None = None, confirm: Callable[[Bucket, Any], None] | None = None,
                 stats: dict | None = None, ring: BufferRing | None = None,
                 in_place: Callable[[torch.Tensor], bool] | None = None, in_place_min: int = IN_PLACE_MIN_BYTES) -> dict:
    """Rank 0's side of the transfer: bucket ``named`` and broadcast each bucket from rank 0 of ``pg``.

    ``mode="bucketed"``: one broadcast of the bucket's flat buffer (SGLang ``load_format="flattened_bucket"``);
    ``"per_tensor"``: one broadcast per tensor, in bucket order (SGLang's default load format).
    Per bucket: ``h = announce(bucket)`` (tell the receivers what comes), the broadcast(s) start (async),
    the *next* bucket is packed while they run, then ``confirm(bucket, h)`` (the receivers took it) and the
    broadcasts are waited for. ``device``: move tensors there first (the group's device; NCCL needs CUDA).
    ``ring``: reusable pack buffers (at least 2: one bucket on the wire, one being packed). ``in_place``: which
    tensors stay put during the send, to go out as they lie, without a pack copy (:func:`iter_buckets`; runs of
    ``in_place_min`` bytes or more). ``named`` a :class:`PackedBuckets` (packed ahead): each goes out as it is.
    Returns (and adds to ``stats``) bytes, buckets, tensors, in_place_bytes."""
    stats = stats if stats is not None else {}
    for k in ("bytes", "buckets", "tensors", "in_place_bytes"):
        stats.setdefault(k, 0)
    dev = torch.device(device) if device is not None else None

    def moved():
        for n, t in named:
            yield n, (t if dev is None or t.device == dev else t.to(dev))

    def finish(bucket, handle, works):
        if confirm is not None:
            confirm(bucket, handle)
        for w in works:
            w.wait()

    if ring is not None and ring.n < 2:
        raise ValueError("send_buckets needs a BufferRing of at least 2 buffers")
    inflight = None
    for bucket in _cut(named, moved, dev, bucket_bytes, ring, in_place, in_place_min):
        # (packing happened in iter_buckets, while `inflight` broadcast)
        if inflight is not None:
            finish(*inflight)
        handle = announce(bucket) if announce is not None else None
        if mode == "bucketed":  # as bytes: SGLang 0.5.23 receives a flattened bucket into a uint8 buffer
            works = [dist.broadcast(bucket_wire.as_bytes(bucket.flat), src=0, group=pg, async_op=True)]
        elif mode == "per_tensor":
            works = [dist.broadcast(t.contiguous(), src=0, group=pg, async_op=True) for _, t in bucket.unpack()]
        else:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        inflight = (bucket, handle, works)
        stats["bytes"] += bucket.nbytes
        stats["buckets"] += 1
        stats["tensors"] += len(bucket)
        stats["in_place_bytes"] += bucket.nbytes if bucket.in_place else 0
    if inflight is not None:
        finish(*inflight)
    return stats


def _cut(named, moved, dev, bucket_bytes, ring, in_place, in_place_min) -> Iterator[Bucket]:
    """The buckets to send: :class:`PackedBuckets` as they are (moved to ``dev`` if elsewhere), else
    :func:`iter_buckets` of the stream ``moved()``."""
    if not isinstance(named, PackedBuckets):
        return iter_buckets(moved(), bucket_bytes, ring=ring, in_place=in_place, in_place_min=in_place_min)
    return (b if dev is None or b.flat.device == dev else Bucket(b.flat.to(dev), b.metadata) for b in named)


def receive(names: Sequence[str], dtypes: Sequence[str | torch.dtype], shapes: Sequence[Sequence[int]],
            pg: dist.ProcessGroup, *, load_format: str | None = "flattened_bucket",
            device: torch.device | str | None = None) -> list[tuple[str, torch.Tensor]]:
    """A receiver's side of one announced bucket, exactly as SGLang's engine does it: allocate, receive
    (one flat buffer for ``"flattened_bucket"``, else one async broadcast per tensor), cut into views.
    For receivers that are not SGLang (benchmarks; a Megatron reference/actor_fwd)."""
    tensors = bucket_wire.announced(names, dtypes, shapes)
    if load_format == "flattened_bucket":
        metas = bucket_wire.plan(tensors)
        flat = bucket_wire.empty_flat(metas, device)
        dist.broadcast(bucket_wire.as_bytes(flat), src=0, group=pg)  # the sender's bytes (send_buckets)
        return bucket_wire.unpack(flat, metas)
    if load_format not in (None, "", "direct"):
        raise ValueError(f"load_format must be 'flattened_bucket' or None, not {load_format!r}")
    out = [(n, torch.empty(s, dtype=d, device=device)) for n, s, d in tensors]
    works = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in out]
    for w in works:
        w.wait()
    return out


# ----------------------------------------------------------------------------------------- sender

class WeightSender:
    """A sending actor rank's end of the weight sync (rank 0's; a node's leader's: see the module docstring).

    bucket_bytes: largest bucket (default 512 MiB, Relax's ``--update-weight-buffer-size``); a bigger tensor
        travels alone. Rank 0 holds at most about two buckets per dtype at a time.
    pause_mode: ``"retract"`` (default: in-flight requests go back to the queue without their KV and finish
        on the new weights after continue; no generated token is wasted), ``"abort"`` (they return at once
        with ``finish_reason.type == "abort"``; nothing spans two versions), ``"in_place"`` (they stay with
        their KV cache; the cache is not flushed). The CPU engine and SGLang support all three.
    mode: ``"bucketed"`` (default; one broadcast of a flat buffer per bucket, ``load_format="flattened_bucket"``)
        or ``"per_tensor"`` (one broadcast per tensor, SGLang's default load format; for comparison).
    backend: of the group; None (default): the first of ``"nccl"`` (with CUDA) and ``"gloo"`` that every member
        serves (:func:`agree_backend`, at ``connect``); a named one is asked strictly. ``device``: where buckets are
        sent from (default ``cuda`` for nccl, else ``cpu``); tensors elsewhere are moved there.
    path: how the weights travel: ``"distributed"`` (a group, broadcasts), ``"tensor"`` (SGLang's
        ``/update_weights_from_tensor``: each bucket's tensors as CUDA IPC handles, or shared memory on CPU; for
        engines on this process's GPU, which cannot join an NCCL group with it), or None (default): ``"tensor"``
        when every member shares this process's GPU, ``"distributed"`` when none does (``/server_info``'s
        ``gpu_uuids``).
    timeout: seconds for each bucket (HTTP call + broadcast) and the group's collective timeout;
        connect_timeout: seconds for the group to form; control_timeout: pause/flush/begin/end/continue.
    reuse_buffers: pack into two buffers kept between pushes (default on CPU, where fresh allocations of
        this size cost page faults; off on GPU, where the caching allocator does it). Holds up to
        2 × bucket_bytes between pushes.
    """

    def __init__(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, pause_mode: str = "retract",
                 mode: str = "bucketed", backend: str | None = None, device: str | torch.device | None = None,
                 group_name: str | None = None, timeout: float = 600.0, connect_timeout: float = 120.0,
                 control_timeout: float = 60.0, reuse_buffers: bool | None = None, api_key: str | None = None,
                 in_place_min_bytes: int = IN_PLACE_MIN_BYTES, path: str | None = None):
        """``api_key``: the run's engine key (``RunDir.api_key()``), sent with every call to an engine given by URL.
        ``in_place_min_bytes``: the shortest run of in-place tensors sent without a pack copy (see ``push``)."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, not {pause_mode!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if path not in (None, *PATHS):
            raise ValueError(f"path must be one of {PATHS} or None, not {path!r}")
        self.bucket_bytes = int(bucket_bytes)
        self.in_place_min_bytes = int(in_place_min_bytes)
        self.pause_mode = pause_mode
        self.mode = mode
        self.asked_backend, self.asked_path, self.asked_device = backend, path, device
        self.path = path or "distributed"  # settled at connect
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")  # settled at connect
        self.reuse_buffers = reuse_buffers
        self._place(self.backend)
        self.group_name = group_name
        self._explicit_name = group_name
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.control_timeout = float(control_timeout)
        self.api_key = api_key
        self.engines: list[EngineClient] = []
        self.infos: dict[str, dict] = {}  # each member's /server_info at the last connect, by URL
        self.sessions: dict[str, bool] = {}  # by engine URL: wrap updates in /begin…/end_weight_update (update_protocol)
        self.tp_sizes: list[int] = []
        self.pg: dist.ProcessGroup | None = None
        self.master_address: str | None = None
        self.master_port: int | None = None
        self._store: dist.TCPStore | None = None
        self._broken: str | None = None  # set when a collective may be left half-done: the group is unusable

    def _place(self, backend: str | None) -> None:
        """Where buckets are packed from: the group's device (CUDA for nccl), or this process's GPU for the tensor
        path; and the reusable pack buffers."""
        dev = self.asked_device
        if dev is None:
            dev = "cuda" if backend == "nccl" or (backend is None and torch.cuda.is_available()) else "cpu"
        self.device = torch.device(dev)
        reuse = self.reuse_buffers
        if reuse is None:  # on GPU the caching allocator already recycles bucket memory
            reuse = self.device.type == "cpu"
        self.ring = BufferRing(2, self.device) if reuse else None

    def __repr__(self) -> str:
        return (f"WeightSender({len(self.engines)} engines, path={self.path}, group={self.group_name!r}, "
                f"world={self.world_size}, mode={self.mode}, pause={self.pause_mode})")

    @property
    def connected(self) -> bool:
        return self.pg is not None or (self.path == "tensor" and bool(self.engines))

    @property
    def world_size(self) -> int:
        return 1 + sum(self.tp_sizes)

    @property
    def rank_offsets(self) -> list[int]:
        return [1 + sum(self.tp_sizes[:i]) for i in range(len(self.tp_sizes))]

    # ------------------------------------------------------------------ group
    def connect(self, engines: Sequence[EngineClient | str], master_address: str, *,
                tp_sizes: Sequence[int] | None = None) -> "WeightSender":
        """Create the weight-sync group with these engines (URLs or clients). ``master_address``: this host's
        name or address as the engines can reach it. ``tp_sizes``: each engine's TP size (default: asked from
        ``/server_info``; this also fails fast, by URL, for an engine that is not answering)."""
        if self.connected:
            raise WeightSyncError(f"already connected ({self!r}); call close() or reconnect()")
        engines = [e if isinstance(e, EngineClient) else EngineClient(str(e), api_key=self.api_key) for e in engines]
        if not engines:
            raise ValueError("connect needs at least one engine")
        self.sessions = {e.url: True for e in engines}
        infos = None
        if tp_sizes is None:
            infos = _wait_engines({daemon_call(e.server_info, thread_name="weight-sync"): e for e in engines}, self.control_timeout,
                                  "asking the engine's TP size (/server_info)")
            tp_sizes = [int(i.get("tp_size") or 1) for i in infos]
            try:
                self.sessions = {e.url: update_protocol(i.get("version")) == "session" for e, i in zip(engines, infos)}
            except ValueError as e:
                raise WeightSyncError(str(e), [u.url for u in engines]) from None
            for e, i in zip(engines, infos):  # SGLang DP replicas in one server would all claim ranks offset+0..tp-1
                if int(i.get("dp_size") or 1) > 1 and not i.get("enable_dp_attention"):
                    raise WeightSyncError(f"engine {e.url} runs dp_size={i['dp_size']} replicas in one server; their "
                                          "weight-sync ranks would collide. Run one server per replica.", [e.url])
        if len(tp_sizes) != len(engines) or any(int(t) < 1 for t in tp_sizes):
            raise ValueError(f"tp_sizes {list(tp_sizes)} do not fit {len(engines)} engines")
        self.infos = {e.url: i for e, i in zip(engines, infos)} if infos is not None else {}
        if infos is not None:
            self._choose(self.infos)
        if self.path == "tensor":  # no group: each update carries its tensors' handles
            self.engines, self.tp_sizes = engines, [int(t) for t in tp_sizes]
            self.master_address = master_address  # a reconnect (an engine left) asks nothing new
            log.info("weights to %s by /update_weights_from_tensor (%s, same %s)", [e.url for e in engines],
                     "CUDA IPC" if self.device.type == "cuda" else "shared memory", self.device.type.upper())
            return self
        self.engines, self.tp_sizes = engines, [int(t) for t in tp_sizes]
        name = self.group_name or f"relax_weight_sync_{os.getpid()}_{next(_group_seq)}"
        timeout = timedelta(seconds=max(self.timeout, self.connect_timeout))
        # port 0: the kernel picks a free one, so two runs on a node never collide
        store = master_store(master_address, None, timeout)  # listening on master_address's address only
        port = store.port
        log.info("weight-sync group %s: %d ranks, store %s:%d, engines %s (TP %s)", name, self.world_size,
                 master_address, port, [e.url for e in engines], self.tp_sizes)
        t0 = time.monotonic()
        futs = {daemon_call(e.init_weights_update_group, master_address, port, off, self.world_size,
                           group_name=name, backend=self.backend, timeout=self.connect_timeout + 30,
                           thread_name=f"weight-sync-init-{i}"): e
                for i, (e, off) in enumerate(zip(engines, self.rank_offsets))}
        ours = daemon_call(new_group, store, 0, self.world_size, name, self.backend, timeout,
                           thread_name="weight-sync-rank0")

        def check_ours():
            if ours.done() and ours.exception() is not None:
                raise WeightSyncError(f"creating rank 0 of weight-sync group {name} failed: {ours.exception()}") \
                    from ours.exception()
        try:
            _wait_engines(futs, self.connect_timeout, f"joining weight-sync group {name} "
                          f"(/init_weights_update_group, store {master_address}:{port})", extra=check_ours)
            pg = ours.result(timeout=max(1.0, self.connect_timeout - (time.monotonic() - t0)))
        except WeightSyncError:
            self.engines, self.tp_sizes = [], []
            raise
        except Exception as e:
            self.engines, self.tp_sizes = [], []
            raise WeightSyncError(f"weight-sync group {name}: rank 0 not ready within {self.connect_timeout:.0f} s: "
                                  f"{type(e).__name__}: {e}") from e
        self.pg, self._store, self.group_name = pg, store, name
        self.master_address, self.master_port = master_address, port
        self._broken = None
        log.info("weight-sync group %s ready in %.2f s", name, time.monotonic() - t0)
        return self

    def _choose(self, infos: dict[str, dict]) -> None:
        """The path and backend every member serves (``/server_info``), or :class:`WeightSyncRefused` at once."""
        gpu = my_gpu()
        shared = [u for u, i in infos.items() if gpu is not None and gpu in (i.get("gpu_uuids") or [])]
        if self.asked_path is None and shared and len(shared) != len(infos):
            raise WeightSyncRefused(
                f"engine(s) {', '.join(shared)} share this actor's GPU and {', '.join(sorted(set(infos) - set(shared)))} "
                "do not: the weights cannot go by CUDA IPC to some and a weight-sync group to the others. Fix: put "
                "every engine on the actor's GPUs or none", [u for u in infos if u not in shared])
        self.path = self.asked_path or ("tensor" if shared else "distributed")
        if self.path == "tensor":
            host = socket.gethostname()
            odd = {u: why for u, i in infos.items() for why in [
                "does not serve /update_weights_from_tensor" if "tensor" not in served(i)[1] else
                f"runs on {i['hostname']}, not on this actor's host {host}" if i.get("hostname") not in (None, host)
                else ""] if why}
            if odd:  # a node's engines get their weights from that node's actor rank: never across hosts
                raise WeightSyncRefused("the weights go by /update_weights_from_tensor (rollout.engine.offload, or "
                                        "engines on the actor's GPU), which needs every member on this actor rank's "
                                        "host: " + "; ".join(f"{u} {w}" for u, w in odd.items()) + ". Fix: rollout."
                                        "engine.offload: false, or place the engines with the actor (roles.rollout."
                                        "share_with: actor, roles.rollout.nodes = roles.actor.nodes), and no "
                                        "roles.actor_fwd", list(odd))
            self.backend = None
        else:
            self.backend = agree_backend(self.asked_backend, infos, cuda=torch.cuda.is_available(), shared_gpu=shared)
        self._place(self.backend)

    def close(self, *, destroy_on_engines: bool = True) -> None:
        """Leave the group (and ask each engine to destroy its side, ignoring failures)."""
        if self.path == "tensor" and self.pg is None:
            self.engines, self.tp_sizes = [], []
            return
        if self.pg is None:
            return
        if destroy_on_engines and not self._broken:
            futs = [daemon_call(e.destroy_weights_update_group, self.group_name, thread_name="weight-sync") for e in self.engines]
            for f, e in zip(futs, self.engines):
                try:
                    f.result(timeout=self.control_timeout)
                except Exception as ex:  # noqa: BLE001 - best effort
                    log.warning("engine %s: destroying weight-sync group failed: %s", e.url, ex)
        try:
            dist.destroy_process_group(self.pg)
        except Exception as ex:  # noqa: BLE001
            log.warning("destroying our side of the weight-sync group failed: %s", ex)
        self.pg, self._store, self.engines, self.tp_sizes = None, None, [], []
        self.group_name = self._explicit_name

    def reconnect(self, engines: Sequence[EngineClient | str], master_address: str | None = None, **kw) -> "WeightSender":
        """New group for a new engine list (an engine joined or left: a group's size is fixed at creation)."""
        addr = master_address or self.master_address
        if addr is None:
            raise ValueError("reconnect needs master_address (never connected before)")
        self.close()
        return self.connect(engines, addr, **kw)

    # ------------------------------------------------------------------ push
    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]] | PackedBuckets, version: str | int, *,
             mode: str | None = None, pause_mode: str | None = None,
             in_place: Callable[[torch.Tensor], bool] | None = None) -> dict[str, float]:
        """Send every (HF name, full tensor) to every engine and set their ``weight_version`` to ``version``.

        ``named_weights`` is consumed lazily (the actor's collective gather yields tensor by tensor), or is a
        :class:`~relax_hpc.weights.buckets.PackedBuckets` (packed ahead: ``relax_hpc.weights.push.Snapshot``), each
        sent as it is. ``in_place``: which of them are views of memory that stays put during the push (the actor's
        param buffer), sent as they lie without a pack copy (:func:`~relax_hpc.weights.buckets.iter_buckets`; runs of
        :attr:`in_place_min_bytes` or more). Returns
        metrics: ``perf/weight_sync_time`` (s, pause to continue; also as Relax's ``perf/update_weights_time``),
        ``perf/weight_sync_transfer_time`` (s, the bucket loop), ``perf/weight_sync_pause_time``,
        ``perf/weight_sync_bytes``, ``perf/weight_sync_buckets``, ``perf/weight_sync_tensors``,
        ``perf/weight_sync_gbps`` (GB/s over the transfer time). Raises WeightSyncError naming the engine on
        any failure; the engines are still ended and continued, but the group may then be unusable
        (``reconnect``).
        """
        if not self.connected:
            raise WeightSyncError("not connected: call connect(engines, master_address) first")
        if self._broken:
            raise WeightSyncError(f"the weight-sync group is unusable after an earlier failure ({self._broken}); "
                                  "call reconnect()")
        mode = mode or self.mode
        pause_mode = pause_mode or self.pause_mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, not {pause_mode!r}")
        version = str(version)
        t0 = time.perf_counter()
        stats = {"bytes": 0, "buckets": 0, "tensors": 0, "in_place_bytes": 0}
        t_xfer0 = t_xfer = t0
        errors: list[BaseException] = []
        in_session = body_failed = False
        try:
            self._on_all(lambda e: e.pause_generation(pause_mode, timeout=self.control_timeout), "/pause_generation")
            if pause_mode != "in_place":  # KV built by the old weights must not be reused by new requests
                self._on_all(lambda e: e.flush_cache(timeout=self.control_timeout), "/flush_cache")
            in_session = True  # SGLang >= 0.5.23 refuses updates outside a session; older releases have none
            self._on_all(lambda e: e.begin_weight_update(), "/begin_weight_update", only=self._in_sessions())
            t_xfer0 = time.perf_counter()
            self._send_all(named_weights, mode, stats, in_place)
            t_xfer = time.perf_counter()
            # the version moves only once every bucket is in (SGLang's /end_weight_update carries none)
            self._on_all(lambda e: e.update_weight_version(version, abort_all_requests=False),
                         "/update_weight_version")
        except BaseException as e:
            errors.append(e)
            body_failed = True
            raise
        finally:
            # always: no engine may stay in a session or paused, also when a step failed on some engine
            cleanup = [(lambda e: e.end_weight_update(), "/end_weight_update", self._in_sessions())] if in_session else []
            cleanup.append((lambda e: e.continue_generation(timeout=self.control_timeout), "/continue_generation", None))
            for fn, what, only in cleanup:
                try:
                    self._on_all(fn, what, only=only)
                except WeightSyncError as e:
                    if errors:
                        log.error("while cleaning up after a failed weight sync: %s", e)
                    else:
                        errors.append(e)
            if errors and not body_failed:  # the body's own error propagates by itself
                raise errors[0]
        total = time.perf_counter() - t0
        xfer = max(t_xfer - t_xfer0, 1e-9)
        metrics = {
            "perf/weight_sync_time": total, "perf/update_weights_time": total,
            "perf/weight_sync_transfer_time": xfer, "perf/weight_sync_pause_time": t_xfer0 - t0,
            "perf/weight_sync_bytes": float(stats["bytes"]), "perf/weight_sync_buckets": float(stats["buckets"]),
            "perf/weight_sync_tensors": float(stats["tensors"]), "perf/weight_sync_gbps": stats["bytes"] / xfer / 1e9,
            "perf/weight_sync_in_place_bytes": float(stats["in_place_bytes"]),
        }
        log.info("weight sync to version %s (%s): %d tensors, %d buckets, %.1f MB in %.3f s (transfer %.3f s, %.2f GB/s)",
                 version, mode, stats["tensors"], stats["buckets"], stats["bytes"] / 1e6, total, xfer,
                 metrics["perf/weight_sync_gbps"])
        return metrics

    def _send_all(self, named_weights, mode: str, stats: dict, in_place=None) -> None:
        if self.path == "tensor":
            return self._hand_all(named_weights, stats)

        def announce(bucket: Bucket):  # the engines learn what comes, then wait in the broadcast
            fmt = "flattened_bucket" if mode == "bucketed" else None
            return {daemon_call(e.update_weights_from_distributed, bucket.names, bucket.dtypes, bucket.shapes,
                               self.group_name, flush_cache=False, load_format=fmt, timeout=self.timeout,
                               thread_name="weight-sync-update"): e for e in self.engines}

        def confirm(bucket: Bucket, futs: dict) -> None:
            what = (f"/update_weights_from_distributed ({len(bucket)} tensors, {bucket.nbytes / 1e6:.1f} MB, "
                    f"first {bucket.names[0]})")
            try:
                _wait_engines(futs, self.timeout, what)
            except WeightSyncError as e:
                # the engine may never take its part of the broadcast: our side of the group can't be trusted
                self._broken = str(e)
                raise

        try:
            send_buckets(named_weights, self.pg, self.bucket_bytes, mode=mode, device=self.device,
                         announce=announce, confirm=confirm, stats=stats, ring=self.ring, in_place=in_place,
                         in_place_min=self.in_place_min_bytes)
        except WeightSyncError:
            raise
        except Exception as e:
            self._broken = f"broadcast failed: {e}"
            raise WeightSyncError(f"weight broadcast failed: {type(e).__name__}: {e}") from e

    def _hand_all(self, named_weights, stats: dict) -> None:
        """The tensor path: per bucket (one dtype, packed on this process's device), its tensors as views of the
        bucket, serialized for each receiving rank (CUDA IPC handles or shared memory: :mod:`relax_hpc.engines.tensor_wire`) and
        given to every engine by ``/update_weights_from_tensor`` (one entry per TP rank, as SGLang asks); the
        bucket stays alive until every engine answered, as the handles point into it."""
        dev = self.device

        def moved():
            return ((n, t if t.device == dev else t.to(dev)) for n, t in named_weights)

        for bucket in _cut(named_weights, moved, dev, self.bucket_bytes, self.ring, None, 0):
            if dev.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the packing copies are done before another process reads
            what = (f"/update_weights_from_tensor ({len(bucket)} tensors, {bucket.nbytes / 1e6:.1f} MB, "
                    f"first {bucket.names[0]})")
            # one serialization per receiving rank: each takes its own reference on the shared block, which the
            # receiver's load gives back (an entry loaded twice would leave the block to be reused while read)
            _wait_engines({daemon_call(e.update_weights_from_tensor,
                                       [serialize_named(bucket.unpack()) for _ in range(tp)], timeout=self.timeout,
                                       thread_name="weight-sync-tensor"): e
                           for e, tp in zip(self.engines, self.tp_sizes)}, self.timeout, what)
            stats["bytes"] += bucket.nbytes
            stats["buckets"] += 1
            stats["tensors"] += len(bucket)

    # ------------------------------------------------------------------ helpers
    def _in_sessions(self) -> list[EngineClient]:
        return [e for e in self.engines if self.sessions.get(e.url, True)]

    def _on_all(self, fn: Callable[[EngineClient], Any], what: str, *,
                only: Sequence[EngineClient] | None = None) -> list[Any]:
        """``fn(engine)`` on every engine (or those ``only``) at once; raises WeightSyncError naming every engine
        that failed."""
        futs = {daemon_call(fn, e, thread_name=f"weight-sync{what.replace('/', '-')}"): e
                for e in (self.engines if only is None else only)}
        deadline = time.monotonic() + self.control_timeout + 5
        failed, results = [], []
        for f, e in futs.items():
            try:
                results.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except Exception as ex:  # noqa: BLE001 - collected and reported together
                cause = str(ex) if isinstance(ex, EngineError) else f"{type(ex).__name__}: {ex or 'no answer in time'}"
                failed.append((e.url, cause))
        if failed:
            raise WeightSyncError(f"{what} failed on {len(failed)} of {len(futs)} engine(s): "
                                  + "; ".join(f"{u}: {c}" for u, c in failed), [u for u, _ in failed])
        return results


def load_from_disk(engine: EngineClient | str, hf_dir: str | os.PathLike, version: str | int, *,
                   timeout: float = 1800.0, api_key: str | None = None) -> dict:
    """Bring a late-joining (new or restarted) engine to the latest weights: ``/update_weights_from_disk`` of
    the last HF export, tagged ``version``. Afterwards the actor includes it in the next group
    (``WeightSender.reconnect``). Raises WeightSyncError naming the engine.

    Not called by a run yet: the engines issue (#11) wires it into the late-joining engine's start."""
    c = engine if isinstance(engine, EngineClient) else EngineClient(str(engine), api_key=api_key)
    try:
        return c.update_weights_from_disk(str(hf_dir), weight_version=str(version), timeout=timeout)
    except EngineError as e:
        raise WeightSyncError(f"loading weights from {hf_dir} failed on engine {c.url}: {e}", [c.url]) from e


def push_from_actor(named: Iterable[tuple[str, torch.Tensor]], sender: WeightSender | None, version: str | int,
                    **kw: Any) -> dict[str, float]:
    """Collective over the actor's ranks: every rank walks ``named``, the (HF name, tensor) stream of
    ``actor.named_hf_weights()`` (the bridge gathers TP/PP shards collectively, so every rank must walk it to the
    end, and every rank gets every full tensor); each rank holding a ``sender`` (rank 0; on several nodes also each
    node's first rank, for its node's engines) pushes it (:meth:`WeightSender.push`, ``kw`` passed on) and gets its
    ``perf/weight_sync_*`` metrics. Other ranks pass ``sender=None`` and get ``{}``."""
    it = named if isinstance(named, PackedBuckets) else iter(named)  # packed ahead: the sender takes them as cut
    if sender is None:
        for _ in it:
            pass
        return {}
    try:
        return sender.push(it, version, **kw)
    except BaseException:
        for _ in it:  # the other ranks walk on to the end: rank 0 must too, or their gathers wait for it
            pass
        raise
