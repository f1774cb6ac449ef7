"""get_mismatch_metrics as Relax trains it: the TIS function's weights and mask apply to the pg loss.

Relax (``loss.py``: ``if args.get_mismatch_metrics or args.use_tis: pg_loss, masks, metrics = tis_func(...)``)
applies the TIS function with either flag, and requires ``custom_tis_function_path`` with
``get_mismatch_metrics`` (``arguments.py``). Every expected number is worked out by hand below.
"""

from __future__ import annotations

import math

import pytest
import torch

from relax_hpc.algo import AlgorithmConfig, check, policy_loss
from relax_hpc.algo.tis import weights_the_loss

F64 = torch.float64
VANILLA = "relax_hpc.algo.tis.vanilla_tis_function"
ICEPOP = "relax_hpc.algo.tis.icepop_function"


def close(actual, expected, tol=1e-7):
    torch.testing.assert_close(actual.to(F64), torch.as_tensor(expected, dtype=F64), rtol=0, atol=tol)


def case():
    """Ratio π_θ/π_old = 1 on every token (old = lp = −1), so grpo's per-token loss is −A = −1, +1, −2.
    π_old/π_roll = 0.5, 3.0, 1.0 (rollout = old − log of that)."""
    lp = torch.full((1, 3), -1.0, dtype=F64, requires_grad=True)
    old = torch.full((1, 3), -1.0, dtype=F64)
    rollout = old - torch.log(torch.tensor([[0.5, 3.0, 1.0]], dtype=F64))
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=F64)
    return lp, old, rollout, adv, torch.ones(1, 3)


def test_mismatch_metrics_with_vanilla_tis_weights_the_loss():
    lp, old, rollout, adv, mask = case()
    cfg = AlgorithmConfig(get_mismatch_metrics=True, custom_tis_function_path=VANILLA)  # use_tis stays off
    loss, m = policy_loss(cfg, lp, old, adv, mask, rollout_log_probs=rollout)
    # weights clamp(0.5, 3.0, 1.0; 0, 2) = 0.5, 2.0, 1.0; weighted −1·0.5 = −0.5, +1·2 = 2, −2·1 = −2
    weighted_mean = (-0.5 + 2.0 - 2.0) / 3
    close(loss, weighted_mean)
    close(m["pg_loss"], weighted_mean)
    close(m["tis"], (0.5 + 3.0 + 1.0) / 3)
    close(m["tis_clipfrac"], 1 / 3)  # only 3.0 was clamped
    close(m["tis_abs"], (0.5 + 2.0 + 0.0) / 3)
    close(m["ois"], 1.0)
    close(m["train_rollout_logprob_abs_diff"], (math.log(2) + math.log(3) + 0.0) / 3)
    loss.backward()
    # ratio 1 is inside [0.8, 1.2]: d(−r·A)/d lp = −A, times the weight, over 3 tokens
    close(lp.grad, [[-1.0 * 0.5 / 3, 1.0 * 2.0 / 3, -2.0 * 1.0 / 3]])


def test_without_the_weights_the_loss_would_differ():
    """The plain loss, −(1 − 1 + 2)/3 = −2/3, is what relax_hpc trained before: not Relax's."""
    lp, old, rollout, adv, mask = case()
    loss, _ = policy_loss(AlgorithmConfig(), lp, old, adv, mask, rollout_log_probs=rollout)
    close(loss, (-1.0 + 1.0 - 2.0) / 3)


def test_mismatch_metrics_with_icepop_drops_tokens_outside_the_band():
    lp, old, rollout, adv, mask = case()
    cfg = AlgorithmConfig(get_mismatch_metrics=True, custom_tis_function_path=ICEPOP)
    loss, m = policy_loss(cfg, lp, old, adv, mask, rollout_log_probs=rollout)
    # 3.0 is outside [0, 2]: weight 0; the others keep their ratio 0.5 and 1.0
    close(loss, (-0.5 + 0.0 - 2.0) / 3)
    close(m["tis_clipfrac"], 1 / 3)


def drop_last_token(cfg, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask):
    """A custom TIS function: weight 1, but the last token leaves the reduction mask."""
    mask = loss_mask.clone()
    mask[:, -1] = 0
    return pg_loss, mask, {"kept": mask}


