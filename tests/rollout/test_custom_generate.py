"""A custom generate function written in Relax's form (it talks HTTP to
``args.sglang_router_ip:args.sglang_router_port`` with the router's key, ``router_headers()``, and fills the Sample
itself) runs unchanged through
``rollout.custom_generate_function_path`` and per sample through ``sample.generate_function_path``; the token
ids and log-probs are the engine's; a function that fills a sample wrongly is named in the error."""


import pytest

from relax_hpc.recipe.schema import ModelConfig, Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.data import RolloutDataSource
from relax_hpc.rollout.driver import RolloutDriver, RolloutError
from relax_hpc.rollout.sample import SampleStatus
from tests.rollout.conftest import import_source

RELAX_GENERATE = '''
    import httpx
    from transformers import AutoTokenizer

    from relax_hpc.engines.router import router_headers

    TOKENIZERS = {}
    CALLS = []


    async def generate(args, sample, sampling_params, evaluation=False):
        """Relax's contract: fill in the sample from SGLang's /generate, behind args.sglang_router_ip:port."""
        tok = TOKENIZERS.setdefault(args.hf_checkpoint, AutoTokenizer.from_pretrained(args.hf_checkpoint))
        url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
        ids = list(sample.tokens) or tok.encode(sample.prompt, add_special_tokens=False)
        payload = {"input_ids": ids, "sampling_params": sampling_params, "return_logprob": not evaluation}
        async with httpx.AsyncClient(headers=router_headers()) as client:  # the router wants its key
            out = (await client.post(url, json=payload, timeout=60)).json()
        CALLS.append((sample.index, evaluation, sampling_params.get("sampling_seed")))
        pairs = out["meta_info"].get("output_token_logprobs") or [[0.0, t] for t in out["output_ids"]]
        new = [int(p[1]) for p in pairs]
        sample.tokens = ids + new
        sample.response = out["text"]
        sample.response_length = len(new)
        sample.rollout_log_probs = [float(p[0]) for p in pairs]
        sample.loss_mask = [1] * len(new)
        reason = out["meta_info"]["finish_reason"]["type"]
        sample.status = sample.Status.TRUNCATED if reason == "length" else sample.Status.COMPLETED
        sample.weight_versions.append(out["meta_info"]["weight_version"])
        return sample


    async def broken(args, sample, sampling_params):
        sample.tokens = [1, 2, 3]
        sample.response_length = 2
        sample.rollout_log_probs = [0.0]
        return sample


    async def split(args, sample, sampling_params, evaluation=False):
        """Relax's list return: the rollout as segments, the first of its first two tokens, the second of all of
        them with the first two masked (trained in the first); a response shorter than 3 tokens stays whole."""
        import copy

        whole = await generate(args, sample, sampling_params, evaluation)
        n = whole.response_length
        if n < 3:
            return [whole]
        prompt = len(whole.tokens) - n
        first = copy.deepcopy(whole)
        first.tokens = whole.tokens[:prompt + 2]
        first.response_length, first.loss_mask = 2, [1, 1]
        first.rollout_log_probs = whole.rollout_log_probs[:2]
        first.response = "first"
        whole.loss_mask = [0, 0] + [1] * (n - 2)
        return [first, whole]


    def reward(args, sample, **kwargs):
        return float(len(sample.response))
'''


@pytest.fixture
def mod(tmp_path, monkeypatch):
    return import_source(tmp_path, monkeypatch, "relax_gen", RELAX_GENERATE)


def _driver(tiny_llama, cpu_engine, path):
    from relax_hpc.rollout.data import load_tokenizer

    recipe = Recipe(model=ModelConfig(path=str(tiny_llama)),
                    rollout=RolloutConfig(custom_generate_function_path=path, custom_rm_path="relax_gen.reward",
                                          n_samples_per_prompt=2, rollout_batch_size=2, max_response_len=5))
    return RolloutDriver(recipe, {"e0": cpu_engine}, tokenizer=load_tokenizer(tiny_llama))


def _groups(tmp_path, tokenizer):
    import json

    from relax_hpc.rollout.data import DataKeys, PromptDataset

    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(2):
            f.write(json.dumps({"q": f"{i}+2=", "a": str(i + 2)}) + "\n")
    ds = PromptDataset(tmp_path / "p.jsonl", keys=DataKeys("q", "a"), tokenizer=tokenizer, apply_chat_template=False)
    return RolloutDataSource(ds, rollout_batch_size=2, n_samples_per_prompt=2).get_samples()


