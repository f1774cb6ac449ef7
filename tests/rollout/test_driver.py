"""The rollout driver and eval against real CPU engine processes (tests/rollout/conftest.py).

Engines: ``cpu_engine`` (the conftest's, alive for the module) and, where one must die, a second engine this
module starts and kills by its PID. Dead engines that never ran are URLs of ports nobody listens on.
"""

import asyncio
import json
import os
import signal
import sys
import textwrap

import pytest

from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource, load_tokenizer
from relax_hpc.rollout.driver import NoEngineError, RolloutDriver, RolloutError
from relax_hpc.engines.launcher import free_port, launch_engine
from relax_hpc.rollout.eval import run_eval, should_eval, should_eval_before_train
from relax_hpc.rollout.metrics import compute_pass_rate, pass_at_k
from relax_hpc.rollout.rewards import RewardError
from relax_hpc.rollout.sample import SampleStatus

REWARD_MODULE = '''
    async def reward_func(args, sample, **kwargs):
        """Relax form; a score that differs between samples of a group, so normalization has work to do."""
        distinct = len(set(sample.response))
        return {"score": distinct / 10.0, "length": float(sample.response_length)}


    import asyncio

    FAILED_LAST = {}  # per event loop: set once sample 4's reward has failed


    async def raising_reward(args, sample, **kwargs):
        """Samples 1 and 4 fail, in the reverse of sample order: 1 only after 4 has (forced, not timed)."""
        event = FAILED_LAST.setdefault(id(asyncio.get_running_loop()), asyncio.Event())
        if sample.index == 1:
            await event.wait()
        if sample.index % 3 == 1:
            if sample.index == 4:
                event.set()
            raise RuntimeError(f"judge unavailable for sample {sample.index}")
        return 1.0


    async def digit_reward(args, sample, **kwargs):
        return 1.0 if any(c.isdigit() for c in sample.response) else 0.0
'''


@pytest.fixture
def reward_mod(tmp_path, monkeypatch):
    (tmp_path / "drv_rewards.py").write_text(textwrap.dedent(REWARD_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "drv_rewards", raising=False)
    return "drv_rewards"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.fixture
def dataset(tmp_path, tokenizer):
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"{i}+{i + 1}=", "answer": str(2 * i + 1), "metadata": {"i": i}}) + "\n")
    return PromptDataset(tmp_path / "prompts.jsonl", keys=DataKeys("question", "answer"), tokenizer=tokenizer,
                         apply_chat_template=True)


def make_recipe(**rollout):
    rollout.setdefault("max_response_len", 12)
    return Recipe(rollout=RolloutConfig(**rollout))


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nobody listens there


def test_sampling_params_come_from_the_recipe():
    """rollout.* for training; each eval_* that is set overrides its own for eval, the others fall back."""
    recipe = make_recipe(rm_type="math", temperature=0.7, top_p=0.9, top_k=5, stop=["\n\n"], stop_token_ids=[2],
                         skip_special_tokens=True, eval_temperature=0.0, eval_max_response_len=3,
                         sglang_server_concurrency=7, max_retries=1, request_timeout_s=30.0)
    driver = RolloutDriver(recipe, [])
    extra = {"skip_special_tokens": True, "no_stop_trim": True, "spaces_between_special_tokens": False,
             "stop": ["\n\n"]}
    sp = driver.sampling_params()
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.stop_token_ids, sp.extra) == (
        12, 0.7, 0.9, 5, [2], extra)
    ev = driver.sampling_params(evaluation=True)
    assert (ev.max_new_tokens, ev.temperature, ev.top_p, ev.top_k) == (3, 0.0, 0.9, 5)
    assert (driver.per_engine, driver.max_retries, driver.client_kwargs["generate_timeout"]) == (7, 1, 30.0)
    with pytest.raises(ValueError, match=r"rollout.request_timeout_s = 0: .*\(the total deadline .*default 600\)"):
        RolloutDriver(make_recipe(rm_type="math", request_timeout_s=0), [])


