"""From scalar rewards to per-token advantages, as Relax does for its GRPO family.

Two steps, as Relax has them (``post_process_rewards``, then the advantages step); Relax runs the first on
the rollout side, relax_hpc runs both on the training side (:func:`relax_hpc.train.plan.train_batch`), so
the exchange carries the raw reward R and a reward that a later role adds can take part:

- :func:`postprocess_rewards`: R → R̃. For every estimator here (grpo, gspo, sapo, cispo),
  unless ``disable_rewards_normalization``: subtract the mean of each group of ``n_samples_per_prompt``
  consecutive samples, then, unless ``disable_grpo_std_normalization`` (Dr.GRPO), divide by that group's
  unbiased std + 1e-6.
- :func:`broadcast_advantages`: A_{i,t} = R̃_i on every response token (0 where the loss
  mask is 0), then :func:`finish_advantages`: with on-policy distillation (``opd:``) the OPD penalty
  A_t ← A_t − opd.kl_coef·D_t (:func:`relax_hpc.algo.opd.apply_opd_penalty`; with ``opd.only_reward`` the
  task advantages are 0 first), then, if ``normalize_advantages``, whiten A over all valid tokens (of the
  data-parallel group when a process group is given). Relax's order: estimator, OPD, whitening.
- :func:`compute_advantages` does both, from raw rewards: the one-call form for tests and local runs.

All take rewards as a 1-D tensor of ``num_groups * n_samples_per_prompt`` samples, the samples of one
prompt consecutive, and a ``[B, T]`` loss mask (0/1 float or bool) with B = number of samples. The
returns equal the advantages for these estimators (Relax stores both; no critic here).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from relax_hpc.algo.config import ESTIMATORS, AlgorithmConfig, OPDConfig
from relax_hpc.algo.opd import apply_opd_penalty

REWARD_STD_EPS = 1e-6
WHITEN_EPS = 1e-8


def group_normalize(
    rewards: torch.Tensor, n_samples_per_prompt: int, *, std_normalization: bool = True, eps: float = REWARD_STD_EPS
) -> torch.Tensor:
    """R̃ = (R − mean_group R) [/ (std_group + eps)], groups of ``n_samples_per_prompt`` consecutive samples.

    std is torch's unbiased std of the mean-subtracted group. A group of one sample has no spread: its
    R̃ is 0 (Relax would produce NaN there, from the unbiased std of one value).
    """
    rewards = _as_float(rewards).reshape(-1)
    n = int(n_samples_per_prompt)
    if n < 1:
        raise ValueError(f"n_samples_per_prompt must be at least 1, got {n_samples_per_prompt}")
    if rewards.numel() % n != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of n_samples_per_prompt = {n}; "
            "group normalization needs whole groups (samples of one prompt next to each other)"
        )
    if rewards.numel() == 0:
        return rewards.clone()
    groups = rewards.reshape(-1, n)
    centered = groups - groups.mean(dim=-1, keepdim=True)
    if std_normalization:
        if n == 1:
            return torch.zeros_like(rewards)
        centered = centered / (centered.std(dim=-1, keepdim=True) + eps)
    return centered.reshape(-1)


def segment_group_normalize(rewards: torch.Tensor, group_ids: Sequence[int], rollout_ids: Sequence[int], *,
                            std_normalization: bool = True, eps: float = REWARD_STD_EPS) -> torch.Tensor:
    """R̃ when rollouts came back as segments (a custom generate function's list return): the statistics are the
    group's *rollouts'* (one value each: the mean of its segments' rewards), so a rollout cut into many segments
    weighs no more than one that was not. Each segment: (R − mean_group) [/ (std_group + eps)], the std unbiased
    over the group's rollouts as in :func:`group_normalize`, which this equals when every rollout is one segment."""
    r = _as_float(rewards).reshape(-1)
    groups = torch.as_tensor(np.asarray(group_ids, dtype=np.int64))
    rollouts = torch.as_tensor(np.asarray(rollout_ids, dtype=np.int64))
    if not (len(groups) == len(rollouts) == r.numel()):
        raise ValueError(f"{r.numel()} rewards, {len(groups)} group ids and {len(rollouts)} rollout ids: one each per sample")
    out = torch.zeros_like(r)
    for g in torch.unique(groups):
        idx = torch.nonzero(groups == g).flatten()
        ids, inv = torch.unique(rollouts[idx], return_inverse=True)
        sums = torch.zeros(len(ids), dtype=r.dtype).index_add_(0, inv, r[idx])
        counts = torch.zeros(len(ids), dtype=r.dtype).index_add_(0, inv, torch.ones_like(r[idx]))
        values = sums / counts
        centered = r[idx] - values.mean()
        if std_normalization:
            if len(ids) == 1:
                continue  # one rollout has no spread: 0, as group_normalize
            centered = centered / ((values - values.mean()).std() + eps)
        out[idx] = centered
    return out


def postprocess_rewards(cfg: AlgorithmConfig, raw_rewards: torch.Tensor, n_samples_per_prompt: int, *,
                        group_ids: Sequence[int] | None = None, rollout_ids: Sequence[int] | None = None) -> torch.Tensor:
    """R → R̃ under ``cfg`` (see the module docstring); a float copy when off. With ``group_ids`` and
    ``rollout_ids`` where some rollout has several segments: :func:`segment_group_normalize`."""
    raw = _as_float(raw_rewards).reshape(-1)
    if cfg.disable_rewards_normalization or cfg.advantage_estimator not in ESTIMATORS:
        return raw.clone()
    std = not cfg.disable_grpo_std_normalization
    if has_segments(rollout_ids) and group_ids is not None:
        return segment_group_normalize(raw, group_ids, rollout_ids, std_normalization=std)
    return group_normalize(raw, n_samples_per_prompt, std_normalization=std)


def has_segments(rollout_ids: Sequence[int] | None) -> bool:
    """Whether some rollout of the step came back as several samples (a rollout id seen twice)."""
    if rollout_ids is None:
        return False
    ids = np.asarray(rollout_ids)
    return len(np.unique(ids)) < len(ids)


def broadcast_advantages(
    cfg: AlgorithmConfig, rewards: torch.Tensor, loss_mask: torch.Tensor, *, process_group=None
) -> torch.Tensor:
    """A[B, T] from already post-processed per-sample rewards R̃[B]: R̃_i on each valid token, 0 elsewhere.

    With ``cfg.normalize_advantages`` the result is whitened over the valid tokens; ``process_group``
    (a torch.distributed group, used only when torch.distributed is initialized) makes the statistics
    those of the whole data-parallel group, as Relax does.
    """
    rewards = _as_float(rewards).reshape(-1)
    mask = loss_mask.to(device=rewards.device, dtype=torch.bool)
    if mask.dim() != 2 or mask.shape[0] != rewards.numel():
        raise ValueError(f"loss_mask must be [B, T] with B = {rewards.numel()} rewards, got {tuple(loss_mask.shape)}")
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    adv = torch.where(mask, rewards[:, None].expand(mask.shape), zero)
    return finish_advantages(cfg, adv, mask, process_group=process_group)[0]


def finish_advantages(
    cfg: AlgorithmConfig, advantages: torch.Tensor, loss_mask: torch.Tensor, *, opd: OPDConfig | None = None,
    student_log_probs: torch.Tensor | None = None, teacher_log_probs: torch.Tensor | None = None,
    student_topk: torch.Tensor | None = None, teacher_topk: torch.Tensor | None = None,
    topk_mask: torch.Tensor | None = None, process_group=None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(A, metrics) from the estimator's per-token advantages (R̃ on the loss tokens), in Relax's order: the OPD
    penalty when ``opd`` is on (:func:`relax_hpc.algo.opd.apply_opd_penalty`: ``student_log_probs`` the rollout
    engine's, ``teacher_log_probs`` the teacher's, same shape; its ``opd/*`` metrics), then whitening with
    ``normalize_advantages``. Any shape: ``[B, T]``, or one flat tensor over a ragged layout."""
    metrics: dict[str, float] = {}
    if opd is not None and opd.enabled:
        advantages, metrics = apply_opd_penalty(opd, advantages, loss_mask, student_log_probs, teacher_log_probs,
                                                student_topk=student_topk, teacher_topk=teacher_topk,
                                                topk_mask=topk_mask)
    if cfg.normalize_advantages:
        advantages = masked_whiten(advantages, loss_mask, process_group=process_group)
    return advantages, metrics


def compute_advantages(
    cfg: AlgorithmConfig, rewards: torch.Tensor, n_samples_per_prompt: int, loss_mask: torch.Tensor, *,
    process_group=None,
) -> torch.Tensor:
    """A[B, T] from RAW per-sample rewards R[B]: :func:`postprocess_rewards` then :func:`broadcast_advantages`.

    Do not pass rewards that were already normalized (R̃): use :func:`broadcast_advantages` for those.
    """
    return broadcast_advantages(
        cfg, postprocess_rewards(cfg, rewards, n_samples_per_prompt), loss_mask, process_group=process_group
    )


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, process_group=None, eps: float = WHITEN_EPS
) -> torch.Tensor:
    """(x − μ) / sqrt(σ² + eps) over the valid tokens; 0 at masked positions.

    μ and σ² are the masked mean and Bessel-corrected variance (N/(N−1) when N ≥ 2 valid tokens), summed
    over ``process_group`` when torch.distributed is initialized. No valid token anywhere is an error.
    """
    mask = mask.to(torch.bool)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    x = torch.where(mask, values, zero)
    m = mask.to(values.dtype)
    stats = torch.stack([x.sum(), (x * x).sum(), m.sum()])
    if process_group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(stats, group=process_group)
    total, total_sq, count = stats.unbind()
    if count.item() == 0:
        raise ValueError("cannot whiten advantages: the loss mask has no valid token")
    mean = total / count
    var = total_sq / count - mean * mean
    if count.item() >= 2:
        var = var * count / (count - 1)
    return torch.where(mask, (x - mean) * torch.rsqrt(var.clamp(min=0) + eps), zero)


def _as_float(t) -> torch.Tensor:
    t = torch.as_tensor(t)
    return t.to(torch.promote_types(t.dtype, torch.float32)) if t.is_floating_point() else t.to(torch.float32)
