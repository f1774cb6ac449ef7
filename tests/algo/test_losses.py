"""Policy losses, TIS, entropy, KL loss and reductions against values worked out by hand.

Inputs are built from chosen ratios r = π_θ/π_old: old_log_probs = log_probs − log r, so every expected
number below follows from r and A with pencil and paper.
"""

import math

import pytest
import torch

from relax_hpc.algo import AlgorithmConfig, policy_loss
from relax_hpc.algo.losses import cispo_loss, ppo_clip_loss, sapo_loss, sequence_log_ratio
from relax_hpc.algo.reductions import per_sample_mean, sample_mean, sum_of_sample_mean, token_mean

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


def close(actual, expected, tol=1e-7):
    torch.testing.assert_close(actual.to(F64), torch.as_tensor(expected, dtype=F64), rtol=0, atol=tol)


def inputs(ratios, lp=None):
    """log_probs (requires grad) and old_log_probs giving π_θ/π_old = ratios."""
    r = t(ratios)
    lp = torch.full_like(r, -1.0) if lp is None else t(lp)
    old = lp - torch.log(r)
    return lp.clone().requires_grad_(), old


# ---------------------------------------------------------------------------------------------- PPO clip
# token: r,   A  | −rA   −clip(r,0.8,1.2)A | loss  clipped | dL/dlp (= −rA if the unclipped term wins)
#  1   1.5   +1  | −1.5  −1.2              | −1.2   1      | 0
#  2   0.5   +1  | −0.5  −0.8              | −0.5   0      | −0.5
#  3   1.1   −1  |  1.1   1.1              |  1.1   0      | 1.1
#  4   0.7   −1  |  0.7   0.8              |  0.8   1      | 0
#  5   3.0   −1  |  3.0   1.2              |  3.0   0      | 3.0   (dual clip c=2: min(2, 3) = 2, grad 0)
R5 = [[1.5, 0.5, 1.1, 0.7, 3.0]]
A5 = [[1.0, 1.0, -1.0, -1.0, -1.0]]


def test_ppo_clip_per_token():
    ppo_kl = -torch.log(t(R5))
    loss, clipfrac = ppo_clip_loss(ppo_kl, t(A5), 0.2, 0.2)
    close(loss, [[-1.2, -0.5, 1.1, 0.8, 3.0]])
    close(clipfrac, [[1.0, 0.0, 0.0, 1.0, 0.0]])


def test_clip_high_widens_only_the_upper_bound():
    ppo_kl = -torch.log(t(R5))
    loss, clipfrac = ppo_clip_loss(ppo_kl, t(A5), 0.2, 0.6)  # upper bound 1.6: token 1 no longer clipped
    close(loss, [[-1.5, -0.5, 1.1, 0.8, 3.0]])
    close(clipfrac, [[0.0, 0.0, 0.0, 1.0, 0.0]])


def test_dual_clip_caps_negative_advantage_tokens():
    ppo_kl = -torch.log(t(R5))
    loss, _ = ppo_clip_loss(ppo_kl, t(A5), 0.2, 0.2, eps_clip_c=2.0)
    close(loss, [[-1.2, -0.5, 1.1, 0.8, 2.0]])
    with pytest.raises(ValueError):
        ppo_clip_loss(ppo_kl, t(A5), 0.2, 0.2, eps_clip_c=1.0)


def test_grpo_policy_loss_value_metrics_and_gradient():
    lp, old = inputs(R5)
    loss, m = policy_loss(AlgorithmConfig(), lp, old, t(A5), torch.ones(1, 5))
    close(loss, (-1.2 - 0.5 + 1.1 + 0.8 + 3.0) / 5)
    close(m["pg_loss"], 0.64)
    close(m["loss"], 0.64)
    close(m["pg_clipfrac"], 2 / 5)
    # ppo_kl = mean(log π_old − log π_θ) = −mean(log r)
    close(m["ppo_kl"], -sum(math.log(x) for x in R5[0]) / 5)
    assert set(m) == {"loss", "pg_loss", "pg_clipfrac", "ppo_kl"}
    assert all(not v.requires_grad for v in m.values())
    loss.backward()
    close(lp.grad, [[0.0, -0.5 / 5, 1.1 / 5, 0.0, 3.0 / 5]])


