"""Reward guards: values that are not rewards, rewards that never return, and failures reported in sample order."""

import asyncio
import sys
import textwrap
import time

import pytest
import torch

from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.rewards import RewardError, RewardRunner, RewardTimeout
from relax_hpc.rollout.sample import Sample, SampleStatus
from tests.rollout.conftest import import_source

MODULE = '''
    import asyncio
    import threading

    HANG = threading.Event()  # set at teardown: the abandoned threads then finish
    CALLS = []


    async def value_reward(args, sample, **kwargs):
        return sample.metadata["value"]


    def value_group_reward(args, samples, **kwargs):
        return [s.metadata["value"] for s in samples]


    def sync_hang(args, sample, **kwargs):
        CALLS.append(sample.index)
        HANG.wait()
        return 1.0


    async def async_hang(args, sample, **kwargs):
        await asyncio.Event().wait()


    def group_hang(args, samples, **kwargs):
        HANG.wait()
        return [1.0] * len(samples)


    def sync_ok_or_hang(args, sample, **kwargs):
        if sample.index == 0:
            HANG.wait()
        return 0.5
'''


@pytest.fixture
def mod(tmp_path, monkeypatch):
    guard_rewards = import_source(tmp_path, monkeypatch, "guard_rewards", MODULE)
    yield guard_rewards
    guard_rewards.HANG.set()


def _recipe(**rollout):
    return Recipe(rollout=RolloutConfig(**rollout))


def _samples(values, group_index=0, start=0):
    return [Sample(index=start + i, group_index=group_index, prompt="p", response=f"r{i}", label="3",
                   metadata={"value": v}) for i, v in enumerate(values)]


BAD = [
    (None, "NoneType None"),
    (float("nan"), "is nan, not a finite number"),
    (float("inf"), "is inf, not a finite number"),
    ("0.5", "got str '0.5'"),
    (True, "got bool True"),
    ([1.0], "got list [1.0]"),
    (torch.tensor(True), "got Tensor"),
    (torch.tensor([0.5, 0.5]), "got Tensor"),
]


@pytest.mark.parametrize("value, want", BAD, ids=[repr(v) for v, _ in BAD])
def test_a_value_that_is_not_a_reward_fails(mod, value, want):
    runner = RewardRunner(_recipe(custom_rm_path="guard_rewards.value_reward", reward_error_policy="skip"))
    group = _samples([1.0, value])
    (f,) = asyncio.run(runner.score_group(group))
    assert f.index == 1 and want in f.error_text and "finite number" in f.error_text
    assert group[0].reward == 1.0 and group[1].reward == 0.0 and group[1].status is SampleStatus.FAILED


@pytest.mark.parametrize("value, want", BAD, ids=[repr(v) for v, _ in BAD])
def test_a_value_that_is_not_a_reward_fails_under_reward_key(mod, value, want):
    runner = RewardRunner(_recipe(custom_rm_path="guard_rewards.value_reward", reward_key="score",
                                reward_error_policy="fail"))
    with pytest.raises(RewardError) as ei:
        asyncio.run(runner.score_group(_samples([{"score": 1.0}, {"score": value, "other": 2.0}])))
    (f,) = ei.value.failures
    assert f.index == 1 and want in f.error_text and "reward['score'] (rollout.reward_key)" in f.error_text


@pytest.mark.parametrize("value, want", BAD[:5], ids=[repr(v) for v, _ in BAD[:5]])
def test_a_value_that_is_not_a_reward_fails_with_group_rm(mod, value, want):
    runner = RewardRunner(_recipe(custom_rm_path="guard_rewards.value_group_reward", group_rm=True,
                                reward_error_policy="skip"))
    group = _samples([0.25, value, 1])
    (f,) = asyncio.run(runner.score_group(group))
    assert f.index == 1 and want in f.error_text
    assert [s.reward for s in group] == [0.25, 0.0, 1]


@pytest.mark.parametrize("value", [0, 1, -2.5, 0.5, torch.tensor(0.75), torch.tensor(3)], ids=repr)
def test_real_numbers_are_rewards(mod, value):
    runner = RewardRunner(_recipe(custom_rm_path="guard_rewards.value_reward"))
    group = _samples([value])
    assert asyncio.run(runner.score_group(group)) == []
    assert group[0].get_reward_value(None) == pytest.approx(float(value))


PAST_FLOAT32 = [(1e39, "is 1e+39, not a finite number in float32", "inf"),
                (-1e39, "is -1e+39, not a finite number in float32", "-inf"),
                (10**40, "is 1e+40, not a finite number in float32", "inf"),
                (10**400, "is inf, not a finite number", None),
                (float("nan"), "is nan, not a finite number", None)]


