"""Per-token KL estimators between the policy and a base distribution (Schulman's k1/k2/k3).

Only the log-probability of the sampled token is known per position, so KL(π ‖ π_base) is estimated
from d = log π − log π_base at that token. The estimators trade bias for variance:

- ``k1`` = d: unbiased for KL(π ‖ π_base) under samples from π, high variance, can be negative;
- ``k2`` = d²/2: biased, low variance, never negative;
- ``k3`` = e^{−d} − 1 + d: unbiased and never negative, low variance;
- ``low_var_kl``: k3, then clamped to [−10, 10] so that one token whose probabilities differ wildly
  cannot blow up the loss (Relax clamps only this one, after any importance weight is applied).

The same function serves the KL loss (policy vs reference) and mismatch metrics. Arithmetic is done in
at least float32 (Relax casts to float), keeping float64 for gradient checks.
"""

from __future__ import annotations

import torch

from relax_hpc.algo.config import KL_TYPES

LOW_VAR_KL_CLAMP = 10.0


def approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs, no reduction.

    ``importance_ratio`` (π_θ/π_old, the ``use_unbiased_kl`` option) multiplies each token's term so the
    estimate is unbiased when samples came from π_old rather than π_θ.
    """
    dtype = torch.promote_types(torch.promote_types(log_probs.dtype, log_probs_base.dtype), torch.float32)
    d = log_probs.to(dtype) - log_probs_base.to(dtype)
    if kl_type == "k1":
        kl = d
    elif kl_type == "k2":
        kl = d.square() / 2.0
    elif kl_type in ("k3", "low_var_kl"):
        kl = torch.exp(-d) - 1.0 + d
    else:
        raise ValueError(f"unknown kl_loss_type {kl_type!r}; use one of {', '.join(KL_TYPES)}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_type == "low_var_kl":
        kl = kl.clamp(min=-LOW_VAR_KL_CLAMP, max=LOW_VAR_KL_CLAMP)
    return kl
