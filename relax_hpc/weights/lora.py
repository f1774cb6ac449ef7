"""``train.lora.mode: adapter``: the weight sync sends the LoRA adapters only (docs/lora.md).

The actor's model carries its LoRA record on each GPTModel chunk (:mod:`relax_hpc.train.lora` sets it; read here by
attribute, as this package does not import the trainer). In ``adapter`` mode the sync's tensors are
megatron-bridge's adapter export under HF module names (``…q_proj.lora_A.weight``, ``…q_proj.lora_B.weight``), B
scaled by alpha / rank so the engine merges ``W0 + B @ A`` without the config (:mod:`relax_hpc.engines.lora`); in
``merge`` mode (and without LoRA) the model's merged HF weights, as for full fine-tuning.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

LORA_ATTR = "_relax_lora"  # relax_hpc.train.lora.LORA_ATTR


def lora_record(model: Any) -> dict | None:
    """The LoRA record of a :class:`~relax_hpc.train.actor.MegatronActor`'s model (chunks maybe in DDP), or None."""
    chunks = getattr(model, "model", None)
    if not isinstance(chunks, (list, tuple)):  # not a MegatronActor (an HF model handed to the sync): no LoRA
        return None
    for chunk in chunks:
        m = chunk
        while m is not None:
            rec = getattr(m, LORA_ATTR, None)
            if rec:
                return rec
            m = getattr(m, "module", None)
    return None


def adapter_mode(model: Any) -> bool:
    rec = lora_record(model)
    return bool(rec) and rec["mode"] == "adapter"


def sync_weights(model: Any) -> Iterator[tuple[str, Any]]:
    """What a sync sends of ``model`` (collective, every rank): its adapters in ``adapter`` mode, else its merged
    HF weights."""
    rec = lora_record(model)
    if not rec or rec["mode"] != "adapter":
        yield from model.named_hf_weights()
        return
    scale = float(rec["config"]["alpha"]) / float(rec["config"]["rank"])
    for name, t in model.bridge.export_adapter_weights(model.model, cpu=True, show_progress=False):
        yield name, (t * scale if name.endswith(".lora_B.weight") else t)
