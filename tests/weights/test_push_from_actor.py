"""push_from_actor, the one push the actor role and the tests share: every rank walks the gather, rank 0 pushes."""

from __future__ import annotations

import torch

from relax_hpc.weights import push_from_actor


def gather(walked: list[str]):
    """A stand-in for ``actor.named_hf_weights()``: records how far it was walked (a collective must end)."""
    for name in ("embed", "lm_head"):
        walked.append(name)
        yield name, torch.ones(2)


class FakeSender:
    def __init__(self):
        self.calls = []

    def push(self, named, version, **kw):
        self.calls.append(([n for n, _ in named], version, kw))
        return {"perf/weight_sync_time": 0.5}


def test_ranks_without_a_sender_walk_the_whole_stream_and_get_nothing():
    walked: list[str] = []
    assert push_from_actor(gather(walked), None, "3") == {}
    assert walked == ["embed", "lm_head"]


def test_rank_zero_pushes_the_stream_and_returns_the_senders_metrics():
    sender, walked = FakeSender(), []
    assert push_from_actor(gather(walked), sender, "3", mode="per_tensor") == {"perf/weight_sync_time": 0.5}
    assert sender.calls == [(["embed", "lm_head"], "3", {"mode": "per_tensor"})]
