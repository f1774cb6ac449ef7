"""The policy loss the actor backpropagates, with Relax's formulas and metric names.

Notation (``reference/relax-inventory.md`` §4): δ = log π_old − log π_θ per token (Relax calls it
``ppo_kl``), r = exp(−δ) = π_θ/π_old, A the advantage. Per-token losses, before reduction:

- grpo (PPO-clip): L = max(−r·A, −clip(r, 1−ε_lo, 1+ε_hi)·A); ``pg_clipfrac`` = 1 where the clipped term
  wins. Dual clip (``eps_clip_c`` = c > 1): for A < 0, L = min(−c·A, L), bounding the loss of a token whose
  ratio exploded.
- gspo: the same clipped form, but δ is the sequence's masked mean δ_i^seq broadcast to its tokens, so
  the ratio (and its gradient, through the mean) is per sequence.
- sapo: a soft gate instead of a clip: L = −(4/τ)·σ(τ(r−1))·A with τ = sapo_tau_pos if A > 0 else
  sapo_tau_neg; "clipfrac" = 1 where the gate's gradient weight 4σ(1−σ) < 0.9.
- cispo: L = −sg(c)·sg(A)·log π_θ with c = min(r, 1+ε_hi) for A ≥ 0, max(r, 1−ε_lo) for A < 0: the
  ratio is clipped but every token keeps a gradient.

Then, in this order: OPSM (``use_opsm``) zeroes A < 0 tokens of sequences with δ^seq > opsm_delta;
TIS (``use_tis``) multiplies by the truncated π_old/π_roll (:mod:`relax_hpc.algo.tis`); the result is
reduced (:mod:`relax_hpc.algo.reductions`: mean over samples of each sample's token-mean, or a token mean
with ``calculate_per_token_loss``). loss = pg_loss − entropy_coef·H̄ [+ kl_loss_coef·KL̄(π_θ ‖ π_ref)].

The reduction is over the samples of *this call*: to reproduce Relax's global-batch mean when a global
batch is split into micro-batches, the trainer weights each call's loss by B_micro / B_global (or by the
token share with ``calculate_per_token_loss``). Metrics use the same reduction.
"""

from __future__ import annotations

import torch

from relax_hpc.algo.config import AlgorithmConfig, clip_high
from relax_hpc.algo.kl import approx_kl
from relax_hpc.algo.reductions import reduce
from relax_hpc.algo.tis import load_tis_function


