"""Relax's five-value environment step, ``(obs, reward, terminated, truncated, info)``, beside the three-value
``(obs, done, info)``: both run through the multi-turn loop against a real CPU engine, the per-step rewards are kept
per turn and reach the reward function, and a malformed answer or a reward that is not a finite number fails its
sample with an error naming the env."""

import asyncio
import json
import math
import re
import sys
import textwrap
from pathlib import Path

import pytest

from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource, load_tokenizer
from relax_hpc.rollout.driver import RolloutDriver, RolloutError
from relax_hpc.rollout.multiturn import EnvError, step_result
from relax_hpc.rollout.sample import SampleStatus
from relax_hpc.tasks.arith import multiturn_reward

# an env whose step answers what STEP_OUT (set per test through the module) says, for every sample
ODD_ENV = '''
    import math

    STEP_OUT = None


    class OddEnv:
        def reset(self):
            return {"obs_str": "", "role": "user"}, {}

        def step(self, response_text):
            return STEP_OUT

        def close(self):
            pass


    def build_env(sample=None, args=None, **_):
        return OddEnv()
'''

OBS = {"obs_str": "", "role": "user"}


@pytest.fixture
def data(tmp_path, tiny_llama):
    tok = load_tokenizer(tiny_llama)
    with open(tmp_path / "p.jsonl", "w") as f:
        for a in range(4):
            f.write(json.dumps({"prompt": f"{a}+1=", "label": str(a + 1)}) + "\n")
    ds = PromptDataset(tmp_path / "p.jsonl", keys=DataKeys("prompt", "label"), tokenizer=tok, apply_chat_template=False)
    return tok, lambda: RolloutDataSource(ds, rollout_batch_size=4, n_samples_per_prompt=2).get_samples()


def _driver(tok, engine, **kw):
    base = dict(interaction_env_path="relax_hpc.tasks.arith_steps",
                custom_rm_path="relax_hpc.tasks.arith_steps.step_reward_sum", max_turns=2, max_response_len=1,
                turn_truncation="continue", n_samples_per_prompt=2, rollout_batch_size=4)
    return RolloutDriver(Recipe(rollout=RolloutConfig(**{**base, **kw})), [engine], tokenizer=tok)


def test_five_value_steps_keep_a_reward_per_turn_for_the_reward_function(cpu_engine, data):
    tok, groups = data
    res = _driver(tok, cpu_engine).generate_rollout_sync(groups(), seed=21)
    assert len(res.samples) == 8
    for s in res.samples:
        traces = s.metadata["rollout_traces"]
        assert [t["reward"] for t in traces] == s.metadata["step_rewards"] and len(traces) in (1, 2)
        correct = [t["info"]["correct"] for t in traces]
        # terminated (a right answer) → done; the env's own last turn, wrong → truncated
        assert s.metadata["rollout_stop_reason"] == ("done" if correct[-1] else "env_truncated")
        assert s.status is (SampleStatus.COMPLETED if correct[-1] else SampleStatus.TRUNCATED)
        # the reward function read only step_rewards; their sum is the three-value recipe's reward of the same turns
        assert s.reward == pytest.approx(sum(s.metadata["step_rewards"]))
        assert s.reward == pytest.approx(asyncio.run(multiturn_reward(None, s)))
    assert res.metrics["rollout/env_failures"] == 0


def test_the_three_value_step_still_works_and_keeps_no_step_rewards(cpu_engine, data):
    tok, groups = data
    env = Path(__file__).resolve().parents[2] / "recipes" / "examples" / "env_arith.py"
    res = _driver(tok, cpu_engine, interaction_env_path=str(env),
                  custom_rm_path="relax_hpc.tasks.arith.multiturn_reward").generate_rollout_sync(groups(), seed=21)
    for s in res.samples:
        assert s.status is not SampleStatus.FAILED and "step_rewards" not in s.metadata
        assert all("reward" not in t for t in s.metadata["rollout_traces"])
        assert s.metadata["rollout_stop_reason"] in ("done", "turns")


@pytest.fixture
def odd_env(tmp_path, monkeypatch):
    (tmp_path / "odd_env.py").write_text(textwrap.dedent(ODD_ENV))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "odd_env", raising=False)
    import odd_env

    yield odd_env
    sys.modules.pop("odd_env", None)


@pytest.mark.parametrize("out, why", [
    ((OBS, True), "returned a tuple of 2 values"),
    ((OBS, 1.0, True, {}), "returned a tuple of 4 values"),
    ([OBS, True, {}], "returned list"),
    ((OBS, math.nan, True, False, {}), "returned the reward nan"),
    ((OBS, math.inf, True, False, {}), "returned the reward inf"),
    ((OBS, 1e39, True, False, {}), "not a finite number \\(float32\\)"),
    ((OBS, 10 ** 400, True, False, {}), "not a finite number"),
    ((OBS, "1.0", True, False, {}), "returned the reward '1.0' \\(str\\)"),
    ((OBS, True, True, False, {}), "returned the reward True \\(bool\\)"),
])
def test_a_malformed_step_or_a_non_finite_reward_fails_its_sample_naming_the_env(cpu_engine, data, odd_env, out, why):
    tok, groups = data
    odd_env.STEP_OUT = out
    res = _driver(tok, cpu_engine, interaction_env_path="odd_env",
                  reward_error_policy="skip").generate_rollout_sync(groups(), seed=3)
    for s in res.samples:
        assert s.status is SampleStatus.FAILED and s.reward == 0.0 and set(s.loss_mask) == {0}
        assert "env.step of OddEnv (" in s.metadata["env_error"] and "odd_env.py" in s.metadata["env_error"]
        assert "step_rewards" not in s.metadata  # a refused reward is never kept for the reward function
    assert re.search(why, res.samples[0].metadata["env_error"]), res.samples[0].metadata["env_error"]
    assert res.metrics["rollout/env_failures"] == 8
    strict = _driver(tok, cpu_engine, interaction_env_path="odd_env", reward_error_policy="fail")
    with pytest.raises(RolloutError, match="the environment failed: env.step of OddEnv"):
        strict.generate_rollout_sync(groups(), seed=3)


def test_step_result_reads_both_forms_and_numpy_and_torch_rewards():
    import numpy as np
    import torch

    env = object()
    assert step_result((OBS, 1, {"a": 1}), env) == (OBS, None, True, False, {"a": 1})
    assert step_result((OBS, 0.25, False, True, {}), env) == (OBS, 0.25, False, True, {})
    assert step_result((OBS, np.float32(0.5), np.bool_(True), False, {}), env)[1:3] == (0.5, True)
    assert step_result((OBS, torch.tensor(-2.0), False, False, {}), env)[1] == -2.0
    with pytest.raises(EnvError, match="returned the reward nan"):
        step_result((OBS, np.float64("nan"), True, False, {}), env)
    with pytest.raises(EnvError, match="returned the reward"):
        step_result((OBS, torch.tensor([1.0, 2.0]), True, False, {}), env)  # not one number
    with pytest.raises(EnvError, match="env.step of object \\(builtins\\) returned NoneType"):
        step_result(None, env)
