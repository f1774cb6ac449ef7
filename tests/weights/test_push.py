"""ActorSync.sync, the actor's sync as one call: an engine that leaves during the push is left out and the push goes
again to the others (at most SYNC_TRIES pushes), a failure with every engine answering fails at once, and an engine
gone before the sync is never pushed to. Real HTTP engines' ``/health`` (stand-ins that stop listening), the real
checker, a real world-1 gloo group; the sender is a stand-in (the transfer is tests/weights/test_weight_sync.py's)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from relax_hpc.weights import SYNC_TRIES, ActorSync, WeightSyncError
from tests.engines.stub_http import StubHandler, StubServer


class Healthy(StubHandler):
    """Answers ``/health`` and closes the connection, so a stopped engine is refused at once."""

    def do_GET(self):
        self.close_connection = True
        self.send_json(200, b"{}")


class Model:
    """A stand-in for the MegatronActor's export: two tensors, nothing in place."""

    def named_hf_weights(self):
        yield "embed", torch.arange(12.0).reshape(6, 2)
        yield "lm_head", torch.ones(3, 2)

    def in_place(self):
        return None


class Sender:
    """Rank 0's WeightSender stand-in: each push in ``dies`` stops that engine and fails naming it, as a push to an
    engine that was scancelled mid-sync does."""

    path = "distributed"  # a group, as WeightSender's to engines off the actor's GPU
    infos: dict[str, dict] = {}  # no engine says its memory is released

    def __init__(self, servers: dict[str, StubServer], dies: list[str | None]):
        self.servers, self.dies = servers, list(dies)
        self.pushes: list[list[str]] = []  # the tensors each push walked
        self.groups: list[list[str]] = []  # the members of each new group

    def push(self, named, version, **kw):
        self.pushes.append([n for n, _ in named])
        victim = self.dies.pop(0) if self.dies else None
        if victim is None:
            return {"perf/update_weights_time": 0.1}
        if victim in self.servers:
            self.servers[victim].close()
        raise WeightSyncError(f"update_weights_from_distributed failed on engine {victim}", [victim])

    def reconnect(self, members):
        self.groups.append(list(members))

    def close(self, destroy_on_engines=True):
        pass


@pytest.fixture()
def servers():
    made: dict[str, StubServer] = {}
    yield made
    for s in made.values():
        s.close()


def actor_sync(servers: dict[str, StubServer], names: list[str], dies: list[str | None]) -> ActorSync:
    for n in names:
        servers[n] = StubServer(Healthy)
    s = ActorSync(0, "gloo", None, address=lambda: "127.0.0.1")
    s.sender = Sender(servers, dies)
    s.engines = {n: servers[n].url for n in names}
    return s


def test_an_engine_that_leaves_mid_push_is_left_out_and_the_others_get_the_push(world, servers, caplog):
    s = actor_sync(servers, ["a", "b"], dies=["b"])
    ticks = []
    try:
        with caplog.at_level(logging.WARNING, logger="relax_hpc.actor"):
            done = s.sync("7", None, Model(), progress=lambda: ticks.append(1), check=False)
    finally:
        s.close()
    assert s.sender.groups == [[servers["a"].url]]  # a new group without b, then the second push
    assert s.sender.pushes == [["embed", "lm_head"]] * 2 and len(ticks) == 4
    assert list(done.dead_engines) == ["b"] and s.engines == {"a": servers["a"].url}
    assert done.engine_versions == {"a": "7"} and done.metrics["perf/update_weights_time"] == 0.1
    assert "perf/weight_sync_time" in done.metrics and done.checks == {} and done.follower_versions == {}
    assert "step sync 7: b left during the push" in caplog.text


def test_the_push_fails_for_good_after_sync_tries_pushes(world, servers):
    names = [f"e{i}" for i in range(SYNC_TRIES + 1)]
    s = actor_sync(servers, names, dies=names[:SYNC_TRIES])
    try:
        with pytest.raises(WeightSyncError, match=f"failed on engine {names[SYNC_TRIES - 1]}"):
            s.sync("3", None, Model(), progress=lambda: None, check=False)
    finally:
        s.close()
    assert len(s.sender.pushes) == SYNC_TRIES


def test_a_failed_push_with_every_engine_answering_is_not_retried(world, servers):
    s = actor_sync(servers, ["a"], dies=["elsewhere"])  # the push fails, yet the engine still answers
    try:
        with pytest.raises(WeightSyncError, match="failed on engine elsewhere"):
            s.sync("3", None, Model(), progress=lambda: None, check=False)
    finally:
        s.close()
    assert len(s.sender.pushes) == 1 and s.sender.groups == []


def test_engines_gone_before_the_sync_are_never_pushed_to(world, servers):
    s = actor_sync(servers, ["a", "b"], dies=[])
    servers["b"].close()
    try:
        done = s.sync("4", {n: servers[n].url for n in ("a", "b")}, Model(), progress=lambda: None, check=False)
        assert list(done.dead_engines) == ["b"] and s.sender.groups == [[servers["a"].url]]
        servers["a"].close()
        with pytest.raises(WeightSyncError, match=re.escape("no rollout engine left to sync: {'a': ")):
            s.sync("5", None, Model(), progress=lambda: None, check=False)
    finally:
        s.close()
    assert len(s.sender.pushes) == 1


def test_a_follower_that_leaves_mid_push_is_not_a_failed_sync(world, servers):
    """actor_fwd restarted alone during a sync: its rank 0, a member of the sync group, stops answering. The push
    goes again to the engines without it (the controller re-follows its new ranks); no engine is counted dead."""
    s = actor_sync(servers, ["a"], dies=["fwd"])
    servers["fwd"] = StubServer(Healthy)
    s.followers = {"fwd": servers["fwd"].url}
    try:
        done = s.sync("7", None, Model(), progress=lambda: None, check=False)
    finally:
        s.close()
    assert s.sender.groups == [[servers["a"].url]] and len(s.sender.pushes) == 2
    assert done.dead_engines == {} and done.engine_versions == {"a": "7"} and s.followers == {}
