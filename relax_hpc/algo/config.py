"""The recipe's ``algorithm:`` section: which RL objective is trained and how.

Keys are Relax's command-line flags with the leading dashes dropped and ``-`` turned into ``_``
(``--eps-clip-high`` → ``eps_clip_high``), with Relax's defaults, so a Relax user's numbers carry over
unchanged (see ``reference/relax-inventory.md`` §4 and §10). Only the flags that change what
:mod:`relax_hpc.algo` computes are here; flags of features relax_hpc does not have (critic/PPO, OPD,
routing replay) are left out so that setting them is an "unknown key" error instead of a silent no-op.

Pure Python on purpose: the recipe validator imports this on the login node. Field types stay within
what :mod:`relax_hpc.recipe.validate` understands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ESTIMATORS = ("grpo", "gspo", "sapo", "cispo")
"""Advantage estimators / policy losses relax_hpc implements (Relax also has ppo, reinforce_plus_plus*, rloo)."""

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


@dataclass
class AlgorithmConfig:
    # --- objective -----------------------------------------------------------------------------------
    advantage_estimator: Literal["grpo", "gspo", "sapo", "cispo"] = "grpo"  # objective: grpo = PPO-clip per token, gspo = sequence-level ratio, sapo = soft gate, cispo = clipped-IS REINFORCE
    eps_clip: float = 0.2  # lower clip margin ε_lo: ratio is clipped below at 1 − eps_clip
    eps_clip_high: float | None = None  # upper clip margin ε_hi: ratio clipped above at 1 + eps_clip_high; None = eps_clip
    eps_clip_c: float | None = None  # dual-clip constant c > 1: for A < 0 the loss is capped at −c·A; None = off
    sapo_tau_pos: float = 1.0  # SAPO gate temperature for tokens with A > 0
    sapo_tau_neg: float = 1.05  # SAPO gate temperature for tokens with A ≤ 0 (higher damps negative updates)
    entropy_coef: float = 0.0  # loss −= entropy_coef · mean entropy (entropy bonus); 0 = entropy only logged
    calculate_per_token_loss: bool = False  # reduction: False = mean over samples of each sample's token-mean; True = sum over all tokens / token count
    # --- KL ------------------------------------------------------------------------------------------
    kl_coef: float = 0.0  # KL reward shaping (PPO only in Relax: no effect on grpo/gspo/sapo/cispo returns); exclusive with kl_loss_coef
    use_kl_loss: bool = False  # add kl_loss_coef · KL(π_θ ‖ π_ref) to the loss (needs ref_log_probs, i.e. a reference role)
    kl_loss_coef: float = 0.0  # weight β of the KL-to-reference loss
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"  # KL estimator: k1 = d, k2 = d²/2, k3 = e^−d − 1 + d, low_var_kl = k3 clamped to [−10, 10]
    use_unbiased_kl: bool = False  # multiply each KL token term by π_θ/π_old (DeepSeek-V3.2 unbiased KL)
    ref_update_interval: int | None = None  # copy actor weights into the reference every N rollout steps; None = never
    # --- rewards and advantages ----------------------------------------------------------------------
    disable_rewards_normalization: bool = False  # skip group reward normalization (rewards used raw)
    disable_grpo_std_normalization: bool = False  # Dr.GRPO: subtract the group mean but do not divide by the group std
    normalize_advantages: bool = False  # whiten advantages (masked mean 0, std 1) over all valid tokens of the data-parallel group
    disable_compute_advantages_and_returns: bool = False  # the advantages step leaves samples alone (custom pipelines set advantages themselves)
    # --- off-policy correction -----------------------------------------------------------------------
    use_rollout_logprobs: bool = False  # use the engine's sampling log-probs as π_old instead of a training-side recompute
    use_tis: bool = False  # truncated importance sampling: pg loss × clamp(π_old/π_rollout, tis_clip_low, tis_clip)
    tis_clip: float = 2.0  # upper bound of the TIS weight
    tis_clip_low: float = 0.0  # lower bound of the TIS weight
    custom_tis_function_path: str | None = None  # "module.function" replacing the TIS weighting, e.g. relax_hpc.algo.tis.icepop_function
    get_mismatch_metrics: bool = False  # log tis/ois/train-rollout mismatch metrics (needs rollout_log_probs) without use_tis
    use_opsm: bool = False  # off-policy sequence masking: drop a sequence's loss if A < 0 and its mean log-ratio > opsm_delta
    opsm_delta: float = 1e-4  # OPSM threshold on the sequence mean of log π_old − log π_θ


def clip_high(cfg: AlgorithmConfig) -> float:
    """ε_hi with Relax's fallback: eps_clip_high if set, else eps_clip."""
    return cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high


