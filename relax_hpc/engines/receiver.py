"""The receiving side of SGLang's weight-update API: process groups beside the default one, update sessions, the
updates themselves (broadcast per tensor or as one flattened bucket, tensors handed over by handle, files), the
version tag and the read-back, by HF parameter name. A flattened bucket's layout is
:mod:`relax_hpc.engines.bucket_wire`'s; handed-over tensors are :mod:`relax_hpc.engines.tensor_wire`'s.

A receiver says what it serves (:meth:`WeightReceiver.sync_info`, merged into ``/server_info``): the group backends
(``weight_sync_backends``: gloo on CPU; nccl and gloo on CUDA, where gloo lands in host memory and is copied to the
device), the update paths, its device, GPU and host. A group asking for a backend it does not serve is refused at
once, naming both, instead of joining a group that can never form.

The CPU engine (:mod:`relax_hpc.engines.model_runner`) is a :class:`WeightReceiver`; so is the forward role that
follows the actor (:mod:`relax_hpc.weights.follower`), so both answer the sender (:mod:`relax_hpc.weights.sync`)
with this one wire format. :func:`weight_routes` is its HTTP half.
"""

from __future__ import annotations

import re
import socket
import threading
from datetime import timedelta
from pathlib import Path

import torch

from relax_hpc.engines import bucket_wire
from relax_hpc.engines.http import HTTPError, brief, ok


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = "weight_update_group", backend: str = "gloo",
                             timeout_s: float = 600.0):
    """Create a torch.distributed group *beside* the default one, the way SGLang's engine joins its weight group.

    Both ends (trainer rank 0 and every engine rank) must build the group the same way: a TCPStore
    rendezvous at ``tcp://master_address:master_port`` (rank 0 hosts it), keys under a
    ``PrefixStore(group_name)``, and registration in torch's group table so ``dist.broadcast(..., group=g)``
    works. It never touches the default process group, so a trainer that already has one (Megatron) and a
    pytest process can both use it. Uses private torch API like SGLang/OpenRLHF/verl do; torch 2.13 checked.
    """
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    assert pg.rank() == rank and pg.size() == world_size
    return pg


def checkpoint_key_mapping(model) -> dict[str, str]:
    """The checkpoint → module name renames transformers applies when ``from_pretrained`` loads ``model``'s class:
    its ``_checkpoint_conversion_mapping`` (regex → replacement), for the classes transformers applies it to (its
    ``VLMS`` list, as ``from_pretrained`` checks it). Qwen2.5-VL (4.57): ``^visual`` → ``model.visual``,
    ``^model(?!\\.(language_model|visual))`` → ``model.language_model``: the checkpoint's (and the bridge's export)
    ``model.layers.*`` are the module's ``model.language_model.layers.*``. Empty for a model saved as it is built."""
    from transformers import modeling_utils

    vlms = getattr(modeling_utils, "VLMS", None)  # 4.57 keeps it "for BC only": without it, the attribute says
    if vlms is not None and not any(v in c.__name__.lower() for c in type(model).__mro__[:-1] for v in vlms):
        return {}
    return dict(getattr(model, "_checkpoint_conversion_mapping", None) or {})


def rename_key(name: str, key_mapping: dict[str, str]) -> str:
    """``name`` renamed as transformers' loader does (``_get_key_renaming_mapping``): the first pattern that
    matches (``re.subn``) replaces, the rest are not tried."""
    for pattern, replacement in key_mapping.items():
        new, n = re.subn(pattern, replacement, name)
        if n:
            return new
    return name


