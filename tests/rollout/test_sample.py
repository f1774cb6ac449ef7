"""Sample: Relax's field names, engine-output bookkeeping, reward reading, copies and serialization."""

import json

import pytest

from relax_hpc.rollout.sample import Sample, SampleStatus, reward_value


def test_relax_field_names_and_defaults():
    s = Sample()
    for name in ("group_index", "index", "prompt", "tokens", "response", "response_length", "label", "reward",
                 "loss_mask", "weight_versions", "rollout_log_probs", "status", "metadata", "remove_sample",
                 "abort_count", "multimodal_inputs", "session_id", "train_metadata"):
        assert hasattr(s, name), name
    assert s.status is Sample.Status.PENDING  # Relax spells it Sample.Status.X
    assert Sample.Status is SampleStatus
    assert s.metadata == {} and s.tokens == [] and s.reward is None and s.weight_version is None


def test_append_response_and_meta_info():
    s = Sample(prompt="2+2=", tokens=[5, 6, 7])
    s.append_response([8, 9], "4.", [-0.1, -0.2])
    s.update_from_meta_info({"finish_reason": {"type": "length", "length": 2}, "weight_version": 3})
    assert s.tokens == [5, 6, 7, 8, 9] and s.response == "4." and s.response_length == 2
    assert s.prompt_length == 3 and s.loss_mask == [1, 1] and s.rollout_log_probs == [-0.1, -0.2]
    assert s.status is SampleStatus.TRUNCATED and s.weight_versions == ["3"] and s.weight_version == "3"
    s.update_from_meta_info({"finish_reason": {"type": "stop"}})
    assert s.status is SampleStatus.COMPLETED
    s.update_from_meta_info({"finish_reason": {"type": "abort"}})
    assert s.status is SampleStatus.ABORTED
    with pytest.raises(ValueError, match="log-probs"):
        s.append_response([1], "x", [0.0, 0.0])
    s.reset_response([5, 6, 7])
    assert s.tokens == [5, 6, 7] and s.response == "" and s.response_length == 0 and s.status is SampleStatus.PENDING


def test_effective_response_length():
    s = Sample(response_length=4)
    assert s.effective_response_length == 4
    s.loss_mask = [1, 0, 1, 0]
    assert s.effective_response_length == 2


def test_reward_value_float_and_dict():
    class Args:
        reward_key = "score"

    assert Sample(reward=1).get_reward_value(None) == 1.0
    assert Sample(reward={"score": 0.5, "acc": 1}).get_reward_value(Args()) == 0.5
    assert Sample(reward={"score": 0.5, "acc": 1}).get_reward_value(reward_key="acc") == 1.0
    assert Sample(reward=0.0).get_reward_value(Args()) == 0.0  # a failed reward reads the same under any key
    with pytest.raises(ValueError, match="reward_key"):
        reward_value({"score": 1.0}, None)
    with pytest.raises(KeyError, match="acc"):
        reward_value({"score": 1.0}, "acc")
    with pytest.raises(TypeError, match="number"):
        reward_value("high", None)


def test_copy_does_not_alias_and_dict_roundtrip():
    a = Sample(prompt="p", tokens=[1, 2], metadata={"k": [1]}, label="l")
    b = a.copy(index=7, group_index=2)
    b.metadata["k"].append(2)
    b.tokens.append(3)
    assert a.metadata == {"k": [1]} and a.tokens == [1, 2] and (b.index, b.group_index) == (7, 2)
    b.status = SampleStatus.COMPLETED
    b.extra_field = "kept"
    d = json.loads(json.dumps(b.to_dict()))
    assert d["status"] == "completed"
    c = Sample.from_dict(d)
    assert c.status is SampleStatus.COMPLETED and c.tokens == [1, 2, 3] and c.extra_field == "kept"
    assert c.metadata == {"k": [1, 2]}


def test_a_partial_sample_survives_json_whole():
    """What partial rollout's buffer saves of an aborted sample comes back equal, field by field: the tokens so far,
    the masked off-policy tokens, the engine's log-probs, the abort count and the rest."""
    s = Sample(group_index=3, index=13, prompt="2+2=", tokens=[5, 6, 7], label="4", metadata={"i": 2, "rm": [1]})
    s.append_response([8, 9], "4.", [-0.1234567890123, -1e-9], loss_mask_value=0)
    s.update_from_meta_info({"finish_reason": {"type": "abort"}, "weight_version": 2})
    s.append_response([10], " ", [-2.5])
    s.abort_count, s.reward, s.non_generation_time = 1, {"score": 0.25}, 0.5
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s and back.status is SampleStatus.ABORTED
    assert (back.prompt_length, back.response_length, back.loss_mask) == (3, 3, [0, 0, 1])
    assert back.rollout_log_probs == [-0.1234567890123, -1e-9, -2.5] and back.weight_version == "2"
