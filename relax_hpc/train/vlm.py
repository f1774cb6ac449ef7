"""Vision-language models (Qwen2.5-VL, Qwen3-VL) through megatron-bridge: build, and per-token log-probs of a
response.

megatron-bridge's ``Qwen25VLModel`` and ``Qwen3VLModel`` wrap transformers' own vision tower (``visual`` /
``vision_model``, replicated on every TP rank) around a Megatron GPTModel (``language_model``, TP/PP-sharded,
M-RoPE; Qwen3-VL's also adds DeepStack vision features into its first layers). Their forward takes the HF inputs —
``input_ids``, ``pixel_values`` (the processor's flattened patches) and ``image_grid_thw`` — puts the merged patch
embeddings at the ``<|image_pad|>`` positions and computes the 3-D M-RoPE positions itself (Qwen2.5-VL: transformers'
``get_rope_index`` bound to the model; Qwen3-VL: the bridge's port of it), so callers pass no position ids.

What the bridge (0.3.1) needs besides :func:`relax_hpc.train.model.build_model`'s text settings:

* Qwen2.5-VL: ``mrope_section`` is not read from the HF config: the provider keeps ``[16, 24, 24]`` (head_dim
  128), wrong for any other head size (a tiny model's head_dim 16 needs e.g. ``[2, 3, 3]``) — it fails in the
  rotary split. :func:`_patch_mrope_section` copies the HF value.
* Qwen3-VL: the provider ignores ``transformer_layer_spec`` and always asks megatron-core for Transformer
  Engine's layer spec (``NameError: TESpecProvider`` without TE). :func:`_patch_qwen3_vl_spec` gives it the
  pure-torch spec :func:`~relax_hpc.train.model.choose_kernels` chose, when it chose that one. (Its forward's
  ``torch.cuda.nvtx`` ranges need :mod:`.cpu_compat` on a CPU.)

The trainer's forward passes (:mod:`.logprobs`, :mod:`.step`) call :func:`vlm_forward` for these models, on padded
micro-batches that carry their samples' ``pixel_values`` and ``image_grid_thw`` (:mod:`.batch`).

Not wired yet: PP > 1 (only the first stage has the vision tower; the forward of the later stages needs the same
``input_ids``/``image_grid_thw`` for M-RoPE), packed (THD) micro-batches (``build_vlm`` refuses
``train.max_tokens_per_micro_batch``), and Qwen3-VL's videos (the bridge's model asserts it takes none).
Qwen2.5-VL's videos go in as ``pixel_values_videos``/``video_grid_thw`` beside the images.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from relax_hpc.errors import PermanentError
from relax_hpc.multimodal import MODEL_FPS, VLM_MODEL_TYPES, encode, images_end, is_vlm

__all__ = ["VLM_MODEL_TYPES", "build_vlm", "check_freeze_vision", "encode", "is_vlm", "is_vlm_model", "vision_tower",
           "vlm_forward", "vlm_log_probs"]  # encode: callers import it here too

_mrope_patched = False
_qwen3_spec_patched = False


def _patch_mrope_section() -> None:
    """Make the Qwen2.5-VL bridge take ``mrope_section`` from the HF config (``rope_scaling``), not its default."""
    global _mrope_patched
    if _mrope_patched:
        return
    from megatron.bridge.models.qwen_vl.qwen25_vl_bridge import Qwen25VLBridge

    orig = Qwen25VLBridge.provider_bridge

    @functools.wraps(orig)
    def provider_bridge(self, hf_pretrained):
        provider = orig(self, hf_pretrained)
        section = (getattr(hf_pretrained.config, "rope_scaling", None) or {}).get("mrope_section")
        if section:
            provider.mrope_section = list(section)
        return provider

    Qwen25VLBridge.provider_bridge = provider_bridge
    _mrope_patched = True


def _patch_qwen3_vl_spec() -> None:
    """Make ``Qwen3VLModelProvider.provide`` build its language model with
    :func:`~relax_hpc.train.model.torch_block_spec` when that is the provider's ``transformer_layer_spec`` (no TE);
    with TE, upstream's TE spec as before."""
    global _qwen3_spec_patched
    if _qwen3_spec_patched:
        return
    from megatron.bridge.models.qwen_vl import qwen3_vl_provider as q3

    from relax_hpc.train.model import torch_block_spec

    orig, te_spec = q3.Qwen3VLModelProvider.provide, q3.get_gpt_layer_with_transformer_engine_spec

    @functools.wraps(orig)
    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        if self.transformer_layer_spec is not torch_block_spec:
            return orig(self, pre_process, post_process, vp_stage)
        q3.get_gpt_layer_with_transformer_engine_spec = lambda **kw: torch_block_spec(self, vp_stage)
        try:  # the module-level name provide() looks up; builds run one at a time
            return orig(self, pre_process, post_process, vp_stage)
        finally:
            q3.get_gpt_layer_with_transformer_engine_spec = te_spec

    q3.Qwen3VLModelProvider.provide = provide
    _qwen3_spec_patched = True


