"""LoRA on the actor: ``train.lora`` adapters on Megatron's linear layers through megatron-bridge's PEFT, the base
weights frozen.

megatron-bridge 0.3.1's ``megatron.bridge.peft.lora.LoRA`` wraps each targeted ``ColumnParallelLinear`` /
``RowParallelLinear`` in a ``LoRALinear`` (the base layer as ``to_wrap``, a ``ParallelLinearAdapter`` A/B pair split
over TP as its base), freezes every other parameter, and its model bridge merges the adapters into the HF weights
it exports (weight sync in ``merge`` mode, ``relax-export``) or streams them alone (``export_adapter_weights``:
``adapter`` mode, ``relax-export --adapter``). So the same mapping serves loading, training, sync and export.

One thing it needs here: ``megatron.bridge.peft.utils`` decides whether a layer is a Transformer Engine one by
``isinstance`` against TE classes it imported, and without TE (this repo's CPU path: :func:`relax_hpc.train.model.
import_bridge` puts an import-only stub in place) those names are the stub's mocks, so ``isinstance`` raises. Where
TE is not really importable we tell that module so (``HAVE_TE = False``), and it takes the megatron-core branches.

Frozen means no gradient and no optimizer state: Megatron's DDP gives a grad buffer only to parameters that require
grad, and ``get_megatron_optimizer`` takes only those (:func:`trainable_bytes` measures what that saves).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from relax_hpc.errors import PermanentError
from relax_hpc.train.config import HF_LORA_TARGETS, LoraConfig, megatron_targets

__all__ = ["HF_LORA_TARGETS", "LoraConfig", "apply_lora", "adapters_off", "base_identity", "check_base",
           "has_lora", "megatron_targets", "trainable_bytes", "peft_config"]

LORA_ATTR = "_relax_lora"  # on each GPTModel chunk: {"config": {...}, "base": base_identity(...)}


class LoraBaseMismatch(PermanentError):
    """A LoRA checkpoint adapts another base model than the one this run (or export) builds."""


def _bridge_without_te(have_te: bool) -> None:
    if have_te:
        return
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False  # its TE names are the import stub's mocks: isinstance against them raises


def _experts_targeted(chunks: list, targets: list[str]) -> list[str]:
    names = []
    for c in chunks:
        for name, _m in c.named_modules():
            if ".mlp.experts." in name and name.rsplit(".", 1)[-1] in targets:
                names.append(name)
    return names


def apply_lora(chunks: list, lcfg: LoraConfig, hf_dir: str | os.PathLike, *, seed: int = 0,
               have_te: bool = False) -> list:
    """Wrap the targeted linears of every chunk in LoRA adapters (A: xavier, B: zero, so the model starts as the
    base), freeze everything else; marks each chunk with the config and the base model's identity."""
    _bridge_without_te(have_te)  # have_te: relax_hpc.train.model's answer (a real TE, not its import stub)
    from megatron.bridge.peft.lora import LoRA

    targets = megatron_targets(lcfg.target_modules)
    experts = _experts_targeted(chunks, targets)
    if experts:
        raise PermanentError(
            f"train.lora.target_modules = {lcfg.target_modules} reaches the model's MoE experts (e.g. {experts[0]}): "
            "adapters on routed experts are not supported here (each expert would carry its own A/B pair, which "
            "the adapter sync and the PEFT export here do not map). "
            "Fix: target the attention only (linear_qkv, linear_proj), or train the MoE model without LoRA")
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if lcfg.rank % tp:
        raise PermanentError(f"train.lora.rank = {lcfg.rank} does not split over train.tp = {tp} ranks (each TP rank "
                             f"holds rank / tp rows of an adapter). Fix: a multiple of {tp}, e.g. {tp * 8}")
    peft = LoRA(target_modules=targets, dim=lcfg.rank, alpha=lcfg.alpha, dropout=lcfg.dropout)
    chunks = peft(chunks, training=True)
    init_adapters(chunks, seed)
    base = base_identity(hf_dir)
    for c in chunks:
        # "mode": what the weight sync sends (relax_hpc.weights.lora): the adapters alone, or merged weights
        setattr(c, LORA_ATTR, {"config": lcfg.as_dict(), "mode": lcfg.mode, "base": base})
    if not any(p.requires_grad for c in chunks for p in c.parameters()):
        raise PermanentError(f"train.lora.target_modules = {lcfg.target_modules} matched no layer of this pipeline "
                             "stage. Fix: linear_qkv, linear_proj, linear_fc1, linear_fc2 (or their HF names)")
    return chunks


