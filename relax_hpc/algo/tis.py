"""Truncated importance sampling (TIS): correct for the rollout engine not being the training engine.

The engine (SGLang) samples with π_roll; the trainer recomputes π_old for the same weights, and the two
differ (kernels, precision, batch invariance). The pg loss per token is multiplied by
w = π_old/π_roll, truncated to [tis_clip_low, tis_clip] so a rare token cannot dominate the step.

A TIS function has the form
``fn(cfg, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask) -> (pg_loss, loss_mask, metrics)``
on ``[B, T]`` tensors: it returns the weighted per-token pg loss, the mask the loss is reduced with (it may
drop tokens), and per-token metric tensors (reduced by the caller with the original mask).
``algorithm.custom_tis_function_path`` names one by dotted path; :func:`vanilla_tis_function` is the
default and :func:`icepop_function` (zero weight outside the band instead of clamping) ships as Relax's
alternative.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

TisFunction = Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def _mismatch(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor):
    log_ratio = (train_log_probs - rollout_log_probs).detach()
    return log_ratio, torch.exp(log_ratio)


def vanilla_tis_function(cfg, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask, **_):
    """w = clamp(exp(log π_old − log π_roll), tis_clip_low, tis_clip); pg_loss·w.

    Metrics per token: ``tis`` (the unclamped ratio), ``tis_clipfrac`` (1 where clamping changed it),
    ``tis_abs`` (|ratio − 1|).
    """
    _, ratio = _mismatch(train_log_probs, rollout_log_probs)
    weight = ratio.clamp(min=cfg.tis_clip_low, max=cfg.tis_clip)
    metrics = {
        "tis": ratio,
        "tis_clipfrac": (weight != ratio).to(ratio.dtype),
        "tis_abs": (ratio - 1).abs(),
    }
    return pg_loss * weight, loss_mask, metrics


def icepop_function(cfg, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask, **_):
    """w = ratio inside [tis_clip_low, tis_clip], else 0 (the token is dropped, not truncated)."""
    _, ratio = _mismatch(train_log_probs, rollout_log_probs)
    inside = (ratio >= cfg.tis_clip_low) & (ratio <= cfg.tis_clip)
    weight = torch.where(inside, ratio, torch.zeros_like(ratio))
    metrics = {
        "tis": ratio,
        "tis_clipfrac": (weight != ratio).to(ratio.dtype),
        "tis_abs": (ratio - 1).abs(),
    }
    return pg_loss * weight, loss_mask, metrics


def load_tis_function(path: str | None) -> TisFunction:
    """The function named by ``path`` ("pkg.module.function" or "pkg.module:function"); vanilla if None."""
    if path is None:
        return vanilla_tis_function
    module, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise ValueError(f"custom_tis_function_path {path!r} is not 'package.module.function'")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"custom_tis_function_path {path!r}: {module} has no function {name!r}")
    return fn
