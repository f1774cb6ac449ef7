"""Megatron weights ↔ HF: a full HF directory on disk, (name, full tensor) pairs for weight sync, those
pairs loaded back (a forward role following the actor through the weight-sync group), and a saved checkpoint
as an HF directory (:func:`export_checkpoint`, what ``relax-export`` runs), a LoRA model's adapters merged
(megatron-bridge merges them on export) or, with ``adapter``, alone in PEFT's format (:func:`export_adapters`).

All go through megatron-bridge, the same mapping that loaded the model, so names, fused-QKV splits and
TP/PP gathering agree with the HF checkpoint we started from. All but :func:`export_checkpoint` (one process) are
collective: every rank of the actor must call them (the bridge gathers TP shards and PP stages).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from relax_hpc.errors import PermanentError


def export_hf(bridge, model: list, out_dir: str | os.PathLike) -> Path:
    """Write config, tokenizer and safetensors weights to ``out_dir`` (rank 0 writes; all ranks call)."""
    out = Path(out_dir)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    bridge.save_hf_pretrained(model, str(out), show_progress=False)
    dist.barrier()
    return out


def named_hf_weights(bridge, model: list, *, cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) in a fixed order; every rank gets every full tensor."""
    for name, tensor in bridge.export_hf_weights(model, cpu=cpu, show_progress=False):
        yield name, tensor


class _InMemory:
    """What megatron-bridge's HF → Megatron loader reads from a pretrained model: its state, by HF name."""

    model_name_or_path = "weight-sync"

    def __init__(self, named: Mapping[str, torch.Tensor]):
        from megatron.bridge.models.hf_pretrained.state import StateDict

        self.state = StateDict(dict(named))


def load_hf_weights(bridge, model: list, named: Mapping[str, torch.Tensor]) -> None:
    """Copy full HF-named tensors into the Megatron model (the bridge splits them to this rank's TP/PP shards).
    Collective over the model's ranks; every rank passes every tensor."""
    bridge._model_bridge.load_weights_hf_to_megatron(_InMemory(named), model)


class NonFiniteWeights(PermanentError):
    """A checkpoint holds NaN or infinite weights: an export of it would be a broken model that loads fine."""


def nonfinite(chunks: list) -> list[tuple[str, int, int]]:
    """(name, non-finite values, values) of every floating-point tensor of the model's state that is not all finite."""
    bad = []
    for i, chunk in enumerate(chunks):
        prefix = f"model{i}." if len(chunks) > 1 else ""
        for name, t in chunk.state_dict().items():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                n = int((~torch.isfinite(t)).sum())
                if n:
                    bad.append((prefix + name, n, t.numel()))
    return bad


def export_adapters(bridge, model: list, out_dir: str | os.PathLike, base_path: str) -> Path:
    """A LoRA model's adapters in PEFT's format (``adapter_model.safetensors`` + ``adapter_config.json``) under their
    HF module names (megatron-bridge splits the fused qkv / gate-up adapters: each of q, k, v keeps the shared A and
    its rows of B, the same update). Collective; rank 0 writes."""
    from safetensors.torch import save_file

    from relax_hpc.train import lora

    rec = lora.has_lora(model)
    if rec is None:
        raise PermanentError("the model has no LoRA adapters to export (its run had no train.lora). "
                             "Fix: export the full model (without --adapter)")
    tensors = {lora.peft_name(n): t.detach().cpu().clone()  # q/k/v (gate/up) share one A: safetensors wants copies
               for n, t in bridge.export_adapter_weights(model, cpu=True, show_progress=False)}
    out = Path(out_dir)
    if dist.get_rank() == 0:
        import json

        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps(lora.peft_config(rec, base_path), indent=1) + "\n")
    dist.barrier()
    return out


def export_checkpoint(step_dir: str | os.PathLike, model_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                      bf16: bool = False, verify: bool = True, adapter: bool = False) -> Path:
    """A checkpoint step directory as an HF directory, in a process whose default group has one rank.

    The model is built at TP=1, PP=1 from ``model_path`` (the run's ``model.path``: architecture, config,
    tokenizer) and its weights replaced by the checkpoint's; dist_checkpointing reshards whatever TP/PP the
    checkpoint was saved with. ``bf16`` must be the run's ``train.bf16`` (the dtype the weights were saved in).
    The checkpoint's files are checked against its manifest first (``verify=False``: the caller just did), and
    weights that are not all finite raise :class:`NonFiniteWeights` naming each tensor before anything is written.
    """
    from relax_hpc.train import checkpoint as ckpt
    from relax_hpc.train.config import TrainConfig
    from relax_hpc.train.model import build_model
    from relax_hpc.train.parallel import init_parallel

    if dist.get_world_size() != 1:
        raise RuntimeError(f"export_checkpoint runs in one process (world size 1), not {dist.get_world_size()}")
    import json

    from relax_hpc.train.config import LoraConfig

    rec = json.loads((ckpt.resolve(step_dir) / "meta.json").read_text()).get("lora")
    if adapter and rec is None:
        raise PermanentError(f"checkpoint {step_dir} holds no LoRA adapters (its run had no train.lora). "
                             "Fix: export the full model (without --adapter)")
    # a LoRA checkpoint: the base from model_path (its digest checked at the load) with the adapters saved
    cfg = TrainConfig(tp=1, pp=1, bf16=bf16, lora=LoraConfig(**rec["config"]) if rec else None)
    init_parallel(1, 1, seed=cfg.seed)
    built = build_model(model_path, cfg)
    for m in built.chunks:
        m.requires_grad_(False)
    ckpt.load(step_dir, built.chunks, None, load_optimizer=False, verify=verify)
    bad = nonfinite(built.chunks)
    if bad:
        raise NonFiniteWeights(f"checkpoint {step_dir} has non-finite weights: " + ", ".join(
            f"{name} ({n} of {total} values NaN or inf)" for name, n, total in bad))
    if adapter:
        return export_adapters(built.bridge, built.chunks, out_dir, str(model_path))
    return export_hf(built.bridge, built.chunks, out_dir)  # a LoRA model's adapters merged into its weights
