"""The schema's check of ``routed_experts`` (MoE routing replay), the one every side uses: the rollout on each engine
answer, the chunk writer, the trainer's door and the trainer's replay. Each bound is tried at its edge."""

from __future__ import annotations

import numpy as np
import pytest

from relax_hpc.exchange.fields import BY_NAME, UNROUTED, Routing, routed_experts_problem

MOE = Routing(layers=2, top_k=2, num_experts=4)


def ids(*rows) -> np.ndarray:
    """[tokens, layers × top_k] int32, as the engine's answer decodes."""
    return np.asarray(rows, dtype=np.int32)


GOOD = ids([0, 1, 2, 3], [3, 2, 1, 0], [0, 3, 3, 0])


def test_sound_rows_pass_flat_or_shaped_and_in_any_integer_dtype():
    assert routed_experts_problem(GOOD, 3, MOE) is None
    assert routed_experts_problem(GOOD.reshape(-1), 3, MOE) is None
    assert routed_experts_problem(GOOD.astype(np.int16), 3, MOE) is None  # decode_routed_experts' compact form
    assert routed_experts_problem(GOOD.astype(np.uint8), 3, MOE) is None
    assert BY_NAME["routed_experts"].dtype == "int32" and "routed_experts_problem" in BY_NAME["routed_experts"].doc


@pytest.mark.parametrize("bad, tokens, want", [
    # the largest id the model has passes (GOOD), one past it does not: [0, num_experts)
    (ids([0, 4, 2, 3], *GOOD[1:]), 3, r"token 0, layer 0 has expert ids \[0, 4\]: an id outside \[0, 4\) "
                                      r"\(the model's num_experts\)"),
    (ids(*GOOD[:2], [0, 3, 1, 99]), 3, r"token 2, layer 1 has expert ids \[1, 99\]: an id outside \[0, 4\)"),
    # a router picks k distinct experts: one twice is not a top-2
    (ids(*GOOD[:2], [2, 2, 3, 0]), 3, r"token 2, layer 0 has expert ids \[2, 2\]: an id repeated \(a router picks "
                                      r"top-2 distinct experts\)"),
    # an engine's answer has no -1 (it ran every token): below 0 is refused
    (ids([-1, -1, 2, 3], *GOOD[1:]), 3, r"token 0, layer 0 has expert ids \[-1, -1\]: an id below 0$"),
    # a row for an extra layer (3 layers × top-2 a token)
    (np.concatenate([GOOD, GOOD[:, :2]], axis=1), 3, r"18 expert ids, not 3 tokens × 2 layers × top-2 = 12 \(.*6 "
                                                     r"ids a token: a row for an extra or a missing layer"),
    # a row for an extra token, and one missing
    (np.concatenate([GOOD, GOOD[:1]]), 3, r"16 expert ids, not 3 tokens × 2 layers × top-2 = 12 \(4 rows of 4"),
    (GOOD[:2], 3, r"8 expert ids, not 3 tokens × 2 layers × top-2 = 12 \(2 rows of 4\)"),
    (GOOD.astype(np.float32), 3, r"expert ids of dtype float32, not integers"),
])
def test_bad_rows_are_named_with_the_token_the_layer_and_the_bound(bad, tokens, want):
    import re

    problem = routed_experts_problem(bad, tokens, MOE)
    assert problem is not None and re.search(want, problem), problem


def test_minus_one_rows_mean_no_recorded_routing_only_where_allowed_and_only_whole():
    """The chunk's rows of tokens no engine ran are -1 (``unrouted``); a (token, layer) -1 in part is no routing at
    all, and neither is -2."""
    unrun = ids(*GOOD[:2], [UNROUTED] * 4)
    assert routed_experts_problem(unrun, 3, MOE, unrouted=True) is None
    assert "below 0" in routed_experts_problem(unrun, 3, MOE)
    assert routed_experts_problem(ids(*GOOD[:2], [-1, -1, 1, 2]), 3, MOE, unrouted=True) is None  # per layer
    assert "and not a whole -1 row" in routed_experts_problem(ids(*GOOD[:2], [-1, 0, 1, 2]), 3, MOE, unrouted=True)
    assert "and not a whole -1 row" in routed_experts_problem(ids(*GOOD[:2], [-2, -2, 1, 2]), 3, MOE, unrouted=True)


