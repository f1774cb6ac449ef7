"""Multi-turn rollouts with a Relax-form environment, against a real CPU engine: the engine's token ids are
appended as they are (loss mask 1, their log-probs), the environment's with loss mask 0, and so they arrive in
the exchange chunk the actor reads; an environment that raises or hangs fails only its sample."""

import json
import sys
import textwrap
from pathlib import Path

import pytest

from relax_hpc.errors import PermanentError
from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.write import write_step
from relax_hpc.train import samples as S
from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource, load_tokenizer
from relax_hpc.rollout.driver import RolloutDriver, RolloutError
from relax_hpc.rollout.multiturn import fit_observation
from relax_hpc.rollout.sample import SampleStatus
from relax_hpc.train.config import TrainConfig

ENV = Path(__file__).resolve().parents[2] / "recipes" / "examples" / "env_arith.py"
LONG_ENV = Path(__file__).resolve().parents[2] / "tests" / "e2e" / "env_long_feedback.py"  # 58-token feedback

FLAKY_ENV = '''
    import asyncio


    class Env:
        def __init__(self, index):
            self.index = index

        def reset(self):
            return {"obs_str": "", "role": "user"}, {}

        async def step(self, response_text):
            if self.index % 4 == 1:
                raise ValueError("tool crashed")
            if self.index % 4 == 2:
                await asyncio.sleep(3600)  # hangs: env_step_timeout_s ends it
            return {"obs_str": "", "role": "user"}, True, {}

        def close(self):
            pass


    def build_env(sample=None, args=None, **_):
        return Env(sample.index)
'''


@pytest.fixture
def data(tmp_path, tiny_llama):
    tok = load_tokenizer(tiny_llama)
    with open(tmp_path / "p.jsonl", "w") as f:
        for a in range(4):
            f.write(json.dumps({"prompt": f"{a}+1=", "label": str(a + 1)}) + "\n")
    ds = PromptDataset(tmp_path / "p.jsonl", keys=DataKeys("prompt", "label"), tokenizer=tok, apply_chat_template=False)
    return tok, lambda: RolloutDataSource(ds, rollout_batch_size=4, n_samples_per_prompt=2).get_samples()


def test_env_tokens_are_masked_and_engine_tokens_arrive_in_the_chunk_as_sampled(tmp_path, cpu_engine, data):
    tok, groups = data
    recipe = Recipe(rollout=RolloutConfig(custom_rm_path="relax_hpc.tasks.arith.multiturn_reward",
                                          interaction_env_path=str(ENV), max_turns=3, max_response_len=1,
                                          turn_truncation="continue",
                                          n_samples_per_prompt=2, rollout_batch_size=4))
    driver = RolloutDriver(recipe, [cpu_engine], tokenizer=tok)
    res = driver.generate_rollout_sync(groups(), seed=21)
    obs = tok.encode(" no=", add_special_tokens=False)
    for s in res.samples:
        traces = s.metadata["rollout_traces"]
        prompt = tok.encode(s.prompt, add_special_tokens=False)
        want_tokens, want_mask = list(prompt), []
        for i, t in enumerate(traces):
            if i:
                want_tokens += obs
                want_mask += [0] * len(obs)
            want_tokens += t["output_ids"]
            want_mask += [1] * len(t["output_ids"])
        assert s.tokens == want_tokens and s.loss_mask == want_mask, s.index
        assert len(s.rollout_log_probs) == s.response_length
        right = traces[-1]["response"][:1] == s.label
        assert s.metadata["rollout_turns"] == len(traces) <= 3
        assert s.metadata["rollout_stop_reason"] == "done"  # right, or the env's last turn (max_turns 3)
        assert right or len(traces) == 3
    assert res.metrics["rollout/turns"] == pytest.approx(sum(len(s.metadata["rollout_traces"]) for s in res.samples) / 8)
    assert 0 < res.metrics["rollout/env_tokens_ratio"] < 1 or res.metrics["rollout/turns"] == 1

    ref = write_step(tmp_path, 1, res)  # what the actor reads: the same ids and mask, through the exchange
    cols = S.read_columns([ref], ("tokens", "loss_mask", "response_length"))
    for i, s in enumerate(res.samples):
        assert cols["tokens"][i].tolist() == s.tokens and cols["loss_mask"][i].tolist() == s.loss_mask


