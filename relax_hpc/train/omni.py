"""Omni models (Qwen2.5-Omni's thinker) in the Megatron actor: the language model in Megatron, the HF audio tower
beside it, frozen; per-token log-probs of a response given a prompt with audio.

megatron-bridge 0.3.1 has no Qwen-Omni bridge. The thinker's language model is a Qwen2 (qkv bias) with M-RoPE; for
a prompt of text and audio, transformers' ``get_rope_index`` gives every token the same position in all three
sections, ``0, 1, 2, …`` (audio tokens advance one a token, as text): M-RoPE is then ordinary RoPE. So
:func:`build_omni` builds the language model with the bridge's Qwen2 (a side directory: the thinker's text config
as a ``Qwen2ForCausalLM`` config, its weight files linked, the checkpoint names of the thinker's language model —
``model.*``, ``lm_head.weight`` — being Qwen2's), and adds transformers' ``Qwen2_5OmniAudioEncoder``, the
thinker's ``audio_tower.*`` weights loaded, as the GPTModel's attribute ``audio_tower`` (replicated on every TP
rank; held beside the Megatron modules, not registered among them: the bridge's export has no mapping for it, and
frozen it needs no gradient buffer, optimizer state or checkpoint). :func:`omni_forward` embeds the ids with the
GPTModel's embedding, puts the tower's output at the ``<|AUDIO|>`` positions (as the thinker does) and runs the
decoder on that (``decoder_input``), positions 0…S−1.

The export (weight sync, HF checkpoints) is the bridge's Qwen2 export: the language model's tensors by the thinker's
names; the audio tower, not trained (``model.freeze_audio``, default and, for now, only true), is not sent: the
engines keep the tower they loaded from ``model.path``, which is the actor's.

Not wired: images or video in an omni prompt (their M-RoPE positions are 3-D: refused at the data), training the
audio tower (the weight sync would have to send it), PP > 1, packed micro-batches, the full Qwen2.5-Omni checkpoint
(``thinker.*`` names, model_type ``qwen2_5_omni``: give the thinker's directory).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from relax_hpc.audio import AUDIO_PAD, OMNI_MODEL_TYPES, audio_tokens, is_omni, model_type
from relax_hpc.errors import PermanentError

__all__ = ["build_omni", "check_freeze_audio", "is_omni", "is_omni_model", "omni_forward", "omni_log_probs"]


def check_freeze_audio(hf_dir: str | os.PathLike, freeze_audio: bool) -> None:
    """``model.freeze_audio: false`` is not wired (the weight sync does not send the audio tower): refused."""
    if not freeze_audio and is_omni(hf_dir):
        raise PermanentError("model.freeze_audio = false: training the audio tower is not wired yet (the actor "
                             "holds it beside the Megatron model, with no gradient buffer, optimizer state or "
                             "checkpoint, and the weight sync sends the language model only, so the engines would "
                             "keep the old tower). Fix: model.freeze_audio: true")


def text_dir(hf_dir: str | os.PathLike) -> Path:
    """A side directory the bridge reads as a Qwen2: the thinker's text config (M-RoPE dropped: positions are 1-D
    for text and audio), the thinker's weight files and tokenizer files linked. Removed when the process ends."""
    src = Path(hf_dir).resolve()
    cfg = json.loads((src / "config.json").read_text())
    text = dict(cfg["text_config"])
    for k in ("rope_scaling", "rope_parameters", "model_type", "architectures", "dtype", "torch_dtype"):
        text.pop(k, None)
    text.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], torch_dtype="float32",
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(k) is not None:
            text[k] = cfg[k]
    out = Path(tempfile.mkdtemp(prefix="relax-omni-text-"))
    atexit.register(shutil.rmtree, out, True)
    (out / "config.json").write_text(json.dumps(text, indent=1))
    for f in src.iterdir():
        if f.suffix == ".safetensors" or f.name.endswith(".safetensors.index.json") or f.name.startswith(
                ("tokenizer", "special_tokens", "vocab", "merges", "generation_config", "chat_template")):
            (out / f.name).symlink_to(f)
    return out