def test_without_the_model_only_what_needs_no_model_is_checked():
    """The trainer's door reads no model: one row a token, ids >= 0 (or whole -1 token rows), integers."""
    assert routed_experts_problem(ids([0, 9, 9, 0]), 1) is None  # 9 experts? repeated? unknown without the model
    assert routed_experts_problem(GOOD, 2) is None  # 6 ids a token: only the model's layers × top-k tell
    assert "not a whole number a token" in routed_experts_problem(GOOD.reshape(-1)[:-1], 3)
    assert routed_experts_problem(ids([-1, -1, -1, -1], [0, 1, 2, 3]), 2, unrouted=True) is None
    assert routed_experts_problem(ids([-1, -1, 1, 2], [0, 1, 2, 3]), 2, unrouted=True) == (
        "token 0 has expert ids [-1, -1, 1, 2]: an id below 0 and not a whole -1 row (no recorded routing)")
    assert "not a whole number a token" in routed_experts_problem(np.zeros(0, np.int32), 0)


def test_the_routing_of_a_model_config():
    qwen3_moe = {"num_hidden_layers": 48, "num_experts_per_tok": 8, "num_experts": 128}
    assert Routing.from_config(qwen3_moe) == Routing(48, 8, 128) and Routing(48, 8, 128).width == 384
    assert Routing.from_config({"text_config": qwen3_moe}) == Routing(48, 8, 128)  # a VLM's text model
    assert Routing.from_config({"num_hidden_layers": 61, "num_experts_per_tok": 8, "n_routed_experts": 256}) == \
        Routing(61, 8, 256)  # DeepSeek's name
    assert Routing.from_config({"num_hidden_layers": 2, "vocab_size": 128}) is None  # dense
    assert Routing.from_config({**qwen3_moe, "num_experts": 0}) is None and Routing.from_config([]) is None


def test_every_field_says_who_writes_it_and_the_sample_types_on_both_sides_have_its_attributes():
    """The sample seam: each field's row names its source; a rollout field the writer has no builder for is the
    rollout Sample's attribute of its name; a field the data plan carries names a TrainingSample attribute, and one
    per response token a MicroBatch attribute too (the micro-batch stacks it): a row that names a missing attribute
    fails here, not in a run."""
    import dataclasses

    from relax_hpc.exchange.fields import (FIELDS, MEDIA_FIELDS, OPTIONAL_ROLLOUT_FIELDS, RESPONSE_VALUES, ROLLOUT,
                                           SAMPLE_FIELDS)
    from relax_hpc.rollout import write
    from relax_hpc.rollout.sample import Sample
    from relax_hpc.train.batch import MicroBatch, TrainingSample

    assert all(f.source and f.per in ("sample", "token", "response", "media") for f in FIELDS)
    plain = {f.name for f in FIELDS if f.writer == ROLLOUT} - set(write._VALUES) - set(MEDIA_FIELDS) - {"raw_reward"}
    assert plain <= {f.name for f in dataclasses.fields(Sample)} | {"weight_version"}, plain  # a property
    assert set(OPTIONAL_ROLLOUT_FIELDS) - set(MEDIA_FIELDS) <= plain
    assert {f.sample for f in SAMPLE_FIELDS} <= set(TrainingSample.__slots__)
    assert set(RESPONSE_VALUES) <= {f.name for f in dataclasses.fields(MicroBatch)}
    assert {f.name: f.sample for f in SAMPLE_FIELDS if f.sample != f.name} == {"log_probs": "old_log_probs"}
