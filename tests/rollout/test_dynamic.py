"""DAPO dynamic sampling against a real CPU engine: rounds of over-sampled groups until enough pass the filter,
the cursor left just after the last group used, the same groups again from the same seed, a clear error when
the filter drops everything, and the per-step sample filter."""

import json

import pytest

from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource, load_tokenizer
from relax_hpc.rollout.driver import RolloutDriver
from relax_hpc.rollout.dynamic import DynamicSamplingError, check_reward_nonzero_std, generate_step
from tests.rollout.conftest import import_source

REWARDS = '''
    def reward_func(args, sample, **kwargs):
        """Prompts with an even i: every sample scores 0 (a group GRPO learns nothing from); odd i: 0 or 1."""
        i = sample.metadata["i"]
        return 0.0 if i % 2 == 0 else float(sample.index % 2)


    def drop_all(args, samples):
        return False


    def remove_first(args, groups):
        for g in groups:
            g[0].remove_sample = True
'''


@pytest.fixture
def mod(tmp_path, monkeypatch):
    return import_source(tmp_path, monkeypatch, "dyn_plugins", REWARDS)


@pytest.fixture
def setup(tmp_path, tiny_llama, cpu_engine, mod):
    tok = load_tokenizer(tiny_llama)
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"q": f"{i}+1=", "a": str(i + 1), "metadata": {"i": i}}) + "\n")
    ds = PromptDataset(tmp_path / "p.jsonl", keys=DataKeys("q", "a"), tokenizer=tok, apply_chat_template=False)
    recipe = Recipe(rollout=RolloutConfig(custom_rm_path="dyn_plugins.reward_func", n_samples_per_prompt=2,
                                          rollout_batch_size=2, max_response_len=3))
    driver = RolloutDriver(recipe, [cpu_engine], tokenizer=tok)
    return driver, (lambda: RolloutDataSource(ds, rollout_batch_size=2, n_samples_per_prompt=2))


def test_rounds_until_enough_groups_pass_and_the_surplus_goes_back(setup):
    driver, source = setup
    data = source()
    res = generate_step(driver, data, target=2, seed=5, group_filter=check_reward_nonzero_std,
                        args=driver.reward.args, over_sampling=3)
    # round 0 draws prompts 0,1,2 (1 passes), round 1 draws 3,4,5 and needs only 3: 4 and 5 go back
    assert [g[0].metadata["i"] for g in res.groups()] == [1, 3]
    for g in res.groups():  # every trained group has a non-zero reward spread
        assert len(set(res.raw_rewards[res.samples.index(g[0]):][:2])) == 2
    m = res.metrics
    assert m["rollout/dynamic_sampling_rounds"] == 2 and m["rollout/dynamic_sampling_generated_groups"] == 4
    assert m["rollout/dynamic_sampling_filtered_ratio"] == pytest.approx(0.5)
    assert m["rollout/dynamic_filter/drop_zero_std_0.0"] == 2
    assert m["rollout/raw_reward"] == pytest.approx(0.5)  # over the kept groups only
    assert [s.metadata["i"] for s in data.next_prompts(1)] == [4]  # the cursor: just after the last group used

    again = generate_step(driver, source(), target=2, seed=5, group_filter=check_reward_nonzero_std,
                          args=driver.reward.args, over_sampling=3)
    assert [s.tokens for s in again.samples] == [s.tokens for s in res.samples]  # a step redone samples alike


def test_without_a_filter_a_step_is_one_plain_batch(setup):
    driver, source = setup
    plain = driver.generate_rollout_sync(source().get_samples(), seed=9)
    step = generate_step(driver, source(), target=2, seed=9, group_filter=None, args=driver.reward.args)
    assert [s.tokens for s in step.samples] == [s.tokens for s in plain.samples]
    assert not any(k.startswith("rollout/dynamic") for k in step.metrics)


def test_a_filter_that_drops_everything_stops_with_the_keys_to_change(setup, mod):
    driver, source = setup
    with pytest.raises(DynamicSamplingError) as e:
        generate_step(driver, source(), target=2, seed=1, group_filter=mod.drop_all, args=driver.reward.args,
                      max_rounds=2)
    msg = str(e.value)
    assert "kept 0 of rollout.rollout_batch_size = 2" in msg and "dynamic_sampling_max_rounds = 2" in msg
    assert "Fix:" in msg