def check_freeze_vision(hf_dir: str | os.PathLike, freeze_vision: bool) -> None:
    """``model.freeze_vision`` needs a vision tower: refused (permanent) for a text model's directory."""
    if freeze_vision and not is_vlm(hf_dir):
        raise PermanentError(f"model.freeze_vision = true but model.path = {str(hf_dir)!r} is a text model: it has "
                             "no vision tower to freeze. Fix: model.freeze_vision: false (or a Qwen2.5-VL/Qwen3-VL "
                             "model.path)")


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "language_model"):
        model = model.module  # Megatron's DDP / Float16Module wrappers
    return model


def is_vlm_model(model) -> bool:
    """Whether ``model`` (a model chunk, DDP-wrapped or not) is the bridge's VLM (its forward takes images)."""
    m = _unwrap(model)
    return hasattr(m, "language_model") and (getattr(m, "visual", None) or getattr(m, "vision_model", None)) is not None


def vision_tower(model) -> torch.nn.Module:
    """The vision tower (encoder and merger: every HF ``visual.*`` tensor) of the bridge's VLM, DDP-unwrapped."""
    model = _unwrap(model)
    tower = getattr(model, "visual", None) or getattr(model, "vision_model", None)  # Qwen2.5-VL / Qwen3-VL
    if tower is None:
        raise ValueError(f"{type(model).__name__} has no vision tower (visual / vision_model)")
    return tower


def build_vlm(hf_dir: str | os.PathLike, cfg, *, freeze_vision: bool = False):
    """:func:`relax_hpc.train.model.build_model` for a Qwen2.5-VL or Qwen3-VL directory: ``chunks[0]`` is the
    bridge's ``Qwen25VLModel``/``Qwen3VLModel`` (vision tower + GPTModel), HF weights loaded.
    ``init_parallel(cfg.tp, cfg.pp)`` first. ``freeze_vision`` (``model.freeze_vision``; Relax's
    ``--freeze-vision-model`` with ``--freeze-vision-projection``): the vision tower's parameters get no gradient,
    so DDP and the optimizer (built after this) leave them out; the weight sync then leaves them out too."""
    from relax_hpc.train.model import build_model, import_bridge

    check_freeze_vision(hf_dir, freeze_vision)
    if not is_vlm(hf_dir):
        raise PermanentError(f"model.path = {str(hf_dir)!r} is not a vision-language model this build knows "
                             f"(config.json model_type must be one of {VLM_MODEL_TYPES}). Fix: a Qwen2.5-VL or "
                             "Qwen3-VL directory, or build it as a text model")
    for key in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch"):
        if getattr(cfg, key, None) is not None:
            raise PermanentError(f"train.{key} = {getattr(cfg, key)} with a vision-language model: packed (THD) "
                                 "micro-batches are not wired for M-RoPE and images (relax_hpc.train.vlm). Fix: "
                                 f"remove train.{key} (padded micro-batches of train.micro_batch_size samples)")
    if cfg.pp != 1:
        raise PermanentError(f"train.pp = {cfg.pp} with a vision-language model: pipeline stages after the first "
                             "are not wired for it yet (relax_hpc.train.vlm). Fix: train.pp: 1")
    import_bridge()
    _patch_mrope_section()
    _patch_qwen3_vl_spec()
    built = build_model(hf_dir, cfg)
    if freeze_vision:
        vision_tower(built.chunks[0]).requires_grad_(False)
    return built


_VISION_TOKENS = ("vision_start_token_id", "image_token_id", "video_token_id")  # the model config's names


