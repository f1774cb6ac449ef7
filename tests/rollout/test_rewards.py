"""Rewards: built-in graders, a custom reward module in Relax's documented form, group rewards, failures."""

import asyncio
import textwrap

import pytest

from relax_hpc.algo import AlgorithmConfig
from relax_hpc.recipe.schema import Recipe, RunConfig
from relax_hpc.rollout.config import DataConfig, RolloutConfig
from relax_hpc.rollout.rewards import RewardError, RewardRunner, builtin_reward, load_function, relax_args
from relax_hpc.rollout.rewards.answers import extract_answer, math_equal
from relax_hpc.rollout.rewards.builtin import math_reward
from relax_hpc.rollout.sample import Sample, SampleStatus


@pytest.mark.parametrize("response, label, want", [
    ("so the answer is \\boxed{\\frac{7}{2}}", "3.5", 1.0),
    ("The total is 1,234.", "1234", 1.0),
    ("first 12, then 13", "13", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{\\dfrac12}", "1/2", 1.0),
    ("work... #### 72", "72", 1.0),
    ("\\boxed{2.50}", "2.5", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{\\text{(B)}}", "(B)", 1.0),
    ("\\boxed{42}", "The answer: \\boxed{42}", 1.0),  # a label that is a whole solution
    ("\\boxed{42} but later 7", "7", 0.0),  # boxed wins over the last number
    ("42", "43", 0.0),
    ("no number here", "5", 0.0),
    ("", "5", 0.0),
])
def test_math_reward(response, label, want):
    assert math_reward(response, label) == want


def test_extract_and_compare():
    assert extract_answer("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"  # nested braces
    assert extract_answer("\\boxed{3} then \\boxed{4}") == "4"
    assert extract_answer("\\boxed 9") == "9"
    assert math_equal("\\frac{\\sqrt{2}}{2}", "\\dfrac{\\sqrt{2}}{2}")  # non-numeric: normalized strings
    assert not math_equal(None, "1")


def test_builtin_types():
    assert builtin_reward("exact_match", "  Paris \n", "Paris") == 1.0
    assert builtin_reward("exact_match", "Paris.", "Paris") == 0.0
    assert builtin_reward("boxed_exact_match", "it is \\boxed{Paris}.", "Paris") == 1.0
    assert builtin_reward("f1", "the cat sat", "a cat sat") == 1.0  # Relax's (HotpotQA) F1 drops a/an/the
    assert builtin_reward("f1", "cat sat down", "cat sat") == pytest.approx(0.8)
    assert builtin_reward("dummy", "x", "y") == 0.0
    with pytest.raises(ValueError, match="unknown rm_type 'nope'"):
        builtin_reward("nope", "x", "y")


RELAX_STYLE_MODULE = '''
    """A reward module written the way Relax's migration guide says (examples/<algo>/reward_<algo>.py)."""
    import re


    def compute_score(predict_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
        m = re.findall(r"-?\\d+", predict_str)
        acc = 1.0 if m and m[-1] == ground_truth else 0.0
        fmt = 1.0 if predict_str.strip().endswith(".") else 0.0
        bonus = float((extra_info or {}).get("bonus", 0.0))
        return {"score": 0.8 * acc + 0.2 * fmt + bonus, "acc": acc, "format": fmt}


    async def reward_func(args, sample, **kwargs):
        """Entry point called by the engine. Wraps compute_score."""
        ground_truth = sample.label
        return compute_score(sample.response, ground_truth, extra_info=sample.metadata)


    async def group_reward_func(args, samples, **kwargs):
        # --group-rm: one call per group; rank within the group by response length
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
        out = [0.0] * len(samples)
        for rank, i in enumerate(order):
            out[i] = rank / max(1, len(samples) - 1) * args.scale
        return out


    async def short_group_reward(args, samples, **kwargs):
        return [1.0]  # one value for a whole group: wrong


    async def flaky_reward(args, sample, **kwargs):
        if "boom" in sample.response:
            raise ValueError(f"cannot parse {sample.response!r}")
        return float(len(sample.response))


    def sync_reward(args, sample, **kwargs):
        return 1.0 if sample.response == sample.label else 0.0


    async def dict_reward(args, sample, **kwargs):
        return {"score": 1.0}


    SEEN_ARGS = []


    def args_reward(args, sample, **kwargs):
        SEEN_ARGS.append(args)
        return {"score": 1.0}


    IN_FLIGHT = [0, 0]  # now, max


    async def slow_reward(args, sample, **kwargs):
        import asyncio
        IN_FLIGHT[0] += 1
        IN_FLIGHT[1] = max(IN_FLIGHT)
        await asyncio.sleep(0.01)
        IN_FLIGHT[0] -= 1
        return 1.0
'''


@pytest.fixture
def reward_pkg(tmp_path, monkeypatch):
    """examples/myalgo/reward_myalgo.py under tmp_path, importable as examples.myalgo.reward_myalgo."""
    pkg = tmp_path / "examples" / "myalgo"
    pkg.mkdir(parents=True)
    (tmp_path / "examples" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "reward_myalgo.py").write_text(textwrap.dedent(RELAX_STYLE_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    return "examples.myalgo.reward_myalgo"


def _samples(responses, label="3", metadata=None):
    return [Sample(index=i, group_index=0, prompt=f"what is 1+2? ({i})", response=r, label=label,
                   metadata=dict(metadata or {})) for i, r in enumerate(responses)]


def _recipe(**rollout):
    return Recipe(rollout=RolloutConfig(**rollout))


def test_custom_reward_relax_form_dict_through_reward_key(reward_pkg):
    runner = RewardRunner(_recipe(custom_rm_path=f"{reward_pkg}.reward_func", reward_key="score"))
    group = _samples(["It is 3.", "It is 4.", "3"], metadata={"bonus": 0.0})
    assert asyncio.run(runner.score_group(group)) == []
    assert group[0].reward == {"score": 1.0, "acc": 1.0, "format": 1.0}
    assert [s.get_reward_value(runner.args) for s in group] == [pytest.approx(1.0), pytest.approx(0.2), pytest.approx(0.8)]
    assert all(s.status is SampleStatus.PENDING for s in group)  # rewards do not touch the generation status


def test_the_reward_function_gets_relax_args_from_the_recipe(reward_pkg, tmp_path):
    """relax_hpc reads the typed recipe; what the user's function receives is still Relax's ``args``."""
    import importlib

    (tmp_path / "cfg.yaml").write_text("judge_url: http://judge:8000\nmax_turns: 3\nn_samples_per_prompt: 4\n")
    recipe = Recipe(run=RunConfig(seed=9), data=DataConfig(path="prompts.jsonl"),
                    algorithm=AlgorithmConfig(eps_clip=0.3),
                    rollout=RolloutConfig(custom_rm_path=f"{reward_pkg}.args_reward", reward_key="score",
                                          n_samples_per_prompt=4, max_response_len=77, temperature=0.5,
                                          custom_config_path=str(tmp_path / "cfg.yaml")))
    runner = RewardRunner(recipe)
    assert asyncio.run(runner.score_group(_samples(["3", "4"]))) == []
    seen = importlib.import_module(reward_pkg).SEEN_ARGS
    assert len(seen) == 2 and all(a is runner.args for a in seen)  # one namespace, every call
    a = seen[0]
    assert (a.n_samples_per_prompt, a.rollout_max_response_len, a.rollout_temperature) == (4, 77, 0.5)
    assert (a.reward_key, a.eval_reward_key, a.custom_rm_path) == ("score", "score", f"{reward_pkg}.args_reward")
    assert (a.prompt_data, a.rollout_seed, a.eps_clip, a.advantage_estimator) == ("prompts.jsonl", 9, 0.3, "grpo")
    assert (a.judge_url, a.max_turns) == ("http://judge:8000", 3)  # rollout.custom_config_path keys


def test_custom_config_cannot_contradict_the_recipe(tmp_path):
    """A YAML key naming a recipe setting would reach the reward function but not the run: refused."""
    (tmp_path / "cfg.yaml").write_text("reward_key: acc\nn_samples_per_prompt: 8\nscale: 2\n")
    with pytest.raises(ValueError, match=r"reward_key: 'acc' \(the recipe gives 'score'\)"):
        relax_args(Recipe(rollout=RolloutConfig(reward_key="score", custom_config_path=str(tmp_path / "cfg.yaml"))))
    args = relax_args(Recipe(rollout=RolloutConfig(reward_key="acc", custom_config_path=str(tmp_path / "cfg.yaml"))))
    assert (args.reward_key, args.n_samples_per_prompt, args.scale) == ("acc", 8, 2)  # the same values: fine


def test_dict_reward_without_reward_key_is_a_reported_failure(reward_pkg):
    runner = RewardRunner(_recipe(custom_rm_path=f"{reward_pkg}.dict_reward"))
    with pytest.raises(RewardError, match="no reward_key is set"):
        asyncio.run(runner.score_group(_samples(["x"])))


def test_sync_custom_reward_and_metadata_rm_type(reward_pkg):
    runner = RewardRunner(_recipe(custom_rm_path=f"{reward_pkg}.sync_reward"))
    group = _samples(["3", "4"])
    asyncio.run(runner.score_group(group))
    assert [s.reward for s in group] == [1.0, 0.0]
    # built-ins: metadata.rm_type wins over rollout.rm_type
    runner = RewardRunner(_recipe(rm_type="exact_match"))
    group = _samples(["\\boxed{3}", "\\boxed{3}"])
    group[1].metadata["rm_type"] = "math"
    asyncio.run(runner.score_group(group))
    assert [s.reward for s in group] == [0.0, 1.0]
    # a reward already set (by a custom generate function) is kept
    group = _samples(["3"])
    group[0].reward = 0.25
    asyncio.run(runner.score_group(group))
    assert group[0].reward == 0.25


def test_group_rm_gets_the_whole_group_and_recipe(reward_pkg, tmp_path):
    (tmp_path / "cfg.yaml").write_text("scale: 2.0\n")
    recipe = _recipe(custom_rm_path=f"{reward_pkg}.group_reward_func", group_rm=True,
                 custom_config_path=str(tmp_path / "cfg.yaml"))
    runner = RewardRunner(recipe)
    assert runner.args.scale == 2.0 and runner.args.group_rm is True  # custom_config keys become args attributes
    group = _samples(["ccc", "a", "bb"])
    asyncio.run(runner.score_group(group))
    assert [s.reward for s in group] == [2.0, 0.0, 1.0]


def test_group_rm_wrong_length_fails_the_whole_group(reward_pkg):
    recipe = _recipe(custom_rm_path=f"{reward_pkg}.short_group_reward", group_rm=True, reward_error_policy="skip")
    group = _samples(["3", "4"])
    failures = asyncio.run(RewardRunner(recipe).score_group(group))
    assert len(failures) == 2 and "must return a list of one reward per sample" in failures[0].error_text
    assert all(s.status is SampleStatus.FAILED and s.reward == 0.0 for s in group)


def test_raising_reward_skip_policy_reports_and_goes_on(reward_pkg, caplog):
    runner = RewardRunner(_recipe(custom_rm_path=f"{reward_pkg}.flaky_reward", reward_error_policy="skip"))
    group = _samples(["ok", "boom here", "fine!"])
    failures = asyncio.run(runner.score_group(group))
    assert [s.reward for s in group] == [2.0, 0.0, 5.0]
    assert [s.status for s in group] == [SampleStatus.PENDING, SampleStatus.FAILED, SampleStatus.PENDING]
    assert group[1].metadata["reward_error"] == "ValueError: cannot parse 'boom here'"
    (f,) = failures
    assert (f.index, f.group_index, f.prompt, f.response, f.label) == (1, 0, "what is 1+2? (1)", "boom here", "3")
    assert isinstance(f.error, ValueError) and "flaky_reward" in f.traceback
    text = str(f)
    assert "index=1" in text and "boom here" in text and "what is 1+2? (1)" in text and "ValueError" in text
    assert f.source == f"{reward_pkg}.flaky_reward"
    assert "reward_error_policy = skip" in caplog.text and "boom here" in caplog.text
    assert runner.failures == failures


def test_raising_reward_fail_policy_stops_with_the_report(reward_pkg):
    runner = RewardRunner(_recipe(custom_rm_path=f"{reward_pkg}.flaky_reward", reward_error_policy="fail"))
    groups = [_samples(["ok", "boom 1"]), _samples(["boom 2", "ok"])]
    for g in groups[1]:
        g.group_index = 1
    with pytest.raises(RewardError) as ei:
        asyncio.run(runner.score_groups(groups))
    msg = str(ei.value)
    assert "reward_error_policy = fail" in msg and "ValueError: cannot parse" in msg
    assert "index=1 group_index=0" in msg and "boom 1" in msg and "what is 1+2? (1)" in msg
    assert ei.value.failures[0].response.startswith("boom")
    assert "Traceback" in msg


def test_reward_concurrency_bound(reward_pkg):
    import importlib

    mod = importlib.import_module(reward_pkg)
    runner = RewardRunner(_recipe(custom_rm_path=f"{reward_pkg}.slow_reward", reward_max_concurrency=3))
    groups = [_samples(["a"] * 4) for _ in range(5)]
    asyncio.run(runner.score_groups(groups))
    assert mod.IN_FLIGHT[1] == 3


def test_load_function_errors(reward_pkg):
    assert callable(load_function(f"{reward_pkg}.reward_func"))
    assert load_function(f"{reward_pkg}:reward_func") is load_function(f"{reward_pkg}.reward_func")  # one loader
    with pytest.raises(ValueError, match="package.module.function"):
        load_function("reward_func")
    with pytest.raises(ImportError, match="cannot import module 'no_such_pkg.mod'"):
        load_function("no_such_pkg.mod.fn")
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        load_function(f"{reward_pkg}.nope")


def test_no_reward_configured_is_reported():
    runner = RewardRunner(_recipe(reward_error_policy="skip"))
    (f,) = asyncio.run(runner.score_group(_samples(["3"])))
    assert "set rollout.custom_rm_path or rollout.rm_type" in f.error_text