def test_batch_of_groups(cpu_engine, client, dataset, tokenizer, reward_mod):
    client.update_weight_version("v7")
    recipe = make_recipe(custom_rm_path=f"{reward_mod}.reward_func", reward_key="score", n_samples_per_prompt=4,
                         rollout_batch_size=3)
    src = RolloutDataSource(dataset, rollout_batch_size=3, n_samples_per_prompt=4)
    driver = RolloutDriver(recipe, {"engine-a": cpu_engine}, tokenizer=tokenizer)
    seen: list[int] = []
    driver.on_progress = seen.append  # the rollout role's heartbeat progress (logging.task_timeout_s)
    res = driver.generate_rollout_sync(src.get_samples())

    assert len(res.samples) == 12 and res.group_size == 4 and len(res.groups()) == 3
    assert sorted(seen) == [1, 1, 1, 4, 4, 4]  # each group once generated (its samples) and once scored
    for gi, group in enumerate(res.groups()):
        assert [s.group_index for s in group] == [gi] * 4
        assert len({s.prompt for s in group}) == 1 and group[0].label == str(2 * gi + 1)
    for s in res.samples:
        prompt_ids = tokenizer.encode(s.prompt, add_special_tokens=False)
        assert s.tokens[:len(prompt_ids)] == prompt_ids and s.prompt_length == len(prompt_ids)
        assert 1 <= s.response_length <= 12 and len(s.tokens) == len(prompt_ids) + s.response_length
        assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length and set(s.loss_mask) == {1}
        assert all(lp <= 0 for lp in s.rollout_log_probs)
        assert s.weight_versions == ["v7"] and s.weight_version == "v7"
        want = SampleStatus.TRUNCATED if s.response_length == 12 else SampleStatus.COMPLETED
        assert s.status is want
        assert s.reward == {"score": len(set(s.response)) / 10.0, "length": float(s.response_length)}
    assert [s.index for s in res.samples] == list(range(12))

    raw = [len(set(s.response)) / 10.0 for s in res.samples]
    assert res.raw_rewards == pytest.approx(raw)  # raw: normalization is the training side's (train.plan)

    m = res.metrics
    assert m["rollout/raw_reward"] == pytest.approx(sum(raw) / 12)
    assert m["rollout/response_len/mean"] == pytest.approx(sum(s.response_length for s in res.samples) / 12)
    assert m["rollout/length/mean"] == pytest.approx(m["rollout/response_len/mean"])  # other dict-reward keys
    assert m["rollout/truncated_ratio"] == pytest.approx(sum(s.status is SampleStatus.TRUNCATED for s in res.samples) / 12)
    for key in ("rollout/response_len/max", "rollout/total_lengths", "perf/rollout_time"):
        assert key in m
    assert "rollout/rewards" not in m  # R̃'s mean comes with the batch the actor trains on


def test_a_seeded_batch_samples_the_same_tokens_whatever_the_concurrency(cpu_engine, dataset, tokenizer):
    """The resume promise at the rollout level: a batch seeded by (run seed, step) samples the same responses
    when requests interleave differently; another seed samples others."""
    groups = lambda: RolloutDataSource(dataset, rollout_batch_size=4, n_samples_per_prompt=4).get_samples()
    runs = []
    for conc, seed in ((1, 77), (4, 77), (4, 78)):
        driver = RolloutDriver(make_recipe(rm_type="math", sglang_server_concurrency=conc, max_response_len=6,
                                           temperature=1.0), [cpu_engine], tokenizer=tokenizer)
        runs.append([s.tokens for s in driver.generate_rollout_sync(groups(), seed=seed).samples])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_concurrency_bound_per_engine(cpu_engine, dataset, tokenizer):
    recipe = make_recipe(rm_type="math", sglang_server_concurrency=3, max_response_len=4, batch_group_requests=False)
    driver = RolloutDriver(recipe, [cpu_engine], tokenizer=tokenizer)
    groups = RolloutDataSource(dataset, rollout_batch_size=4, n_samples_per_prompt=4).get_samples()
    res = driver.generate_rollout_sync(groups)
    (stats,) = driver.engine_stats().values()
    assert len(res.samples) == 16 and stats["requests"] == 16 and stats["peak_in_flight"] == 3


def test_a_group_is_one_request(cpu_engine, dataset, tokenizer):
    """rollout.batch_group_requests (the default): one /generate per group, every sample filled as by its own."""
    driver = RolloutDriver(make_recipe(rm_type="math", max_response_len=4), [cpu_engine], tokenizer=tokenizer)
    res = driver.generate_rollout_sync(RolloutDataSource(dataset, rollout_batch_size=4,
                                                         n_samples_per_prompt=4).get_samples())
    (stats,) = driver.engine_stats().values()
    assert len(res.samples) == 16 and stats["requests"] == 4
    assert all(s.response_length > 0 and len(s.rollout_log_probs) == s.response_length for s in res.samples)


