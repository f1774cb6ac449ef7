"""The recipe's ``forward:`` section (reference and actor_fwd's own TP/PP, sequence parallelism and token budget,
Relax's --ref-actor-config): what the forward roles build with, and the checks that refuse a layout they could not
build, each naming its key. That the roles really build with it: tests/train/test_build.py."""

from __future__ import annotations

import pytest

from relax_hpc.recipe import RecipeError, recipe_from_dict
from relax_hpc.train.config import TrainConfig
from relax_hpc.train.forward_config import ForwardConfig, forward_train, role_train

REF = {"enabled": True, "gpus_per_node": 0, "tasks_per_node": 1}
ACTOR4 = {"tasks_per_node": 4}


def problems(data) -> dict[str, str]:
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(data)
    return {k: m for k, _, m in e.value.problems}


def test_forward_keys_go_over_the_actor_s():
    tr = TrainConfig(tp=2, pp=2, sequence_parallel=True, max_tokens_per_micro_batch=8192,
                     logprob_max_tokens_per_micro_batch=16384)
    assert forward_train(tr, None) is tr
    f = forward_train(tr, ForwardConfig(tp=1))
    assert (f.tp, f.pp, f.sequence_parallel, f.logprob_max_tokens_per_micro_batch) == (1, 2, False, 16384)
    f = forward_train(tr, ForwardConfig(tp=4, max_tokens_per_micro_batch=32768))
    assert (f.tp, f.sequence_parallel, f.logprob_max_tokens_per_micro_batch) == (4, True, 32768)
    assert f.max_tokens_per_micro_batch == 8192 and tr.tp == 2  # the actor's own budget and config untouched
    r = recipe_from_dict({"forward": {"tp": 1}, "train": {"tp": 2}, "roles": {"actor": ACTOR4, "reference": REF}})
    assert role_train(r, "reference").tp == role_train(r, "actor_fwd").tp == 1 and role_train(r, "actor").tp == 2


def test_a_forward_layout_that_cannot_build_is_refused_by_key():
    p = problems({"forward": {"tp": 2}, "roles": {"reference": REF}})
    assert "does not divide roles.reference's 1 ranks" in p["forward.tp"]
    p = problems({"forward": {"tp": 1, "sequence_parallel": True}, "roles": {"actor_fwd": REF}})
    assert "needs tensor parallelism" in p["forward.sequence_parallel"]
    p = problems({"forward": {"max_tokens_per_micro_batch": 1024}, "roles": {"reference": REF}})
    assert "below train.max_seq_len = 4096" in p["forward.max_tokens_per_micro_batch"]
    p = problems({"forward": {"pp": 0}, "roles": {"reference": REF}})
    assert "at least 1" in p["forward.pp"]


def test_forward_without_a_forward_role_is_refused_as_doing_nothing():
    p = problems({"forward": {"tp": 1}})
    assert "both are disabled: it would change nothing" in p["forward"]


def test_the_actor_s_tp_that_does_not_divide_a_forward_role_is_refused_before_it_fails_at_build():
    """Without forward:, the forward roles build with train.tp: TP 2 on a reference of one rank failed at its build
    (Megatron: "does not divide the world size"); now the recipe is refused, pointing at forward.tp."""
    p = problems({"train": {"tp": 2}, "roles": {"actor": ACTOR4, "reference": REF}})
    assert "does not divide roles.reference's 1 ranks" in p["train.tp"] and "forward.tp" in p["train.tp"]
    recipe_from_dict({"train": {"tp": 2}, "forward": {"tp": 1}, "roles": {"actor": ACTOR4, "reference": REF}})
