"""On-policy distillation (OPD): the divergence between the student and a teacher on the student's own tokens,
as a penalty folded into the advantages or as a loss term. Pure torch, any shape.

The student samples a response; the teacher scores the same tokens (its log-probs of the student's tokens, or of
top-k token ids at each position). Notation: s = log π_student, t = log π_teacher, per response token. Formulas are
Relax's (``relax/utils/opd/opd_utils.py`` @02bf712a: ``compute_opd_kl``, ``compute_opd_kl_topk``,
``apply_opd_to_advantages``, ``compute_policy_opd_loss``), whose sampled-token advantage form comes from slime's
``apply_opd_kl_to_advantages`` (``A ← A − opd_kl_coef·(s − t)``, after tinker-cookbook's on-policy distillation).

Per-token divergence D_t (:func:`opd_signal`):

- sampled token (``token_selection: student_sampled``): ``reverse_kl`` D = s − t (k1, the unbiased estimate of
  KL(π_s ‖ π_t) under the student's samples; can be negative), ``low_var_kl`` D = e^{t−s} − 1 + (s − t) (k3,
  never negative; unlike :mod:`relax_hpc.algo.kl`'s it is not clamped at ±10, as in Relax). A JSD or a forward KL
  needs the distributions, not one token: refused at validation (:func:`~relax_hpc.algo.config.check_opd`).
- top-k (``[..., K]`` log-probs of both models at the same K token ids): the K probabilities plus one bin for
  the rest (``norm_mode: tail``: log(1 − Σ p), the sum clamped to at most e^{−1e−7}), or renormalized over the K
  (``norm``), or taken as they are (``trunc``); then with M = (1−α)·p_s + α·p_t:
  JSD_α = (1−α)·Σ p_s (log p_s − log M) + α·Σ p_t (log p_t − log M). α = 0 is KL(p_s ‖ p_t) (``reverse_kl``),
  α = 1 is KL(p_t ‖ p_s) (``forward_kl``), ``jsd`` uses ``jsd_alpha``; ``low_var_kl`` is k3 per id, summed.

``log_prob_min_clamp`` clamps both log-probs from below first; ``per_token_clip`` then caps D_t from above (both
forms; Relax's sampled-token advantage path skips this cap although its flag says it applies there: relax_hpc
applies it). Penalty form (:func:`apply_opd_penalty`, ``opd.kl_coef``): with ``only_reward`` the task advantages
are set to 0 first, then A_t ← A_t − kl_coef·sg(D_t) on loss-mask tokens, with s the rollout engine's log-probs;
this runs after group normalization and before ``normalize_advantages`` whitening (Relax's order). Loss form
(:func:`opd_loss`, ``opd.loss_coef``): D_t from this forward's log π_θ (with gradient) and the teacher's (data),
× min(exp(log π_θ − log π_old), is_clip) detached with ``is_clip``, reduced like the policy loss, × loss_coef.

Non-finite numbers are never dropped here: a NaN or inf teacher log-prob on a loss token makes that token's
advantage (and the metrics) non-finite, which the trainer refuses (``train.nonfinite``: the door,
:func:`relax_hpc.train.plan.check_train_columns`, checks ``teacher_log_probs`` like the other log-prob columns;
then the built advantages, then the loss). Masked positions are zeroed with ``where``, as in the policy loss.
"""

from __future__ import annotations

import math

import torch

from relax_hpc.algo.config import OPD_KL_TYPES, OPDConfig
from relax_hpc.algo.reductions import reduce, token_mean

TAIL_LOG_MASS_MAX = -1e-7
"""The top-k mass is clamped to at most e^{−1e−7} before log(1 − Σ p) (Relax's): the tail bin stays finite."""


def _floats(*ts: torch.Tensor) -> list[torch.Tensor]:
    dtype = torch.float32
    for t in ts:
        dtype = torch.promote_types(dtype, t.dtype)
    return [t.to(dtype) for t in ts]