def vlm_forward(model, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                image_grid_thw: torch.Tensor | None, *, image_limits: Sequence[int] | None = None,
                image_counts: Sequence[int] | None = None, pad_id: int = 0,
                pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """The VLM's logits [B, S, V/tp] of ``input_ids`` [B, S] (right-padded) with the batch's images: the model called
    with keyword arguments (it computes the M-RoPE positions itself, so no position ids), right-padded here to a
    multiple of the TP size under sequence parallelism.

    ``image_limits``: per row, the position from which a vision token id (``<|vision_start|>``, ``<|image_pad|>``,
    ``<|video_pad|>``) is no image of the row but a token like any other (its response's start; 0 for a row without
    images, e.g. a sample failed for its images, and for rows past the list): those ids go in as ``pad_id``, since
    the model takes every image pad for one of the batch's image features and every vision start for the start of
    an image (a sampled one would break the M-RoPE positions; the logits after it change, the targets do not).
    ``image_counts``: per row, its images; a row's limit moves past its last image when that lies after its start
    (a multi-turn sample's observation images: the rollout ends a sample at a sampled vision token, so any before
    the last image are the images' own).

    ``pixel_values_videos``/``video_grid_thw``: the batch's videos (Qwen2.5-VL only; megatron-bridge 0.3.1's
    Qwen3-VL refuses them), their frames shown at :data:`relax_hpc.multimodal.MODEL_FPS` (``second_per_grid_ts``
    made here, as the engines make it)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    from relax_hpc.train import cpu_compat

    dev = cpu_compat.device()
    B, S = input_ids.shape
    ids = input_ids.to(dev)
    config = get_model_config(model)
    if image_limits is not None:
        limits = torch.zeros(B, 1, dtype=torch.long)
        limits[: len(image_limits), 0] = torch.as_tensor(list(image_limits), dtype=torch.long)
        for b, n in enumerate(image_counts or []):
            if n > 0:
                end = images_end(input_ids[b].tolist(), n, config.vision_start_token_id, config.image_token_id)
                limits[b, 0] = max(int(limits[b, 0]), end)
        special = torch.tensor([getattr(config, k) for k in _VISION_TOKENS], device=dev)
        stray = (torch.arange(S).unsqueeze(0) >= limits).to(dev) & torch.isin(ids, special)
        if bool(stray.any()):
            ids = ids.masked_fill(stray, pad_id)
    tp = ps.get_tensor_model_parallel_world_size()
    if config.sequence_parallel and S % tp:
        ids = torch.nn.functional.pad(ids, (0, tp - S % tp), value=pad_id)
    videos = {}
    if video_grid_thw is not None and video_grid_thw.numel():
        if not hasattr(_unwrap(model), "visual"):
            raise PermanentError(f"videos for {type(_unwrap(model)).__name__}: megatron-bridge 0.3.1 takes videos "
                                 "for Qwen2.5-VL only. Fix: a Qwen2.5-VL model.path, or images")
        temporal = _unwrap(model).visual.config.temporal_patch_size  # frames a time step takes (2)
        videos = dict(pixel_values_videos=pixel_values_videos.to(dev), video_grid_thw=video_grid_thw.to(dev),
                      second_per_grid_ts=torch.full((video_grid_thw.shape[0],), temporal / MODEL_FPS, device=dev))
    logits = model(input_ids=ids, attention_mask=None, position_ids=None,
                   pixel_values=None if pixel_values is None else pixel_values.to(dev),
                   image_grid_thw=None if image_grid_thw is None else image_grid_thw.to(dev), **videos)  # [B, S', V/tp]
    return logits[:, :S]


def vlm_log_probs(model, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                  image_grid_thw: torch.Tensor | None, response_start: int | Sequence[int], *,
                  temperature: float = 1.0, pad_id: int = 0, pixel_values_videos: torch.Tensor | None = None,
                  video_grid_thw: torch.Tensor | None = None) -> list[torch.Tensor]:
    """log p of each response token, given the prompt and its images, from the Megatron VLM (TP-sharded vocab).

    ``input_ids`` [B, S] (right-padded with ``pad_id`` when lengths differ: the model is causal, a pad only
    follows), the processor's ``pixel_values`` [N_patches, C·T·P·P] and ``image_grid_thw`` [N_images, 3] for every
    image of the batch, in order. ``response_start``: each row's first response index (one int for all rows).
    Returns one float32 tensor [S − start] per row (through the padding for a padded row: slice it).
    Differentiable when grad is on. Every TP rank calls it with the same inputs. With sequence parallelism the
    batch is right-padded here to a multiple of the TP size (the model splits S over the TP ranks).
    """
    from relax_hpc.train.vocab import vocab_parallel_logprobs

    B, S = input_ids.shape
    starts = [response_start] * B if isinstance(response_start, int) else list(response_start)
    if len(starts) != B or min(starts) < 1:
        raise ValueError(f"response_start {response_start!r}: one start ≥ 1 per row of input_ids {(B, S)}")
    logits = vlm_forward(model, input_ids, pixel_values, image_grid_thw, pad_id=pad_id,
                         pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw)  # [B, S, V/tp]
    ids = input_ids.to(logits.device)
    if temperature != 1.0:
        logits = logits / temperature
    lp, _ = vocab_parallel_logprobs(logits[:, :S - 1], ids[:, 1:S])  # [B, S-1]: token t+1 given ≤ t
    return [lp[b, s - 1:] for b, s in enumerate(starts)]