class WeightReceiver:
    """The receiving side of SGLang's weight-update API, by HF parameter name into ``params``: groups, update
    sessions, the updates themselves, the version tag. The CPU engine is one; a forward role following the actor
    (:mod:`relax_hpc.weights.follower`) is another, so both answer the sender with this one wire format.

    ``key_mapping`` (:func:`checkpoint_key_mapping`): the sender sends checkpoint names (the bridge's export); a
    model whose modules transformers renames on load (Qwen2.5-VL) holds them under other names. Every name that
    comes in (updates, read-back) is renamed as transformers renames it when loading; one that names no parameter
    even then is refused, naming it."""

    device = "cpu"  # where nccl broadcasts land and what is refilled ("cpu" or "cuda:N"); gloo ones land on the CPU
    weight_sync_backends: list[str] | None = None  # the backends served, when not the device's (a test hook)
    update_paths: tuple[str, ...] = ("distributed", "disk")  # the /update_weights_from_* this receiver answers
    # SGLang before 0.5.23 (``--sglang-version``): no update sessions; the updates come alone
    legacy_updates = False
    reported_version: str | None = None  # what /server_info says the version is (``--sglang-version``)

    def __init__(self, params: dict[str, torch.Tensor], weight_version: str = "default",
                 key_mapping: dict[str, str] | None = None):
        self.params = params  # HF names → live tensors (tied names included)
        self.key_mapping = dict(key_mapping or {})
        self.weight_version = weight_version
        self.model_lock = threading.Lock()  # readers of params vs weight loads
        self.groups: dict[str, object] = {}
        self.group_backends: dict[str, str] = {}  # group name → the backend it was built with
        self.session = False
        self.session_lock = threading.Lock()

    def served_backends(self) -> list[str]:
        """The weight-sync group backends this receiver joins: ``weight_sync_backends`` if set, else gloo on the
        CPU, nccl and gloo on CUDA (gloo lands in host memory, then is copied to the device)."""
        if self.weight_sync_backends:
            return list(self.weight_sync_backends)
        return ["gloo"] if torch.device(self.device).type == "cpu" else ["nccl", "gloo"]

    def sync_info(self) -> dict:
        """What the sender needs to pick a backend and an update path; merged into ``/server_info``."""
        dev = torch.device(self.device)
        uuids = [str(torch.cuda.get_device_properties(dev).uuid)] if dev.type == "cuda" else []
        return {"weight_sync_backends": self.served_backends(), "weight_update_paths": list(self.update_paths),
                "device": str(self.device), "gpu_uuids": uuids, "hostname": socket.gethostname()}

    def backend(self, body: dict) -> str:
        """The group's backend: the one asked (SGLang's default "nccl"), if this receiver serves it; else a 400
        naming both, at once (a group built with two backends never forms, and both ends would wait for it)."""
        asked = str(body.get("backend") or "nccl")
        served = self.served_backends()
        if asked not in served:
            raise HTTPError(400, f"this engine serves {', '.join(served)}; the sender asked {asked} (engine device "
                                 f"{self.device}). Fix: build the weight-sync group with a backend every member serves "
                                 "(each says which in /server_info: weight_sync_backends)")
        return asked

    def abort_all(self, message: str) -> None:
        """Requests in flight when an update asks to abort them (an engine has some)."""

    def loaded(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Called after tensors were copied into ``params``."""

    def updates_refused(self) -> str | None:
        """Why weight updates are refused now (an engine whose weights are released), or None."""
        return None

    def init_weights_update_group(self, body: dict) -> tuple[bool, str]:
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            return False, f"weight update group {name!r} already exists"
        backend = self.backend(body)  # before any rendezvous: a backend not served is refused at once
        try:
            pg = init_weight_update_group(body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
                                          int(body["world_size"]), name, backend=backend,
                                          timeout_s=float(body.get("timeout", 600.0)))
        except KeyError as e:
            return False, f"missing field {e}"
        except Exception as e:
            return False, f"Failed to init process group: {type(e).__name__}: {e}"
        self.groups[name] = pg
        self.group_backends[name] = backend
        return True, (f"Succeeded to initialize custom process group (rank {body['rank_offset']} of "
                      f"{body['world_size']}, backend {backend}).")

    def destroy_weights_update_group(self, body: dict) -> tuple[bool, str]:
        import torch.distributed as dist
        name = body.get("group_name", "weight_update_group")
        pg = self.groups.pop(name, None)
        self.group_backends.pop(name, None)
        if pg is None:
            return False, "no such weight update group"
        dist.destroy_process_group(pg)
        return True, "Succeeded to destroy custom process group."

    def begin_weight_update(self) -> tuple[bool, str]:
        with self.session_lock:
            if self.session:
                return False, "A weight update session is already active; call end_weight_update() first."
            self.session = True
        return True, "Weight update session started."

    def end_weight_update(self) -> tuple[bool, str]:
        with self.session_lock:
            if not self.session:
                return False, "No weight update session is active; call begin_weight_update() first."
            self.session = False
        return True, "Weight update session ended."

    def update_weights_from_distributed(self, body: dict) -> tuple[bool, str]:
        import torch.distributed as dist
        if not self.session and not self.legacy_updates:
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update().")
        if (why := self.updates_refused()) is not None:
            return False, why
        group_name = body.get("group_name", "weight_update_group")
        pg = self.groups.get(group_name)
        if pg is None:
            return False, (f"Group {group_name} not in {list(self.groups)}. "
                           "Please call `init_weights_update_group` first.")
        fmt = body.get("load_format")
        try:  # refused before any byte comes, as SGLang refuses them: the announcement itself is wrong
            announced = bucket_wire.announced(body.get("names"), body.get("dtypes"), body.get("shapes"))
            metas = bucket_wire.plan(announced) if fmt == "flattened_bucket" else None
        except ValueError as e:
            return False, str(e)
        if body.get("abort_all_requests"):
            self.abort_all("Abort by update_weights_from_distributed (abort_all_requests).")
        # nccl lands on this receiver's device; gloo in host memory (load_named copies it to the device)
        device = self.device if self.group_backends.get(group_name, "gloo") == "nccl" else "cpu"
        # Receive everything the trainer sends before judging names/shapes: refusing halfway would hang its broadcast.
        if fmt == "flattened_bucket":  # one buffer, received as bytes (bucket_wire has the layout)
            flat = bucket_wire.empty_flat(metas, device)
            dist.broadcast(bucket_wire.as_bytes(flat), src=0, group=pg)
            named = bucket_wire.unpack(flat, metas)
        elif fmt in (None, "", "direct"):
            named = [(n, torch.empty(s, dtype=d, device=device)) for n, s, d in announced]
            works = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in named]
            for w in works:
                w.wait()
        else:
            return False, f"load_format {fmt!r} is not supported by the CPU engine (null or 'flattened_bucket')"
        self.load_named(named)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return True, f"Succeeded to update parameter online ({len(named)} tensors)."

    def update_weights_from_tensor(self, body: dict) -> tuple[bool, str]:
        """SGLang's ``/update_weights_from_tensor``: one ``serialized_named_tensors`` entry per TP rank (TP 1 here),
        each a :mod:`~relax_hpc.engines.tensor_wire` list of (name, tensor) handles, copied into ``params``."""
        from relax_hpc.engines.tensor_wire import deserialize_named

        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], str):
            n = len(entries) if isinstance(entries, list) else type(entries).__name__
            return False, (f"serialized_named_tensors must be a list of one base64 string (one per TP rank; this "
                           f"engine has TP 1), got {n}")
        fmt = body.get("load_format")
        if fmt == "flattened_bucket":
            return False, ("load_format 'flattened_bucket' needs SGLang's own bucket metadata class; this engine "
                           "reads plain (name, tensor) lists: send load_format null or 'direct'")
        if fmt not in (None, "", "direct"):
            return False, f"load_format {fmt!r} is not supported by this engine (null or 'direct')"
        try:  # opened even when the call is then refused: an opened handle is released, an unopened one is leaked
            named = deserialize_named(entries[0], device=self.device if self.device != "cpu" else None)
        except ValueError as e:
            return False, f"Failed to read serialized_named_tensors: {e}"
        if not self.session and not self.legacy_updates:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()."
        if (why := self.updates_refused()) is not None:
            return False, why
        if body.get("abort_all_requests"):
            self.abort_all("Abort by update_weights_from_tensor (abort_all_requests).")
        self.load_named(named)
        for dev in {t.device for _, t in named if t.device.type == "cuda"}:
            torch.cuda.synchronize(dev)  # the copies are done before the sender may reuse or free its tensors
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return True, f"Succeeded to update parameter online from tensors ({len(named)} tensors)."

    def update_weights_from_disk(self, body: dict) -> tuple[bool, str]:
        from safetensors.torch import load_file
        path = Path(body.get("model_path") or "")
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return False, f"Failed to update weights: no *.safetensors files in model_path {str(path)!r}"
        if (why := self.updates_refused()) is not None:
            return False, why
        if body.get("abort_all_requests"):
            self.abort_all("Abort by update_weights_from_disk (abort_all_requests).")
        named = [kv for f in files for kv in load_file(str(f)).items()]
        self.load_named(named)
        self.model_path = str(path)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return True, f"Succeeded to update model weights from {path} ({len(named)} tensors)."

    def param(self, name: str) -> tuple[str, torch.Tensor]:
        """The parameter an incoming (checkpoint) name is, and its name in ``params``; a 400 naming it if none."""
        key = rename_key(name, self.key_mapping) if self.key_mapping else name
        p = self.params.get(key)
        if p is None:
            as_ = f" (loaded as {key!r})" if key != name else ""
            raise HTTPError(400, f"unknown parameter {brief(name)}{as_}: not in the HF model's state_dict")
        return key, p

    def load_named(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model by HF name; all are checked before any is copied."""
        keys = []
        for name, t in named:
            key, p = self.param(name)
            if tuple(p.shape) != tuple(t.shape):
                raise HTTPError(400, f"shape mismatch for {name}: model {tuple(p.shape)}, received {tuple(t.shape)}")
            keys.append(key)
        with self.model_lock, torch.no_grad():
            if (why := self.updates_refused()) is not None:  # released since the call was accepted
                raise HTTPError(400, why)
            for key, (_, t) in zip(keys, named):
                self.params[key].data.copy_(t)
        self.loaded(named)

    def get_weights_by_name(self, body: dict):
        _, p = self.param(str(body.get("name")))
        if (why := self.updates_refused()) is not None:  # the released weights hold nothing to read
            raise HTTPError(400, why)
        return p.detach()[: int(body.get("truncate_size", 100))].float().tolist()


def weight_routes(receiver: WeightReceiver) -> dict:
    """The weight-update endpoints of SGLang's HTTP API (groups, sessions, updates, version, read-back)."""
    def result(fn, **extra):
        """Weight/session endpoints answer {"success", "message"} with 200/400, never an error object."""
        def call(b):
            try:
                success, message = fn(b)
            except HTTPError as e:
                success, message = False, e.message
            return (200 if success else 400), {"success": success, "message": message, **extra}
        return call

    def version(b):
        if b.get("abort_all_requests", True):
            receiver.abort_all("Abort by update_weight_version.")
        receiver.weight_version = str(b["new_version"])
        return 200, {"success": True, "message": "Weight version updated.", "new_version": receiver.weight_version}

    return {
        "/init_weights_update_group": result(receiver.init_weights_update_group),
        "/destroy_weights_update_group": result(receiver.destroy_weights_update_group),
        **({} if receiver.legacy_updates else {  # older SGLang has no such routes: 404, as there
            "/begin_weight_update": result(lambda b: receiver.begin_weight_update()),
            "/end_weight_update": result(lambda b: receiver.end_weight_update())}),
        "/update_weights_from_distributed": result(receiver.update_weights_from_distributed),
        **({"/update_weights_from_tensor": result(receiver.update_weights_from_tensor)}
           if "tensor" in receiver.update_paths else {}),
        "/update_weights_from_disk": result(receiver.update_weights_from_disk, num_paused_requests=0),
        "/update_weight_version": version,
        "/get_weights_by_name": lambda b: ok(receiver.get_weights_by_name(b)),
    }
