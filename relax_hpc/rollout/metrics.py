"""Rollout and eval metrics with Relax's names, and pass@k: pure functions of samples and rewards (the
driver and the periodic eval, :mod:`relax_hpc.rollout.eval`, call them).

Metric names (as Relax logs them; ``rollout/`` for training batches, ``eval/<name>`` per eval set):

- ``rollout/raw_reward`` (mean scalar reward), ``rollout/rewards`` (mean after group normalization),
  ``rollout/response_len/{mean,median,max,min}`` (effective response lengths: loss-mask sums),
  ``rollout/response_lengths``, ``rollout/total_lengths``, ``rollout/truncated`` and
  ``rollout/truncated_ratio``, ``rollout/zero_std/count_<reward>`` (groups whose rewards are all equal),
  ``rollout/<key>/{mean,median,max,min}`` for the other numeric keys of dict rewards,
  ``rollout/passrate/pass@k`` with ``log_passrate``; relax_hpc adds ``rollout/reward_failed`` (samples whose
  reward raised, under ``reward_error_policy: skip``), ``rollout/aborted_ratio`` and ``rollout/engine_retries``.
- eval: ``eval/<name>`` (mean reward), ``eval/<name>-truncated_ratio``, ``eval/<name>-pass@k`` for
  k = 1, 2, 4, ... up to ``n_samples_per_eval_prompt``, and ``eval/<name>/response_len/mean`` etc.

pass@k is the unbiased estimator 1 − C(n−c, k)/C(n, k) per prompt (n samples, c correct), averaged over
prompts; a sample is correct when its scalar reward is ≥ 1 (Relax counts reward == 1).
"""

from __future__ import annotations

import math
import statistics

from relax_hpc.rollout.sample import Sample, SampleStatus


# --------------------------------------------------------------------------------------------------
# pass@k
# --------------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` samples of which ``c`` are correct (Chen et al. 2021)."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(group_size: int) -> list[int]:
    """k = 1, 2, 4, ... up to ``group_size`` (Relax's choice of k)."""
    ks, k = [], 1
    while k <= group_size:
        ks.append(k)
        k *= 2
    return ks


def compute_pass_rate(flat_rewards: list[float], group_size: int, *, threshold: float = 1.0) -> dict[str, float]:
    """``{"pass@1": ..., "pass@2": ..., ...}`` from rewards of consecutive groups of ``group_size``."""
    if group_size < 1 or not flat_rewards:
        return {}
    if len(flat_rewards) % group_size:
        raise ValueError(f"{len(flat_rewards)} rewards are not whole groups of {group_size}")
    groups = [flat_rewards[i:i + group_size] for i in range(0, len(flat_rewards), group_size)]
    correct = [sum(1 for r in g if r >= threshold) for g in groups]
    return {f"pass@{k}": sum(pass_at_k(group_size, c, k) for c in correct) / len(groups) for k in pass_ks(group_size)}


# --------------------------------------------------------------------------------------------------
# Metrics from samples
# --------------------------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "median": float(statistics.median(values)),
            "max": float(max(values)), "min": float(min(values))}


def _prefixed(d: dict[str, float], prefix: str) -> dict[str, float]:
    return {f"{prefix}{k}": v for k, v in d.items()}


def sample_metrics(samples: list[Sample], raw_rewards: list[float], *, reward_key: str | None = None,
                   group_size: int = 1, log_passrate: bool = False) -> dict[str, float]:
    """Relax's per-batch rollout statistics, without a prefix (``raw_reward``, ``response_len/mean``, ...)."""
    if not samples:
        return {}
    out: dict[str, float] = {}
    lengths = [float(s.effective_response_length) for s in samples]
    out |= _prefixed(_stats(lengths), "response_len/")
    out["raw_reward"] = statistics.fmean(raw_rewards)
    extra: dict[str, list[float]] = {}
    for s in samples:
        if isinstance(s.reward, dict):
            for k, v in s.reward.items():
                if not isinstance(k, str) or not k or k == reward_key or k == "raw_reward" or k.startswith("_"):
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                extra.setdefault(k, []).append(float(v))
    for k, vals in extra.items():
        out |= _prefixed(_stats(vals), f"{k}/")
    if group_size > 1 and len(raw_rewards) % group_size == 0:
        counts: dict[str, int] = {}
        for i in range(0, len(raw_rewards), group_size):
            g = raw_rewards[i:i + group_size]
            if all(r == g[0] for r in g):
                key = str(round(g[0], 1))
                counts[key] = counts.get(key, 0) + 1
        out |= {f"zero_std/count_{k}": float(v) for k, v in counts.items()}
        if log_passrate:
            out |= _prefixed(compute_pass_rate(raw_rewards, group_size), "passrate/")
    out["truncated_ratio"] = statistics.fmean(float(s.status is SampleStatus.TRUNCATED) for s in samples)
    out["aborted_ratio"] = statistics.fmean(float(s.status is SampleStatus.ABORTED) for s in samples)
    out["reward_failed"] = float(sum(1 for s in samples if "reward_error" in s.metadata))
    return out


def eval_metrics(name: str, samples: list[Sample], rewards: list[float], group_size: int) -> dict[str, float]:
    out = {f"eval/{name}": statistics.fmean(rewards) if rewards else 0.0}
    out[f"eval/{name}-truncated_ratio"] = statistics.fmean(float(s.status is SampleStatus.TRUNCATED) for s in samples)
    out |= _prefixed(compute_pass_rate(rewards, group_size), f"eval/{name}-")
    lengths = [float(s.effective_response_length) for s in samples]
    out |= _prefixed(_stats(lengths), f"eval/{name}/response_len/")
    return out