def ppo_clip_loss(
    ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss and clip indicator (grpo and gspo), with optional dual clip."""
    ratio = torch.exp(-ppo_kl)
    loss1 = -ratio * advantages
    loss2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    loss = torch.maximum(loss1, loss2)
    clipfrac = (loss2 > loss1).to(ratio.dtype)
    if eps_clip_c is not None:
        if eps_clip_c <= 1:
            raise ValueError(f"eps_clip_c must be > 1 for dual-clip PPO, got {eps_clip_c}")
        loss = torch.where(advantages < 0, torch.minimum(-eps_clip_c * advantages, loss), loss)
    return loss, clipfrac


def sapo_loss(
    ppo_kl: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token SAPO loss −(4/τ)σ(τ(r−1))A and its off-policy indicator 1[4σ(1−σ) < 0.9]."""
    ratio = torch.exp(-ppo_kl)
    tau = torch.where(advantages > 0, torch.full_like(advantages, tau_pos), torch.full_like(advantages, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * advantages
    clipfrac = (4.0 * gate * (1.0 - gate) < 0.9).to(ratio.dtype)
    return loss, clipfrac


def cispo_loss(
    log_probs: torch.Tensor, ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CISPO loss −sg(c)·sg(A)·log π_θ and the indicator of a ratio outside its bound."""
    ratio = torch.exp(-ppo_kl).detach()
    upper, lower = 1.0 + eps_clip_high, 1.0 - eps_clip
    pos = advantages >= 0
    coef = torch.where(pos, ratio.clamp(max=upper), ratio.clamp(min=lower))
    loss = -(coef * advantages.detach() * log_probs)
    clipfrac = ((pos & (ratio > upper)) | (~pos & (ratio < lower))).to(ratio.dtype)
    return loss, clipfrac


def sequence_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: δ_i^seq = Σ_t m(log π_old − log π_θ) / max(Σ_t m, 1) (GSPO's ratio exponent, OPSM's test)."""
    m = loss_mask.to(log_probs.dtype)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    diff = torch.where(loss_mask != 0, (old_log_probs - log_probs) * m, zero)
    return (diff.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)).unsqueeze(-1)


def policy_loss(
    cfg: AlgorithmConfig,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    ref_log_probs: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss to backprop and detached scalar metrics, for one batch of ``[B, T]`` tensors.

    ``log_probs`` (π_θ, with grad) and ``entropy`` (with grad, needed when entropy_coef ≠ 0) come from
    this forward; ``old_log_probs`` (π_old), ``ref_log_probs`` (π_ref, needed with use_kl_loss),
    ``rollout_log_probs`` (π_roll, needed with use_tis / get_mismatch_metrics / use_rollout_logprobs)
    and ``advantages`` (per token) are data and are not differentiated. With ``use_rollout_logprobs``
    π_old is ``rollout_log_probs`` and ``old_log_probs`` may be None. Values at masked positions are
    ignored, whatever they are.

    Metrics (Relax's names): loss, pg_loss, pg_clipfrac, ppo_kl; entropy_loss when entropy is given;
    kl_loss with use_kl_loss; tis, tis_clipfrac, tis_abs, ois with use_tis or get_mismatch_metrics;
    opsm_clipfrac with use_opsm; train_rollout_logprob_abs_diff, train_rollout_prob_abs_diff whenever
    rollout_log_probs is given.
    """
    valid = loss_mask != 0
    shape = log_probs.shape
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=log_probs.device)

    def take(name: str, t: torch.Tensor | None, *, data: bool = True) -> torch.Tensor | None:
        if t is None:
            return None
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like log_probs")
        t = t.to(dtype)
        return torch.where(valid, t.detach() if data else t, zero)

    if loss_mask.shape != shape or log_probs.dim() != 2:
        raise ValueError(
            f"log_probs and loss_mask must both be [B, T], got {tuple(shape)} and {tuple(loss_mask.shape)}"
        )
    lp = take("log_probs", log_probs, data=False)
    adv = take("advantages", advantages)
    rollout = take("rollout_log_probs", rollout_log_probs)
    ref = take("ref_log_probs", ref_log_probs)
    ent = take("entropy", entropy, data=False)
    given_old = take("old_log_probs", old_log_probs)
    if cfg.use_rollout_logprobs:
        if rollout is None:
            raise ValueError("use_rollout_logprobs needs rollout_log_probs")
        old = rollout
    else:
        if given_old is None:
            raise ValueError("old_log_probs is None (only allowed with use_rollout_logprobs)")
        old = given_old
    mask = valid.to(dtype)
    per_token = cfg.calculate_per_token_loss

    # δ: per token, or the sequence mean for GSPO (gradient flows through the mean).
    if cfg.advantage_estimator == "gspo":
        ppo_kl = sequence_log_ratio(lp, old, valid).expand(shape)
    else:
        ppo_kl = old - lp

    est = cfg.advantage_estimator
    if est in ("grpo", "gspo"):
        pg, clipfrac = ppo_clip_loss(ppo_kl, adv, cfg.eps_clip, clip_high(cfg), cfg.eps_clip_c)
    elif est == "sapo":
        pg, clipfrac = sapo_loss(ppo_kl, adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    elif est == "cispo":
        pg, clipfrac = cispo_loss(lp, ppo_kl, adv, cfg.eps_clip, clip_high(cfg))
    else:
        raise ValueError(f"unknown advantage_estimator {est!r}")

    metrics: dict[str, torch.Tensor] = {}
    if cfg.use_opsm:
        dropped = ((adv < 0) & (sequence_log_ratio(lp, old, valid).detach() > cfg.opsm_delta)).to(dtype)
        pg = pg * (1 - dropped)
        metrics["opsm_clipfrac"] = reduce(dropped, mask, per_token)

    # Training side of the train/rollout mismatch: π_old, or with rollout log-probs as π_old the
    # recompute if one was given, else this forward.
    train_side = old if not cfg.use_rollout_logprobs else (given_old if given_old is not None else lp.detach())
    reduce_mask = mask
    if cfg.use_tis or cfg.get_mismatch_metrics:
        if rollout is None:
            raise ValueError("use_tis / get_mismatch_metrics need rollout_log_probs")
        tis_fn = load_tis_function(cfg.custom_tis_function_path)
        weighted, tis_mask, tis_metrics = tis_fn(
            cfg, pg_loss=pg, train_log_probs=train_side, rollout_log_probs=rollout, loss_mask=mask
        )
        if cfg.use_tis:
            pg, reduce_mask = weighted, tis_mask.to(dtype)
        metrics["ois"] = reduce(torch.exp(-ppo_kl).detach(), mask, per_token)
        for key, value in tis_metrics.items():
            metrics[key] = reduce(value.detach().to(dtype), mask, per_token)

    pg_loss = reduce(pg, reduce_mask, per_token)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss
    metrics["pg_clipfrac"] = reduce(clipfrac, reduce_mask, per_token)
    metrics["ppo_kl"] = reduce(ppo_kl.detach(), reduce_mask, per_token)

    if ent is not None:
        entropy_loss = reduce(ent, reduce_mask, per_token)
        loss = loss - cfg.entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss
    elif cfg.entropy_coef != 0:
        raise ValueError("entropy_coef is non-zero but no entropy was given")

    if cfg.use_kl_loss:
        if ref is None:
            raise ValueError("use_kl_loss needs ref_log_probs (a reference role)")
        ratio = torch.exp(lp - old) if cfg.use_unbiased_kl else None
        kl_loss = reduce(approx_kl(lp, ref, cfg.kl_loss_type, importance_ratio=ratio), reduce_mask, per_token)
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss

    if rollout is not None:
        metrics["train_rollout_logprob_abs_diff"] = reduce((train_side - rollout).abs().detach(), mask, per_token)
        metrics["train_rollout_prob_abs_diff"] = reduce(
            (torch.exp(train_side) - torch.exp(rollout)).abs().detach(), mask, per_token
        )

    metrics["loss"] = loss
    return loss, {k: v.detach() for k, v in metrics.items()}