def test_mismatch_metrics_with_a_custom_mask_changes_the_reduction():
    lp, old, rollout, adv, mask = case()
    cfg = AlgorithmConfig(get_mismatch_metrics=True, custom_tis_function_path=f"{__name__}:drop_last_token")
    loss, m = policy_loss(cfg, lp, old, adv, mask, rollout_log_probs=rollout)
    close(loss, (-1.0 + 1.0) / 2)  # two tokens left
    close(m["kept"], 2 / 3)  # metrics are reduced over the original mask


def test_mismatch_metrics_with_per_sample_mean_over_two_samples():
    """Two samples, the second with one token: per-sample means, then their mean."""
    lp = torch.full((2, 2), -1.0, dtype=F64, requires_grad=True)
    old = lp.detach().clone()
    rollout = old - torch.log(torch.tensor([[4.0, 0.25], [1.5, 1.0]], dtype=F64))
    adv = torch.tensor([[1.0, 1.0], [-1.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    cfg = AlgorithmConfig(get_mismatch_metrics=True, custom_tis_function_path=VANILLA, tis_clip_low=0.5)
    loss, _ = policy_loss(cfg, lp, old, adv, mask, rollout_log_probs=rollout)
    # weights: clamp(4, .5, 2) = 2, clamp(.25, .5, 2) = .5 | 1.5; per-token −A·w: −2, −0.5 | +1.5
    close(loss, ((-2.0 - 0.5) / 2 + 1.5 / 1) / 2)


@pytest.mark.parametrize("use_tis, mismatch, path, weights", [
    (False, False, None, False),
    (True, False, None, True),
    (False, True, None, False),  # refused by check(); a hand-built config only logs vanilla's metrics
    (False, True, VANILLA, True),
    (True, True, ICEPOP, True),
    (False, False, ICEPOP, False),  # a TIS function alone does nothing: Relax runs it only with a flag on
])
def test_when_the_tis_function_weights_the_loss(use_tis, mismatch, path, weights):
    cfg = AlgorithmConfig(use_tis=use_tis, get_mismatch_metrics=mismatch, custom_tis_function_path=path)
    assert weights_the_loss(cfg) is weights


def test_check_refuses_mismatch_metrics_without_a_tis_function_naming_both_keys():
    (problem,) = [p for p in check(AlgorithmConfig(get_mismatch_metrics=True)) if p[0] == "get_mismatch_metrics"]
    key, value, msg = problem
    assert value is True and "algorithm.custom_tis_function_path" in msg and "Fix:" in msg
    assert not [p for p in check(AlgorithmConfig(get_mismatch_metrics=True, custom_tis_function_path=VANILLA))]


# --- train_rollout_logprob_abs_diff as Relax reports it ------------------------------------------------------------


def relax_reported(micro_batches: list, per_token: bool = False) -> float:
    """Relax's ``train_rollout_logprob_abs_diff`` (slime's Megatron backend, which Relax's ``loss.py`` is; context
    parallel size 1), transcribed. Per micro-batch, ``loss_function`` logs ``values = [num_samples (num_tokens with
    --calculate-per-token-loss), sum_of_sample_mean(|old_log_probs − rollout_log_probs|)]``, where
    ``get_sum_of_sample_mean`` gives ``Σ_i (x_i·m_i).sum() / clamp_min(m_i.sum(), 1)`` (per token:
    ``Σ_i (x_i·m_i).sum()`` and ``num_tokens = Σ_i clamp_min(m_i.sum(), 1)``); ``train_one_step`` sums ``values``
    over the micro-batches (and the DP ranks) and reports ``values[1] / values[0]``. ``micro_batches``: lists of
    (old, rollout, mask) per sample, 1-D over its response tokens."""
    values = [0.0, 0.0]
    for samples in micro_batches:
        x = [(old - rollout).abs() for old, rollout, _ in samples]
        masks = [m for _, _, m in samples]
        if per_token:
            values[0] += float(sum(torch.clamp_min(m.sum(), 1) for m in masks))
            values[1] += float(sum((x_i * m_i).sum() for x_i, m_i in zip(x, masks)))
        else:
            values[0] += len(samples)
            values[1] += float(sum((x_i * m_i).sum() / torch.clamp_min(m_i.sum(), 1) for x_i, m_i in zip(x, masks)))
    return values[1] / values[0]


def relax_hpc_reported(micro_batches: list, per_token: bool = False, name: str = "train_rollout_logprob_abs_diff"):
    """The same through :func:`policy_loss`, one padded ``[B, T]`` call per micro-batch, each value weighted as
    ``relax_hpc.train.step.train_step`` weighs every loss metric of a micro-batch (``mb.weight``: its samples, or with
    ``calculate_per_token_loss`` its loss tokens, over the step's)."""
    n = sum(len(mb) for mb in micro_batches)
    tokens = sum(float(m.sum()) for mb in micro_batches for _, _, m in mb)
    out = 0.0
    for samples in micro_batches:
        T = max(len(m) for _, _, m in samples)

        def pad(i, fill=0.0):
            return torch.stack([torch.cat([t[i], torch.full((T - len(t[i]),), fill, dtype=F64)]) for t in samples])

        old, rollout, mask = pad(0, -1.0), pad(1, -1.0), pad(2)
        _, m = policy_loss(AlgorithmConfig(calculate_per_token_loss=per_token), old.clone(), old,
                           torch.ones_like(old), mask, rollout_log_probs=rollout)
        weight = float(mask.sum()) / tokens if per_token else len(samples) / n
        out += float(m[name]) * weight
    return out


def sample(gaps: list[float], mask: list[int]) -> tuple:
    """One sample's (old, rollout, mask): π_old −1 on each response token, the engine off by ``gaps``."""
    old = torch.full((len(gaps),), -1.0, dtype=F64)
    return old, old - torch.tensor(gaps, dtype=F64), torch.tensor(mask, dtype=F64)


# per-sample masks of different lengths, a masked token far off, a FAILED sample (no loss token, placeholder
# engine log-probs 0 against π_old −1), and micro-batches of 2 and 3 samples
STEP = [[sample([0.1, 0.3, 5.0], [1, 1, 0]), sample([0.002], [1])],
        [sample([0.01, 0.02, 0.03, 0.04], [1, 1, 1, 1]), sample([-1.0, -1.0], [0, 0]), sample([0.5, 0.0], [1, 0])]]


@pytest.mark.parametrize("per_token", [False, True], ids=["sample_mean", "per_token"])
def test_the_engine_gap_is_relax_s_sum_of_sample_mean(per_token):
    """train_rollout_logprob_abs_diff (and the prob variant, the same reducer) is Relax's number on a step whose
    samples have loss masks of different lengths: the mean over the step's samples of each one's mean |Δ| over its
    loss tokens (a sample with none counts 0, and counts), or the token mean with calculate_per_token_loss."""
    step = STEP if not per_token else [[s for s in mb if float(s[2].sum()) > 0] for mb in STEP]
    want = relax_reported(step, per_token)
    close(torch.tensor(relax_hpc_reported(step, per_token), dtype=F64), want, tol=1e-12)
    # the prob variant: the same formula on exp(old) − exp(rollout)
    probs = [[(torch.exp(o), torch.exp(r), m) for o, r, m in mb] for mb in step]
    close(torch.tensor(relax_hpc_reported(step, per_token, "train_rollout_prob_abs_diff"), dtype=F64),
          relax_reported(probs, per_token), tol=1e-12)


def test_the_token_mean_is_not_relax_s_number():
    """The negative control: on the same step the mean over loss tokens (what relax_hpc reported before) is far from
    Relax's sample mean, so the test above tells them apart."""
    tokens = [(o - r).abs()[m != 0] for mb in STEP for o, r, m in mb]
    token_mean = float(torch.cat(tokens).mean())
    sample_mean = relax_reported(STEP)
    assert abs(token_mean - sample_mean) > 0.015, (token_mean, sample_mean)  # 0.1253 vs 0.1454
    assert abs(relax_hpc_reported(STEP) - token_mean) > 0.015


def test_masked_tokens_count_for_nothing_in_the_engine_gap():
    """A masked token's engine log-prob (an observation's, a failed sample's placeholder) is no engine's: changing it
    changes nothing; the loss mask decides, not a TIS function's reduction mask."""
    lp = torch.full((1, 3), -1.0, dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    for far in (-1.0, -50.0):
        rollout = torch.tensor([[-1.5, -1.0, far]], dtype=F64)
        _, m = policy_loss(AlgorithmConfig(), lp, lp, torch.ones_like(lp), mask, rollout_log_probs=rollout)
        close(m["train_rollout_logprob_abs_diff"], 0.5 / 2)
    cfg = AlgorithmConfig(get_mismatch_metrics=True, custom_tis_function_path=f"{__name__}:drop_last_token")
    _, m = policy_loss(cfg, lp, lp, torch.ones_like(lp), torch.ones(1, 3), rollout_log_probs=rollout)
    close(m["train_rollout_logprob_abs_diff"], (0.5 + 0.0 + 49.0) / 3)  # the loss mask's 3 tokens, TIS dropped one