def test_dual_clip_through_policy_loss():
    lp, old = inputs(R5)
    loss, _ = policy_loss(AlgorithmConfig(eps_clip_c=2.0), lp, old, t(A5), torch.ones(1, 5))
    close(loss, (-1.2 - 0.5 + 1.1 + 0.8 + 2.0) / 5)
    loss.backward()
    close(lp.grad, [[0.0, -0.5 / 5, 1.1 / 5, 0.0, 0.0]])


def test_clip_high_through_policy_loss():
    lp, old = inputs(R5)
    loss, m = policy_loss(AlgorithmConfig(eps_clip_high=0.6), lp, old, t(A5), torch.ones(1, 5))
    close(loss, (-1.5 - 0.5 + 1.1 + 0.8 + 3.0) / 5)
    close(m["pg_clipfrac"], 1 / 5)


# ---------------------------------------------------------------------------------------------- reductions
def test_sample_mean_vs_token_mean_and_padding_is_ignored():
    # ratio 1 everywhere → per-token loss −A. Sample 0 has 3 valid tokens, sample 1 has 1 (+ 2 padding
    # positions holding NaN log-probs and junk advantages, which must not leak into loss or gradient).
    mask = t([[1, 1, 1], [1, 0, 0]])
    adv = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    lp = t([[-1.0, -1.0, -1.0], [-1.0, float("nan"), float("nan")]]).requires_grad_()
    old = t([[-1.0, -1.0, -1.0], [-1.0, float("nan"), 5.0]])
    # default: mean over samples of each sample's token mean = ((−6)/3 + (−4))/2 = −3
    loss, m = policy_loss(AlgorithmConfig(), lp, old, adv, mask)
    close(loss, -3.0)
    loss.backward()
    # d/dlp of −rA at r = 1 is −A, times 1/(3·2) for sample 0 and 1/(1·2) for sample 1
    close(lp.grad, [[-1 / 6, -2 / 6, -3 / 6], [-4 / 2, 0.0, 0.0]])
    # per-token: −(1+2+3+4)/4 = −2.5
    lp2 = lp.detach().clone().requires_grad_()
    loss, _ = policy_loss(AlgorithmConfig(calculate_per_token_loss=True), lp2, old, adv, mask)
    close(loss, -2.5)
    loss.backward()
    close(lp2.grad, [[-1 / 4, -2 / 4, -3 / 4], [-4 / 4, 0.0, 0.0]])


def test_bool_mask_equals_float_mask():
    lp, old = inputs([[1.5, 0.9], [1.0, 1.0]])
    adv = t([[1.0, -1.0], [2.0, 2.0]])
    a, _ = policy_loss(AlgorithmConfig(), lp, old, adv, t([[1, 1], [1, 0]]))
    b, _ = policy_loss(AlgorithmConfig(), lp, old, adv, torch.tensor([[True, True], [True, False]]))
    close(a, b.detach())
    # sample 0: (−1.2 + 0.9)/2 = −0.15 ; sample 1: −2 → mean −1.075
    close(a, -1.075)


def test_reduction_helpers():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = t([[1, 1, 0], [0, 0, 1], [0, 0, 0]])
    close(per_sample_mean(x, mask), [1.5, 6.0, 0.0])  # an all-masked sample contributes 0
    close(sum_of_sample_mean(x, mask), 7.5)
    close(sample_mean(x, mask), 2.5)  # ... but still counts as a sample
    close(token_mean(x, mask), 3.0)  # (1 + 2 + 6) / 3
    close(token_mean(x, torch.zeros_like(x)), 0.0)