def sampled_kl(student: torch.Tensor, teacher: torch.Tensor, kl_type: str = "reverse_kl",
               log_prob_min_clamp: float | None = None) -> torch.Tensor:
    """D_t from the sampled token's log-probs, same shape as the inputs: s − t (reverse_kl) or e^{t−s} − 1 + s − t
    (low_var_kl), after clamping both below at ``log_prob_min_clamp``."""
    s, t = _floats(student, teacher)
    if log_prob_min_clamp is not None:
        s, t = s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)
    d = s - t
    if kl_type == "reverse_kl":
        return d
    if kl_type == "low_var_kl":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"opd.kl_type {kl_type!r} needs top-k log-probs of both models; with the sampled token only, "
                     "use reverse_kl or low_var_kl")


def _with_rest(lp: torch.Tensor, norm_mode: str) -> torch.Tensor:
    if norm_mode == "tail":
        mass = torch.logsumexp(lp, dim=-1, keepdim=True).clamp(max=TAIL_LOG_MASS_MAX)
        return torch.cat([lp, torch.log(-torch.expm1(mass))], dim=-1)
    if norm_mode == "norm":
        return lp - torch.logsumexp(lp, dim=-1, keepdim=True)
    if norm_mode == "trunc":
        return lp
    raise ValueError(f"unknown opd.norm_mode {norm_mode!r}; use tail, norm or trunc")