def test_the_sample_filter_zeroes_the_loss_mask_of_removed_samples(setup, mod):
    driver, source = setup
    res = generate_step(driver, source(), target=2, seed=3, group_filter=None, args=driver.reward.args,
                        sample_filter=mod.remove_first)
    for g in res.groups():
        assert g[0].loss_mask == [0] * g[0].response_length and set(g[1].loss_mask or [1]) == {1}
    assert res.metrics["rollout/removed_samples_ratio"] == pytest.approx(0.5)
    assert len(res.raw_rewards) == 4  # removed samples still count in the group normalization


# ------------------------------------------------------------------------------------ partial rollout ---

def _snapshot(groups):
    return {s.index: (list(s.tokens), s.response_length, s.status) for g in groups for s in g}


def test_partial_rollout_keeps_what_was_generated_and_continues_it_next_step(setup):
    """Timing decides which groups finish first and how far the others got; what must hold whatever the timing:
    exactly rollout_batch_size complete groups per step, every other group drawn goes to the buffer (none lost,
    none trained twice), and a buffered sample is continued, not restarted, with its earlier tokens masked."""
    from relax_hpc.rollout.dynamic import PartialRollout
    from relax_hpc.rollout.sample import SampleStatus

    driver, source = setup
    driver.cfg.max_response_len = 24
    data = source()
    partial = PartialRollout(mask_offpolicy=True)
    first = generate_step(driver, data, target=2, seed=4, group_filter=None, args=driver.reward.args,
                          over_sampling=4, partial=partial)
    kept1 = {g[0].group_index for g in first.groups()}
    assert len(kept1) == 2 and all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
                                   for s in first.samples)
    assert len(first.raw_rewards) == 4 and first.metrics["rollout/partial_buffer_groups"] == 2
    buffered = {g[0].group_index for g in partial.buffer}
    assert kept1 | buffered == {0, 1, 2, 3} and not kept1 & buffered  # every group drawn: trained or kept back
    before = _snapshot(partial.buffer)
    for g in partial.buffer:
        for s in g:
            assert s.status in (SampleStatus.PENDING, SampleStatus.ABORTED, SampleStatus.COMPLETED,
                                SampleStatus.TRUNCATED)
            assert s.tokens[:s.prompt_length] == s.tokens[:len(s.tokens) - s.response_length]
            if s.status is SampleStatus.ABORTED:
                assert s.abort_count == 1 and s.loss_mask == [0] * s.response_length  # older weights: masked

    second = generate_step(driver, data, target=2, seed=5, group_filter=None, args=driver.reward.args,
                           over_sampling=4, partial=partial)
    kept2 = {g[0].group_index for g in second.groups()}
    assert not kept1 & kept2 and len(kept2) == 2
    assert kept2 == buffered  # the buffer goes first (FIFO engine slots): its groups finish first
    for s in second.samples:
        tokens, k, status = before[s.index]
        assert s.tokens[:len(tokens)] == tokens and s.response_length >= k  # continued from where it stopped
        assert s.response_length <= 24
        if status is SampleStatus.ABORTED:  # the tokens of before the abort are out of the loss, the rest in
            assert s.loss_mask == [0] * k + [1] * (s.response_length - k)
        else:  # finished (or never sent) before the step ended: nothing to mask
            assert s.loss_mask == [1] * s.response_length