def test_all_masked_batch_gives_zero_loss_with_a_graph():
    lp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, m = policy_loss(AlgorithmConfig(), lp, torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64),
                          torch.zeros(2, 3))
    close(loss, 0.0)
    loss.backward()
    close(lp.grad, torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------------- GSPO
def test_gspo_uses_the_sequence_mean_log_ratio():
    # valid log-ratios log π_θ − log π_old = 0.05, 0.15 (third token is padding)
    # δ_seq = −0.1 → r = e^0.1 = 1.1051709180756477 for every token; A = 1, inside the clip: loss −r
    lp = t([[0.05, 0.15, 0.0]]).requires_grad_()
    old = t([[0.0, 0.0, 7.0]])
    mask = t([[1, 1, 0]])
    adv = t([[1.0, 1.0, 0.0]])
    loss, m = policy_loss(AlgorithmConfig(advantage_estimator="gspo"), lp, old, adv, mask)
    close(loss, -1.1051709180756477)
    close(m["ppo_kl"], -0.1)
    close(m["pg_clipfrac"], 0.0)
    loss.backward()
    # L = −exp(mean(lp − old)): dL/dlp_t = −r / 2 for each of the 2 valid tokens
    close(lp.grad, [[-1.1051709180756477 / 2, -1.1051709180756477 / 2, 0.0]])
    # GRPO on the same tokens differs: −(e^0.05 + e^0.15)/2
    lp2 = lp.detach().clone().requires_grad_()
    grpo, _ = policy_loss(AlgorithmConfig(), lp2, old, adv, mask)
    close(grpo, -(math.exp(0.05) + math.exp(0.15)) / 2)


def test_gspo_clips_the_sequence_ratio():
    # log-ratios 0.2, 0.4 → δ_seq = −0.3, r = e^0.3 = 1.35 > 1.2: clipped to −1.2, no gradient
    lp = t([[0.2, 0.4]]).requires_grad_()
    loss, m = policy_loss(AlgorithmConfig(advantage_estimator="gspo"), lp, t([[0.0, 0.0]]), t([[1.0, 1.0]]),
                          t([[1, 1]]))
    close(loss, -1.2)
    close(m["pg_clipfrac"], 1.0)
    loss.backward()
    close(lp.grad, [[0.0, 0.0]])


def test_sequence_log_ratio():
    out = sequence_log_ratio(t([[0.1, 0.3, 9.0], [0.0, 0.0, 0.0]]), t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
                             t([[1, 1, 0], [0, 0, 0]]))
    close(out, [[-0.2], [0.0]])


# ---------------------------------------------------------------------------------------------- SAPO
# σ(1) = 0.7310585786300049; 4σ(1)(1−σ(1)) = 0.7864477329659274
SIG1 = 0.7310585786300049


def test_sapo_gate_values():
    # r = 1: σ(0) = 1/2 → loss −(4/τ)(1/2)A = −2A/τ ; weight 4·¼ = 1 → not "clipped"
    # (A=+1, τ=1) → −2 ; (A=−1, τ=1.05) → 2/1.05 ; (A=0, τ=1.05) → 0 ; (r=2, A=+1, τ=1) → −4σ(1)
    # near the 0.9 threshold: r = 1.65: σ(0.65) = 0.6570104626734988, 4σ(1−σ) = 0.9013... → kept
    #                         r = 1.7:  σ(0.7) = 0.6681877721681662, 4σ(1−σ) = 0.8868... → "clipped"
    ppo_kl = -torch.log(t([[1.0, 1.0, 1.0, 2.0, 1.65, 1.7]]))
    loss, clipfrac = sapo_loss(ppo_kl, t([[1.0, -1.0, 0.0, 1.0, 1.0, 1.0]]), 1.0, 1.05)
    close(loss, [[-2.0, 2 / 1.05, 0.0, -4 * SIG1, -4 * 0.6570104626734988, -4 * 0.6681877721681662]])
    close(clipfrac, [[0.0, 0.0, 0.0, 1.0, 0.0, 1.0]])  # 0.786 and 0.887 < 0.9


def test_sapo_policy_loss_and_gradient():
    lp, old = inputs([[1.0, 1.0, 2.0]])
    loss, m = policy_loss(AlgorithmConfig(advantage_estimator="sapo"), lp, old, t([[1.0, -1.0, 1.0]]),
                          torch.ones(1, 3))
    close(loss, (-2.0 + 2 / 1.05 - 4 * SIG1) / 3)
    close(m["pg_clipfrac"], 1 / 3)
    loss.backward()
    # dL/dlp = −4σ(1−σ)·r·A (τ cancels): r=1,A=1 → −1 ; r=1,A=−1 → +1 ; r=2,A=1 → −2·0.78645
    close(lp.grad, [[-1 / 3, 1 / 3, -2 * 0.7864477329659274 / 3]])


def test_sapo_temperatures_change_the_loss():
    lp, old = inputs([[2.0]])
    loss, _ = policy_loss(AlgorithmConfig(advantage_estimator="sapo", sapo_tau_pos=2.0), lp, old, t([[1.0]]),
                          torch.ones(1, 1))
    # τ = 2, r = 2: −(4/2)·σ(2) = −2·0.8807970779778823
    close(loss, -2 * 0.8807970779778823)


# ---------------------------------------------------------------------------------------------- CISPO
def test_cispo_loss_and_gradient_only_through_log_probs():
    # r, A → coef: (1.5,+1) → min(1.5,1.2) = 1.2 clipped ; (0.5,+1) → 0.5 ; (0.5,−1) → max(0.5,0.8) = 0.8
    # clipped ; (1.5,−1) → 1.5. loss = −coef·A·log π_θ with log π_θ = −1, −2, −0.5, −0.25
    lp, old = inputs([[1.5, 0.5, 0.5, 1.5]], lp=[[-1.0, -2.0, -0.5, -0.25]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    per_token, clipfrac = cispo_loss(lp, old - lp, adv, 0.2, 0.2)
    close(per_token, [[1.2, 1.0, -0.4, -0.375]])
    close(clipfrac, [[1.0, 0.0, 1.0, 0.0]])
    loss, m = policy_loss(AlgorithmConfig(advantage_estimator="cispo"), lp, old, adv, torch.ones(1, 4))
    close(loss, (1.2 + 1.0 - 0.4 - 0.375) / 4)
    close(m["pg_clipfrac"], 0.5)
    loss.backward()
    close(lp.grad, [[-1.2 / 4, -0.5 / 4, 0.8 / 4, 1.5 / 4]])  # −coef·A, every token keeps a gradient


# ---------------------------------------------------------------------------------------------- TIS
def tis_case():
    # ratio 1 (old = lp = −1), A = 1 → per-token pg −1. π_old/π_roll = 0.5, 3.0, 1.0
    lp = torch.full((1, 3), -1.0, dtype=F64, requires_grad=True)
    old = torch.full((1, 3), -1.0, dtype=F64)
    rollout = old - torch.log(t([[0.5, 3.0, 1.0]]))
    return lp, old, rollout, torch.ones(1, 3, dtype=F64), torch.ones(1, 3)


def test_tis_truncates_and_weights_the_pg_loss():
    lp, old, rollout, adv, mask = tis_case()
    loss, m = policy_loss(AlgorithmConfig(use_tis=True), lp, old, adv, mask, rollout_log_probs=rollout)
    # weights clamp(·, 0, 2) = 0.5, 2.0, 1.0 → (−0.5 − 2 − 1)/3
    close(loss, -3.5 / 3)
    close(m["tis"], (0.5 + 3.0 + 1.0) / 3)
    close(m["tis_clipfrac"], 1 / 3)
    close(m["tis_abs"], (0.5 + 2.0 + 0.0) / 3)
    close(m["ois"], 1.0)
    close(m["train_rollout_logprob_abs_diff"], (math.log(2) + math.log(3)) / 3)
    e = math.exp(-1)
    close(m["train_rollout_prob_abs_diff"], (abs(e - e / 0.5) + abs(e - e / 3.0)) / 3)
    loss.backward()
    close(lp.grad, [[-0.5 / 3, -2.0 / 3, -1.0 / 3]])  # weights are constants


def test_tis_clip_low_and_high():
    lp, old, rollout, adv, mask = tis_case()
    loss, m = policy_loss(AlgorithmConfig(use_tis=True, tis_clip_low=0.6, tis_clip=2.5), lp, old, adv, mask,
                          rollout_log_probs=rollout)
    close(loss, -(0.6 + 2.5 + 1.0) / 3)
    close(m["tis_clipfrac"], 2 / 3)


def test_icepop_drops_tokens_outside_the_band():
    lp, old, rollout, adv, mask = tis_case()
    cfg = AlgorithmConfig(use_tis=True, custom_tis_function_path="relax_hpc.algo.tis.icepop_function")
    loss, m = policy_loss(cfg, lp, old, adv, mask, rollout_log_probs=rollout)
    close(loss, -(0.5 + 0.0 + 1.0) / 3)
    close(m["tis_clipfrac"], 1 / 3)


def test_custom_tis_function_can_change_the_reduction_mask():
    lp, old, rollout, adv, mask = tis_case()
    cfg = AlgorithmConfig(use_tis=True, custom_tis_function_path=f"{__name__}:drop_middle_token")
    loss, m = policy_loss(cfg, lp, old, adv, mask, rollout_log_probs=rollout)
    close(loss, -1.0)  # two tokens left, each −1, averaged over 2
    close(m["custom_metric"], 7.0)


def drop_middle_token(cfg, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask):
    mask = loss_mask.clone()
    mask[:, 1] = 0
    return pg_loss, mask, {"custom_metric": torch.full_like(pg_loss, 7.0)}


def test_mismatch_metrics_alone_do_not_weight_the_loss():
    lp, old, rollout, adv, mask = tis_case()
    loss, m = policy_loss(AlgorithmConfig(get_mismatch_metrics=True), lp, old, adv, mask, rollout_log_probs=rollout)
    close(loss, -1.0)
    close(m["tis"], 1.5)


def test_use_rollout_logprobs_makes_them_pi_old():
    # rollout log-probs give r = π_θ/π_roll = 1.5, A = 1 → clipped at −1.2; old_log_probs may be None
    lp = t([[-1.0]]).requires_grad_()
    rollout = t([[-1.0 - math.log(1.5)]])
    loss, m = policy_loss(AlgorithmConfig(use_rollout_logprobs=True), lp, None, t([[1.0]]), t([[1]]),
                          rollout_log_probs=rollout)
    close(loss, -1.2)
    close(m["train_rollout_logprob_abs_diff"], math.log(1.5))  # this forward vs the engine


# ---------------------------------------------------------------------------------------------- entropy, KL
def test_entropy_bonus_uses_the_same_reduction():
    # A = 0 so pg = 0. entropy: sample 0 valid [0.5, 1.0] → 0.75 ; sample 1 valid [2.0] → 2.0 ; mean 1.375
    mask = t([[1, 1, 0], [1, 0, 0]])
    ent = t([[0.5, 1.0, 9.0], [2.0, 9.0, 9.0]]).requires_grad_()
    lp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, m = policy_loss(AlgorithmConfig(entropy_coef=0.1), lp, torch.zeros(2, 3, dtype=F64),
                          torch.zeros(2, 3, dtype=F64), mask, entropy=ent)
    close(m["entropy_loss"], 1.375)
    close(loss, -0.1375)
    loss.backward()
    close(ent.grad, [[-0.1 / 4, -0.1 / 4, 0.0], [-0.1 / 2, 0.0, 0.0]])
    # per-token: (0.5 + 1 + 2)/3
    _, m = policy_loss(AlgorithmConfig(calculate_per_token_loss=True), lp, torch.zeros(2, 3, dtype=F64),
                       torch.zeros(2, 3, dtype=F64), mask, entropy=ent)
    close(m["entropy_loss"], 3.5 / 3)


def test_entropy_coef_without_entropy_is_an_error():
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(AlgorithmConfig(entropy_coef=0.01), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1),
                    torch.ones(1, 1))


# d = log π_θ − log π_ref = [0.5, 0]; A = 0 so only the KL term is in the loss
KL_EXPECTED = {"k1": 0.25, "k2": 0.0625, "k3": 0.10653065971263342 / 2, "low_var_kl": 0.10653065971263342 / 2}


@pytest.mark.parametrize("kind", list(KL_EXPECTED))
def test_kl_loss_each_estimator(kind):
    lp = t([[0.0, -1.0]]).requires_grad_()
    ref = t([[-0.5, -1.0]])
    cfg = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type=kind)
    loss, m = policy_loss(cfg, lp, lp.detach(), torch.zeros(1, 2, dtype=F64), torch.ones(1, 2), ref_log_probs=ref)
    close(m["kl_loss"], KL_EXPECTED[kind])
    close(loss, 0.5 * KL_EXPECTED[kind])
    loss.backward()
    # 0.5 · (1/2) · dk/dlp at d = 0.5 and d = 0
    dk = {"k1": [1.0, 1.0], "k2": [0.5, 0.0], "k3": [1 - math.exp(-0.5), 0.0], "low_var_kl": [1 - math.exp(-0.5), 0.0]}
    close(lp.grad, [[0.25 * dk[kind][0], 0.25 * dk[kind][1]]])


def test_unbiased_kl_multiplies_by_the_ratio_to_pi_old():
    # π_θ/π_old = 2 on token 0, 1 on token 1; k1 = [0.5, 0] → [1.0, 0] → mean 0.5
    lp = t([[0.0, -1.0]]).requires_grad_()
    old = t([[-math.log(2), -1.0]])
    cfg = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=1.0, use_unbiased_kl=True)
    _, m = policy_loss(cfg, lp, old, torch.zeros(1, 2, dtype=F64), torch.ones(1, 2), ref_log_probs=t([[-0.5, -1.0]]))
    close(m["kl_loss"], 0.5)