@pytest.mark.parametrize("value, want, stored", PAST_FLOAT32, ids=["1e39", "-1e39", "int 1e40", "int 1e400", "nan"])
@pytest.mark.parametrize("how", ["plain", "reward_key", "group_rm", "set by generate"])
def test_a_reward_past_float32_is_refused_under_both_policies(mod, value, want, stored, how):
    """The exchange stores raw_reward as float32: 1e39 is finite as a Python float and inf there. Refused with
    why, through every way a reward comes in; then reward_error_policy decides, as for any failed reward."""
    key = "score" if how == "reward_key" else None
    fn = "guard_rewards.value_group_reward" if how == "group_rm" else "guard_rewards.value_reward"

    def group():
        g = _samples([1.0, {"score": value} if key else value])
        if how == "set by generate":  # a custom generate function scored the sample itself (Relax's rule)
            g[1].reward = value
        return g

    skip = RewardRunner(_recipe(custom_rm_path=fn, group_rm=how == "group_rm", reward_key=key,
                                reward_error_policy="skip"))
    g = group()
    (f,) = asyncio.run(skip.score_group(g))
    assert f.index == 1 and want in f.error_text, f.error_text
    if stored is not None:
        assert "the dtype of the exchange's raw_reward column (|reward| <= 3.402823e+38): it would be stored as " \
               f"{stored}" in f.error_text, f.error_text
    assert g[1].reward == 0.0 and g[1].status is SampleStatus.FAILED and want in g[1].metadata["reward_error"]
    assert g[0].reward == 1.0 and g[0].status is not SampleStatus.FAILED

    fail = RewardRunner(_recipe(custom_rm_path=fn, group_rm=how == "group_rm", reward_key=key,
                                reward_error_policy="fail"))
    with pytest.raises(RewardError) as ei:
        asyncio.run(fail.score_group(group()))
    assert [f.index for f in ei.value.failures] == [1] and want in str(ei.value)


@pytest.mark.parametrize("value", [3.0e38, -3.0e38, 3.4028234e38], ids=repr)
def test_a_reward_within_float32_is_kept(mod, value):
    runner = RewardRunner(_recipe(custom_rm_path="guard_rewards.value_reward", reward_error_policy="fail"))
    group = _samples([value])
    assert asyncio.run(runner.score_group(group)) == [] and group[0].reward == value


def test_missing_reward_key_is_named(mod):
    runner = RewardRunner(_recipe(custom_rm_path="guard_rewards.value_reward", reward_key="score",
                                reward_error_policy="skip"))
    (f,) = asyncio.run(runner.score_group(_samples([{"acc": 1.0}])))
    assert "no key 'score'" in f.error_text and "acc" in f.error_text


@pytest.mark.parametrize("fn, group_rm", [("sync_hang", False), ("async_hang", False), ("group_hang", True)])
def test_a_reward_that_never_returns_times_out(mod, fn, group_rm):
    """A sync reward stuck in its thread is abandoned: asyncio.run returns without joining it."""
    runner = RewardRunner(_recipe(custom_rm_path=f"guard_rewards.{fn}", group_rm=group_rm, reward_timeout_s=0.2,
                                reward_error_policy="fail"))
    t0 = time.monotonic()
    with pytest.raises(RewardError) as ei:
        asyncio.run(runner.score_group(_samples([1.0, 1.0])))
    assert time.monotonic() - t0 < 3.0
    assert [f.index for f in ei.value.failures] == [0, 1]
    assert all(isinstance(f.error, RewardTimeout) for f in ei.value.failures)
    msg = str(ei.value)
    assert f"reward guard_rewards.{fn} raised RewardTimeout: timed out after 0.2 s" in msg
    assert "rollout.reward_timeout_s = 0.2; raise it" in msg


def test_only_the_stuck_call_fails_under_skip(mod):
    runner = RewardRunner(_recipe(custom_rm_path="guard_rewards.sync_ok_or_hang", reward_timeout_s=0.2,
                                reward_error_policy="skip"))
    group = _samples([1.0, 1.0, 1.0])
    (f,) = asyncio.run(runner.score_group(group))
    assert f.index == 0 and isinstance(f.error, RewardTimeout)
    assert [s.reward for s in group] == [0.0, 0.5, 0.5] and group[0].status is SampleStatus.FAILED


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "300"])
def test_reward_timeout_must_be_positive(mod, bad):
    with pytest.raises(ValueError, match=r"rollout.reward_timeout_s = .*positive number of seconds \(default 300\)"):
        RewardRunner(_recipe(custom_rm_path="guard_rewards.value_reward", reward_timeout_s=bad))


def test_score_groups_reports_in_sample_order_whatever_finishes_first(mod, tmp_path, monkeypatch):
    """Group 1's reward fails first (group 0's waits until it has), yet the report lists group 0 first."""
    (tmp_path / "order_rewards.py").write_text(textwrap.dedent('''
        import asyncio

        EVENTS = {}

        def _event():
            return EVENTS.setdefault(id(asyncio.get_running_loop()), asyncio.Event())

        async def reverse_order(args, sample, **kwargs):
            if sample.group_index == 0:
                await _event().wait()  # only after group 1 failed
                raise RuntimeError(f"late failure of sample {sample.index}")
            _event().set()
            raise RuntimeError(f"early failure of sample {sample.index}")
    '''))
    monkeypatch.delitem(sys.modules, "order_rewards", raising=False)
    runner = RewardRunner(_recipe(custom_rm_path="order_rewards.reverse_order", reward_error_policy="fail"))
    groups = [_samples([1.0, 1.0]), _samples([1.0, 1.0], group_index=1, start=2)]
    with pytest.raises(RewardError) as ei:
        asyncio.run(runner.score_groups(groups))
    assert [f.index for f in ei.value.failures] == [0, 1, 2, 3]
    assert runner.failures[0].index in (2, 3)  # they did finish in the other order
    msg = str(ei.value)
    assert msg.index("index=0 ") < msg.index("index=2 ")