def topk_kl(student: torch.Tensor, teacher: torch.Tensor, kl_type: str = "reverse_kl", jsd_alpha: float = 0.5,
            norm_mode: str = "tail", log_prob_min_clamp: float | None = None,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """D_t from ``[..., K]`` log-probs of both models at the same K token ids (the module docstring's JSD_α; α = 0
    for reverse_kl, 1 for forward_kl, ``jsd_alpha`` for jsd; low_var_kl per id, summed). ``mask`` ``[..., K]``
    (True = a real id) drops padded ids. Returns ``[...]``."""
    s, t = _floats(student, teacher)
    if s.shape != t.shape:
        raise ValueError(f"student top-k log-probs {tuple(s.shape)} and teacher's {tuple(t.shape)} must match")
    if log_prob_min_clamp is not None:
        s, t = s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)
    if mask is not None:  # padding back to -inf (the clamp may have lifted it): no mass
        s, t = s.masked_fill(~mask, -math.inf), t.masked_fill(~mask, -math.inf)
    if kl_type == "low_var_kl":
        d = s - t
        per = torch.exp(-d) - 1.0 + d
        return (per if mask is None else per.masked_fill(~mask, 0.0)).sum(dim=-1)
    alpha = {"reverse_kl": 0.0, "forward_kl": 1.0, "jsd": float(jsd_alpha)}.get(kl_type)
    if alpha is None:
        raise ValueError(f"unknown opd.kl_type {kl_type!r}; use one of {', '.join(OPD_KL_TYPES)}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"opd.jsd_alpha must be in [0, 1], got {jsd_alpha}")
    s, t = _with_rest(s, norm_mode), _with_rest(t, norm_mode)
    k = s.shape[-1]

    def total(x: torch.Tensor) -> torch.Tensor:
        if mask is not None:  # the tail bin (index K) is always real
            keep = torch.cat([mask, mask.new_ones(mask.shape[:-1] + (k - mask.shape[-1],))], dim=-1)
            x = x.masked_fill(~keep, 0.0)
        return x.sum(dim=-1)

    if alpha == 0.0:
        return total(_p_log_ratio(s, t))
    if alpha == 1.0:
        return total(_p_log_ratio(t, s))
    m = torch.logsumexp(torch.stack([s + math.log(1.0 - alpha), t + math.log(alpha)]), dim=0)
    return (1.0 - alpha) * total(_p_log_ratio(s, m)) + alpha * total(_p_log_ratio(t, m))


def _p_log_ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """e^a·(a − b), 0 where e^a = 0 (an id with no mass: 0·log 0 = 0, where −inf − −inf would give NaN)."""
    return torch.where(a == -math.inf, torch.zeros((), dtype=a.dtype, device=a.device), a.exp() * (a - b))


def opd_signal(cfg: OPDConfig, student: torch.Tensor | None = None, teacher: torch.Tensor | None = None, *,
               student_topk: torch.Tensor | None = None, teacher_topk: torch.Tensor | None = None,
               topk_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(D_t after ``log_prob_min_clamp`` and ``per_token_clip``, the clip indicator 1[D_t > clip] or None): from the
    top-k log-probs with a top-k ``token_selection``, else from the sampled token's. Gradient flows where the
    inputs have it."""
    if cfg.token_selection != "student_sampled":
        if student_topk is None or teacher_topk is None:
            raise ValueError(f"opd.token_selection {cfg.token_selection} needs the top-k log-probs of both models")
        d = topk_kl(student_topk, teacher_topk, cfg.kl_type, cfg.jsd_alpha, cfg.norm_mode, cfg.log_prob_min_clamp,
                    topk_mask)
    else:
        if student is None or teacher is None:
            raise ValueError("OPD needs the student's and the teacher's log-probs of the sampled tokens")
        if student.shape != teacher.shape:
            raise ValueError(f"student log-probs {tuple(student.shape)} and teacher_log_probs "
                             f"{tuple(teacher.shape)} must have the same shape (one per response token)")
        d = sampled_kl(student, teacher, cfg.kl_type, cfg.log_prob_min_clamp)
    if cfg.per_token_clip is None:
        return d, None
    clipped = (d.detach() > cfg.per_token_clip).to(d.dtype)
    return d.clamp(max=float(cfg.per_token_clip)), clipped


def apply_opd_penalty(cfg: OPDConfig, advantages: torch.Tensor, loss_mask: torch.Tensor,
                      student_log_probs: torch.Tensor | None, teacher_log_probs: torch.Tensor | None, *,
                      student_topk: torch.Tensor | None = None, teacher_topk: torch.Tensor | None = None,
                      topk_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantage form: (A', metrics) with A'_t = [0 if only_reward else A_t] − kl_coef·sg(D_t) on the tokens
    where ``loss_mask`` ≠ 0 and A'_t = 0 elsewhere (where the group-normalized advantages are 0 already). Any
    shape (``[B, T]``, or one flat tensor over a ragged layout), all tensors alike. ``student_log_probs`` are the
    rollout engine's log-probs of the sampled tokens (Relax's ``rollout_log_probs``). In the loss form
    (``kl_coef`` 0) only ``only_reward``'s zeroing applies, and the metrics are still computed from the data.

    Metrics (:func:`opd_metrics`, token means over the loss-mask tokens), whenever the inputs D needs are given."""
    if advantages.shape != loss_mask.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} and loss_mask {tuple(loss_mask.shape)} must match")
    valid = loss_mask != 0
    adv = advantages.to(torch.promote_types(advantages.dtype, torch.float32))
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    base = torch.zeros_like(adv) if cfg.only_reward else adv
    topk = cfg.token_selection != "student_sampled"
    have = (student_topk is not None and teacher_topk is not None) if topk else (
        student_log_probs is not None and teacher_log_probs is not None)
    if not have:
        if cfg.kl_coef != 0:
            what = "top-k log-probs of both models" if topk else "student and teacher log-probs of the sampled tokens"
            raise ValueError(f"opd.kl_coef = {cfg.kl_coef} needs the {what}")
        return torch.where(valid, base, zero), {}
    d, clipped = opd_signal(cfg, student_log_probs, teacher_log_probs, student_topk=student_topk,
                            teacher_topk=teacher_topk, topk_mask=topk_mask)
    d = d.detach().to(adv.dtype)
    out = torch.where(valid, base - cfg.kl_coef * d, zero) if cfg.kl_coef != 0 else torch.where(valid, base, zero)
    return out, opd_metrics(d, loss_mask, student_log_probs, teacher_log_probs, clipped)


def opd_metrics(d: torch.Tensor, loss_mask: torch.Tensor, student_log_probs: torch.Tensor | None = None,
                teacher_log_probs: torch.Tensor | None = None,
                clipped: torch.Tensor | None = None) -> dict[str, float]:
    """The data-side ``opd/*`` metrics, token means over the ``loss_mask`` tokens: ``opd/kl`` (D after the clamp and
    clip), ``opd/reverse_kl`` (s − t, Relax's MOPD ``rkl_approx``), ``opd/teacher_log_prob`` and
    ``opd/student_log_prob`` (when both sampled-token log-probs are given), ``opd/per_token_clip_frac`` (with
    ``per_token_clip``). A NaN or inf on a loss token stays in them."""
    m = loss_mask.to(torch.float32)

    def mean(x: torch.Tensor) -> float:
        x = x.detach().to(torch.promote_types(x.dtype, torch.float32)).reshape(m.shape)
        return float(token_mean(x, m.to(x.dtype)))

    out = {"opd/kl": mean(d)}
    if student_log_probs is not None and teacher_log_probs is not None and student_log_probs.shape == m.shape:
        s, t = _floats(student_log_probs, teacher_log_probs)
        out["opd/reverse_kl"] = mean(s - t)
        out["opd/teacher_log_prob"] = mean(t)
        out["opd/student_log_prob"] = mean(s)
    if clipped is not None:
        out["opd/per_token_clip_frac"] = mean(clipped)
    return out


def opd_loss(cfg: OPDConfig, log_probs: torch.Tensor, old_log_probs: torch.Tensor, loss_mask: torch.Tensor, *,
             teacher_log_probs: torch.Tensor | None = None, per_token: bool = False,
             student_topk: torch.Tensor | None = None, teacher_topk: torch.Tensor | None = None,
             topk_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss form, for ``[B, T]`` tensors: (loss_coef·D̄, metrics). D_t is :func:`opd_signal` of this forward's
    ``log_probs`` (π_θ, with gradient; with a top-k selection ``student_topk``, also from this forward) against the
    teacher's (data); with ``is_clip`` × min(exp(log π_θ − log π_old), is_clip), detached; D̄ is its reduction over
    ``loss_mask`` as the policy loss's (:func:`relax_hpc.algo.reductions.reduce`, ``per_token`` =
    ``calculate_per_token_loss``). Metrics (Relax's names): ``opd_loss`` (D̄), ``opd_per_token_clip_frac``,
    ``opd_is_clip_frac``, reduced the same way. Masked positions are ignored whatever they hold."""
    valid = loss_mask != 0

    def zeroed(x: torch.Tensor | None) -> torch.Tensor | None:  # padding never reaches D (nor a NaN gradient)
        return None if x is None else torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))

    log_probs, old_log_probs = zeroed(log_probs), zeroed(old_log_probs)
    teacher = zeroed(None if teacher_log_probs is None else teacher_log_probs.detach())
    t_topk = None if teacher_topk is None else teacher_topk.detach()
    d, clipped = opd_signal(cfg, log_probs, teacher, student_topk=student_topk, teacher_topk=t_topk,
                            topk_mask=topk_mask)
    d = torch.where(valid, d, torch.zeros((), dtype=d.dtype, device=d.device))
    m = loss_mask.to(d.dtype)
    metrics: dict[str, torch.Tensor] = {}
    if clipped is not None:
        metrics["opd_per_token_clip_frac"] = reduce(clipped, m, per_token)
    if cfg.is_clip is not None:
        ratio = torch.exp(log_probs.detach().to(d.dtype) - old_log_probs.detach().to(d.dtype))
        d = d * ratio.clamp(max=float(cfg.is_clip))
        metrics["opd_is_clip_frac"] = reduce((ratio > cfg.is_clip).to(d.dtype), m, per_token)
    mean = reduce(d, m, per_token)
    metrics["opd_loss"] = mean
    return cfg.loss_coef * mean, {k: v.detach() for k, v in metrics.items()}
