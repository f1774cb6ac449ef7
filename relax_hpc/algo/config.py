"""The recipe's ``algorithm:`` section: which RL objective is trained and how.

Keys are Relax's command-line flags with the leading dashes dropped and ``-`` turned into ``_``
(``--eps-clip-high`` → ``eps_clip_high``), with Relax's defaults, so a Relax user's numbers carry over
unchanged (see ``reference/relax-inventory.md`` §4 and §10). Only the flags that change what
:mod:`relax_hpc.algo` computes are here; flags of features relax_hpc does not have (critic/PPO, routing
replay) are left out so that setting them is an "unknown key" error instead of a silent no-op.

:class:`OPDConfig` is the recipe's top-level ``opd:`` section (on-policy distillation, Relax's ``--opd-*`` flags;
the formulas are in :mod:`relax_hpc.algo.opd`), and :func:`check_opd` its meaning checks.

Pure Python on purpose: the recipe validator imports this on the login node. Field types stay within
what :mod:`relax_hpc.recipe.validate` understands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

Estimator = Literal["grpo", "gspo", "sapo", "cispo"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
"""Advantage estimators / policy losses relax_hpc implements (Relax also has ppo, reinforce_plus_plus*, rloo)."""

KlType = Literal["k1", "k2", "k3", "low_var_kl"]
KL_TYPES: tuple[str, ...] = get_args(KlType)
"""KL estimators (:func:`relax_hpc.algo.kl.approx_kl`)."""

PLUGIN_CALLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "custom_tis_function_path": (("cfg",), ("pg_loss", "train_log_probs", "rollout_log_probs", "loss_mask")),
    "custom_loss_path": (("batch", "cfg"), ()),
}
"""How relax_hpc calls the function each key names: (positional, keyword) arguments. Here, torch-free, so
the recipe validator checks a function's signature against the very call the trainer makes."""


@dataclass
class AlgorithmConfig:
    # --- objective (see relax_hpc/algo/losses.py for the formulas) -------------------------------------
    # grpo: PPO-clip per token; gspo: one ratio per sequence; sapo: soft gate; cispo: clipped-IS REINFORCE
    advantage_estimator: Estimator = "grpo"  # which objective is trained
    eps_clip: float = 0.2  # lower clip margin: the ratio is clipped below at 1 − eps_clip
    eps_clip_high: float | None = None  # upper clip margin: ratio clipped above at 1 + eps_clip_high; None = eps_clip
    eps_clip_c: float | None = None  # dual clip c > 1: the loss of A < 0 tokens is capped at −c·A; None = off
    sapo_tau_pos: float = 1.0  # SAPO gate temperature for tokens with A > 0
    sapo_tau_neg: float = 1.05  # SAPO gate temperature for tokens with A ≤ 0 (higher: damps negative updates)
    entropy_coef: float = 0.0  # entropy bonus: loss −= entropy_coef · mean entropy (0: entropy only logged)
    calculate_per_token_loss: bool = False  # False: mean over samples of per-sample token means; True: token mean
    custom_loss_path: str | None = None  # your per-token pg loss replacing the estimator's: file.py:fn or pkg.mod.fn
    # --- KL ----------------------------------------------------------------------------------------------
    kl_coef: float = 0.0  # Relax's reward-shaping KL, which its GRPO family ignores: only 0 is accepted (see check)
    use_kl_loss: bool = False  # add kl_loss_coef · KL(π_θ ‖ π_ref) to the loss (needs a reference role)
    kl_loss_coef: float = 0.0  # weight of the KL-to-reference loss
    kl_loss_type: KlType = "k1"  # KL estimator (relax_hpc/algo/kl.py)
    use_unbiased_kl: bool = False  # multiply each KL token term by π_θ/π_old (DeepSeek-V3.2 unbiased KL)
    ref_update_interval: int | None = None  # copy actor weights into the reference every N steps; None = never
    # --- rewards and advantages --------------------------------------------------------------------------
    disable_rewards_normalization: bool = False  # no group reward normalization: advantages are raw rewards
    disable_grpo_std_normalization: bool = False  # Dr.GRPO: subtract the group mean, do not divide by its std
    normalize_advantages: bool = False  # whiten advantages over all valid tokens of the data-parallel group
    # --- off-policy correction ---------------------------------------------------------------------------
    use_rollout_logprobs: bool = False  # π_old = the engine's sampling log-probs instead of a trainer recompute
    use_tis: bool = False  # truncated IS: pg loss × clamp(π_old/π_rollout, tis_clip_low, tis_clip)
    tis_clip: float = 2.0  # upper bound of the TIS weight
    tis_clip_low: float = 0.0  # lower bound of the TIS weight
    custom_tis_function_path: str | None = None  # function replacing TIS: pkg.module.fn, pkg.module:fn or file.py:fn
    get_mismatch_metrics: bool = False  # log tis/ois metrics and, as Relax, apply custom_tis_function_path (required)
    use_opsm: bool = False  # off-policy sequence masking: drop A < 0 tokens of sequences with δ_seq > opsm_delta
    opsm_delta: float = 1e-4  # OPSM threshold on the sequence mean of log π_old − log π_θ

