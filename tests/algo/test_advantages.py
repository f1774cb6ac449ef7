"""Reward normalization and advantage broadcast against values worked out by hand."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax_hpc.algo import AlgorithmConfig
from relax_hpc.algo.advantages import (
    broadcast_advantages,
    compute_advantages,
    group_normalize,
    masked_whiten,
    postprocess_rewards,
    segment_group_normalize,
)

EPS = 1e-6
# Two groups of 4.
# group 1: [1, 0, 0, 1]: mean 0.5, centered ±0.5, unbiased std sqrt(4·0.25/3) = sqrt(1/3)
# group 2: [2, 2, 2, 5]: mean 2.75, centered [-0.75, -0.75, -0.75, 2.25], std sqrt(6.75/3) = 1.5
RAW = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
CENTERED = [0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]
S1 = math.sqrt(1 / 3) + EPS
S2 = 1.5 + EPS
GRPO = [0.5 / S1, -0.5 / S1, -0.5 / S1, 0.5 / S1, -0.75 / S2, -0.75 / S2, -0.75 / S2, 2.25 / S2]


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0, atol=tol)


def test_group_mean_and_std():
    close(group_normalize(RAW, 4), GRPO)
    assert GRPO[0] == pytest.approx(0.8660239, abs=1e-6)  # the hand formula is what we think it is


def test_std_off_is_mean_only():
    close(group_normalize(RAW, 4, std_normalization=False), CENTERED)


def test_groups_are_consecutive_samples():
    # n = 2 pairs [1,0] [0,1] [2,2] [2,5]: centered ±0.5, 0, ∓1.5; std of a pair ±a is a·sqrt(2)
    s05 = 0.5 * math.sqrt(2) + EPS
    s15 = 1.5 * math.sqrt(2) + EPS
    close(group_normalize(RAW, 2), [0.5 / s05, -0.5 / s05, -0.5 / s05, 0.5 / s05, 0.0, 0.0, -1.5 / s15, 1.5 / s15])


def test_all_equal_group_gives_zero_and_single_sample_groups_give_zero():
    close(group_normalize(torch.tensor([3.0, 3.0, 3.0]), 3), [0.0, 0.0, 0.0])
    close(group_normalize(torch.tensor([3.0, -1.0]), 1), [0.0, 0.0])
    close(group_normalize(torch.tensor([3.0, -1.0]), 1, std_normalization=False), [0.0, 0.0])


def test_partial_group_is_an_error():
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt = 4"):
        group_normalize(torch.ones(6), 4)
    with pytest.raises(ValueError):
        group_normalize(torch.ones(4), 0)


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "sapo", "cispo"])
def test_postprocess_follows_config(estimator):
    close(postprocess_rewards(AlgorithmConfig(advantage_estimator=estimator), RAW, 4), GRPO)
    dr = AlgorithmConfig(advantage_estimator=estimator, disable_grpo_std_normalization=True)
    close(postprocess_rewards(dr, RAW, 4), CENTERED)
    off = AlgorithmConfig(advantage_estimator=estimator, disable_rewards_normalization=True)
    close(postprocess_rewards(off, RAW, 4), RAW.tolist())


def test_postprocess_accepts_integer_rewards():
    out = postprocess_rewards(AlgorithmConfig(), torch.tensor([1, 0]), 2)
    assert out.dtype == torch.float32
    s = 0.5 * math.sqrt(2) + EPS
    close(out, [0.5 / s, -0.5 / s])


def test_broadcast_puts_the_reward_on_valid_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    close(broadcast_advantages(AlgorithmConfig(), torch.tensor([0.5, -1.0]), mask), [[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]])
    # a boolean mask and a mask with a hole in the middle (multi-turn: tool output tokens)
    hole = torch.tensor([[True, False, True]])
    close(broadcast_advantages(AlgorithmConfig(), torch.tensor([2.0]), hole), [[2.0, 0.0, 2.0]])


def test_broadcast_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="B = 3 rewards"):
        broadcast_advantages(AlgorithmConfig(), torch.zeros(3), torch.ones(2, 4))


def test_compute_advantages_end_to_end():
    # raw [1, 0] in one group of 2: centered ±0.5, std 0.5·sqrt(2) → ±0.7071...
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    a = 0.5 / (0.5 * math.sqrt(2) + EPS)
    close(compute_advantages(AlgorithmConfig(), torch.tensor([1.0, 0.0]), 2, mask), [[a, a, a], [-a, -a, 0.0]])
    dr = AlgorithmConfig(disable_grpo_std_normalization=True)
    close(compute_advantages(dr, torch.tensor([1.0, 0.0]), 2, mask), [[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0]])


def test_normalize_advantages_whitens_over_valid_tokens():
    # valid tokens hold 1, 1, 3: mean 5/3, Bessel variance ((2/3)²·2 + (4/3)²)/2 = 4/3
    # → (1 − 5/3)/sqrt(4/3) = −1/√3 and (3 − 5/3)/sqrt(4/3) = 2/√3; padding stays 0
    cfg = AlgorithmConfig(normalize_advantages=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = broadcast_advantages(cfg, torch.tensor([1.0, 3.0]), mask)
    r3 = math.sqrt(3)
    close(out, [[-1 / r3, -1 / r3], [2 / r3, 0.0]], tol=1e-5)


def test_whiten_single_token_and_empty_mask():
    # one valid token: no Bessel correction, variance 0 → (x − x)·rsqrt(eps) = 0
    close(masked_whiten(torch.tensor([[5.0, 7.0]]), torch.tensor([[1.0, 0.0]])), [[0.0, 0.0]])
    with pytest.raises(ValueError, match="no valid token"):
        masked_whiten(torch.ones(1, 2), torch.zeros(1, 2))


@settings(max_examples=40, deadline=None)
@given(
    st.integers(min_value=2, max_value=6),
    st.integers(min_value=1, max_value=4),
    st.data(),
)
def test_group_property_mean_zero_std_one(n, groups, data):
    values = data.draw(st.lists(st.integers(min_value=-5, max_value=5), min_size=n * groups, max_size=n * groups))
    rewards = torch.tensor(values, dtype=torch.float64)
    out = group_normalize(rewards, n).reshape(groups, n)
    raw = rewards.reshape(groups, n)
    for g in range(groups):
        assert out[g].mean().item() == pytest.approx(0.0, abs=1e-9)
        if raw[g].max() == raw[g].min():
            assert out[g].abs().max().item() == 0.0
        else:
            assert out[g].std().item() == pytest.approx(1.0, abs=1e-4)


def test_segments_normalize_over_the_groups_rollouts():
    # group 0: rollout 10 in two segments (rewards 1, 0: value 0.5), rollouts 11 (1) and 12 (0) whole:
    # values [0.5, 1, 0], mean 0.5, unbiased std 0.5. group 1: rollouts 20 (3) and 21 in three segments (1, 1, 4: 2)
    # values [3, 2], mean 2.5, std sqrt(0.5)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 1.0, 1.0, 4.0])
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    rollouts = [10, 10, 11, 12, 20, 21, 21, 21]
    s0, s1 = 0.5 + EPS, math.sqrt(0.5) + EPS
    want = [0.5 / s0, -0.5 / s0, 0.5 / s0, -0.5 / s0, 0.5 / s1, -1.5 / s1, -1.5 / s1, 1.5 / s1]
    close(segment_group_normalize(rewards, groups, rollouts), want, tol=1e-5)
    close(segment_group_normalize(rewards, groups, rollouts, std_normalization=False),
          [0.5, -0.5, 0.5, -0.5, 0.5, -1.5, -1.5, 1.5])
    cfg = AlgorithmConfig(advantage_estimator="grpo")
    close(postprocess_rewards(cfg, rewards, 4, group_ids=groups, rollout_ids=rollouts), want, tol=1e-5)


def test_segments_without_segments_equal_plain_group_normalization():
    ids = list(range(8))  # every rollout one sample: the same numbers as group_normalize
    close(segment_group_normalize(RAW, [0] * 4 + [1] * 4, ids), GRPO, tol=1e-5)
    cfg = AlgorithmConfig(advantage_estimator="grpo")
    assert torch.equal(postprocess_rewards(cfg, RAW, 4, group_ids=[0] * 4 + [1] * 4, rollout_ids=ids),
                       postprocess_rewards(cfg, RAW, 4))  # no repeated rollout id: the plain path, bit for bit


def test_a_group_of_one_rollout_in_segments_has_no_spread():
    close(segment_group_normalize(torch.tensor([1.0, 5.0]), [0, 0], [3, 3]), [0.0, 0.0])
