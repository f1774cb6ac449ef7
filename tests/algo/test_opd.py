"""On-policy distillation's objective (relax_hpc/algo/opd.py), against values computed by hand: the per-token
divergences, the advantage penalty, the loss term, only_reward, the clips, and non-finite teacher log-probs."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from relax_hpc.algo import AlgorithmConfig, OPDConfig, policy_loss
from relax_hpc.algo.advantages import compute_advantages, finish_advantages, masked_whiten
from relax_hpc.algo.opd import apply_opd_penalty, opd_loss, opd_signal, sampled_kl, topk_kl

OPD = OPDConfig(teacher_url="http://teacher:30000/generate")
LOSS_FORM = dataclasses.replace(OPD, kl_coef=0.0, loss_coef=0.5)

# student and teacher log-probs of the sampled tokens; D = s - t = [0.5, -1, 0] | [1, 2, 9 (masked)]
S = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -0.5, -1.0]])
T = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -2.5, -10.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
D = torch.tensor([[0.5, -1.0, 0.0], [1.0, 2.0, 9.0]])

# top-2 probabilities (the rest, 0.2, is the tail bin): hand values with math.log below
PS, PT = [0.5, 0.3], [0.4, 0.4]


def lp(ps):
    return torch.tensor([[math.log(p) for p in ps]], dtype=torch.float64)


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def jsd(p, q, alpha):
    m = [(1 - alpha) * a + alpha * b for a, b in zip(p, q)]
    return (1 - alpha) * kl(p, m) + alpha * kl(q, m)


# --- the per-token divergence -----------------------------------------------------------------------------

def test_reverse_kl_of_the_sampled_token_is_student_minus_teacher():
    assert torch.allclose(sampled_kl(S, T, "reverse_kl"), D)


def test_low_var_kl_is_k3_unclamped():
    got = sampled_kl(torch.tensor([-1.0, -2.0, -0.5, -1.0]), torch.tensor([-1.5, -1.0, -0.5, -30.0]), "low_var_kl")
    want = [math.exp(-0.5) - 1 + 0.5, math.e - 2, 0.0, math.exp(-29.0) - 1 + 29.0]  # 28.0: no clamp at 10
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_a_jsd_of_one_sampled_token_is_refused():
    with pytest.raises(ValueError, match="top-k"):
        sampled_kl(S, T, "jsd")


@pytest.mark.parametrize("alpha, want", [(0.5, 0.006367198333995731), (0.25, 0.0048042869539443095)])
def test_jsd_over_top_k_with_a_tail_bin(alpha, want):
    full_s, full_t = PS + [0.2], PT + [0.2]
    assert jsd(full_s, full_t, alpha) == pytest.approx(want, rel=1e-12)
    got = topk_kl(lp(PS), lp(PT), "jsd", jsd_alpha=alpha, norm_mode="tail")
    assert got.shape == (1,) and float(got) == pytest.approx(want, rel=1e-9)


def test_top_k_reverse_and_forward_kl_are_jsd_at_its_ends():
    full_s, full_t = PS + [0.2], PT + [0.2]
    assert float(topk_kl(lp(PS), lp(PT), "reverse_kl")) == pytest.approx(kl(full_s, full_t), rel=1e-9)
    assert float(topk_kl(lp(PS), lp(PT), "forward_kl")) == pytest.approx(kl(full_t, full_s), rel=1e-9)
    assert float(topk_kl(lp(PS), lp(PT), "jsd", jsd_alpha=0.0)) == pytest.approx(kl(full_s, full_t), rel=1e-9)


def test_norm_mode_renormalizes_the_top_k_and_trunc_takes_them_as_they_are():
    norm = kl([0.625, 0.375], [0.5, 0.5])  # 0.5/0.8, 0.3/0.8 against 0.4/0.8, 0.4/0.8
    assert float(topk_kl(lp(PS), lp(PT), "reverse_kl", norm_mode="norm")) == pytest.approx(norm, rel=1e-9)
    assert float(topk_kl(lp(PS), lp(PT), "reverse_kl", norm_mode="trunc")) == pytest.approx(kl(PS, PT), rel=1e-9)


def test_padded_top_k_ids_carry_no_mass():
    s = torch.cat([lp(PS), torch.tensor([[-3.0]], dtype=torch.float64)], dim=-1)
    t = torch.cat([lp(PT), torch.tensor([[-7.0]], dtype=torch.float64)], dim=-1)
    mask = torch.tensor([[True, True, False]])
    for kind in ("reverse_kl", "jsd", "low_var_kl"):
        assert float(topk_kl(s, t, kind, mask=mask)) == pytest.approx(float(topk_kl(lp(PS), lp(PT), kind)), rel=1e-9)
    # -inf sentinels (an id a model gave no mass) are 0·log 0 = 0, not NaN
    s_inf = torch.cat([lp(PS), torch.tensor([[-math.inf]], dtype=torch.float64)], dim=-1)
    t_inf = torch.cat([lp(PT), torch.tensor([[-math.inf]], dtype=torch.float64)], dim=-1)
    assert float(topk_kl(s_inf, t_inf, "reverse_kl")) == pytest.approx(kl(PS + [0.2], PT + [0.2]), rel=1e-9)


def test_log_prob_min_clamp_bounds_both_sides_first():
    got = sampled_kl(torch.tensor([-30.0, -1.0]), torch.tensor([-50.0, -40.0]), "reverse_kl", log_prob_min_clamp=-20.0)
    assert got.tolist() == [0.0, 19.0]  # (-20) - (-20), (-1) - (-20)


def test_per_token_clip_caps_d_from_above_and_says_where():
    cfg = dataclasses.replace(OPD, per_token_clip=1.5)
    d, clipped = opd_signal(cfg, S, T)
    assert d.tolist() == [[0.5, -1.0, 0.0], [1.0, 1.5, 1.5]]  # negative values are not lifted
    assert clipped.tolist() == [[0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]


# --- the advantage form -------------------------------------------------------------------------------------

def test_penalty_moves_each_loss_token_by_exactly_minus_coef_times_d():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]])
    cfg = dataclasses.replace(OPD, kl_coef=0.3)
    out, metrics = apply_opd_penalty(cfg, adv, MASK, S, T)
    assert torch.allclose(out - adv, torch.tensor([[-0.15, 0.3, 0.0], [-0.3, -0.6, 0.0]]))  # masked token untouched
    assert metrics["opd/kl"] == pytest.approx((0.5 - 1.0 + 0.0 + 1.0 + 2.0) / 5)
    assert metrics["opd/reverse_kl"] == pytest.approx(0.5)
    assert metrics["opd/teacher_log_prob"] == pytest.approx((-1.5 - 1.0 - 0.5 - 2.0 - 2.5) / 5)
    assert metrics["opd/student_log_prob"] == pytest.approx((-1.0 - 2.0 - 0.5 - 1.0 - 0.5) / 5)
    assert "opd/per_token_clip_frac" not in metrics


def test_only_reward_leaves_the_opd_term_alone():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]])
    out, _ = apply_opd_penalty(dataclasses.replace(OPD, only_reward=True), adv, MASK, S, T)
    assert torch.allclose(out, -D * MASK)
    loss_form, _ = apply_opd_penalty(dataclasses.replace(LOSS_FORM, only_reward=True), adv, MASK, S, T)
    assert torch.equal(loss_form, torch.zeros_like(adv))  # loss form: the advantages are 0, the loss trains


def test_the_loss_form_leaves_advantages_as_they_are_and_still_reports():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]])
    out, metrics = apply_opd_penalty(LOSS_FORM, adv, MASK, S, T)
    assert torch.equal(out, adv) and metrics["opd/reverse_kl"] == pytest.approx(0.5)


def test_penalty_with_per_token_clip_in_the_sampled_path():
    cfg = dataclasses.replace(OPD, per_token_clip=1.5)
    out, metrics = apply_opd_penalty(cfg, torch.zeros(2, 3), MASK, S, T)
    assert out.tolist() == [[-0.5, 1.0, -0.0], [-1.0, -1.5, 0.0]]
    assert metrics["opd/per_token_clip_frac"] == pytest.approx(1 / 5)


def test_penalty_from_top_k_needs_both_sides():
    cfg = dataclasses.replace(OPD, kl_type="jsd", token_selection="student_topk", log_prob_top_k=2)
    out, metrics = apply_opd_penalty(cfg, torch.zeros(1, 1), torch.ones(1, 1), None, None,
                                     student_topk=lp(PS).unsqueeze(0), teacher_topk=lp(PT).unsqueeze(0))
    assert float(out) == pytest.approx(-0.006367198333995731, rel=1e-6)  # the advantages are float32
    assert "opd/teacher_log_prob" not in metrics  # no sampled-token teacher log-probs given
    with pytest.raises(ValueError, match="top-k"):
        apply_opd_penalty(cfg, torch.zeros(1, 1), torch.ones(1, 1), S[:1, :1], T[:1, :1])


def test_the_penalty_comes_before_whitening():
    algo = AlgorithmConfig(normalize_advantages=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    out, metrics = finish_advantages(algo, adv, MASK.bool(), opd=OPD, student_log_probs=S, teacher_log_probs=T)
    assert torch.allclose(out, masked_whiten(adv - D * MASK, MASK.bool()))
    assert "opd/kl" in metrics
    off, none = finish_advantages(algo, adv, MASK.bool(), opd=dataclasses.replace(OPD, enabled=False),
                                  student_log_probs=S, teacher_log_probs=T)
    assert torch.allclose(off, masked_whiten(adv, MASK.bool())) and none == {}
    # without opd, broadcast/compute_advantages are what they were
    rewards = torch.tensor([1.0, 0.0])
    assert torch.allclose(compute_advantages(algo, rewards, 2, MASK), masked_whiten(
        torch.tensor([[0.7071, 0.7071, 0.7071], [-0.7071, -0.7071, 0.0]]), MASK.bool()), atol=1e-3)


# --- the loss form ------------------------------------------------------------------------------------------

def test_loss_form_value_and_gradient():
    """reverse_kl: D̄ = mean over samples of each sample's token mean of s − t; its gradient is loss_coef/(B·n_i)
    on each of sample i's loss tokens (Relax's: the teacher is data)."""
    s = S.clone().requires_grad_(True)
    loss, metrics = opd_loss(LOSS_FORM, s, S, MASK, teacher_log_probs=T)
    want = ((0.5 - 1.0 + 0.0) / 3 + (1.0 + 2.0) / 2) / 2
    assert float(metrics["opd_loss"]) == pytest.approx(want)
    assert float(loss.detach()) == pytest.approx(0.5 * want)
    loss.backward()
    assert torch.allclose(s.grad, torch.tensor([[1 / 12, 1 / 12, 1 / 12], [1 / 8, 1 / 8, 0.0]]))
    per_token, _ = opd_loss(LOSS_FORM, S, S, MASK, teacher_log_probs=T, per_token=True)
    assert float(per_token) == pytest.approx(0.5 * (0.5 - 1.0 + 0.0 + 1.0 + 2.0) / 5)


def test_loss_form_is_clip_weights_d_by_the_capped_detached_ratio():
    cfg = dataclasses.replace(LOSS_FORM, is_clip=1.2)
    old = S - torch.tensor([[0.0, math.log(2.0), 0.0], [math.log(0.5), 0.0, 0.0]])  # ratios 1, 2, 1 | 0.5, 1
    s = S.clone().requires_grad_(True)
    loss, metrics = opd_loss(cfg, s, old, MASK, teacher_log_probs=T)
    w = torch.tensor([[1.0, 1.2, 1.0], [0.5, 1.0, 0.0]])
    want = ((0.5 - 1.2 + 0.0) / 3 + (0.5 + 2.0) / 2) / 2
    assert float(loss.detach()) == pytest.approx(0.5 * want, rel=1e-6)
    assert float(metrics["opd_is_clip_frac"]) == pytest.approx((1 / 3 + 0) / 2)
    loss.backward()
    assert torch.allclose(s.grad, 0.5 * w / torch.tensor([[6.0], [4.0]]))  # the ratio carries no gradient


def test_loss_form_per_token_clip_reports_its_fraction():
    cfg = dataclasses.replace(LOSS_FORM, per_token_clip=1.5)
    loss, metrics = opd_loss(cfg, S, S, MASK, teacher_log_probs=T)
    assert float(metrics["opd_loss"]) == pytest.approx(((0.5 - 1.0) / 3 + (1.0 + 1.5) / 2) / 2)
    assert float(metrics["opd_per_token_clip_frac"]) == pytest.approx((0 + 1 / 2) / 2)


def test_policy_loss_adds_the_opd_term_and_its_metrics():
    algo = AlgorithmConfig()
    adv = torch.tensor([[1.0, -1.0, 0.5], [0.2, 0.3, 0.0]])
    base, m0 = policy_loss(algo, S, S, adv, MASK)
    with_opd, m1 = policy_loss(algo, S, S, adv, MASK, opd=LOSS_FORM, teacher_log_probs=T)
    assert float(with_opd - base) == pytest.approx(0.5 * float(m1["opd_loss"]))
    assert float(m1["loss"]) == pytest.approx(float(with_opd)) and "opd_loss" not in m0
    same, _ = policy_loss(algo, S, S, adv, MASK, opd=OPD, teacher_log_probs=T)  # advantage form: nothing here
    assert float(same) == pytest.approx(float(base))
    with pytest.raises(ValueError, match="teacher_log_probs"):
        policy_loss(algo, S, S, adv, MASK, opd=LOSS_FORM)


# --- non-finite teacher log-probs ---------------------------------------------------------------------------

def test_a_nan_teacher_log_prob_never_vanishes():
    bad = T.clone()
    bad[0, 1] = float("nan")
    out, metrics = apply_opd_penalty(OPD, torch.zeros(2, 3), MASK, S, bad)
    assert math.isnan(out[0, 1]) and math.isnan(metrics["opd/kl"]) and math.isnan(metrics["opd/teacher_log_prob"])
    assert torch.isfinite(out[torch.arange(6).reshape(2, 3) != 1]).all()  # the other tokens are unchanged
    loss, _ = opd_loss(LOSS_FORM, S, S, MASK, teacher_log_probs=bad)
    assert math.isnan(float(loss))  # the step's loss is not finite: train.nonfinite refuses the update
    inf = T.clone()
    inf[1, 0] = -float("inf")
    assert math.isinf(apply_opd_penalty(OPD, torch.zeros(2, 3), MASK, S, inf)[0][1, 0])


def test_the_trainers_door_refuses_a_non_finite_teacher_log_prob_masked_or_not():
    """As the other log-prob columns (docs/reliability.md): the step is skipped or the run fails, by train.nonfinite."""
    from relax_hpc.exchange.chunk import Ragged
    from relax_hpc.train.plan import UnsoundTrainData, check_train_columns

    def ragged(rows):
        data = np.concatenate([np.asarray(r, dtype=np.float32) for r in rows])
        return Ragged(data, np.cumsum([0] + [len(r) for r in rows]).astype(np.int64))

    good = {"raw_reward": np.zeros(2, np.float32), "index": np.array([10, 11]), "response_length": np.array([2, 1]),
            "teacher_log_probs": ragged([[-0.5, -1.0], [-2.0]])}
    check_train_columns(good)
    for value, what in ((float("nan"), "not finite"), (float("-inf"), "not finite"), (0.5, "above 0")):
        cols = dict(good, teacher_log_probs=ragged([[-0.5, -1.0], [value]]))
        with pytest.raises(UnsoundTrainData, match=what) as e:
            check_train_columns(cols)
        assert (e.value.field, e.value.sample) == ("teacher_log_probs", 1) and "index 11" in str(e.value)
