"""Megatron weights → HF: a full HF directory on disk, or (name, full tensor) pairs for weight sync.

Both go through megatron-bridge, the same mapping that loaded the model, so names, fused-QKV splits and
TP/PP gathering agree with the HF checkpoint we started from. Both are collective: every rank of the
actor must call them (the bridge gathers TP shards and PP stages).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
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