def clip_high(cfg: AlgorithmConfig) -> float:
    """ε_hi with Relax's fallback: eps_clip_high if set, else eps_clip."""
    return cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high


def check(cfg: AlgorithmConfig) -> list[tuple[str, object, str]]:
    """Meaning checks the type pass cannot do: (key, value, "problem. fix") for every bad value.

    The recipe validator calls it and prefixes the keys with ``algorithm.``; code that builds an
    :class:`AlgorithmConfig` by hand should call it too.
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
    need(cfg.kl_coef == 0, "kl_coef",
         "would do nothing: Relax's --kl-coef shapes the reward only for its ppo and reinforce_plus_plus "
         f"estimators, and its {', '.join(ESTIMATORS)} (the ones relax_hpc has) ignore it. Fix: remove it (or 0); to "
         "keep the policy near the reference, set algorithm.use_kl_loss: true with algorithm.kl_loss_coef (e.g. "
         "0.001) and enable roles.reference")
    need(cfg.kl_loss_coef >= 0, "kl_loss_coef", "must be 0 or more. Fix: e.g. 0.001")
    if cfg.ref_update_interval is not None:
        need(cfg.ref_update_interval >= 1, "ref_update_interval", "must be at least 1 or null. Fix: use null for never")
    need(cfg.tis_clip_low >= 0, "tis_clip_low", "must be 0 or more. Fix: use 0")
    need(cfg.tis_clip > cfg.tis_clip_low, "tis_clip",
         f"must be greater than algorithm.tis_clip_low = {cfg.tis_clip_low}. Fix: e.g. 2.0")
    need(not (cfg.use_tis and cfg.use_rollout_logprobs), "use_tis",
         "cannot be on together with algorithm.use_rollout_logprobs (π_old would be π_rollout: the TIS weight is 1). "
         "Fix: turn one of them off")
    for key in ("custom_tis_function_path", "custom_loss_path"):
        out += _plugin_form(key, getattr(cfg, key))
    need(not cfg.get_mismatch_metrics or cfg.custom_tis_function_path is not None, "get_mismatch_metrics",
         "needs algorithm.custom_tis_function_path: Relax applies that function's weights and mask to the pg loss "
         "whenever get_mismatch_metrics is on, and refuses the flag without one. Fix: set "
         "algorithm.custom_tis_function_path (relax_hpc.algo.tis.vanilla_tis_function trains with the truncated "
         "IS weights, as Relax would), or turn get_mismatch_metrics off (use_tis: true logs the same metrics)")
    need(cfg.opsm_delta >= 0, "opsm_delta", "must be 0 or more. Fix: e.g. 1e-4")
    return out


def _plugin_form(key: str, value: str | None) -> list[tuple[str, object, str]]:
    """The form of a function reference, without importing it: the roles reload the recipe where the user's
    module may not import (the validator loads it before submit, ``relax_hpc.launch.files.check_files``)."""
    if value is None:
        return []
    from relax_hpc.plugins import PluginError, parse_spec

    try:
        parse_spec(value, f"algorithm.{key}")
    except PluginError as e:
        return [(key, value, e.message)]
    return []


# --------------------------------------------------------------------------------------------------
# opd: on-policy distillation (Relax's --opd-* flags, relax/utils/opd/opd_utils.py)
# --------------------------------------------------------------------------------------------------

OpdKlType = Literal["reverse_kl", "low_var_kl", "forward_kl", "jsd"]
OPD_KL_TYPES: tuple[str, ...] = get_args(OpdKlType)
"""Per-token OPD divergences (Relax's ``OPD_KL_TYPES``); forward_kl and jsd need top-k log-probs of both models."""

OpdTokenSelection = Literal["student_sampled", "student_topk", "teacher_topk"]
OPD_TOKEN_SELECTIONS: tuple[str, ...] = get_args(OpdTokenSelection)
"""Which tokens the divergence is over (Relax's ``--opd-token-selection``; its ``union`` is not here)."""

OPD_SAMPLED_KL_TYPES = ("reverse_kl", "low_var_kl")
"""The estimators that need only the sampled token's log-probs (Relax refuses the others with student_sampled)."""

_HTTP_URL = re.compile(r"https?://[^\s/?#]+[^\s]*")


@dataclass
class OPDConfig:
    """On-policy distillation: the student samples, a teacher scores the student's own tokens, and the per-token
    divergence D_t between the two is folded into the advantages (``kl_coef``) or added to the loss
    (``loss_coef``). Writing the section turns it on. Formulas: :mod:`relax_hpc.algo.opd`, docs/distillation.md."""

    enabled: bool = True  # the section turns OPD on; false keeps it written but off (Relax --use-opd)
    teacher_url: str | None = None  # the teacher SGLang server's /generate endpoint, http(s)://... (--opd-teacher-url)
    teacher_timeout_s: float = 30.0  # one teacher request (--opd-teacher-timeout-s)
    # the run's own teacher engines (roles.teacher) serve this HF directory (--teacher-hf-checkpoint); None: teacher_url
    teacher_model_path: str | None = None
    # exactly one of the two is non-zero (Relax's rule)
    kl_coef: float = 1.0  # advantage form: A_t ← A_t − kl_coef·D_t, after group normalization (--opd-kl-coef)
    loss_coef: float = 0.0  # loss form: loss ← loss + loss_coef·D̄, D with gradient through log π_θ (--opd-loss-coef)
    only_reward: bool = False  # OPD is the only signal: the task reward's advantages are set to 0 (--opd-only-reward)
    kl_type: OpdKlType = "reverse_kl"  # the per-token divergence D_t (--opd-kl-type)
    jsd_alpha: float = 0.5  # kl_type jsd: the teacher's mixture weight; 0 = reverse KL, 1 = forward (--opd-jsd-alpha)
    norm_mode: Literal["tail", "norm", "trunc"] = "tail"  # top-k: the mass outside the k tokens (--opd-norm-mode)
    token_selection: OpdTokenSelection = "student_sampled"  # tokens D is over (--opd-token-selection)
    log_prob_top_k: int = 0  # k of the top-k log-probs; > 0 only with a top-k token_selection (--opd-log-prob-top-k)
    per_token_clip: float | None = None  # D_t ← min(D_t, per_token_clip) in both forms (--opd-per-token-clip)
    is_clip: float | None = None  # loss form: D_t × min(π_θ/π_old, is_clip), the ratio detached (--opd-is-clip)
    log_prob_min_clamp: float | None = None  # both log-probs clamped below at this before D (--opd-log-prob-min-clamp)


def check_opd(cfg: OPDConfig) -> list[tuple[str, object, str]]:
    """Meaning checks of the ``opd:`` section: (key, value, "problem. Fix: ...") for every bad value; the recipe
    validator prefixes the keys with ``opd.``. A section with ``enabled: false`` is not checked (it is off)."""
    if not cfg.enabled:
        return []
    out: list[tuple[str, object, str]] = []

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            out.append((key, getattr(cfg, key), msg))

    if cfg.teacher_url is None:
        out.append(("teacher_url", None, "is required: the teacher scores the student's tokens there (Relax "
                    "--opd-teacher-url). Fix: the teacher SGLang server's /generate endpoint, e.g. "
                    "'http://teacher-host:30000/generate'"))
    else:
        need(bool(_HTTP_URL.fullmatch(cfg.teacher_url)), "teacher_url",
             "is not an http(s) URL. Fix: the teacher SGLang server's /generate endpoint, e.g. "
             "'http://teacher-host:30000/generate'")
    need(cfg.teacher_timeout_s > 0, "teacher_timeout_s", "must be more than 0 seconds. Fix: e.g. 30")
    kl_on, loss_on = cfg.kl_coef != 0, cfg.loss_coef != 0
    if kl_on == loss_on:  # Relax: exactly one of --opd-kl-coef / --opd-loss-coef is non-zero
        key = "loss_coef" if kl_on else "kl_coef"
        out.append((key, getattr(cfg, key),
                    f"exactly one of opd.kl_coef and opd.loss_coef must be non-zero (got kl_coef = {cfg.kl_coef}, "
                    f"loss_coef = {cfg.loss_coef}). Fix: kl_coef: X with loss_coef: 0 (advantage form, the default), "
                    "or kl_coef: 0 with loss_coef: X (loss form)"))
    need(cfg.kl_coef >= 0, "kl_coef", "must be 0 or more (a negative weight pushes the student away from the "
         "teacher). Fix: e.g. 1.0")
    need(cfg.loss_coef >= 0, "loss_coef", "must be 0 or more (a negative weight pushes the student away from the "
         "teacher). Fix: e.g. 1.0")
    need(cfg.kl_type in OPD_KL_TYPES, "kl_type", f"is not an OPD divergence. Fix: one of {', '.join(OPD_KL_TYPES)}")
    need(cfg.token_selection in OPD_TOKEN_SELECTIONS, "token_selection",
         f"is not a token selection here. Fix: one of {', '.join(OPD_TOKEN_SELECTIONS)}")
    sampled = cfg.token_selection == "student_sampled"
    need(not sampled or cfg.kl_type in OPD_SAMPLED_KL_TYPES, "kl_type",
         f"needs the top-k log-probs of both models, and with token_selection student_sampled only the sampled "
         f"token's are known (a divergence over one token is not a {cfg.kl_type}; Relax refuses it too). Fix: "
         "kl_type: reverse_kl (or low_var_kl), or token_selection: student_topk with log_prob_top_k > 0")
    need(cfg.log_prob_top_k >= 0, "log_prob_top_k", "must be 0 or more. Fix: 0 (sampled tokens) or e.g. 16")
    if sampled:
        need(cfg.log_prob_top_k == 0, "log_prob_top_k",
             "does nothing with token_selection student_sampled (Relax collects top-k there for overlap metrics "
             "only, which relax_hpc does not log). Fix: remove it, or set token_selection: student_topk")
    else:
        need(cfg.log_prob_top_k > 0, "log_prob_top_k",
             f"must be more than 0 with token_selection {cfg.token_selection} (Relax's rule: the divergence is "
             "over the top-k tokens). Fix: e.g. 16")
    need(0.0 <= cfg.jsd_alpha <= 1.0, "jsd_alpha", "must be between 0 and 1. Fix: e.g. 0.5")
    need(cfg.jsd_alpha == 0.5 or cfg.kl_type == "jsd", "jsd_alpha",
         f"is used only with kl_type jsd (kl_type is {cfg.kl_type}). Fix: remove it, or set kl_type: jsd")
    need(cfg.norm_mode == "tail" or not sampled, "norm_mode",
         "is used only over top-k tokens (token_selection student_topk or teacher_topk). Fix: remove it")
    if cfg.per_token_clip is not None:
        need(cfg.per_token_clip > 0, "per_token_clip", "must be more than 0, or null for no clip. Fix: e.g. 5.0")
    if cfg.is_clip is not None:
        need(cfg.is_clip > 0, "is_clip", "must be more than 0, or null for no clip. Fix: e.g. 2.0")
        need(loss_on, "is_clip",
             "acts only in the loss form (opd.loss_coef non-zero): the advantage form's D is data, with no "
             "importance ratio to clip (Relax ignores it there). Fix: remove it, or use loss_coef")
    if cfg.log_prob_min_clamp is not None:
        need(cfg.log_prob_min_clamp < 0, "log_prob_min_clamp",
             "must be below 0 (log-probs are at most 0: a clamp at 0 or above makes every D_t zero). "
             "Fix: e.g. -20, or null for none")
    return out
