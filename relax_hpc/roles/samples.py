"""Rollout samples ↔ chunk files ↔ the actor's training batch.

The rollout role writes one step's samples as one chunk (:mod:`relax_hpc.exchange.chunk`) in
``RUN_DIR/exchange/step_<N>/``; the chunk's ref (path, checksum, size, ...) travels to the actor in its
``train`` task through the controller, and the actor reads it back, checksum verified, into the batch
format of :mod:`relax_hpc.train.batch`. Which fields make the trip, their dtypes and who writes them is
:mod:`relax_hpc.exchange.fields`; this module only converts.

Rewards travel raw (``raw_reward`` = R): group normalization and advantages (R → R̃ → A,
:mod:`relax_hpc.algo.advantages`) run here, on the training side, so a reward field can come from a role
that runs after the rollout.

Representations of one sample on the way to the loss: the engine's response → :class:`Sample` → columns
(one numpy array per field) → the HDF5 chunk → flat columns read back (views into the verified bytes) →
per-sample tensors of this DP rank's share only (views again, no copies) → the padded micro-batch of
:mod:`relax_hpc.train.batch`.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from relax_hpc.errors import PermanentError
from relax_hpc.exchange.chunk import ChunkRef, DamagedChunk, Ragged, columns_to_samples, read_chunk, write_chunk
from relax_hpc.exchange.fields import (BY_NAME, FORWARD_FIELDS, LOGPROB_FIELDS, LOGPROB_TOLERANCE, PRODUCER,
                                      SEGMENT_FIELDS, TRAIN_FIELDS, rollout_fields)

__all__ = ["FORWARD_FIELDS", "LOGPROB_FIELDS", "PRODUCER", "TRAIN_FIELDS", "exchange_root", "write_step",
           "read_columns", "read_samples", "logprob_batch", "mini_batch_order", "TrainPlan", "train_plan", "train_batch",
           "read_train_columns", "read_train_batch", "UnsoundTrainData", "check_train_columns"]

LOGPROB_COLUMNS = ("rollout_log_probs", "ref_log_probs", "log_probs")


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


def _column(name: str, values: list) -> Any:
    """One field's values as the column its schema says: ndarray, a list of per-sample arrays, or a JSON list."""
    f = BY_NAME[name]
    if f.kind == "fixed":
        return np.asarray(values, dtype=f.dtype)
    if f.kind == "ragged":  # per-sample arrays: write_chunk writes them as they are, not concatenated first
        return [np.asarray(v, dtype=f.dtype) for v in values]
    return list(values)


def write_step(run_path: str | os.PathLike, step: int, result: Any, seq: int = 0,
               attrs: dict | None = None) -> ChunkRef:
    """Write a :class:`~relax_hpc.rollout.driver.RolloutResult` as the chunk of rollout step ``step``;
    ``attrs`` join the chunk's (and its journal record's), e.g. the prompts it holds
    (:func:`~relax_hpc.exchange.audit.prompt_attrs`)."""
    values = _rollout_values(result.samples)
    values["raw_reward"] = list(result.raw_rewards)
    names = rollout_fields()
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


def logprob_batch(cols: dict[str, Any]) -> list[dict[str, Any]]:
    """What a forward pass needs of each sample, from the ``tokens`` and ``response_length`` columns:
    ``tokens`` (a view) and ``response_start`` (the response is the last ``response_length`` tokens)."""
    import torch

    out = []
    for tok, r in zip(cols["tokens"], cols["response_length"]):
        t = torch.from_numpy(tok)
        out.append({"tokens": t, "response_start": int(t.numel() - int(r))})
    return out


def _row_sums(r: Ragged) -> np.ndarray:
    """Each sample's sum of a ragged column (float64: exact for 0/1 masks)."""
    cs = np.zeros(len(r.data) + 1, dtype=np.float64)
    np.cumsum(r.data, dtype=np.float64, out=cs[1:])
    return cs[r.offsets[1:]] - cs[r.offsets[:-1]]


class UnsoundTrainData(PermanentError, ValueError):
    """A value of a training column no update may use (NaN, ±inf, a log-prob above 0): the trainer's last check,
    behind the rollout's. Names the field and the sample (its position in the step, and its ``index``)."""

    def __init__(self, field: str, sample: int, value: float, what: str, index: int | None = None):
        self.field, self.sample, self.value = field, sample, value
        who = f"sample {sample}" + (f" (index {index})" if index is not None and index >= 0 else "")
        super().__init__(f"{field} of {who} is {value}: {what}")


