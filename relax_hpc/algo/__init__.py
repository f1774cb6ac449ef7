"""RL objectives of relax_hpc, in pure torch (no Megatron), with Relax's formulas, defaults and metric names.

Why pure torch: the same code runs in the Megatron actor on GPUs, in the CPU path, in the CPU
``advantages`` role and in unit tests, and its numbers can be checked by hand.

- :mod:`.config`: the recipe's ``algorithm:`` section (:class:`AlgorithmConfig`) and its ``check``.
- :mod:`.advantages`: rewards → group-normalized rewards → per-token advantages.
- :mod:`.kl`: k1/k2/k3/low_var_kl estimators.
- :mod:`.losses`: the table of per-token policy losses (:data:`~.losses.LOSSES`: grpo/gspo/sapo/cispo, or the
  user's ``custom_loss_path``) and :func:`policy_loss`, the trainer's entry.
- :mod:`.tis`: truncated importance sampling against the rollout engine's log-probs.
- :mod:`.reductions`: per-sample token-mean and per-token reductions.
- :mod:`.opd`: on-policy distillation's per-token divergence to a teacher, as an advantage penalty or a loss term
  (the recipe's ``opd:`` section, :class:`OPDConfig`).
"""

from relax_hpc.algo.config import ESTIMATORS, KL_TYPES, AlgorithmConfig, OPDConfig, check, check_opd, clip_high

# The torch-using names load on first use, so that the recipe validator (which imports
# ``relax_hpc.algo.config`` on a login node, possibly without torch) never imports torch.
_LAZY = {
    "broadcast_advantages": "advantages",
    "compute_advantages": "advantages",
    "finish_advantages": "advantages",
    "group_normalize": "advantages",
    "masked_whiten": "advantages",
    "postprocess_rewards": "advantages",
    "approx_kl": "kl",
    "LOSSES": "losses",
    "LossInputs": "losses",
    "cispo_loss": "losses",
    "loss_function": "losses",
    "policy_loss": "losses",
    "register_loss": "losses",
    "ppo_clip_loss": "losses",
    "sapo_loss": "losses",
    "sequence_log_ratio": "losses",
    "per_sample_mean": "reductions",
    "reduce": "reductions",
    "sample_mean": "reductions",
    "sum_of_sample_mean": "reductions",
    "token_mean": "reductions",
    "apply_opd_penalty": "opd",
    "opd_loss": "opd",
    "opd_signal": "opd",
    "icepop_function": "tis",
    "load_tis_function": "tis",
    "vanilla_tis_function": "tis",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"relax_hpc.algo.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'relax_hpc.algo' has no attribute {name!r}")


__all__ = [
    "AlgorithmConfig",
    "OPDConfig",
    "apply_opd_penalty",
    "ESTIMATORS",
    "KL_TYPES",
    "LOSSES",
    "LossInputs",
    "approx_kl",
    "broadcast_advantages",
    "check",
    "check_opd",
    "cispo_loss",
    "clip_high",
    "compute_advantages",
    "finish_advantages",
    "group_normalize",
    "icepop_function",
    "load_tis_function",
    "loss_function",
    "masked_whiten",
    "opd_loss",
    "opd_signal",
    "per_sample_mean",
    "policy_loss",
    "postprocess_rewards",
    "ppo_clip_loss",
    "reduce",
    "register_loss",
    "sample_mean",
    "sapo_loss",
    "sequence_log_ratio",
    "sum_of_sample_mean",
    "token_mean",
    "vanilla_tis_function",
]