def test_kl_loss_needs_ref_log_probs():
    with pytest.raises(ValueError, match="ref_log_probs"):
        policy_loss(AlgorithmConfig(use_kl_loss=True), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1),
                    torch.ones(1, 1))


def test_tis_needs_rollout_log_probs():
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss(AlgorithmConfig(use_tis=True), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1),
                    torch.ones(1, 1))


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(AlgorithmConfig(), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_combined_loss_is_pg_plus_kl_minus_entropy():
    lp, old = inputs([[1.5, 0.5]])
    cfg = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1", entropy_coef=0.1)
    ref = lp.detach() - 0.5  # k1 = 0.5 on both tokens
    loss, m = policy_loss(cfg, lp, old, t([[1.0, 1.0]]), torch.ones(1, 2), ref_log_probs=ref,
                          entropy=t([[1.0, 3.0]]))
    # pg: (−1.2 − 0.5)/2 = −0.85 ; kl 0.5 ; entropy 2.0 → −0.85 + 0.25 − 0.2
    close(m["pg_loss"], -0.85)
    close(loss, -0.8)
    assert set(m) == {"loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "kl_loss"}


# ---------------------------------------------------------------------------------------------- OPSM
def test_opsm_drops_off_policy_negative_sequences():
    # seq 0: A = −1, δ_seq = 0.01 > 1e-4 → dropped ; seq 1: A = −1, δ_seq = 0 → kept (loss −rA = 1)
    # seq 2: A = +1, δ_seq = 0.01 → kept (positive advantage), loss −e^−0.01
    lp = torch.full((3, 2), -1.0, dtype=F64, requires_grad=True)
    old = t([[-0.99, -0.99], [-1.0, -1.0], [-0.99, -0.99]])
    adv = t([[-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0]])
    loss, m = policy_loss(AlgorithmConfig(use_opsm=True), lp, old, adv, torch.ones(3, 2))
    close(loss, (0.0 + 1.0 - math.exp(-0.01)) / 3)
    close(m["opsm_clipfrac"], 1 / 3)


# ---------------------------------------------------------------------------------------------- gradcheck
CONFIGS = [
    AlgorithmConfig(),
    AlgorithmConfig(eps_clip_high=0.28, eps_clip_c=3.0),
    AlgorithmConfig(advantage_estimator="gspo"),
    AlgorithmConfig(advantage_estimator="sapo"),
    AlgorithmConfig(use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01),
    AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2", use_unbiased_kl=True,
                    calculate_per_token_loss=True),
]


# CISPO is left out on purpose: its ratio coefficient is stop-gradient, so its gradient is not the
# derivative of its loss value (checked by hand in test_cispo_loss_and_gradient_only_through_log_probs).
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.advantage_estimator}-tis{c.use_tis}-kl{c.kl_loss_type}")
def test_gradcheck(cfg):
    g = torch.Generator().manual_seed(1)
    shape = (3, 4)
    lp = (-torch.rand(shape, generator=g, dtype=F64) * 2 - 0.1).requires_grad_()
    old = lp.detach() + (torch.rand(shape, generator=g, dtype=F64) - 0.5) * 0.8
    adv = torch.randn(shape, generator=g, dtype=F64)
    ref = lp.detach() + (torch.rand(shape, generator=g, dtype=F64) - 0.5)
    rollout = old + (torch.rand(shape, generator=g, dtype=F64) - 0.5)
    ent = (torch.rand(shape, generator=g, dtype=F64) * 3).requires_grad_()
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0]])

    def f(log_probs, entropy):
        loss, _ = policy_loss(cfg, log_probs, old, adv, mask, ref_log_probs=ref, rollout_log_probs=rollout,
                              entropy=entropy)
        return loss

    assert torch.autograd.gradcheck(f, (lp, ent))