def _sample_of(r: Ragged, flat: int) -> int:
    """The sample whose values hold position ``flat`` of a ragged column's data."""
    return int(np.searchsorted(r.offsets[1:], flat, side="right"))


def check_train_columns(cols: dict[str, Any]) -> None:
    """Raise :class:`UnsoundTrainData` at the first bad value of the columns an update reads: ``raw_reward``
    (finite, as stored: float32, where 1e39 is inf), and ``rollout_log_probs``, ``ref_log_probs``, ``log_probs``
    where present (finite and at most ``LOGPROB_TOLERANCE``), every token, masked or not (a masked NaN still
    poisons a ratio). Checks only: no tensor is built."""
    idx = cols.get("index")

    def index(i: int) -> int | None:
        return int(idx[i]) if idx is not None and i < len(idx) else None

    raw = np.asarray(cols["raw_reward"])
    bad = np.flatnonzero(~np.isfinite(raw))
    if bad.size:
        i = int(bad[0])
        raise UnsoundTrainData("raw_reward", i, float(raw[i]), "not finite", index(i))
    for name in LOGPROB_COLUMNS:
        r = cols.get(name)
        if r is None:
            continue
        data = np.asarray(r.data)
        bad = np.flatnonzero(~np.isfinite(data) | (data > LOGPROB_TOLERANCE))
        if bad.size:
            t = int(bad[0])
            i = _sample_of(r, t)
            what = "not finite" if not np.isfinite(data[t]) else f"a log-prob above 0 (tolerance {LOGPROB_TOLERANCE})"
            raise UnsoundTrainData(name, i, float(data[t]), f"{what}, at response token {t - int(r.offsets[i])}",
                                   index(i))


def mini_batch_order(n: int, k: int, seed: int, step: int) -> list[np.ndarray]:
    """The sample indices of each of the ``k`` mini-batches of a step: the step's samples shuffled with
    (``seed``, ``step``), so a step redone after a requeue splits the same way, then cut into k parts (sizes
    differ by at most one). ``k == 1``: the samples in order, as one batch."""
    if k <= 1:
        return [np.arange(n)]
    order = np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(step)])).permutation(n)
    return np.array_split(order, k)


@dataclass
class TrainPlan:
    """The step's training data as this DP rank sees it: one :class:`~relax_hpc.train.batch.Share` per
    mini-batch (this rank's samples and the whole mini-batch's statistics) and the step's reward metrics."""

    shares: list
    metrics: dict[str, float]

    @property
    def samples(self) -> list[dict[str, Any]]:
        """Every sample this rank trains on, in order: π_old is computed for all of them before the first update."""
        return [s for sh in self.shares for s in sh.samples]


