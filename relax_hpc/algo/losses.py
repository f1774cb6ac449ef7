"""The policy loss the actor backpropagates, with Relax's formulas and metric names.

Notation (``reference/relax-inventory.md`` §4): δ = log π_old − log π_θ per token (Relax calls it
``ppo_kl``), r = exp(−δ) = π_θ/π_old, A the advantage. Per-token losses, before reduction, one entry of
:data:`LOSSES` each, picked by ``advantage_estimator``:

- grpo (PPO-clip): L = max(−r·A, −clip(r, 1−ε_lo, 1+ε_hi)·A); ``pg_clipfrac`` = 1 where the clipped term
  wins. Dual clip (``eps_clip_c`` = c > 1): for A < 0, L = min(−c·A, L), bounding the loss of a token whose
  ratio exploded.
- gspo: the same clipped form, but δ is the sequence's masked mean δ_i^seq broadcast to its tokens, so
  the ratio (and its gradient, through the mean) is per sequence.
- sapo: a soft gate instead of a clip: L = −(4/τ)·σ(τ(r−1))·A with τ = sapo_tau_pos if A > 0 else
  sapo_tau_neg; "clipfrac" = 1 where the gate's gradient weight 4σ(1−σ) < 0.9.
- cispo: L = −sg(c)·sg(A)·log π_θ with c = min(r, 1+ε_hi) for A ≥ 0, max(r, 1−ε_lo) for A < 0: the
  ratio is clipped but every token keeps a gradient.

``algorithm.custom_loss_path`` replaces that per-token loss with yours (a :data:`LossFn`, see
:func:`loss_function`); everything after it applies to it the same way.

Then, in this order: OPSM (``use_opsm``) zeroes A < 0 tokens of sequences with δ^seq > opsm_delta;
TIS multiplies by the truncated π_old/π_roll (:mod:`relax_hpc.algo.tis`; with ``use_tis``, or as in Relax
with ``get_mismatch_metrics`` and a ``custom_tis_function_path``: L ← L·w and the function's mask becomes
the reduction mask); the result is reduced (:mod:`relax_hpc.algo.reductions`: mean over samples of each
sample's token-mean, or a token mean with ``calculate_per_token_loss``).
loss = pg_loss − entropy_coef·H̄ [+ kl_loss_coef·KL̄(π_θ ‖ π_ref)] [+ opd.loss_coef·D̄], the last the loss form of
on-policy distillation (:func:`relax_hpc.algo.opd.opd_loss`: D_t between π_θ and the teacher, reduced like the
pg loss over the loss mask).

The reduction is over the samples of *this call*: to reproduce Relax's global-batch mean when a global
batch is split into micro-batches, the trainer weights each call's loss by B_micro / B_global (or by the
token share with ``calculate_per_token_loss``). Metrics use the same reduction.

Where relax_hpc departs from Relax on purpose:

- Per-token normalizer (``calculate_per_token_loss``): a sample whose tokens are all masked adds 0 tokens to
  the count here; Relax counts such a sample as 1 token. A batch without fully masked samples is the same.
- ``opsm_clipfrac`` counts only loss tokens (mask ≠ 0) that OPSM dropped, reduced like the loss; Relax's
  counts from its whole-sequence mask, padding included, so the two differ on partially masked samples.
  The loss itself is the same: a dropped token outside the mask contributes nothing either way.
- CISPO's clamp is Relax's formula above (one-sided, by the sign of A). slime and verl clamp the ratio
  differently, so CISPO runs ported from them do not reproduce exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from relax_hpc.algo.config import PLUGIN_CALLS, AlgorithmConfig, OPDConfig, clip_high
from relax_hpc.algo.kl import approx_kl
from relax_hpc.algo.opd import opd_loss
from relax_hpc.algo.reductions import reduce
from relax_hpc.algo.tis import load_tis_function, weights_the_loss
from relax_hpc.plugins import load_plugin


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


# --------------------------------------------------------------------------------------------------
# The loss table
# --------------------------------------------------------------------------------------------------


@dataclass
class LossInputs:
    """One batch as every policy loss sees it: ``[B, T]`` tensors of one float dtype (at least float32),
    zero wherever ``loss_mask`` is 0 (so padding never reaches a loss, whatever it held).

    ``log_probs`` (π_θ) and ``entropy`` carry this forward's gradient; the rest are data (detached).
    ``old_log_probs`` is π_old: the trainer's recompute, or the rollout engine's log-probs with
    ``use_rollout_logprobs``. ``ref_log_probs`` is there with a reference role, ``rollout_log_probs`` when the
    engine returned them, ``entropy`` when the trainer computed it, ``teacher_log_probs`` (the OPD teacher's log-probs
    of the sampled tokens) with on-policy distillation.
    """

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        """``[B, T]`` bool: the tokens the loss is over."""
        return self.loss_mask != 0


LossFn = Callable[[LossInputs, AlgorithmConfig], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``fn(batch, cfg) -> (loss, metrics)``: ``loss`` the per-token policy-gradient loss ``[B, T]`` (lower is
better; masked positions are ignored), ``metrics`` name → ``[B, T]`` per-token values (reduced like the loss)
or 0-dim scalars (reported as they are). ``ppo_kl``, if given, is the δ the loss used (per token, or GSPO's
sequence δ broadcast): it is reported and gives ``ois``; without it both use the per-token δ."""

