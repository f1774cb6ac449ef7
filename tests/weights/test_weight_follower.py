"""A follower (actor_fwd's rank 0) in the weight-sync group beside a real CPU engine process: one push reaches both,
tagged with the version; the follower hands out exactly that version's tensors and refuses any other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax_hpc.engines.client import EngineClient
from relax_hpc.weights import WeightSender
from relax_hpc.weights.check import EngineChecker
from relax_hpc.weights.follower import Follower

from .conftest import REPO, perturb

N_ENGINES = 1


@pytest.fixture()
def follower_url(tiny_model):
    p = subprocess.Popen([sys.executable, str(Path(__file__).with_name("follower_peer.py")), str(tiny_model)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        url = p.stdout.readline().strip()
        assert url.startswith("http://"), "the follower did not start (its stderr is above)"
        yield url
    finally:
        p.stdin.close()
        p.wait(timeout=30)


def test_one_push_reaches_the_engine_and_the_follower(engines, hf_model, follower_url):
    engine, follower = EngineClient(engines[0].url, timeout=60), EngineClient(follower_url, timeout=60)
    sender = WeightSender(bucket_bytes=48 * 1024, timeout=120, connect_timeout=60)
    try:
        sender.connect([engine, follower], "127.0.0.1")
        assert sender.world_size == 3  # rank 0 here, the engine, the follower
        want = perturb(hf_model, seed=3)
        sender.push(hf_model.state_dict().items(), version="3")
        assert follower.weight_version() == "3"
        for name, t in want.items():  # every tensor, whole
            got = torch.tensor(follower.get_weights_by_name(name, truncate_size=t.shape[0]))
            assert torch.equal(got.reshape(t.shape), t), name
        # the actor's spot check reads the follower like an engine: same fingerprint, the version it holds
        heads = {n: t[:4] for n, t in want.items()}
        checker = EngineChecker()
        checks = checker.check({"engine0": engine.url, "actor_fwd": follower.url}, heads, "3")
        checker.close()
        for name in ("engine0", "actor_fwd"):
            assert checks[name]["fingerprint_equal"] and checks[name]["version"] == "3", (name, checks[name])
    finally:
        sender.close()
        engine.close()
        follower.close()


def test_a_follower_hands_out_only_the_version_it_holds(hf_model):
    f = Follower({n: t.detach().clone() for n, t in hf_model.state_dict().items()}, "0")
    f.weight_version = "3"  # as /update_weight_version leaves it after a push
    assert f.take("3") is f.params
    with pytest.raises(RuntimeError, match="holds those of '3'"):
        f.take("2")
