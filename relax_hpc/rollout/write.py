"""The rollout's chunk writer: one step's :class:`~relax_hpc.rollout.sample.Sample` objects → the chunk of the exchange.

The producer's side of the sample seam. Which fields a chunk holds, their dtypes and where each comes from is the
field table (:mod:`relax_hpc.exchange.fields`, each field's ``source``); this module turns samples into those
columns: a field's per-sample value is the Sample attribute of its name, unless :data:`_VALUES` has a builder for
it (a default, an enum's value) or it is a media field (the model's processor makes it from the sample's
``multimodal_inputs``: :func:`_image_values`, :func:`_video_values`, :func:`_audio_values`). The chunk format is
:mod:`relax_hpc.exchange.chunk`; the trainer reads the chunk back with :mod:`relax_hpc.train.samples`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from relax_hpc.exchange.chunk import ChunkRef, write_chunk
from relax_hpc.exchange.fields import (BY_NAME, MEDIA_FIELDS, OPTIONAL_ROLLOUT_FIELDS, PRODUCER, Routing,
                                       rollout_fields, routed_experts_problem)

__all__ = ["exchange_root", "write_step"]


def exchange_root(run_path: str | os.PathLike) -> str:
    return os.path.join(str(run_path), "exchange")


# the rollout fields whose value is not simply the Sample attribute of the field's name (the table's source says so)
_VALUES: dict[str, Callable[[Any], Any]] = {
    "loss_mask": lambda x: x.loss_mask if x.loss_mask is not None else [1] * x.response_length,
    "rollout_log_probs": lambda x: x.rollout_log_probs or [],
    "index": lambda x: -1 if x.index is None else x.index,
    "group_index": lambda x: -1 if x.group_index is None else x.group_index,
    "rollout_id": lambda x: x.rollout_id if x.rollout_id is not None else -1 if x.index is None else x.index,
    "status": lambda x: x.status.value,
}


def _rollout_values(s: Any) -> dict[str, list]:
    """Each field every chunk has (:func:`rollout_fields`) but ``raw_reward`` (the result's): its per-sample values."""
    return {name: [_VALUES.get(name, lambda x, n=name: getattr(x, n))(x) for x in s]
            for name in rollout_fields() if name != "raw_reward"}


def _optional_values(s: Any, model_dir: str | os.PathLike | None = None) -> dict[str, list]:
    """The optional rollout fields (:data:`~relax_hpc.exchange.fields.OPTIONAL_ROLLOUT_FIELDS`) these samples carry:
    a field is written when every sample has it (OPD's ``teacher_log_probs``), and none may have it partly.
    ``routed_experts`` are checked by the schema (:func:`~relax_hpc.exchange.fields.routed_experts_problem`: a row
    a token but the last, -1 rows allowed; with ``model_dir``'s config, its layers × top-k, experts, distinct)."""
    out: dict[str, list] = {}
    for name in OPTIONAL_ROLLOUT_FIELDS:
        if name in MEDIA_FIELDS:  # made from multimodal_inputs by the media builders (_MEDIA)
            continue
        vals = [getattr(x, name, None) for x in s]
        if name == "routed_experts":  # the sample's [tokens, layers × top_k] (numpy, compact) goes flat to the field
            vals = [None if v is None else np.asarray(v).reshape(-1) for v in vals]
        have = [v is not None for v in vals]
        if any(have) and not all(have):
            i = have.index(False)
            raise ValueError(f"{name}: {sum(have)} of {len(vals)} samples carry it, sample {i} (index "
                             f"{s[i].index}) does not: a step's chunk has the field for every sample or for none")
        routing = _routing(model_dir) if name == "routed_experts" and any(have) else None
        for x, v in zip(s, vals):  # per response token, as rollout_log_probs; routed experts: per token but the last
            if v is not None and name == "routed_experts":
                problem = routed_experts_problem(v, len(x.tokens) - 1, routing, unrouted=True)
                if problem is not None:
                    raise ValueError(f"routed_experts of sample index {x.index} ({len(x.tokens)} tokens): {problem}")
            elif v is not None and BY_NAME[name].per == "response" and len(v) != x.response_length:
                raise ValueError(f"{name} of sample index {x.index} has {len(v)} values for a response of "
                                 f"{x.response_length} tokens")
        if s and all(have):
            out[name] = vals
    return out


def _routing(model_dir: str | os.PathLike | None) -> Routing | None:
    """The model's routing replay rows (layers × top-k, experts) from ``model_dir``'s config.json, if any."""
    import json

    try:
        return Routing.from_config(json.loads((Path(model_dir) / "config.json").read_text())) if model_dir else None
    except (OSError, ValueError):
        return None


def _image_values(s: Any, model_dir: str | os.PathLike | None) -> dict[str, list]:
    """``pixel_values`` and ``image_grid_thw`` (:data:`~relax_hpc.exchange.fields.IMAGE_FIELDS`) of these samples'
    images (``multimodal_inputs["images"]``, base64 PNG as the data made them; a multi-turn sample's observations
    add theirs), by the image processor of ``model_dir`` (:func:`relax_hpc.multimodal.encode_ids`, which also
    checks each image pad run of ``tokens`` up to the last image matches its image); written when some sample has
    images, empty for a sample without (a sample failed for its images: its loss mask is 0). The processor runs
    once per distinct image list (a group shares its prompt's)."""
    refs = [(x.multimodal_inputs or {}).get("images") or [] for x in s]
    if not any(refs):
        return {}
    if model_dir is None:
        raise ValueError("samples carry images but write_step got no model_dir to run the image processor of")
    from relax_hpc.multimodal import IMAGE_PAD, VISION_START, encode_ids, images_end, load_image, token_id

    pixels, grids, done = [], [], {}
    start_id, pad_id = token_id(model_dir, VISION_START), token_id(model_dir, IMAGE_PAD)
    for x, imgs in zip(s, refs):
        if not imgs:
            pixels.append(np.zeros(0, np.float32))
            grids.append(np.zeros(0, np.int64))
            continue
        # the prompt, or up to the last image of a multi-turn sample's observations (rollout/multiturn.py)
        end = max(len(x.tokens) - x.response_length,
                  images_end(x.tokens, len(imgs), start_id, pad_id))
        key = (tuple(imgs), tuple(x.tokens[:end]))
        if key not in done:
            enc = encode_ids(model_dir, x.tokens[:end], [load_image(r) for r in imgs])
            done[key] = (enc["pixel_values"].numpy().astype(np.float32).reshape(-1),
                         enc["image_grid_thw"].numpy().astype(np.int64).reshape(-1))
        pixels.append(done[key][0])
        grids.append(done[key][1])
    return {"pixel_values": pixels, "image_grid_thw": grids}


def _video_values(s: Any, model_dir: str | os.PathLike | None) -> dict[str, list]:
    """``pixel_values_videos`` and ``video_grid_thw`` (:data:`~relax_hpc.exchange.fields.VIDEO_FIELDS`) of these
    samples' videos (``multimodal_inputs["videos"]``: lists of base64 PNG frames as the data sampled them), by the
    image processor of ``model_dir`` (:func:`relax_hpc.multimodal.encode_media_ids`, which checks each video pad run
    of the prompt); written when some sample has videos, empty for one without. Once per distinct video list and
    prompt (a group shares its prompt's)."""
    refs = [(x.multimodal_inputs or {}).get("videos") or [] for x in s]
    if not any(refs):
        return {}
    if model_dir is None:
        raise ValueError("samples carry videos but write_step got no model_dir to run the image processor of")
    from relax_hpc.multimodal import encode_media_ids, load_image

    pixels, grids, done = [], [], {}
    for x, vids in zip(s, refs):
        if not vids:
            pixels.append(np.zeros(0, np.float32))
            grids.append(np.zeros(0, np.int64))
            continue
        prompt = tuple(x.tokens[:len(x.tokens) - x.response_length])
        key = (tuple(tuple(v) for v in vids), prompt)
        if key not in done:
            enc = encode_media_ids(model_dir, list(prompt), videos=[[load_image(f) for f in v] for v in vids])
            if enc["input_ids"][0].tolist() != list(prompt):
                raise ValueError(f"sample index {x.index}: its prompt's video pads are not its videos' expansion")
            done[key] = (enc["pixel_values_videos"].numpy().astype(np.float32).reshape(-1),
                         enc["video_grid_thw"].numpy().astype(np.int64).reshape(-1))
        pixels.append(done[key][0])
        grids.append(done[key][1])
    return {"pixel_values_videos": pixels, "video_grid_thw": grids}


def _audio_values(s: Any, model_dir: str | os.PathLike | None) -> dict[str, list]:
    """``input_features`` and ``audio_feature_lens`` (:data:`~relax_hpc.exchange.fields.AUDIO_FIELDS`) of these
    samples' clips (``multimodal_inputs["audios"]``, base64 WAV as the data made them), by the feature extractor of
    ``model_dir`` (:func:`relax_hpc.audio.encode_audio_ids`, which also checks each clip's audio pad run in the
    prompt); written when some sample has audio, empty for one without. Once per distinct clip list and prompt."""
    refs = [(x.multimodal_inputs or {}).get("audios") or [] for x in s]
    if not any(refs):
        return {}
    if model_dir is None:
        raise ValueError("samples carry audio but write_step got no model_dir to run the feature extractor of")
    from relax_hpc.audio import encode_audio_ids, load_audio

    feats, lens, done = [], [], {}
    for x, clips in zip(s, refs):
        if not clips:
            feats.append(np.zeros(0, np.float32))
            lens.append(np.zeros(0, np.int64))
            continue
        prompt = tuple(x.tokens[:len(x.tokens) - x.response_length])
        key = (tuple(clips), prompt)
        if key not in done:
            enc = encode_audio_ids(model_dir, list(prompt), [load_audio(r, model_dir) for r in clips])
            if enc["input_ids"] != list(prompt):
                raise ValueError(f"sample index {x.index}: its prompt's audio pads are not its clips' expansion")
            done[key] = (np.concatenate(enc["features"]).reshape(-1).astype(np.float32),
                         np.asarray([f.shape[0] for f in enc["features"]], np.int64))
        feats.append(done[key][0])
        lens.append(done[key][1])
    return {"input_features": feats, "audio_feature_lens": lens}


# the media fields' builders, each writing its group of MEDIA_FIELDS (images, audio, videos) where samples have them
_MEDIA = (_image_values, _audio_values, _video_values)


def _column(name: str, values: list) -> Any:
    """One field's values as the column its schema says: ndarray, a list of per-sample arrays, or a JSON list."""
    f = BY_NAME[name]
    if f.kind == "fixed":
        return np.asarray(values, dtype=f.dtype)
    if f.kind == "ragged":  # per-sample arrays: write_chunk writes them as they are, not concatenated first
        return [np.asarray(v, dtype=f.dtype) for v in values]
    return list(values)


def write_step(run_path: str | os.PathLike, step: int, result: Any, seq: int = 0,
               attrs: dict | None = None, model_dir: str | os.PathLike | None = None) -> ChunkRef:
    """Write a :class:`~relax_hpc.rollout.driver.RolloutResult` as the chunk of rollout step ``step``, with the
    optional fields its samples carry (OPD's ``teacher_log_probs``; a VLM's images as the processor's outputs of
    ``model_dir``'s image processor, :func:`_image_values`; its videos and audio clips likewise); ``attrs`` join the
    chunk's (and its journal record's), e.g. the prompts it holds (:func:`~relax_hpc.exchange.audit.prompt_attrs`)."""
    values = _rollout_values(result.samples)
    values["raw_reward"] = list(result.raw_rewards)
    extra = _optional_values(result.samples, model_dir)
    for build in _MEDIA:
        extra.update(build(result.samples, model_dir))
    values.update(extra)
    names = rollout_fields(tuple(extra))
    assert set(values) == set(names), sorted(set(values) ^ set(names))  # the schema and this writer agree
    root = exchange_root(run_path)
    os.makedirs(os.path.join(root, f"step_{int(step)}"), exist_ok=True)
    fields = {name: _column(name, values[name]) for name in names}
    return write_chunk(root, step, PRODUCER, seq, fields, attrs={"group_size": result.group_size, **(attrs or {})})