def test_a_group_request_samples_what_single_requests_sample(cpu_engine, dataset, tokenizer):
    """Each sample of a group request keeps its own sampling_seed: seeded batches give the same tokens either way."""
    runs = []
    for batched in (True, False):
        driver = RolloutDriver(make_recipe(rm_type="math", max_response_len=6, temperature=1.0,
                                           batch_group_requests=batched), [cpu_engine], tokenizer=tokenizer)
        groups = RolloutDataSource(dataset, rollout_batch_size=3, n_samples_per_prompt=4).get_samples()
        res = driver.generate_rollout_sync(groups, seed=7)
        runs.append([(s.tokens, s.rollout_log_probs) for s in res.samples])
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    assert len({tuple(t) for t, _ in runs[0]}) > 1  # sampled, not one answer repeated
    for (_, a), (_, b) in zip(*runs):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_group_request_on_a_dead_engine_goes_sample_by_sample(cpu_engine, dataset, tokenizer):
    """A group request that fails is not retried as a group: its samples take the per-sample path, which finds the
    dead engine, reports it and finishes them on the live one."""
    driver = RolloutDriver(make_recipe(rm_type="math", max_response_len=4),
                           {"dead": dead_url(), "live": cpu_engine}, tokenizer=tokenizer)
    res = driver.generate_rollout_sync(RolloutDataSource(dataset, rollout_batch_size=4,
                                                         n_samples_per_prompt=3).get_samples())
    assert len(res.samples) == 12 and all(s.response_length > 0 for s in res.samples)
    assert [f.name for f in res.engine_failures] == ["dead"] and driver.live_engines == ["live"]


def test_engine_killed_mid_batch_is_reported_and_requests_retried(cpu_engine, tiny_llama, tmp_path, dataset,
                                                                  tokenizer, caplog):
    victim = launch_engine("cpu", tiny_llama, log_path=tmp_path / "victim.log", ready_timeout=120,
                           extra_args=["--threads", "1", "--seed", "1"])
    try:
        dead_seen = []
        recipe = make_recipe(rm_type="math", sglang_server_concurrency=2, max_response_len=48,
                             batch_group_requests=False)  # per-sample requests: some in flight on the victim
        driver = RolloutDriver(recipe, {"survivor": cpu_engine, "victim": victim}, tokenizer=tokenizer,
                               on_engine_dead=lambda name, why: dead_seen.append((name, why)))
        groups = RolloutDataSource(dataset, rollout_batch_size=6, n_samples_per_prompt=4).get_samples()

        async def run():
            task = asyncio.create_task(driver.generate_rollout(groups))
            v = driver.pool.engines[1]
            while v.served < 3 or v.in_flight == 0:  # requests have gone to the victim, some are in flight there
                assert not task.done()
                await asyncio.sleep(0.01)
            assert v.in_flight > 0
            os.kill(victim.pid, signal.SIGKILL)
            return await task

        res = asyncio.run(run())
    finally:
        victim.stop()

    assert len(res.samples) == 24
    assert all(s.response_length > 0 and s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
               for s in res.samples)
    assert all(len(s.rollout_log_probs) == s.response_length for s in res.samples)
    (fail,) = res.engine_failures
    assert fail.name == "victim" and fail.url == victim.url
    assert [n for n, _ in dead_seen] == ["victim"] and driver.dead_engines.keys() == {"victim"}
    assert driver.live_engines == ["survivor"] and res.retries >= 1
    assert res.metrics["rollout/engines_dead"] == 1.0
    assert "rollout engine victim is dead" in caplog.text
    # the next batch runs on the survivor alone
    res2 = driver.generate_rollout_sync(RolloutDataSource(dataset, rollout_batch_size=1, n_samples_per_prompt=2).get_samples())
    assert len(res2.samples) == 2 and res2.engine_failures == []


def test_no_engine_left_names_every_dead_engine(dataset, tokenizer):
    recipe = make_recipe(rm_type="math")
    driver = RolloutDriver(recipe, {"gpu-node-3": dead_url(), "gpu-node-4": dead_url()}, tokenizer=tokenizer)
    groups = RolloutDataSource(dataset, rollout_batch_size=2, n_samples_per_prompt=2).get_samples()
    with pytest.raises(NoEngineError) as ei:
        driver.generate_rollout_sync(groups)
    msg = str(ei.value)
    assert "no rollout engine left" in msg and "gpu-node-3: " in msg and "gpu-node-4: " in msg
    assert "cannot connect" in msg or "connection refused" in msg


