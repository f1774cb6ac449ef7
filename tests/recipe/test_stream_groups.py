"""``rollout.stream_groups`` (streaming within a step) at validation, and Relax's ``--num-iters-per-train-update``,
refused with its reason in the recipe and in ``--from-relax-args``."""

import pytest

from relax_hpc.recipe import RecipeError, recipe_from_dict
from relax_hpc.recipe.from_relax import convert


def problems(data) -> dict[str, str]:
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(data)
    return {k: m for k, _, m in e.value.problems}


def test_stream_groups_is_a_count_of_groups_and_zero_is_one_chunk_per_step():
    assert recipe_from_dict({}).rollout.stream_groups == 0
    assert recipe_from_dict({"rollout": {"stream_groups": 4}}).rollout.stream_groups == 4
    assert "0 (one chunk per step) or more" in problems({"rollout": {"stream_groups": -1}})["rollout.stream_groups"]


@pytest.mark.parametrize("extra,key,text", [
    ({"rollout": {"dynamic_sampling_filter_path": "relax_hpc.rollout.dynamic.check_reward_nonzero_std"}},
     "rollout.dynamic_sampling_filter_path", "known only at its end"),
    ({"mode": "fully_async", "max_staleness": 1,
      "rollout": {"partial_rollout": True, "over_sampling_batch_size": 16}}, "rollout.partial_rollout", "aborted"),
    ({"rollout": {"sample_filter_path": "tests.rollout.filters.drop_none"}}, "rollout.sample_filter_path",
     "whole step's groups"),
    ({"train": {"routing_replay": True}}, "rollout.stream_groups", "routing_replay"),
])
def test_stream_groups_is_refused_where_a_step_is_known_only_whole(extra, key, text):
    data = {**extra, "rollout": {"rollout_batch_size": 8, "stream_groups": 2, **extra.get("rollout", {})}}
    got = problems(data)
    assert key in got and text in got[key] and "stream_groups" in got[key] and "Fix:" in got[key], got
    data["rollout"]["stream_groups"] = 0  # the same recipe without streaming has no streaming problem
    try:
        recipe_from_dict(data)
    except RecipeError as e:
        assert all("stream_groups" not in m for _, _, m in e.problems)


def test_num_iters_per_train_update_is_refused_with_the_reason_in_recipes_and_from_relax_args():
    msg = problems({"train": {"num_iters_per_train_update": 2}})["train.num_iters_per_train_update"]
    assert "--num-iters-per-train-update" in msg and "num_steps_per_rollout" in msg and "Fix:" in msg
    data, notes = convert(["--num-iters-per-train-update", "2"])
    assert "num_iters_per_train_update" not in str(data)
    note = next(n for n in notes if n.startswith("--num-iters-per-train-update 2"))
    assert "not supported" in note and "num_steps_per_rollout" in note
