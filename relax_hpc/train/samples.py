"""Rollout samples ↔ chunk files ↔ columns: the conversions on both sides of the exchange.

The rollout role writes one step's samples as one chunk (:mod:`relax_hpc.exchange.chunk`) in
``RUN_DIR/exchange/step_<N>/`` (:func:`write_step`); the chunk's ref (path, checksum, size, ...) travels to the
actor in its ``train`` task through the controller, and the trainer's roles read it back, checksum verified, as
columns (:func:`read_columns`: one numpy array per field, views into the verified bytes), which the data plan
(:mod:`relax_hpc.train.plan`) turns into the actor's batch. Which fields make the trip, their dtypes and who
writes them is :mod:`relax_hpc.exchange.fields`; this module only converts.

Representations of one sample on the way to the loss: the engine's response → :class:`Sample` → columns
(one numpy array per field) → the HDF5 chunk → flat columns read back → per-sample tensors of this DP rank's
share only (:class:`~relax_hpc.train.batch.TrainingSample`, views again, no copies) → the padded micro-batch of
:mod:`relax_hpc.train.batch`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from relax_hpc.exchange.chunk import ChunkRef, DamagedChunk, Ragged, columns_to_samples, read_chunk, write_chunk
from relax_hpc.exchange.fields import (BY_NAME, MEDIA_FIELDS, OPTIONAL_ROLLOUT_FIELDS, PRODUCER, TRAIN_FIELDS,
                                       Routing, rollout_fields, routed_experts_problem)

__all__ = ["exchange_root", "write_step", "as_ref", "read_columns", "read_samples"]


def exchange_root(run_path: str | os.PathLike) -> str:
    return os.path.join(str(run_path), "exchange")


def _rollout_values(s: Any) -> dict[str, list]:
    """Each rollout field's per-sample values (the names and order of :func:`rollout_fields`)."""
    return {
        "tokens": [x.tokens for x in s],
        "response_length": [x.response_length for x in s],
        "loss_mask": [x.loss_mask if x.loss_mask is not None else [1] * x.response_length for x in s],
        "rollout_log_probs": [x.rollout_log_probs or [] for x in s],
        "raw_reward": None,  # the result's, set by write_step
        "index": [-1 if x.index is None else x.index for x in s],
        "group_index": [-1 if x.group_index is None else x.group_index for x in s],
        "rollout_id": [x.rollout_id if x.rollout_id is not None else -1 if x.index is None else x.index for x in s],
        "weight_version": [x.weight_version for x in s],
        "status": [x.status.value for x in s],
        "prompt": [x.prompt for x in s],
        "response": [x.response for x in s],
        "label": [x.label for x in s],
    }


def _optional_values(s: Any, model_dir: str | os.PathLike | None = None) -> dict[str, list]:
    """The optional rollout fields (:data:`~relax_hpc.exchange.fields.OPTIONAL_ROLLOUT_FIELDS`) these samples carry:
    a field is written when every sample has it (OPD's ``teacher_log_probs``), and none may have it partly.
    ``routed_experts`` are checked by the schema (:func:`~relax_hpc.exchange.fields.routed_experts_problem`: a row
    a token but the last, -1 rows allowed; with ``model_dir``'s config, its layers × top-k, experts, distinct)."""
    out: dict[str, list] = {}
    for name in OPTIONAL_ROLLOUT_FIELDS:
        if name in MEDIA_FIELDS:  # made from multimodal_inputs by _image_values / _audio_values
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
            elif v is not None and len(v) != x.response_length:
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
    ``model_dir``'s image processor, :func:`_image_values`); ``attrs`` join the chunk's (and its journal
    record's), e.g. the prompts it holds (:func:`~relax_hpc.exchange.audit.prompt_attrs`)."""
    values = _rollout_values(result.samples)
    values["raw_reward"] = list(result.raw_rewards)
    extra = {**_optional_values(result.samples, model_dir), **_image_values(result.samples, model_dir),
             **_audio_values(result.samples, model_dir), **_video_values(result.samples, model_dir)}
    values.update(extra)
    names = rollout_fields(tuple(extra))
    assert set(values) == set(names), sorted(set(values) ^ set(names))  # the schema and this writer agree
    root = exchange_root(run_path)
    os.makedirs(os.path.join(root, f"step_{int(step)}"), exist_ok=True)
    fields = {name: _column(name, values[name]) for name in names}
    return write_chunk(root, step, PRODUCER, seq, fields, attrs={"group_size": result.group_size, **(attrs or {})})


def as_ref(r: dict | ChunkRef) -> ChunkRef:
    """A chunk ref as tasks carry it (a dict) or already decoded."""
    return r if isinstance(r, ChunkRef) else ChunkRef.from_dict(r)


def read_columns(refs: Sequence[dict | ChunkRef], fields: Sequence[str] = TRAIN_FIELDS, *,
                 agree: bool = False) -> dict[str, Any]:
    """The ``fields`` of these chunks (samples in order) as columns: ``fixed`` → ndarray, ``ragged`` → one
    flat :class:`Ragged`, ``json`` → list. Raises DamagedChunk on a bad file.

    ``agree``: a collective of the role's ranks (each reads the same chunks): if any rank could not read, every
    rank raises DamagedChunk, so none goes on into a collective that the others never join."""
    parts: list[dict[str, Any]] = []
    damage = None
    try:
        parts = [read_chunk(as_ref(r), list(fields), ragged="flat") for r in refs]
    except DamagedChunk as e:
        damage = e
    if agree and _any_rank(damage is not None) and damage is None:
        path = as_ref(refs[0]).path if refs else "?"
        damage = DamagedChunk(path, "another rank of this role could not read this task's chunks")
    if damage is not None:
        raise damage
    return {name: _concat([p[name] for p in parts]) for name in fields}


def _concat(cols: list) -> Any:
    if len(cols) == 1:
        return cols[0]
    if cols and isinstance(cols[0], Ragged):
        lengths = np.concatenate([c.lengths() for c in cols])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Ragged(np.concatenate([c.data for c in cols]), offsets)
    if cols and isinstance(cols[0], np.ndarray):
        return np.concatenate(cols)
    return [v for c in cols for v in c]


def read_samples(refs: Sequence[dict | ChunkRef], fields: Sequence[str] = TRAIN_FIELDS, *,
                 agree: bool = False) -> list[dict[str, Any]]:
    """The samples of these chunks (in order) as dicts of ``fields``, for readers that walk samples one by
    one (the forward roles, people); the actor reads columns (:func:`read_train_batch`)."""
    cols = read_columns(refs, fields, agree=agree)
    return columns_to_samples({k: v.to_list() if isinstance(v, Ragged) else v for k, v in cols.items()})


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the role's process group (just ``flag`` without one)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