def _audio_tower(hf_dir: str | os.PathLike):
    """transformers' audio encoder of the thinker, its ``audio_tower.*`` weights loaded (fp32)."""
    from safetensors import safe_open
    from transformers import Qwen2_5OmniThinkerConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    cfg = Qwen2_5OmniThinkerConfig.from_pretrained(str(hf_dir))  # AutoConfig does not know the thinker alone
    tower = Qwen2_5OmniAudioEncoder._from_config(cfg.audio_config, dtype=torch.float32)
    state, prefix = {}, "audio_tower."
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if k.startswith(prefix):
                    state[k[len(prefix):]] = h.get_tensor(k).float()
    missing, unexpected = tower.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise PermanentError(f"{hf_dir}: the audio tower's weights do not fit its config (missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]})")
    return tower.eval()


def build_omni(hf_dir: str | os.PathLike, cfg, *, freeze_audio: bool = True):
    """:func:`relax_hpc.train.model.build_model` for an omni thinker's directory: ``chunks[0]`` is the bridge's Qwen2
    GPTModel with the HF audio tower as its attribute ``audio_tower`` (frozen, not a registered submodule).
    ``init_parallel(cfg.tp, cfg.pp)`` first."""
    from relax_hpc.train import cpu_compat
    from relax_hpc.train.model import BuiltModel, build_model

    kind = model_type(hf_dir)
    if kind not in OMNI_MODEL_TYPES:
        hint = " (the whole Qwen2.5-Omni: give its thinker's directory)" if kind == "qwen2_5_omni" else ""
        raise PermanentError(f"model.path = {str(hf_dir)!r} (model_type {kind!r}) is not an omni thinker this build "
                             f"knows{hint}: config.json model_type must be one of {OMNI_MODEL_TYPES}")
    check_freeze_audio(hf_dir, freeze_audio)
    for key in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch"):
        if getattr(cfg, key, None) is not None:
            raise PermanentError(f"train.{key} = {getattr(cfg, key)} with an omni model: packed (THD) micro-batches "
                                 f"are not wired for audio (relax_hpc.train.omni). Fix: remove train.{key}")
    if cfg.pp != 1:
        raise PermanentError(f"train.pp = {cfg.pp} with an omni model: only one pipeline stage holds the audio "
                             "tower (relax_hpc.train.omni). Fix: train.pp: 1")
    built = build_model(text_dir(hf_dir), cfg)
    gpt = built.chunks[0]
    tower = _audio_tower(hf_dir)
    tower.requires_grad_(False)  # frozen (model.freeze_audio): outside DDP's buffers and the optimizer
    if cfg.bf16:
        tower.to(torch.bfloat16)
    # not registered as a submodule: the bridge's export and load walk every parameter and have no mapping for
    # the tower's; frozen, it needs no DDP buffer, optimizer state or checkpoint either
    object.__setattr__(gpt, "audio_tower", tower.to(cpu_compat.device()))
    gpt._audio_pad_id = audio_pad_id(hf_dir)
    return BuiltModel(bridge=built.bridge, chunks=built.chunks, hf_dir=str(hf_dir))


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "audio_tower"):
        model = model.module  # Megatron's DDP / Float16Module wrappers
    return model


def is_omni_model(model) -> bool:
    """Whether ``model`` (a model chunk, wrapped or not) is :func:`build_omni`'s (a GPTModel with an audio tower)."""
    return getattr(_unwrap(model), "audio_tower", None) is not None