def test_an_env_that_raises_or_hangs_fails_only_its_sample(tmp_path, cpu_engine, data, monkeypatch):
    tok, groups = data
    (tmp_path / "flaky_env.py").write_text(textwrap.dedent(FLAKY_ENV))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flaky_env", raising=False)
    base = dict(custom_rm_path="relax_hpc.tasks.arith.multiturn_reward", interaction_env_path="flaky_env",
                max_turns=2, max_response_len=1, n_samples_per_prompt=2, rollout_batch_size=4, env_step_timeout_s=0.5,
                turn_truncation="continue",
                reward_error_policy="skip")
    driver = RolloutDriver(Recipe(rollout=RolloutConfig(**base)), [cpu_engine], tokenizer=tok)
    res = driver.generate_rollout_sync(groups(), seed=2)
    assert len(res.samples) == 8
    for s in res.samples:
        if s.index % 4 in (1, 2):
            assert s.status is SampleStatus.FAILED and s.reward == 0.0 and set(s.loss_mask) == {0}
            assert ("tool crashed" if s.index % 4 == 1 else "longer than 0.5 s") in s.metadata["env_error"]
        else:
            assert s.status is not SampleStatus.FAILED and "env_error" not in s.metadata
    assert res.metrics["rollout/env_failures"] == 4
    strict = RolloutDriver(Recipe(rollout=RolloutConfig(**{**base, "reward_error_policy": "fail"})), [cpu_engine],
                           tokenizer=tok)
    with pytest.raises(RolloutError, match="the environment failed: step\\(\\) raised ValueError: tool crashed"):
        strict.generate_rollout_sync(groups(), seed=2)


def test_by_default_a_turn_cut_at_max_response_len_stops_the_rollout(cpu_engine, data):
    """Relax's rule: finish_reason length → TRUNCATED, no env step, reported as truncated_by/response."""
    tok, groups = data
    recipe = Recipe(rollout=RolloutConfig(custom_rm_path="relax_hpc.tasks.arith.multiturn_reward",
                                          interaction_env_path=str(ENV), max_turns=3, max_response_len=1,
                                          n_samples_per_prompt=2, rollout_batch_size=4))
    res = RolloutDriver(recipe, [cpu_engine], tokenizer=tok).generate_rollout_sync(groups(), seed=21)
    assert all(s.status is SampleStatus.TRUNCATED and s.metadata["rollout_turns"] == 1 for s in res.samples)
    assert res.metrics["rollout/truncated_by/response"] == 1.0 and res.metrics["rollout/turns"] == 1.0