def test_a_relax_generate_function_runs_unchanged(tmp_path, tiny_llama, cpu_engine, mod):
    driver = _driver(tiny_llama, cpu_engine, "relax_gen.generate")
    res = driver.generate_rollout_sync(_groups(tmp_path, driver.tokenizer), seed=11)
    assert len(res.samples) == 4 and len(mod.CALLS) == 4 and driver.router.requests == 4
    assert {c[1] for c in mod.CALLS} == {False} and all(c[2] is not None for c in mod.CALLS)  # seeded per sample
    for s in res.samples:
        prompt = driver.tokenizer.encode(s.prompt, add_special_tokens=False)
        assert s.tokens[:len(prompt)] == prompt and 1 <= s.response_length <= 5
        assert len(s.rollout_log_probs) == s.response_length and all(lp <= 0 for lp in s.rollout_log_probs)
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and s.weight_version is not None
        assert s.reward == float(len(s.response))
    # the engine's ids as sampled, not re-tokenized: the built-in path with the same seeds gives the same tokens
    plain = RolloutDriver(Recipe(rollout=RolloutConfig(custom_rm_path="relax_gen.reward", max_response_len=5)),
                          {"e0": cpu_engine}, tokenizer=driver.tokenizer)
    again = plain.generate_rollout_sync(_groups(tmp_path, driver.tokenizer), seed=11)
    assert [s.tokens for s in again.samples] == [s.tokens for s in res.samples]
    driver.router.close()


def test_per_sample_function_and_a_wrongly_filled_sample(tmp_path, tiny_llama, cpu_engine, mod):
    driver = _driver(tiny_llama, cpu_engine, None)
    groups = _groups(tmp_path, driver.tokenizer)
    for s in groups[0]:
        s.generate_function_path = "relax_gen.generate"  # Relax's per-sample choice; group 1 takes the built-in path
    driver.generate_rollout_sync(groups, seed=3)
    assert sorted(c[0] for c in mod.CALLS) == sorted(s.index for s in groups[0])
    groups = _groups(tmp_path, driver.tokenizer)
    groups[1][0].generate_function_path = "relax_gen.broken"
    with pytest.raises(RolloutError, match=r"relax_gen.broken returned sample index=\d+ with 1 rollout_log_probs"):
        driver.generate_rollout_sync(groups)
    driver.router.close()


def test_a_list_return_is_segments_of_one_rollout(tmp_path, tiny_llama, cpu_engine, mod):
    """Each segment is a sample of its own, in its group, with the rollout's id; rewards and group statistics
    count each rollout once (its segments' mean); the segments go through the exchange to the actor's batch."""
    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.train import plan as P
    from relax_hpc.rollout.write import write_step

    driver = _driver(tiny_llama, cpu_engine, "relax_gen.split")
    groups = _groups(tmp_path, driver.tokenizer)
    origin = {s.index: s.group_index for g in groups for s in g}
    res = driver.generate_rollout_sync(groups, seed=5)
    rollouts = [s.rollout_id for s in res.samples]
    assert sorted(set(rollouts)) == sorted(origin) and len(res.samples) > len(origin)  # some rollouts were split
    for s in res.samples:
        assert s.group_index == origin[s.rollout_id] and len(s.loss_mask) == s.response_length
    assert [len(g) for g in res.groups()] == [sum(origin[r] == gi for r in rollouts) for gi in (0, 1)]
    means = [sum(r for s, r in zip(res.samples, res.raw_rewards) if s.rollout_id == i) / rollouts.count(i)
             for i in sorted(origin)]
    assert res.metrics["rollout/raw_reward"] == pytest.approx(sum(means) / len(means))
    assert res.metrics["rollout/segments_per_rollout"] == len(res.samples) / len(origin)
    ref = write_step(tmp_path, 1, res)
    batch, _ = P.train_batch(P.read_train_columns([ref]), AlgorithmConfig(), group_size=2)
    assert len(batch) == len(res.samples)
    split = next(i for i, s in enumerate(res.samples) if s.response == "first")
    assert batch[split + 1].loss_mask[:2].tolist() == [0.0, 0.0]  # the tokens the first segment trains
    driver.router.close()


def test_a_list_holding_something_else_is_refused(tmp_path, tiny_llama, cpu_engine, mod):
    async def empty(args, sample, sampling_params):
        return []

    mod.empty = empty
    driver = _driver(tiny_llama, cpu_engine, "relax_gen.empty")
    with pytest.raises(RolloutError, match="relax_gen.empty returned an empty list for sample index="):
        driver.generate_rollout_sync(_groups(tmp_path, driver.tokenizer))
    driver.router.close()
