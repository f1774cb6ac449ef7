"""Masked reductions of per-token values ``[B, T]`` to one number, as Relax reduces its losses.

Relax's default (``calculate_per_token_loss`` off) gives every sample the same weight whatever its length:
each sample's values are averaged over its valid tokens, then samples are averaged. Megatron's per-token
mode (on) gives every token the same weight instead: a sum over all valid tokens divided by their count.
Relax's ``sum_of_sample_mean`` returns the *sum* over samples of the per-sample means and lets Megatron
divide by the global batch size; :func:`sum_of_sample_mean` is that sum, for a trainer that accumulates
micro-batches itself, and :func:`sample_mean` the mean over the samples given.

Masks are 0/1 (float or bool) ``[B, T]``; a sample with no valid token contributes 0 (its denominator is
clamped to 1) but still counts as a sample. Masked positions are excluded with ``where``, so a NaN or inf
in padding never reaches the result.
"""

from __future__ import annotations

import torch


def _masked(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape")
    m = mask.to(values.dtype)
    x = torch.where(mask != 0, values * m, torch.zeros((), dtype=values.dtype, device=values.device))
    return x, m


def per_sample_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: Σ_t m·x / max(Σ_t m, 1) for every sample."""
    x, m = _masked(values, mask)
    return x.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)


def sum_of_sample_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_i (Σ_t m·x / max(Σ_t m, 1)): Relax's per-micro-batch reducer before Megatron's 1/global_batch."""
    return per_sample_mean(values, mask).sum()


def sample_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the B samples of each sample's token-mean (Relax's default loss reduction)."""
    per = per_sample_mean(values, mask)
    return per.sum() / max(per.numel(), 1)


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ m·x / max(Σ m, 1) over all tokens of all samples (``calculate_per_token_loss``)."""
    x, m = _masked(values, mask)
    return x.sum() / m.sum().clamp(min=1)


def reduce(values: torch.Tensor, mask: torch.Tensor, per_token: bool) -> torch.Tensor:
    """:func:`token_mean` if ``per_token`` else :func:`sample_mean`."""
    return token_mean(values, mask) if per_token else sample_mean(values, mask)
