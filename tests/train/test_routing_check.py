"""The trainer's own check of a micro-batch's routed experts against the model it built
(:func:`relax_hpc.train.routing.check`, run by ``replay`` before every forward): behind the rollout's check of each
engine answer and the trainer's door, it refuses what would index past the router's experts (on CUDA a device-side
assert, on CPU "index 99 is out of bounds" naming nothing) or train a wrong mixture silently, naming the field."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.errors import PermanentError
from relax_hpc.exchange.fields import Routing
from relax_hpc.train.routing import check

MODEL = Routing(layers=2, top_k=2, num_experts=4)  # the tiny Qwen3-MoE


def micro_batch(*rows) -> torch.Tensor:
    """``[tokens, layers × top_k]`` as :attr:`MicroBatch.routed_experts` lays it out (long; -1: padding, a last
    token)."""
    return torch.tensor(rows, dtype=torch.long)


def test_a_sound_micro_batch_with_padding_rows_passes():
    check(micro_batch([0, 1, 2, 3], [3, 2, 1, 0], [-1, -1, -1, -1]), MODEL)


@pytest.mark.parametrize("rows, want", [
    ([[0, 1, 2, 3], [3, 2, 1, 99]], r"token 1, layer 1 has expert ids \[1, 99\]: an id outside \[0, 4\)"),
    ([[0, 1, 2, 3], [3, 3, 1, 0]], r"token 1, layer 0 has expert ids \[3, 3\]: an id repeated"),
    ([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 1, 2]], r"12 expert ids, not 2 tokens × 2 layers × top-2 = 8 .*6 ids a token: "
                                               r"a row for an extra or a missing layer"),
    ([[0, 1, 2, 3], [-1, 1, 2, 3]], r"token 1, layer 0 has expert ids \[-1, 1\]: an id below 0 and not a whole -1"),
], ids=["out_of_range", "duplicate", "extra_layer", "partly_unrouted"])
def test_ids_that_do_not_fit_the_model_fail_naming_the_field_the_model_and_the_fix(rows, want):
    with pytest.raises(PermanentError, match=want) as e:
        check(micro_batch(*rows), MODEL)
    msg = str(e.value)
    assert msg.startswith("routed_experts (train.routing_replay) do not fit the model the actor trains (2 layers, "
                          "top-2 of 4 experts): ")
    assert "Fix: serve the same model on the engines as the actor trains" in msg
