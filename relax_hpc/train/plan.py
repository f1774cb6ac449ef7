"""The trainer's data plan: one step's columns (:mod:`relax_hpc.train.samples`) → the actor's batch.

Rewards travel raw (``raw_reward`` = R): group normalization and advantages (R → R̃ → A,
:mod:`relax_hpc.algo.advantages`) run here, on the training side, so a reward field can come from a role
that runs after the rollout. The plan checks every value an update reads (:func:`check_train_columns`), splits
the step into mini-batches (:func:`mini_batch_order`) and DP shares, and builds a
:class:`~relax_hpc.train.batch.TrainingSample` for each of this rank's samples only (views into the verified
chunk bytes, no copies): the type :mod:`relax_hpc.train.batch` takes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from relax_hpc.errors import PermanentError
from relax_hpc.exchange.chunk import ChunkRef, Ragged
from relax_hpc.exchange.fields import (FORWARD_FIELDS, LOGPROB_COLUMNS, LOGPROB_TOLERANCE, OPTIONAL_ROLLOUT_FIELDS,
                                       SAMPLE_FIELDS, SEGMENT_FIELDS, TRAIN_FIELDS, routed_experts_problem)
from relax_hpc.train.samples import as_ref, read_columns

if TYPE_CHECKING:
    from relax_hpc.train.batch import TrainingSample

__all__ = ["logprob_batch", "mini_batch_order", "TrainPlan", "train_plan", "train_batch", "read_train_columns",
           "read_train_batch", "UnsoundTrainData", "check_train_columns"]


def logprob_batch(cols: dict[str, Any]) -> list[TrainingSample]:
    """What a forward pass needs of each sample, from the ``tokens`` and ``response_length`` columns:
    ``tokens`` (a view) and ``response_start`` (the response is the last ``response_length`` tokens)."""
    import torch

    from relax_hpc.train.batch import TrainingSample

    out = []
    for i, (tok, r) in enumerate(zip(cols["tokens"], cols["response_length"])):
        t = torch.from_numpy(tok)
        out.append(_fill(cols, i, TrainingSample(tokens=t, response_start=int(t.numel() - int(r))), int(r)))
    return out


def _fill(cols: dict[str, Any], i: int, s: TrainingSample, r: int) -> TrainingSample:
    """``s`` with sample ``i``'s values of the columns the field table carries on a TrainingSample
    (:data:`~relax_hpc.exchange.fields.SAMPLE_FIELDS`: log-probs, routed experts, a VLM's images and videos, an omni
    model's audio), views, where the columns are there and ``s`` has none yet; a per-response-token one only where
    it has a value for each of the ``r`` response tokens (an engine that returned no log-probs: none)."""
    import torch

    for f in SAMPLE_FIELDS:
        if f.name in cols and getattr(s, f.sample) is None:
            v = cols[f.name][i]
            if f.per != "response" or v.size == r:
                setattr(s, f.sample, torch.from_numpy(v))
    return s


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
    (finite, as stored: float32, where 1e39 is inf), and ``rollout_log_probs``, ``ref_log_probs``, ``log_probs``,
    ``teacher_log_probs`` (OPD) where present (finite and at most ``LOGPROB_TOLERANCE``), every token, masked or
    not (a masked NaN still poisons a ratio); a VLM's images; routing replay's ``routed_experts``
    (:func:`_check_routed`). Checks only: no tensor is built."""
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
    teacher = cols.get("teacher_log_probs")  # OPD: one per response token, or the step would train without some
    if teacher is not None:
        lens = np.asarray(cols["response_length"], dtype=np.int64)
        bad = np.flatnonzero(teacher.lengths() != lens)
        if bad.size:
            i = int(bad[0])
            raise UnsoundTrainData("teacher_log_probs", i, float(teacher.lengths()[i]),
                                   f"that many values for a response of {int(lens[i])} tokens", index(i))
    for pix_name, grid_name in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        pixels, grids = cols.get(pix_name), cols.get(grid_name)  # a VLM's images, and its videos
        if pixels is not None and pixels.data.size:
            bad = np.flatnonzero(~np.isfinite(pixels.data))
            if bad.size:
                t = int(bad[0])
                raise UnsoundTrainData(pix_name, _sample_of(pixels, t), float(pixels.data[t]), "not finite",
                                       index(_sample_of(pixels, t)))
        if grids is not None:
            bad = np.flatnonzero(grids.lengths() % 3 != 0)
            if bad.size:
                i = int(bad[0])
                raise UnsoundTrainData(grid_name, i, float(grids.lengths()[i]),
                                       "that many values: 3 per image or video (t, h, w)", index(i))
    feats = cols.get("input_features")  # an omni model's audio
    if feats is not None and feats.data.size:
        bad = np.flatnonzero(~np.isfinite(feats.data))
        if bad.size:
            t = int(bad[0])
            raise UnsoundTrainData("input_features", _sample_of(feats, t), float(feats.data[t]), "not finite",
                                   index(_sample_of(feats, t)))
    routed = cols.get("routed_experts")  # routing replay: a row of layers × top_k expert ids a token but the last
    if routed is not None:
        _check_routed(routed, cols["tokens"].lengths() - 1, index)


def _check_routed(routed: Ragged, rows: np.ndarray, index: Callable[[int], int | None]) -> None:
    """Each sample's ``routed_experts`` as the schema wants them (:func:`routed_experts_problem`, -1 rows allowed:
    tokens no engine ran), and one width for the step (one model). The model's own bounds (experts, top-k, layers)
    are checked where the trainer knows them: :func:`relax_hpc.train.routing.replay`."""
    width = None
    for i in range(len(rows)):
        ids, n = routed[i], int(rows[i])
        problem = routed_experts_problem(ids, n, unrouted=True)
        if problem is not None:
            raise UnsoundTrainData("routed_experts", i, float(ids.size),
                                   f"that many expert ids for {n} tokens, refused: {problem}", index(i))
        if width is not None and ids.size != n * width:
            raise UnsoundTrainData("routed_experts", i, float(ids.size // n), f"expert ids a token, where sample 0 "
                                   f"has {width}: one model routes every sample (layers × top_k)", index(i))
        width = ids.size // n


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
    def samples(self) -> list[TrainingSample]:
        """Every sample this rank trains on, in order: π_old is computed for all of them before the first update."""
        return [s for sh in self.shares for s in sh.samples]


def train_plan(cols: dict[str, Any], algo_cfg: Any, group_size: int, *, k: int = 1, seed: int = 0,
               step: int = 0, dp: int = 1, dp_rank: int = 0, opd: Any = None, balance: bool = False) -> TrainPlan:
    """The actor's batch (:mod:`relax_hpc.train.batch`) from the columns of :func:`read_columns`: the
    step's samples split into ``k`` mini-batches (:func:`mini_batch_order`), each cut into ``dp`` shares.

    Statistics that span the step come from the columns (every rank has them: the chunk is verified whole):
    R̃ is the group-normalized ``raw_reward`` (:func:`~relax_hpc.algo.advantages.postprocess_rewards`,
    groups of ``group_size`` consecutive samples, or by ``group_index`` over rollouts when some rollout came back
    as several segments (``rollout_id`` repeats); ``rollout/rewards`` is its mean, and
    ``rollout/zero_std_group_ratio`` the share of groups whose raw rewards are all equal); the per-token advantages
    A are R̃ on the loss-mask tokens, 0 elsewhere, whitened over the whole step if
    ``algorithm.normalize_advantages``, built as one flat tensor over the ragged layout; with ``opd`` (on-policy
    distillation) the teacher's penalty −kl_coef·D_t goes in before the whitening, D from the ``rollout_log_probs``
    and ``teacher_log_probs`` columns (:func:`~relax_hpc.algo.advantages.finish_advantages`). Only this rank's
    samples become tensors: tokens, response_start, loss_mask, advantages and rollout_log_probs as views,
    plus ``ref_log_probs`` / ``old_log_probs`` / ``teacher_log_probs`` from the ``ref_log_probs`` / ``log_probs`` /
    ``teacher_log_probs`` columns. ``balance`` (``train.balance_data``): each mini-batch is dealt to the ranks
    by :func:`~relax_hpc.train.batch.balanced_shares` (even token counts, the same share sizes) instead of in
    contiguous runs; the loss weights come from the mini-batch's statistics, so the update is the same sum either
    way. ``perf/dp_token_imbalance`` (the deal used) and ``perf/dp_token_imbalance_contiguous`` (the contiguous
    one) are the largest :func:`~relax_hpc.train.batch.token_imbalance` over the step's mini-batches.

    Raises :class:`UnsoundTrainData` where a value is not fit to train on: the columns (:func:`check_train_columns`,
    before any tensor), then R̃ and the advantages built from them (float32 overflow in a group's statistics)."""
    from relax_hpc.train.batch import GlobalStats, Share, balanced_shares, dp_shard, token_imbalance

    check_train_columns(cols)
    rewards, adv, opd_metrics = _advantages(cols, algo_cfg, group_size, opd)
    mask: Ragged = cols["loss_mask"]
    loss_tokens = _row_sums(mask)
    seq_lens = cols["tokens"].lengths()
    shares, used, contiguous = [], 1.0, 1.0
    for part in mini_batch_order(len(rewards), k, seed, step):
        stats = GlobalStats(n=len(part), loss_tokens=float(loss_tokens[part].sum()),
                            max_seq_len=int(seq_lens[part].max()) if len(part) else 0)
        lens = [int(seq_lens[i]) for i in part]
        plain = [dp_shard(range(len(part)), dp, r) for r in range(dp)]
        deal = balanced_shares(lens, dp) if balance else plain
        contiguous = max(contiguous, token_imbalance(lens, plain))
        used = max(used, token_imbalance(lens, deal))
        shares.append(Share([_sample(cols, adv, int(part[j])) for j in deal[dp_rank]], stats))
    balance_metrics = {"perf/dp_token_imbalance": used, "perf/dp_token_imbalance_contiguous": contiguous}
    return TrainPlan(shares, {**_reward_metrics(cols, rewards, group_size), **opd_metrics, **balance_metrics})


def _advantages(cols: dict[str, Any], algo_cfg: Any, group_size: int, opd: Any = None) -> tuple[Any, Any, dict]:
    """(R̃ per sample, A per token as one flat tensor over the ragged layout, OPD's metrics): :func:`train_plan`'s
    statistics."""
    import torch

    from relax_hpc.algo.advantages import finish_advantages, postprocess_rewards

    raw = torch.from_numpy(np.asarray(cols["raw_reward"], dtype=np.float32))
    rewards = postprocess_rewards(algo_cfg, raw, group_size, group_ids=cols.get("group_index"),
                                  rollout_ids=cols.get("rollout_id"))
    lens = np.asarray(cols["response_length"], dtype=np.int64)
    mask: Ragged = cols["loss_mask"]
    bad = np.flatnonzero(mask.lengths() != lens)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sample {i}: loss_mask has {mask.lengths()[i]} values for a response of {lens[i]} tokens")
    flat_mask = torch.from_numpy(mask.data)
    zero = torch.zeros((), dtype=rewards.dtype)
    adv = torch.where(flat_mask.bool(), torch.repeat_interleave(rewards, torch.from_numpy(lens)), zero)
    metrics: dict[str, float] = {}
    if len(raw):
        student = teacher = None
        if opd is not None and opd.enabled:  # D_t = f(the engine's log-prob, the teacher's), token by token
            student, teacher = (_flat_beside(cols, name, mask, lens) for name in ("rollout_log_probs", "teacher_log_probs"))
        adv, metrics = finish_advantages(algo_cfg, adv, flat_mask.bool(), opd=opd, student_log_probs=student,
                                         teacher_log_probs=teacher)
    _check_built(rewards, adv, mask, cols.get("index"))
    return rewards, adv, metrics


def _flat_beside(cols: dict[str, Any], name: str, mask: Ragged, lens: Any) -> Any:
    """Column ``name`` as one flat tensor laid out as ``loss_mask`` (a value per response token of every sample)."""
    import torch

    col = cols.get(name)
    if col is None or not np.array_equal(col.lengths(), lens):
        have = "missing" if col is None else f"{int(np.sum(col.lengths() != lens))} samples with another length"
        raise ValueError(f"on-policy distillation needs {name} for every response token ({have}). Fix: the engine "
                         "must return log-probs (rollout) and the teacher must score every sample (opd)")
    return torch.from_numpy(col.data)


def _sample(cols: dict[str, Any], adv: Any, i: int) -> TrainingSample:
    """Sample ``i`` of the columns as tensors, views of the columns (and of ``adv``): no copies."""
    import torch

    from relax_hpc.train.batch import TrainingSample

    mask: Ragged = cols["loss_mask"]
    r, o = int(cols["response_length"][i]), int(mask.offsets[i])
    t = torch.from_numpy(cols["tokens"][i])
    s = TrainingSample(tokens=t, response_start=int(t.numel() - r), loss_mask=torch.from_numpy(mask.data[o: o + r]),
                       advantages=adv[o: o + r])
    return _fill(cols, i, s, r)  # the rest as the field table says (routed experts: check_train_columns checked them)


def _reward_metrics(cols: dict[str, Any], rewards: Any, group_size: int) -> dict[str, float]:
    """``rollout/rewards`` (the mean R̃) and ``rollout/zero_std_group_ratio`` (groups whose raw rewards are all equal:
    GRPO learns nothing from them)."""
    from relax_hpc.algo.advantages import has_segments

    metrics = {"rollout/rewards": statistics.fmean(rewards.tolist())}
    raw64 = np.asarray(cols["raw_reward"], dtype=np.float64)
    n = len(raw64)
    if has_segments(cols.get("rollout_id")):  # per group, over its segments: all equal, all advantages 0
        flat = [raw64[np.asarray(cols["group_index"]) == g] for g in np.unique(cols["group_index"])]
        metrics["rollout/zero_std_group_ratio"] = float(np.mean([g.max() == g.min() for g in flat]))
    elif group_size >= 1 and n % group_size == 0:  # groups GRPO learns nothing from: all rewards equal
        groups = raw64.reshape(-1, group_size)
        metrics["rollout/zero_std_group_ratio"] = float(np.mean(groups.max(axis=1) == groups.min(axis=1)))
    return metrics


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


def train_batch(cols: dict[str, Any], algo_cfg: Any, group_size: int) -> tuple[list[TrainingSample], dict[str, float]]:
    """:func:`train_plan` for one process holding the whole step as one batch: (samples, reward metrics)."""
    plan = train_plan(cols, algo_cfg, group_size)
    return plan.samples, plan.metrics


def read_train_columns(refs: Sequence[dict | ChunkRef], *, agree: bool = True) -> dict[str, Any]:
    """:func:`read_columns` of the train fields, and of the segment fields, the optional rollout fields (OPD's
    ``teacher_log_probs``) and the forward roles' side fields every chunk has."""
    chunks = [as_ref(r) for r in refs]
    extra = [f for f in (*SEGMENT_FIELDS, *OPTIONAL_ROLLOUT_FIELDS, *FORWARD_FIELDS)
             if all(f in c.all_fields for c in chunks)]
    return read_columns(chunks, (*TRAIN_FIELDS, *extra), agree=agree)


def read_train_batch(refs: Sequence[dict | ChunkRef], algo_cfg: Any, group_size: int, *,
                     agree: bool = True) -> tuple[list[TrainingSample], dict[str, float]]:
    """:func:`read_train_columns`, then :func:`train_batch`."""
    return train_batch(read_train_columns(refs, agree=agree), algo_cfg, group_size)