def test_a_sample_whose_step_ended_is_not_sent_and_a_partial_one_continues(setup):
    import asyncio

    from relax_hpc.rollout.sample import SampleStatus

    driver, source = setup
    (a, b), = source().get_samples(1)
    stop = asyncio.Event()
    stop.set()
    sent = sum(st["requests"] for st in driver.engine_stats().values())
    asyncio.run(driver.generate_sample(a, driver.sampling_params(), stop=stop))
    assert a.status is SampleStatus.PENDING and a.response_length == 0
    assert sum(st["requests"] for st in driver.engine_stats().values()) == sent  # never sent

    prompt = driver.prompt_ids(b)
    b.tokens = prompt
    b.append_response([5, 6], "ab", [-1.0, -1.0], loss_mask_value=0)  # what an earlier step left
    b.status = SampleStatus.ABORTED
    asyncio.run(driver.generate_sample(b, driver.sampling_params(), seed=3))
    assert b.tokens[:len(prompt) + 2] == prompt + [5, 6] and b.status is not SampleStatus.ABORTED
    assert 2 < b.response_length <= 3  # max_response_len 3: one token left to generate
    assert b.loss_mask[:2] == [0, 0] and len(b.rollout_log_probs) == b.response_length


def _buffered_group(gi: int, prompt_ids: list[int]):
    """A group as a step leaves it in the buffer: one sample aborted mid-response (tokens masked off-policy), one
    finished and scored, one never sent."""
    from relax_hpc.rollout.sample import Sample, SampleStatus

    tmpl = Sample(prompt=f"{gi}+1=", tokens=list(prompt_ids), label=str(gi + 1), metadata={"i": gi})
    a, b, c = (tmpl.copy(group_index=gi, index=3 * gi + k) for k in range(3))
    a.append_response([7, 8], "xy", [-0.5, -0.25], loss_mask_value=0)
    a.weight_versions, a.status, a.abort_count = ["1"], SampleStatus.ABORTED, 1
    b.append_response([9], "z", [-1.5])
    b.weight_versions, b.status, b.reward = ["1"], SampleStatus.COMPLETED, 1.0
    return [a, b, c]


def test_the_buffer_state_round_trips_and_names_each_prompt_once():
    import json

    from relax_hpc.rollout.dynamic import PartialRollout

    partial = PartialRollout(buffer=[_buffered_group(4, [11, 12, 13]), _buffered_group(5, [14, 15])])
    state = json.loads(json.dumps(partial.state_dict()))
    again = PartialRollout()
    again.load_state_dict(state)
    assert again.buffer == partial.buffer  # every field of every sample, in order
    g = state["groups"][0]
    assert g["prompt_tokens"] == [11, 12, 13] and g["shared"]["prompt"] == "4+1=" and "prompt" not in g["samples"][0]
    assert [s.get("tokens", []) for s in g["samples"]] == [[7, 8], [9], []]  # the responses only
    again.load_state_dict(None)
    assert again.buffer == []


def test_a_saved_buffer_loads_back_and_a_wrong_one_is_refused(tmp_path):
    from relax_hpc.errors import is_permanent
    from relax_hpc.rollout.dynamic import PartialRollout, PartialStateError

    partial = PartialRollout(buffer=[_buffered_group(0, [1, 2])])
    ref = partial.save(tmp_path, 3)
    assert ref["file"] == f"partial_rollout/after_00000003_{ref['sha256'][:16]}.json"
    assert (ref["groups"], ref["samples"]) == (1, 3) and PartialRollout.file_step(ref["file"].split("/")[1]) == 3
    assert (tmp_path / ref["file"]).stat().st_size == ref["size"]
    back = PartialRollout()
    back.load(tmp_path, ref)
    assert back.buffer == partial.buffer
    assert PartialRollout().save(tmp_path, 4) == {"groups": 0, "samples": 0}  # an empty buffer: no file
    assert not list((tmp_path / "partial_rollout").glob("after_00000004*"))
    other = PartialRollout(buffer=[_buffered_group(1, [1, 2])]).save(tmp_path, 3)  # the step generated again
    assert other["file"] != ref["file"]  # under a name of its own: the first is still there for what names it
    back.load(tmp_path, ref)
    assert back.buffer == partial.buffer
    (tmp_path / ref["file"]).write_bytes((tmp_path / other["file"]).read_bytes())  # damaged in place
    with pytest.raises(PartialStateError, match="not the buffer the data cursor names") as e:
        back.load(tmp_path, ref)
    assert is_permanent(e.value) and "Fix:" in str(e.value)
    (tmp_path / ref["file"]).unlink()
    with pytest.raises(PartialStateError, match="is missing"):
        back.load(tmp_path, ref)
