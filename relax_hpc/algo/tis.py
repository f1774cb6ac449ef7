"""Truncated importance sampling (TIS): correct for the rollout engine not being the training engine.

The engine (SGLang) samples with π_roll; the trainer recomputes π_old for the same weights, and the two
differ (kernels, precision, batch invariance). The pg loss per token is multiplied by
w = π_old/π_roll, truncated to [tis_clip_low, tis_clip] so a rare token cannot dominate the step.

A TIS function has the form
``fn(cfg, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask) -> (pg_loss, loss_mask, metrics)``
on ``[B, T]`` tensors: it returns the weighted per-token pg loss, the mask the loss is reduced with (it may
drop tokens), and per-token metric tensors (reduced by the caller with the original mask).
``algorithm.custom_tis_function_path`` names one (``pkg.module.fn``, ``pkg.module:fn`` or ``file.py:fn``,
see :mod:`relax_hpc.plugins`); :func:`vanilla_tis_function` is the default and :func:`icepop_function`
(zero weight outside the band instead of clamping) ships as Relax's alternative.

When the weights apply (:func:`weights_the_loss`): with ``use_tis``, and, as in Relax, with
``get_mismatch_metrics`` and a ``custom_tis_function_path`` (Relax requires the function with that flag).
"""

from __future__ import annotations

from typing import Callable

import torch

from relax_hpc.algo.config import PLUGIN_CALLS, AlgorithmConfig
from relax_hpc.plugins import load_plugin

TisFunction = Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def _mismatch(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor):
    log_ratio = (train_log_probs - rollout_log_probs).detach()
    return log_ratio, torch.exp(log_ratio)


def vanilla_tis_function(cfg: AlgorithmConfig, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask, **_):
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


def icepop_function(cfg: AlgorithmConfig, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask, **_):
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


TIS_PARAMS, TIS_KEYWORDS = PLUGIN_CALLS["custom_tis_function_path"]
"""How a TIS function is called: ``fn(cfg, pg_loss=..., train_log_probs=..., rollout_log_probs=..., loss_mask=...)``."""


def load_tis_function(path: str | None, key: str = "algorithm.custom_tis_function_path") -> TisFunction:
    """The function ``path`` names (any form :func:`relax_hpc.plugins.load_plugin` takes); vanilla if None.

    The signature is checked against the call above, so a function written for Relax's call (``args``,
    ``loss_masks``) is refused with the fix instead of failing inside the first training step.
    """
    if path is None:
        return vanilla_tis_function
    return load_plugin(path, key, params=TIS_PARAMS, keywords=TIS_KEYWORDS)


def weights_the_loss(cfg) -> bool:
    """Whether the TIS function's weights and mask replace the pg loss and its reduction mask.

    Relax applies the TIS function whenever ``use_tis`` or ``get_mismatch_metrics`` is on (``loss.py``:
    ``if args.get_mismatch_metrics or args.use_tis: pg_loss, masks, metrics = tis_func(...)``), and refuses
    ``get_mismatch_metrics`` without ``custom_tis_function_path`` (``arguments.py``), so with the flag the
    custom function's weights and mask always train. relax_hpc does the same; the one combination Relax
    refuses (``get_mismatch_metrics`` alone, vanilla function), which the recipe validator refuses too, only
    logs vanilla's metrics when a config built by hand reaches :func:`relax_hpc.algo.losses.policy_loss`.
    """
    return bool(cfg.use_tis or (cfg.get_mismatch_metrics and cfg.custom_tis_function_path is not None))
