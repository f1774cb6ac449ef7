"""Megatron weights ↔ HF: a full HF directory on disk, (name, full tensor) pairs for weight sync, and those
pairs loaded back (a forward role following the actor through the weight-sync group).

Both go through megatron-bridge, the same mapping that loaded the model, so names, fused-QKV splits and
TP/PP gathering agree with the HF checkpoint we started from. Both are collective: every rank of the
actor must call them (the bridge gathers TP shards and PP stages).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist


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