LOSSES: dict[str, LossFn] = {}
"""Built-in policy losses by ``advantage_estimator`` name."""

_RESERVED = ("loss", "pg_loss", "entropy_loss", "kl_loss", "ois", "opsm_clipfrac", "train_rollout_logprob_abs_diff",
             "train_rollout_prob_abs_diff", "opd_loss", "opd_per_token_clip_frac", "opd_is_clip_frac")
"""Metric names :func:`policy_loss` reports itself, which a loss must not return."""


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: add a :data:`LossFn` to :data:`LOSSES` under ``name``; a name is registered once."""

    def add(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"a policy loss named {name!r} is already registered ({LOSSES[name].__qualname__})")
        LOSSES[name] = fn
        return fn

    return add


def token_log_ratio(batch: LossInputs) -> torch.Tensor:
    """Per-token δ = log π_old − log π_θ."""
    return batch.old_log_probs - batch.log_probs


@register_loss("grpo")
def grpo_loss(batch: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip on the per-token ratio (with dual clip when ``eps_clip_c`` is set)."""
    ppo_kl = token_log_ratio(batch)
    loss, clipfrac = ppo_clip_loss(ppo_kl, batch.advantages, cfg.eps_clip, clip_high(cfg), cfg.eps_clip_c)
    return loss, {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl}