def test_refused_request_names_the_sample(cpu_engine, dataset, tokenizer):
    driver = RolloutDriver(make_recipe(rm_type="math"), [cpu_engine], tokenizer=tokenizer)
    groups = RolloutDataSource(dataset, rollout_batch_size=1, n_samples_per_prompt=1).get_samples()
    groups[0][0].tokens = [5] * 600  # longer than the tiny model's 512-token context
    with pytest.raises(RolloutError, match=r"refused the request of sample index=0 .*600 prompt tokens.*context"):
        driver.generate_rollout_sync(groups)


def test_reward_error_policy_in_a_batch(cpu_engine, dataset, tokenizer, reward_mod):
    groups = lambda: RolloutDataSource(dataset, rollout_batch_size=2, n_samples_per_prompt=3).get_samples()  # noqa: E731
    skip = RolloutDriver(make_recipe(custom_rm_path=f"{reward_mod}.raising_reward", reward_error_policy="skip",
                                     max_response_len=4), [cpu_engine], tokenizer=tokenizer)
    res = skip.generate_rollout_sync(groups())
    failed = [s for s in res.samples if s.status is SampleStatus.FAILED]
    assert [s.index for s in failed] == [1, 4] and all(s.reward == 0.0 for s in failed)
    assert [f.index for f in res.reward_failures] == [1, 4] and res.metrics["rollout/reward_failed"] == 2.0
    assert "judge unavailable for sample 1" in res.reward_failures[0].error_text
    assert res.reward_failures[0].response == failed[0].response

    fail = RolloutDriver(make_recipe(custom_rm_path=f"{reward_mod}.raising_reward", reward_error_policy="fail",
                                     max_response_len=4), [cpu_engine], tokenizer=tokenizer)
    with pytest.raises(RewardError) as ei:
        fail.generate_rollout_sync(groups())
    assert [f.index for f in ei.value.failures] == [1, 4]  # sample order, though 4 failed first
    assert fail.reward.failures[0].index == 4
    msg = str(ei.value)
    assert msg.index("index=1 group_index=0") < msg.index("index=4 group_index=1")
    assert "judge unavailable for sample 1" in msg.split("Traceback of the first failure:")[1]


def test_eval_with_pass_at_k(cpu_engine, dataset, tokenizer, reward_mod, tmp_path):
    recipe = make_recipe(custom_rm_path=f"{reward_mod}.digit_reward", n_samples_per_eval_prompt=4,
                         eval_max_response_len=6, eval_temperature=1.0, eval_interval=2)
    driver = RolloutDriver(recipe, [cpu_engine], tokenizer=tokenizer)
    sets = {"tiny": list(dataset)[:3], "tinier": list(dataset)[3:5]}
    metrics, results = asyncio.run(run_eval(driver, sets, step=4))
    for name, n_prompts in (("tiny", 3), ("tinier", 2)):
        r = results[name]
        assert len(r.samples) == n_prompts * 4 and all(s.response_length <= 6 for s in r.samples)
        assert all(s.rollout_log_probs is None for s in r.samples)  # eval asks for no log-probs
        assert metrics[f"eval/{name}"] == pytest.approx(sum(r.raw_rewards) / len(r.raw_rewards))
        want = compute_pass_rate(r.raw_rewards, 4)
        assert set(want) == {"pass@1", "pass@2", "pass@4"}
        for k, v in want.items():
            assert metrics[f"eval/{name}-{k}"] == pytest.approx(v)
        assert f"eval/{name}-truncated_ratio" in metrics and f"eval/{name}/response_len/mean" in metrics
    assert metrics["eval/step"] == 4.0


def test_pass_at_k_and_eval_schedule():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert compute_pass_rate([1, 0, 0, 0, 1, 1, 0, 0], 4) == pytest.approx(
        {"pass@1": (0.25 + 0.5) / 2, "pass@2": (0.5 + (1 - 1 / 6)) / 2, "pass@4": 1.0})
    assert compute_pass_rate([1.0, 0.0], 1) == {"pass@1": 0.5}
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)
    assert [s for s in range(10) if should_eval(s, 3)] == [2, 5, 8]
    assert [s for s in range(10) if should_eval(s, 3, num_steps=10)] == [2, 5, 8, 9]
    assert not any(should_eval(s, None) for s in range(5))
    assert should_eval_before_train(3) and not should_eval_before_train(3, True) and not should_eval_before_train(None)
