"""Audio for the reference engine (:mod:`.model_runner`): an omni thinker's directory loads as
``Qwen2_5OmniThinkerForConditionalGeneration`` (``AutoConfig`` does not know the thinker alone), and a request's
``audio_data`` (SGLang's form: one clip or a list for one request, a list per item of a batch; each base64, a
``data:`` URL or a path on the engine's host, WAV) is read, resampled and turned into the processor's features
(:mod:`relax_hpc.audio`); the prompt has one ``<|AUDIO|>`` per clip, as the chat template writes it, or the runs
already expanded. A request with audio runs alone, as one with images (its features are per request). A bad clip
is answered 400 naming its place and the reason, never its bytes. Its answer's ``meta_info["input_ids"]`` is the
expanded prompt, as for images.

Positions: with text and audio only, the thinker's M-RoPE positions are ``0, 1, 2, …`` in all three sections
(transformers' ``get_rope_index``), so the prefill passes those and the decoding steps go on one a token.
"""

from __future__ import annotations

import functools

from relax_hpc.audio import AUDIO_PAD, AudioError, is_omni

__all__ = ["audio_inputs", "is_omni", "load_config", "model_class", "prefill_kwargs"]


def load_config(path: str):
    from transformers import Qwen2_5OmniThinkerConfig

    return Qwen2_5OmniThinkerConfig.from_pretrained(path)


def model_class():
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    return Qwen2_5OmniThinkerForConditionalGeneration


def audio_inputs(runner, audio_data, prompts: list, batched: bool, http_error) -> list[dict | None]:
    """Per item: None (no audio) or ``{"input_ids": [1, S] expanded, "features": [per clip [frames, mel]]}``.
    ``http_error(status, message)`` makes the HTTP error to raise. Audio for a model without an audio tower, a
    bare ``<|AUDIO|>`` without audio, or a bad clip: 400."""
    import torch

    omni = getattr(runner, "omni", False)
    pad = runner.tokenizer.convert_tokens_to_ids(AUDIO_PAD) if omni and runner.tokenizer is not None else None
    if audio_data is None or audio_data == []:
        for i, p in enumerate(prompts):
            if pad is not None and pad in p:
                raise http_error(400, f"{'item %d: ' % i if batched else ''}the prompt has audio pad tokens (id {pad}) "
                                      "but the request has no audio_data for it")
        return [None] * len(prompts)
    if not omni:
        raise http_error(400, f"audio_data given, but the model ({getattr(runner.config, 'model_type', '?')}) has no "
                              "audio tower: serve a Qwen2.5-Omni thinker directory")
    if not batched:
        per_item = [audio_data if isinstance(audio_data, list) else [audio_data]]
    elif isinstance(audio_data, list) and len(audio_data) == len(prompts):
        per_item = [x if isinstance(x, list) else ([] if x is None else [x]) for x in audio_data]
    else:
        raise http_error(400, f"audio_data must have one entry per item of the batch of {len(prompts)}")
    from relax_hpc.audio import audio_tokens, expand_audio

    out: list[dict | None] = []
    for i, (p, refs) in enumerate(zip(prompts, per_item)):
        if not refs:
            out.append(None)
            continue
        feats = []
        for j, ref in enumerate(refs):
            where = f"audio_data[{i}][{j}]" if batched else f"audio_data[{j}]"
            try:
                feats.append(clip_features(runner.model_path, ref))  # a keyed request: paths anywhere, no URLs
            except AudioError as e:
                kind = f"{type(ref).__name__} of {len(ref)}" if hasattr(ref, "__len__") else type(ref).__name__
                raise http_error(400, f"{where} ({kind}) is not a usable audio clip: {e}") from None
        try:
            ids = expand_audio(list(p), [audio_tokens(f.shape[0]) for f in feats], pad)
        except AudioError as e:
            raise http_error(400, f"{'item %d: ' % i if batched else ''}{e}") from None
        out.append({"input_ids": torch.tensor([ids]), "features": feats})
    return out


def clip_features(model_path: str, ref):
    """One clip's features [frames, mel]; a clip sent inline (base64, a ``data:`` URL) is read once for the
    requests that repeat it (a GRPO group's samples share their prompt's clip), a path every time (its file may
    change)."""
    from relax_hpc.audio import features, load_audio, may_be_path

    if isinstance(ref, str) and (ref.startswith("data:") or not may_be_path(ref)):
        return _inline_features(model_path, ref)
    return features(model_path, [load_audio(ref, model_path)])[0]


@functools.lru_cache(maxsize=64)
def _inline_features(model_path: str, ref: str):
    from relax_hpc.audio import features, load_audio

    f = features(model_path, [load_audio(ref, model_path)])[0]
    f.setflags(write=False)  # shared by the requests that repeat the clip
    return f


def prefill_kwargs(mm: dict, ids, dev, dtype) -> tuple:
    """(positions [3, 1, L], rope delta [1, 1], the forward's audio keyword arguments) of a request with audio."""
    import torch

    from relax_hpc.audio import padded

    L = ids.shape[1]
    pos = torch.arange(L).view(1, 1, L).expand(3, 1, L)
    x, mask = padded(mm["features"])
    return pos, torch.zeros(1, 1, dtype=torch.long), {"input_features": x.to(dev, dtype),
                                                       "feature_attention_mask": mask.to(dev)}
