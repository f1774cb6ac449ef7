"""An example policy loss for ``algorithm.custom_loss_path``, written by hand.

Use it with any recipe, from the repository root:

    relax-submit --local recipes/quickstart.yaml algorithm.custom_loss_path=recipes/examples/custom_loss.py:my_loss

A custom loss is ``fn(batch, cfg) -> (loss, metrics)``:

- ``batch`` (``relax_hpc.algo.losses.LossInputs``): ``[B, T]`` tensors, zero where ``batch.loss_mask`` is 0:
  ``log_probs`` (π_θ, with gradient), ``old_log_probs`` (π_old), ``advantages``, ``loss_mask``, and, when
  present, ``ref_log_probs``, ``rollout_log_probs``, ``entropy``.
- ``cfg``: the recipe's ``algorithm:`` section (``relax_hpc.algo.AlgorithmConfig``): read your knobs from it
  (here ``eps_clip`` and ``eps_clip_high``).
- ``loss``: the per-token loss ``[B, T]`` to minimize. relax_hpc masks and reduces it (``calculate_per_token_loss``)
  and still applies OPSM, TIS, the entropy bonus and the KL loss as the recipe configures them.
- ``metrics``: name → ``[B, T]`` per-token values (reduced like the loss) or 0-dim tensors, logged as
  ``train/<name>``. ``ppo_kl``, if you return it, is logged as ``train/ppo_kl`` and gives ``train/ois``.

Only torch is needed here: the file is loaded on its own, by path, in the actor (and once by relax-submit,
which checks that it loads and that ``my_loss(batch, cfg)`` is a valid call before submitting).
"""

from __future__ import annotations

import torch


def my_loss(batch, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, by hand: L = max(−r·A, −clip(r, 1 − ε_lo, 1 + ε_hi)·A), r = π_θ / π_old.

    The same numbers as the built-in ``advantage_estimator: grpo`` without dual clip, so a run with this file
    should learn like one without it.
    """
    eps_low = cfg.eps_clip
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    log_ratio = batch.log_probs - batch.old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * batch.advantages
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * batch.advantages
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_clipfrac": (clipped > unclipped).to(loss.dtype),
        "ppo_kl": -log_ratio,
    }
    return loss, metrics


def reinforce_loss(batch, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain REINFORCE, L = −A·log π_θ (no ratio, no clip): on-policy only, a baseline to compare against."""
    return -batch.advantages * batch.log_probs, {}