def _global_name(chunk, name: str) -> str:
    """A module's name with its layer numbered as in the whole model (a pipeline stage numbers its own from 0)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        layer = chunk.decoder.layers[int(parts[2])]
        parts[2] = str(int(getattr(layer, "layer_number", int(parts[2]) + 1)) - 1)
    return ".".join(parts)


@torch.no_grad()
def init_adapters(chunks: list, seed: int) -> None:
    """Every adapter's A drawn from a generator seeded by ``seed`` and the adapted module's name in the whole model
    (B stays zero): the same adapters at any TP/PP layout (the bridge's own init draws from the process RNG in
    build order, which differs per pipeline stage). A is Xavier-normal over the full [rank, in] matrix; each TP
    rank keeps its shard."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for c in chunks:
        for name, m in c.named_modules():
            adapter = getattr(m, "adapter", None)
            if adapter is None or not hasattr(adapter, "linear_in"):
                continue
            w = adapter.linear_in.weight
            r, n_in = adapter.dim, adapter.linear_in.input_size  # full sizes; the weight is this TP rank's shard
            g = torch.Generator().manual_seed(seed * 1_000_003 + int(hashlib.sha256(
                _global_name(c, name).encode()).hexdigest()[:8], 16))
            full = torch.randn(r, n_in, generator=g) * (2.0 / (r + n_in)) ** 0.5
            for dim in (0, 1):
                if w.shape[dim] != full.shape[dim]:
                    full = full.chunk(tp, dim=dim)[tp_rank]
            w.copy_(full.to(w.dtype))
            adapter.linear_out.weight.zero_()


def _chunks(model: list) -> list:
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)


def has_lora(model: list) -> dict | None:
    """The LoRA record of a model (its chunks may be wrapped in DDP), or None for a model without adapters."""
    for c in _chunks(model):
        rec = getattr(c, LORA_ATTR, None)
        if rec:
            return rec
    return None


@contextmanager
def adapters_off(model: list) -> Iterator[None]:
    """The base model's forward: every adapter switched off (e.g. the reference's log-probs from the actor's own
    weights, no second copy), back on after."""
    wrappers = [m for c in _chunks(model) for m in c.modules() if hasattr(m, "disable_adapter_layers")]
    for m in wrappers:
        m.disable_adapter_layers()
    try:
        yield
    finally:
        for m in wrappers:
            m.enable_adapter_layers()


def is_adapter_key(name: str) -> bool:
    return ".adapter." in name