def audio_embeddings(tower, features: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
    """The tower's output [tokens, hidden] for clips whose features [frames, mel] are concatenated in ``features``
    (``lens``: each clip's frames), as the thinker's ``get_audio_features``."""
    lens_t = torch.as_tensor(list(lens), dtype=torch.long, device=features.device)
    after_cnn = (lens_t - 1) // 2 + 1
    dtype = next(tower.parameters()).dtype
    out = tower(features.t().to(dtype), feature_lens=lens_t, aftercnn_lens=after_cnn).last_hidden_state
    want = sum(audio_tokens(n) for n in lens)
    if out.shape[0] != want:
        raise ValueError(f"the audio tower gave {out.shape[0]} embeddings for clips of {list(lens)} frames "
                         f"({want} audio tokens)")
    return out


def omni_forward(model, input_ids: torch.Tensor, features: torch.Tensor | None, feature_lens: Sequence[int] | None,
                 *, audio_limits: Sequence[int] | None = None, pad_id: int = 0) -> torch.Tensor:
    """The logits [B, S, V/tp] of ``input_ids`` [B, S] (right-padded) with the batch's clips: ``features`` [frames,
    mel] of every clip of the batch concatenated in row order, ``feature_lens`` each clip's frames. Each
    ``<|AUDIO|>`` before its row's ``audio_limits`` (where its prompt ends; 0 for a row without audio) takes one
    audio embedding, in order; one at or after it (sampled in a response) goes in as ``pad_id``."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import (gather_from_sequence_parallel_region,
                                               scatter_to_sequence_parallel_region)
    from megatron.core.utils import get_model_config

    from relax_hpc.train import cpu_compat

    gpt = _unwrap(model)
    dev = cpu_compat.device()
    config = get_model_config(model)
    B, S = input_ids.shape
    ids = input_ids.to(dev)
    pad = getattr(gpt, "_audio_pad_id", None)
    if pad is None:
        raise ValueError("the omni model has no audio pad id (build_omni sets it)")
    limits = torch.zeros(B, 1, dtype=torch.long)
    if audio_limits is not None:
        limits[: len(audio_limits), 0] = torch.as_tensor(list(audio_limits), dtype=torch.long)
    in_prompt = torch.arange(S).unsqueeze(0) < limits
    is_pad = (ids == pad).cpu()
    stray = is_pad & ~in_prompt
    if bool(stray.any()):
        ids = ids.masked_fill(stray.to(dev), pad_id)
    tp = ps.get_tensor_model_parallel_world_size()
    sp = bool(config.sequence_parallel)
    if sp and S % tp:
        ids = torch.nn.functional.pad(ids, (0, tp - S % tp), value=pad_id)
    S2 = ids.shape[1]
    pos = torch.arange(S2, device=dev).unsqueeze(0).expand(B, -1)
    emb = gpt.embedding(input_ids=ids, position_ids=pos)  # [S2(/tp with SP), B, H]
    if sp:
        emb = gather_from_sequence_parallel_region(emb, tensor_parallel_output_grad=False)
    slots = (is_pad & in_prompt)
    n_slots = int(slots.sum())
    n_feats = 0 if feature_lens is None else sum(audio_tokens(n) for n in feature_lens)
    if n_slots != n_feats:
        raise ValueError(f"the batch has {n_slots} audio pad tokens in its prompts but its clips give {n_feats} "
                         "audio embeddings")
    if n_slots:
        aud = audio_embeddings(gpt.audio_tower, features.to(dev), list(feature_lens)).to(emb.dtype)
        mask = torch.zeros(B, S2, dtype=torch.bool)
        mask[:, :S] = slots
        emb = emb.transpose(0, 1).masked_scatter(mask.to(dev).unsqueeze(-1), aud).transpose(0, 1).contiguous()
    if sp:
        emb = scatter_to_sequence_parallel_region(emb)
    logits = model(ids, pos, None, decoder_input=emb)  # [B, S2, V/tp]
    return logits[:, :S]


def omni_log_probs(model, input_ids: torch.Tensor, features: torch.Tensor | None, feature_lens: Sequence[int] | None,
                   response_start: int | Sequence[int], *, temperature: float = 1.0,
                   pad_id: int = 0) -> list[torch.Tensor]:
    """log p of each response token given the prompt and its clips (TP-sharded vocab), one float32 tensor [S −
    start] per row (through the padding for a padded row: slice it). Every TP rank calls it with the same inputs."""
    from relax_hpc.train.vocab import vocab_parallel_logprobs

    B, S = input_ids.shape
    starts = [response_start] * B if isinstance(response_start, int) else list(response_start)
    if len(starts) != B or min(starts) < 1:
        raise ValueError(f"response_start {response_start!r}: one start ≥ 1 per row of input_ids {(B, S)}")
    logits = omni_forward(model, input_ids, features, feature_lens, audio_limits=starts, pad_id=pad_id)
    ids = input_ids.to(logits.device)
    if temperature != 1.0:
        logits = logits / temperature
    lp, _ = vocab_parallel_logprobs(logits[:, :S - 1], ids[:, 1:S])
    return [lp[b, s - 1:] for b, s in enumerate(starts)]


def audio_pad_id(hf_dir: str | os.PathLike) -> int:
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    v = cfg.get("audio_token_index", cfg.get("audio_token_id"))
    if v is None:
        from relax_hpc.audio import token_id

        v = token_id(hf_dir, AUDIO_PAD)
    return int(v)