def test_an_observation_is_encoded_as_a_chat_continuation(tiny_llama):
    """With a chat template, the observation's tokens are exactly what the template adds for that message after the
    conversation so far, generation prompt included (the dummy-prefix trick); without one, the text's own ids."""
    from relax_hpc.rollout.multiturn import encode_observation

    tok = load_tokenizer(tiny_llama)

    class Env:
        pass

    ids, text = encode_observation(tok, {"obs_str": "no", "role": "user"}, Env(), chat=True)
    assert text == "<|im_start|>user\nno<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode(text, add_special_tokens=False)
    ids, text = encode_observation(tok, {"obs_str": " no=", "role": "user"}, Env(), chat=False)
    assert (ids, text) == (tok.encode(" no=", add_special_tokens=False), " no=")


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_long_observation_never_takes_a_sample_past_train_max_seq_len(tmp_path, cpu_engine, data, policy):
    """The issue's failure: a sentence of feedback made 25-token samples for train.max_seq_len = 16, and the run
    failed at step 1. The bound (rollout.max_context_len unset: train.max_seq_len) holds for prompt, answers and
    observations: under ``stop`` the feedback that does not fit ends the rollout, under ``continue`` it is cut to
    leave one token for the answer. What the actor reads from the exchange is within the bound."""
    from tests.e2e.env_long_feedback import FEEDBACK

    tok, groups = data
    # every token is a stop token: each turn is one token that ends by "stop", not by length, so the env is asked
    recipe = Recipe(rollout=RolloutConfig(custom_rm_path="relax_hpc.tasks.arith.multiturn_reward",
                                          interaction_env_path=str(LONG_ENV), max_turns=2, max_response_len=2,
                                          stop_token_ids=list(range(len(tok))), turn_truncation=policy,
                                          n_samples_per_prompt=2, rollout_batch_size=4),
                    train=TrainConfig(max_seq_len=16))
    res = RolloutDriver(recipe, [cpu_engine], tokenizer=tok).generate_rollout_sync(groups(), seed=21)
    feedback = tok.encode(FEEDBACK, add_special_tokens=False)
    wrong = [s for s in res.samples if s.metadata["rollout_traces"][0]["response"][:1] != s.label]
    assert wrong and len(feedback) == 58
    for s in wrong:
        first, prompt = s.metadata["rollout_traces"][0], len(s.tokens) - s.response_length
        assert s.status is SampleStatus.TRUNCATED and s.metadata["rollout_stop_reason"] == "context"
        if policy == "stop":  # the feedback does not go in: the rollout ends with the first answer
            assert s.metadata["rollout_turns"] == 1 and first["obs_truncated"] == 58 and "obs" not in first
            assert len(s.tokens) == prompt + 1
        else:  # the feedback's head that leaves one token for the answer: 16 - (4 + 1) - 1 = 10 tokens
            assert s.metadata["rollout_turns"] == 2 and first["obs_truncated"] == 58 - 10
            assert s.tokens[prompt + 1: prompt + 11] == feedback[:10] and first["obs"] == FEEDBACK[:10]
            assert len(s.tokens) == 16 and s.loss_mask == [1] + [0] * 10 + [1]
    assert res.metrics["rollout/truncated_observations"] == len(wrong)
    assert res.metrics["rollout/truncated_by/context"] == len(wrong) / len(res.samples)

    ref = write_step(tmp_path, 1, res)  # what the actor reads
    lengths = S.read_columns([ref], ("tokens",))["tokens"].lengths()
    assert len(lengths) == 8 and max(lengths) <= 16


def test_a_prompt_that_fills_the_bound_fails_naming_the_fix(cpu_engine, data):
    tok, groups = data
    recipe = Recipe(rollout=RolloutConfig(custom_rm_path="relax_hpc.tasks.arith.multiturn_reward",
                                          interaction_env_path=str(LONG_ENV), max_turns=2, max_response_len=1,
                                          n_samples_per_prompt=2, rollout_batch_size=4),
                    train=TrainConfig(max_seq_len=4))  # the prompts "a+1=" are 4 tokens
    with pytest.raises(PermanentError, match="prompt has 4 tokens, and the context bound is 4.*rollout.max_prompt_len"):
        RolloutDriver(recipe, [cpu_engine], tokenizer=tok).generate_rollout_sync(groups(), seed=21)


def test_an_observation_cut_under_a_chat_template_keeps_the_turn_boundary(tiny_llama):
    """With a chat template the cut is on the text, so the template's end of turn and generation prompt stay whole."""
    from relax_hpc.rollout.multiturn import encode_observation
    from tests.e2e.env_long_feedback import FEEDBACK, LongFeedbackEnv

    tok, env = load_tokenizer(tiny_llama), LongFeedbackEnv(label="1", max_turns=2)
    obs = {"obs_str": FEEDBACK, "role": "user"}
    whole, _ = encode_observation(tok, obs, env, chat=True)
    ids, text = fit_observation(tok, obs, env, chat=True, room=len(whole) - 20)
    assert len(ids) == len(whole) - 20
    assert text == f"<|im_start|>user\n{FEEDBACK[:-20]}<|im_end|>\n<|im_start|>assistant\n"
    assert fit_observation(tok, obs, env, chat=True, room=len(whole) - 58) is None  # not one character fits
    assert fit_observation(tok, obs, env, chat=False, room=5)[0] == tok.encode(FEEDBACK, add_special_tokens=False)[:5]
