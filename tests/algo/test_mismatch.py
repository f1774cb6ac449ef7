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


def test_the_engine_gaps_count_only_loss_tokens():
    """A sample with no loss token (a failed one: placeholder log-prob 0 against the trainer's −1) and a masked
    token of a live sample count for nothing in train_rollout_logprob_abs_diff / train_rollout_prob_abs_diff, in
    both reduction modes: the mean is over the three tokens with loss mask 1 (|Δ| ln 2, ln 3, 0)."""
    lp = torch.full((2, 3), -1.0, dtype=F64)
    rollout = torch.cat([lp[:1] - torch.log(torch.tensor([[0.5, 3.0, 1.0]], dtype=F64)),
                         torch.zeros(1, 3, dtype=F64)])
    rollout[0, 2] = -1.0
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    want_lp = (math.log(2) + math.log(3)) / 3
    e = math.exp(-1)
    want_p = (abs(e - e / 0.5) + abs(e - e / 3.0)) / 3
    for per_token in (False, True):
        _, m = policy_loss(AlgorithmConfig(calculate_per_token_loss=per_token), lp, lp, torch.ones(2, 3, dtype=F64),
                           mask, rollout_log_probs=rollout)
        close(m["train_rollout_logprob_abs_diff"], want_lp)
        close(m["train_rollout_prob_abs_diff"], want_p)
    mask[0, 1] = 0.0  # a live sample's masked token (an observation): left out too
    _, m = policy_loss(AlgorithmConfig(), lp, lp, torch.ones(2, 3, dtype=F64), mask, rollout_log_probs=rollout)
    close(m["train_rollout_logprob_abs_diff"], math.log(2) / 2)