@register_loss("gspo")
def gspo_loss(batch: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip on the sequence ratio exp(−δ^seq), broadcast to the sequence's tokens."""
    ppo_kl = sequence_log_ratio(batch.log_probs, batch.old_log_probs, batch.valid).expand(batch.log_probs.shape)
    loss, clipfrac = ppo_clip_loss(ppo_kl, batch.advantages, cfg.eps_clip, clip_high(cfg), cfg.eps_clip_c)
    return loss, {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl}


@register_loss("sapo")
def sapo_policy_loss(batch: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO's soft gate on the per-token ratio."""
    ppo_kl = token_log_ratio(batch)
    loss, clipfrac = sapo_loss(ppo_kl, batch.advantages, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    return loss, {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl}


@register_loss("cispo")
def cispo_policy_loss(batch: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: REINFORCE weighted by the clipped, detached per-token ratio."""
    ppo_kl = token_log_ratio(batch)
    loss, clipfrac = cispo_loss(batch.log_probs, ppo_kl, batch.advantages, cfg.eps_clip, clip_high(cfg))
    return loss, {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl}


CUSTOM_LOSS_KEY = "algorithm.custom_loss_path"
LOSS_PARAMS = PLUGIN_CALLS["custom_loss_path"][0]
"""How a loss is called: ``fn(batch, cfg)``, the :class:`LossInputs` and the :class:`AlgorithmConfig`."""


def loss_function(cfg: AlgorithmConfig) -> LossFn:
    """The per-token loss to train: the user's ``custom_loss_path`` if set, else :data:`LOSSES` by estimator.

    A custom loss is written like the built-ins above::

        def my_loss(batch: LossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
            ratio = torch.exp(batch.log_probs - batch.old_log_probs)
            return -ratio * batch.advantages, {}

    It replaces only the per-token policy-gradient term: OPSM, TIS, the reduction, the entropy bonus and the
    KL loss still apply as configured, and ``advantage_estimator`` still picks the advantages.
    """
    if cfg.custom_loss_path is not None:
        return load_plugin(cfg.custom_loss_path, CUSTOM_LOSS_KEY, params=LOSS_PARAMS)
    try:
        return LOSSES[cfg.advantage_estimator]
    except KeyError:
        raise ValueError(f"unknown advantage_estimator {cfg.advantage_estimator!r}; "
                         f"policy losses: {', '.join(LOSSES)}") from None


def run_loss(cfg: AlgorithmConfig, batch: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call the loss and check what it returned, naming the loss (the recipe key for a custom one)."""
    fn = loss_function(cfg)
    who = (f"{CUSTOM_LOSS_KEY} = {cfg.custom_loss_path!r}" if cfg.custom_loss_path is not None
           else f"loss {cfg.advantage_estimator!r}")
    out = fn(batch, cfg)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) and isinstance(out[1], dict)):
        raise TypeError(f"{who} returned {type(out).__name__}, not (loss, metrics). "
                        "Fix: return a [B, T] per-token loss tensor and a dict of metrics ({} for none)")
    loss, metrics = out
    shape = batch.log_probs.shape
    if loss.shape != shape:
        raise ValueError(f"{who} returned a loss of shape {tuple(loss.shape)}, expected {tuple(shape)} (one value "
                         "per token). Fix: return the per-token loss; relax_hpc masks and reduces it")
    for name, value in metrics.items():
        if name in _RESERVED:
            raise ValueError(f"{who} returned metric {name!r}, which policy_loss reports itself. Fix: rename it")
        scalar_ok = name != "ppo_kl"  # ppo_kl gives ois per token
        if not isinstance(value, torch.Tensor) or not (value.shape == shape or (scalar_ok and value.dim() == 0)):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{who} returned metric {name!r} of shape {got}, expected {tuple(shape)} or a "
                             "0-dim tensor. Fix: return per-token values or a scalar tensor")
    return loss.to(batch.log_probs.dtype), dict(metrics)


# --------------------------------------------------------------------------------------------------
# policy_loss: the trainer's entry point
# --------------------------------------------------------------------------------------------------


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
    opd: OPDConfig | None = None,
    teacher_log_probs: torch.Tensor | None = None,
    student_topk_log_probs: torch.Tensor | None = None,
    teacher_topk_log_probs: torch.Tensor | None = None,
    topk_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss to backprop and detached scalar metrics, for one batch of ``[B, T]`` tensors.

    ``log_probs`` (π_θ, with grad) and ``entropy`` (with grad, needed when entropy_coef ≠ 0) come from
    this forward; ``old_log_probs`` (π_old), ``ref_log_probs`` (π_ref, needed with use_kl_loss),
    ``rollout_log_probs`` (π_roll, needed with use_tis / get_mismatch_metrics / use_rollout_logprobs)
    and ``advantages`` (per token) are data and are not differentiated. With ``use_rollout_logprobs``
    π_old is ``rollout_log_probs`` and ``old_log_probs`` may be None. Values at masked positions are
    ignored, whatever they are. ``opd`` (the recipe's ``opd:`` section) with a non-zero ``loss_coef`` adds the OPD
    loss: ``teacher_log_probs`` ``[B, T]`` (data), or with a top-k ``token_selection`` ``student_topk_log_probs``
    (this forward's, with grad) and ``teacher_topk_log_probs`` ``[B, T, K]`` and ``topk_mask``.

    Metrics (Relax's names): loss, pg_loss, pg_clipfrac, ppo_kl; entropy_loss when entropy is given;
    kl_loss with use_kl_loss; tis, tis_clipfrac, tis_abs, ois with use_tis or get_mismatch_metrics;
    opsm_clipfrac with use_opsm; train_rollout_logprob_abs_diff, train_rollout_prob_abs_diff whenever
    rollout_log_probs is given; opd_loss (+ opd_per_token_clip_frac, opd_is_clip_frac) with the OPD loss form;
    a custom loss's own metrics.
    """
    batch, train_side = _inputs(cfg, log_probs, old_log_probs, advantages, loss_mask,
                                ref_log_probs=ref_log_probs, rollout_log_probs=rollout_log_probs, entropy=entropy,
                                teacher_log_probs=teacher_log_probs)
    per_token = cfg.calculate_per_token_loss
    pg, loss_metrics = run_loss(cfg, batch)
    ppo_kl = loss_metrics.pop("ppo_kl", None)
    if ppo_kl is None:
        ppo_kl = token_log_ratio(batch)

    metrics: dict[str, torch.Tensor] = {}
    pg = _opsm(cfg, batch, pg, metrics)
    pg, reduce_mask = _tis(cfg, batch, pg, train_side, ppo_kl, metrics)

    pg_loss = reduce(pg, reduce_mask, per_token)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss
    for name, value in loss_metrics.items():
        value = value.detach().to(reduce_mask.dtype)
        metrics[name] = value if value.dim() == 0 else reduce(value, reduce_mask, per_token)
    metrics["ppo_kl"] = reduce(ppo_kl.detach(), reduce_mask, per_token)

    loss = _entropy_term(cfg, batch, loss, reduce_mask, metrics)
    loss = _kl_term(cfg, batch, loss, reduce_mask, metrics)
    loss = _opd_term(cfg, opd, batch, loss, metrics, student_topk_log_probs, teacher_topk_log_probs, topk_mask)
    _mismatch_diffs(cfg, batch, train_side, metrics)
    metrics["loss"] = loss
    return loss, {k: v.detach() for k, v in metrics.items()}


def _inputs(cfg: AlgorithmConfig, log_probs: torch.Tensor, old_log_probs: torch.Tensor | None,
            advantages: torch.Tensor, loss_mask: torch.Tensor, *, ref_log_probs: torch.Tensor | None,
            rollout_log_probs: torch.Tensor | None, entropy: torch.Tensor | None,
            teacher_log_probs: torch.Tensor | None = None) -> tuple[LossInputs, torch.Tensor]:
    """The :class:`LossInputs` (shapes checked, one dtype, masked positions zeroed, data detached) and the
    training side of the train/rollout mismatch: π_old, or with rollout log-probs as π_old the recompute if
    one was given, else this forward."""
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
    batch = LossInputs(lp, old, adv, valid.to(dtype), ref_log_probs=ref, rollout_log_probs=rollout, entropy=ent,
                       teacher_log_probs=take("teacher_log_probs", teacher_log_probs))
    train_side = old if not cfg.use_rollout_logprobs else (given_old if given_old is not None else lp.detach())
    return batch, train_side


def _opsm(cfg: AlgorithmConfig, batch: LossInputs, pg: torch.Tensor, metrics: dict) -> torch.Tensor:
    """OPSM: zero the A < 0 tokens of sequences that drifted more than opsm_delta from π_old."""
    if not cfg.use_opsm:
        return pg
    drift = sequence_log_ratio(batch.log_probs, batch.old_log_probs, batch.valid).detach()
    dropped = ((batch.advantages < 0) & (drift > cfg.opsm_delta)).to(pg.dtype)
    metrics["opsm_clipfrac"] = reduce(dropped, batch.loss_mask, cfg.calculate_per_token_loss)
    return pg * (1 - dropped)


def _tis(cfg: AlgorithmConfig, batch: LossInputs, pg: torch.Tensor, train_side: torch.Tensor,
         ppo_kl: torch.Tensor, metrics: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The TIS function's weighted loss and reduction mask (when :func:`~relax_hpc.algo.tis.weights_the_loss`),
    and its metrics with ``ois`` reduced over the original mask, so dropped tokens still count in them."""
    mask = batch.loss_mask
    if not (cfg.use_tis or cfg.get_mismatch_metrics):
        return pg, mask
    if batch.rollout_log_probs is None:
        raise ValueError("use_tis / get_mismatch_metrics need rollout_log_probs")
    per_token = cfg.calculate_per_token_loss
    tis_fn = load_tis_function(cfg.custom_tis_function_path)
    weighted, tis_mask, tis_metrics = tis_fn(
        cfg, pg_loss=pg, train_log_probs=train_side, rollout_log_probs=batch.rollout_log_probs, loss_mask=mask
    )
    reduce_mask = mask
    if weights_the_loss(cfg):
        pg, reduce_mask = weighted, tis_mask.to(mask.dtype)
    metrics["ois"] = reduce(torch.exp(-ppo_kl).detach(), mask, per_token)
    for key, value in tis_metrics.items():
        metrics[key] = reduce(value.detach().to(mask.dtype), mask, per_token)
    return pg, reduce_mask


def _entropy_term(cfg: AlgorithmConfig, batch: LossInputs, loss: torch.Tensor, reduce_mask: torch.Tensor,
                  metrics: dict) -> torch.Tensor:
    """loss − entropy_coef·H̄ (H̄ logged as entropy_loss whenever entropy is given)."""
    if batch.entropy is None:
        if cfg.entropy_coef != 0:
            raise ValueError("entropy_coef is non-zero but no entropy was given")
        return loss
    entropy_loss = reduce(batch.entropy, reduce_mask, cfg.calculate_per_token_loss)
    metrics["entropy_loss"] = entropy_loss
    return loss - cfg.entropy_coef * entropy_loss


def _kl_term(cfg: AlgorithmConfig, batch: LossInputs, loss: torch.Tensor, reduce_mask: torch.Tensor,
             metrics: dict) -> torch.Tensor:
    """loss + kl_loss_coef·KL̄(π_θ ‖ π_ref) with use_kl_loss (each term × π_θ/π_old with use_unbiased_kl)."""
    if not cfg.use_kl_loss:
        return loss
    if batch.ref_log_probs is None:
        raise ValueError("use_kl_loss needs ref_log_probs (a reference role)")
    lp = batch.log_probs
    ratio = torch.exp(lp - batch.old_log_probs) if cfg.use_unbiased_kl else None
    kl = approx_kl(lp, batch.ref_log_probs, cfg.kl_loss_type, importance_ratio=ratio)
    kl_loss = reduce(kl, reduce_mask, cfg.calculate_per_token_loss)
    metrics["kl_loss"] = kl_loss
    return loss + cfg.kl_loss_coef * kl_loss


def _opd_term(cfg: AlgorithmConfig, opd: OPDConfig | None, batch: LossInputs, loss: torch.Tensor, metrics: dict,
              student_topk: torch.Tensor | None, teacher_topk: torch.Tensor | None,
              topk_mask: torch.Tensor | None) -> torch.Tensor:
    """loss + opd.loss_coef·D̄ (on-policy distillation's loss form), D̄ reduced over the loss mask like the pg loss."""
    if opd is None or not opd.enabled or opd.loss_coef == 0:
        return loss
    if opd.token_selection == "student_sampled" and batch.teacher_log_probs is None:
        raise ValueError("opd.loss_coef is non-zero but no teacher_log_probs were given")
    term, opd_metrics = opd_loss(opd, batch.log_probs, batch.old_log_probs, batch.loss_mask,
                                 teacher_log_probs=batch.teacher_log_probs, per_token=cfg.calculate_per_token_loss,
                                 student_topk=student_topk, teacher_topk=teacher_topk, topk_mask=topk_mask)
    metrics.update(opd_metrics)
    return loss + term


def _mismatch_diffs(cfg: AlgorithmConfig, batch: LossInputs, train_side: torch.Tensor, metrics: dict) -> None:
    """|train − rollout| log-prob and prob gaps, whenever the engine's log-probs are there (metrics only), reduced as
    Relax reports ``train_rollout_logprob_abs_diff``: its ``sum_of_sample_mean`` over the loss mask (each sample's
    mean over its loss tokens; a sample with none counts 0, in the count of samples too), which the trainer turns
    into the mean over the step's samples like every other loss metric; with ``calculate_per_token_loss`` the token
    mean (Relax's per-token reducer). The loss mask, not TIS's: a masked token's engine log-prob is no engine's."""
    rollout = batch.rollout_log_probs
    if rollout is None:
        return
    mask, per_token = batch.loss_mask, cfg.calculate_per_token_loss
    metrics["train_rollout_logprob_abs_diff"] = reduce((train_side - rollout).abs().detach(), mask, per_token)
    metrics["train_rollout_prob_abs_diff"] = reduce(
        (torch.exp(train_side) - torch.exp(rollout)).abs().detach(), mask, per_token
    )