def base_identity(hf_dir: str | os.PathLike) -> dict:
    """What names a base model without reading all of it: sha256 over config.json and, for each weight file, its
    name, size and first MiB. Another model (or the same path with other weights) gives another digest."""
    root = Path(hf_dir)
    h = hashlib.sha256()
    for f in sorted(root.iterdir()):
        if f.name == "config.json" or f.suffix in (".safetensors", ".bin"):
            h.update(f.name.encode())
            h.update(str(f.stat().st_size).encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
    return {"path": str(root.resolve()), "digest": h.hexdigest()}


def check_base(saved: dict | None, model: list, where: str) -> None:
    """Refuse to load a checkpoint into a model whose LoRA setting or base model differ from the ones it was saved
    with: a LoRA checkpoint holds the adapters only, so its numbers mean something on its own base only."""
    mine = has_lora(model)
    if saved is None and mine is None:
        return
    if saved is None:
        raise LoraBaseMismatch(f"checkpoint {where} was saved without LoRA, but this model has train.lora set. "
                               "Fix: remove train.lora, or start the LoRA run from the base model (no checkpoint)")
    if mine is None:
        raise LoraBaseMismatch(f"checkpoint {where} holds LoRA adapters of base model {saved['base']['path']}, but "
                               "this model has no train.lora. Fix: set train.lora as the run that saved it did: "
                               f"{saved['config']}")
    if saved["base"]["digest"] != mine["base"]["digest"]:
        raise LoraBaseMismatch(
            f"checkpoint {where} holds LoRA adapters of base model {saved['base']['path']} (digest "
            f"{saved['base']['digest'][:12]}), not of {mine['base']['path']} (digest {mine['base']['digest'][:12]}). "
            f"Fix: set model.path to the base model it adapts ({saved['base']['path']})")
    keys = ("rank", "alpha", "target_modules")
    a, b = {k: saved["config"][k] for k in keys}, {k: mine["config"][k] for k in keys}
    if a != b:
        raise LoraBaseMismatch(f"checkpoint {where} holds LoRA adapters of {a}, but train.lora says {b}. "
                               f"Fix: set train.lora's rank, alpha and target_modules as saved: {a}")


def trainable_bytes(model: list) -> dict[str, int]:
    """Parameter bytes trainable vs frozen on this rank: Adam keeps fp32 master (bf16 only), exp_avg and exp_avg_sq and
    DDP an fp32 grad for the trainable ones only, so the frozen ones' grad+optimizer state (~16 bytes each) is saved."""
    out = {"params_trainable": 0, "params_frozen": 0, "bytes_trainable": 0, "bytes_frozen": 0}
    for c in _chunks(model):
        for p in c.parameters():
            k = "trainable" if p.requires_grad else "frozen"
            out[f"params_{k}"] += p.numel()
            out[f"bytes_{k}"] += p.numel() * p.element_size()
    return out


def grad_buffer_bytes(model: list) -> int:
    """Bytes of Megatron DDP's gradient buffers on this rank (0 for a model not wrapped in DDP)."""
    n = 0
    for m in model:
        for buf in getattr(m, "buffers", []) or []:
            g = getattr(buf, "grad_data", None)
            if g is not None:
                n += g.numel() * g.element_size()
    return n


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer's per-parameter state (Adam's moments, master weights) on this rank."""
    n = 0
    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for o in opts:
        inner = getattr(o, "optimizer", o)
        for st in getattr(inner, "state", {}).values():
            for t in st.values():
                if isinstance(t, torch.Tensor):
                    n += t.numel() * t.element_size()
    return n


def hf_target_modules(megatron: list[str]) -> list[str]:
    """The HF module names (PEFT's ``target_modules``) of Megatron's targets."""
    out = []
    for m in megatron:
        out += [hf for hf, meg in HF_LORA_TARGETS.items() if meg == m]
    return out


def peft_config(rec: dict, base_path: str) -> dict:
    """PEFT's ``adapter_config.json`` for a LoRA record."""
    cfg = rec["config"]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
            "r": cfg["rank"], "lora_alpha": cfg["alpha"], "lora_dropout": cfg["dropout"],
            "target_modules": hf_target_modules(megatron_targets(cfg["target_modules"])), "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "modules_to_save": None}


def peft_name(bridge_name: str) -> str:
    """megatron-bridge's adapter name (``model.layers.0.self_attn.q_proj.lora_A.weight``, already PEFT's module
    naming) as PEFT's saved key (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    return "base_model.model." + bridge_name


def record_json(rec: dict) -> str:
    return json.dumps(rec, sort_keys=True)