def check(cfg: AlgorithmConfig) -> list[tuple[str, object, str]]:
    """Meaning checks the type pass cannot do: (key, value, "problem. fix") for every bad value.

    Also run by :func:`relax_hpc.algo.losses.policy_loss` callers that build a config by hand, so a
    value that is off here is never trained with silently.
    """
    out: list[tuple[str, object, str]] = []

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            out.append((key, getattr(cfg, key), msg))

    need(cfg.advantage_estimator in ESTIMATORS, "advantage_estimator",
         f"is not an estimator relax_hpc implements. Fix: use one of {', '.join(ESTIMATORS)} "
         "(ppo, reinforce_plus_plus and rloo are not available)")
    need(cfg.kl_loss_type in KL_TYPES, "kl_loss_type", f"is not a KL estimator. Fix: use one of {', '.join(KL_TYPES)}")
    need(0 < cfg.eps_clip < 1, "eps_clip", "must be between 0 and 1 (exclusive). Fix: e.g. 0.2")
    if cfg.eps_clip_high is not None:
        need(cfg.eps_clip_high > 0, "eps_clip_high", "must be positive or null. Fix: e.g. 0.28, or null for eps_clip")
    if cfg.eps_clip_c is not None:
        need(cfg.eps_clip_c > 1, "eps_clip_c",
             "must be greater than 1 (dual clip caps the loss of A < 0 tokens at −c·A). Fix: e.g. 3.0, or null for off")
        need(cfg.advantage_estimator in ("grpo", "gspo"), "eps_clip_c",
             f"has no effect with advantage_estimator {cfg.advantage_estimator!r} (dual clip is part of the PPO-clip "
             "loss of grpo/gspo). Fix: set it to null")
    need(cfg.sapo_tau_pos > 0, "sapo_tau_pos", "must be positive. Fix: e.g. 1.0")
    need(cfg.sapo_tau_neg > 0, "sapo_tau_neg", "must be positive. Fix: e.g. 1.05")
    need(cfg.kl_coef >= 0, "kl_coef", "must be 0 or more. Fix: use 0")
    need(cfg.kl_loss_coef >= 0, "kl_loss_coef", "must be 0 or more. Fix: e.g. 0.001")
    need(not (cfg.kl_coef != 0 and cfg.kl_loss_coef != 0), "kl_coef",
         "and algorithm.kl_loss_coef cannot both be non-zero (Relax forbids it). Fix: set kl_coef to 0 and use the KL loss")
    if cfg.ref_update_interval is not None:
        need(cfg.ref_update_interval >= 1, "ref_update_interval", "must be at least 1 or null. Fix: use null for never")
    need(cfg.tis_clip_low >= 0, "tis_clip_low", "must be 0 or more. Fix: use 0")
    need(cfg.tis_clip > cfg.tis_clip_low, "tis_clip",
         f"must be greater than algorithm.tis_clip_low = {cfg.tis_clip_low}. Fix: e.g. 2.0")
    need(not (cfg.use_tis and cfg.use_rollout_logprobs), "use_tis",
         "and algorithm.use_rollout_logprobs cannot both be on (with rollout log-probs as π_old the TIS weight is 1). "
         "Fix: turn one of them off")
    if cfg.custom_tis_function_path is not None:
        need("." in cfg.custom_tis_function_path.strip(".") and " " not in cfg.custom_tis_function_path,
             "custom_tis_function_path", "must be a dotted path 'package.module.function'. "
             "Fix: e.g. relax_hpc.algo.tis.icepop_function")
    need(cfg.opsm_delta >= 0, "opsm_delta", "must be 0 or more. Fix: e.g. 1e-4")
    return out