def train_plan(cols: dict[str, Any], algo_cfg: Any, group_size: int, *, k: int = 1, seed: int = 0,
               step: int = 0, dp: int = 1, dp_rank: int = 0) -> TrainPlan:
    """The actor's batch (:mod:`relax_hpc.train.batch`) from the columns of :func:`read_columns`: the
    step's samples split into ``k`` mini-batches (:func:`mini_batch_order`), each cut into ``dp`` shares.

    Statistics that span the step come from the columns (every rank has them: the chunk is verified whole):
    R̃ is the group-normalized ``raw_reward`` (:func:`~relax_hpc.algo.advantages.postprocess_rewards`,
    groups of ``group_size`` consecutive samples, or by ``group_index`` over rollouts when some rollout came back
    as several segments (``rollout_id`` repeats); ``rollout/rewards`` is its mean, and
    ``rollout/zero_std_group_ratio`` the share of groups whose raw rewards are all equal); the per-token advantages
    A are R̃ on the loss-mask tokens, 0 elsewhere, whitened over the whole step if
    ``algorithm.normalize_advantages``, built as one flat tensor over the ragged layout. Only this rank's
    samples become tensors: tokens, response_start, loss_mask, advantages and rollout_log_probs as views,
    plus ``ref_log_probs`` / ``old_log_probs`` from the ``ref_log_probs`` / ``log_probs`` columns.

    Raises :class:`UnsoundTrainData` where a value is not fit to train on: the columns (:func:`check_train_columns`,
    before any tensor), then R̃ and the advantages built from them (float32 overflow in a group's statistics)."""
    import torch

    from relax_hpc.algo.advantages import has_segments, masked_whiten, postprocess_rewards
    from relax_hpc.train.batch import GlobalStats, Share, dp_shard

    check_train_columns(cols)
    raw = torch.from_numpy(np.asarray(cols["raw_reward"], dtype=np.float32))
    rewards = postprocess_rewards(algo_cfg, raw, group_size, group_ids=cols.get("group_index"),
                                  rollout_ids=cols.get("rollout_id"))
    n = len(raw)
    lens = np.asarray(cols["response_length"], dtype=np.int64)
    mask: Ragged = cols["loss_mask"]
    bad = np.flatnonzero(mask.lengths() != lens)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sample {i}: loss_mask has {mask.lengths()[i]} values for a response of {lens[i]} tokens")
    flat_mask = torch.from_numpy(mask.data)
    zero = torch.zeros((), dtype=rewards.dtype)
    adv = torch.where(flat_mask.bool(), torch.repeat_interleave(rewards, torch.from_numpy(lens)), zero)
    if algo_cfg.normalize_advantages and n:
        adv = masked_whiten(adv, flat_mask.bool())
    _check_built(rewards, adv, mask, cols.get("index"))
    loss_tokens = _row_sums(mask)
    seq_lens = cols["tokens"].lengths()
    sides = [(name, key) for name, key in (("ref_log_probs", "ref_log_probs"), ("log_probs", "old_log_probs"))
             if name in cols]

    def sample(i: int) -> dict[str, Any]:
        r, o = int(lens[i]), int(mask.offsets[i])
        t = torch.from_numpy(cols["tokens"][i])
        item = {"tokens": t, "response_start": int(t.numel() - r), "loss_mask": flat_mask[o: o + r],
                "advantages": adv[o: o + r]}
        lp = cols["rollout_log_probs"][i]
        if lp.size == r:
            item["rollout_log_probs"] = torch.from_numpy(lp)
        for name, key in sides:
            if cols[name][i].size == r:
                item[key] = torch.from_numpy(cols[name][i])
        return item

    shares = []
    for part in mini_batch_order(n, k, seed, step):
        stats = GlobalStats(n=len(part), loss_tokens=float(loss_tokens[part].sum()),
                            max_seq_len=int(seq_lens[part].max()) if len(part) else 0)
        shares.append(Share([sample(int(i)) for i in dp_shard(part, dp, dp_rank)], stats))
    metrics = {"rollout/rewards": statistics.fmean(rewards.tolist())}
    raw64 = np.asarray(cols["raw_reward"], dtype=np.float64)
    if has_segments(cols.get("rollout_id")):  # per group, over its segments: all equal, all advantages 0
        flat = [raw64[np.asarray(cols["group_index"]) == g] for g in np.unique(cols["group_index"])]
        metrics["rollout/zero_std_group_ratio"] = float(np.mean([g.max() == g.min() for g in flat]))
    elif group_size >= 1 and n % group_size == 0:  # groups GRPO learns nothing from: all rewards equal
        groups = raw64.reshape(-1, group_size)
        metrics["rollout/zero_std_group_ratio"] = float(np.mean(groups.max(axis=1) == groups.min(axis=1)))
    return TrainPlan(shares, metrics)


def _check_built(rewards: Any, adv: Any, mask: Ragged, idx: Any) -> None:
    """R̃ (per sample) and the advantages (per token) finite, or :class:`UnsoundTrainData`."""
    import torch

    for field, values, per_token in (("rewards", rewards, False), ("advantages", adv, True)):
        bad = torch.nonzero(~torch.isfinite(values)).flatten()
        if bad.numel():
            t = int(bad[0])
            i = _sample_of(mask, t) if per_token else t
            index = int(idx[i]) if idx is not None else None
            raise UnsoundTrainData(field, i, float(values[t]), "not finite (built from raw_reward: R̃ = the "
                                   "group-normalized reward, A = R̃ on the response tokens)", index)


def train_batch(cols: dict[str, Any], algo_cfg: Any, group_size: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """:func:`train_plan` for one process holding the whole step as one batch: (samples, reward metrics)."""
    plan = train_plan(cols, algo_cfg, group_size)
    return plan.samples, plan.metrics


def read_train_columns(refs: Sequence[dict | ChunkRef], *, agree: bool = True) -> dict[str, Any]:
    """:func:`read_columns` of the train fields, and of the segment fields and the forward roles' side fields
    every chunk has."""
    chunks = [as_ref(r) for r in refs]
    extra = [f for f in (*SEGMENT_FIELDS, *FORWARD_FIELDS) if all(f in c.all_fields for c in chunks)]
    return read_columns(chunks, (*TRAIN_FIELDS, *extra), agree=agree)


def read_train_batch(refs: Sequence[dict | ChunkRef], algo_cfg: Any, group_size: int, *,
                     agree: bool = True) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """:func:`read_train_columns`, then :func:`train_batch`."""
    return train_batch(read_train_columns(refs, agree=agree), algo_cfg, group_size)
