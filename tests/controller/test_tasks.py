"""Tasks over the control socket: a role's long poll gets an assigned task at once, nothing after its wait,
and the same task again until it reports it done (a lost reply is never a lost task)."""

import threading
import time

import pytest

from ctl_helpers import TOKEN
from relax_hpc.controller.protocol import MAX_TASK_WAIT_S, Client, ProtocolError


@pytest.fixture
def client(channel):
    c = Client("127.0.0.1", channel.port, TOKEN, timeout_s=MAX_TASK_WAIT_S + 5)
    yield c
    c.close()


def test_no_task_means_none_after_the_wait(channel, client):
    t0 = time.monotonic()
    assert client.next_task("actor", 0, wait_s=0.3) is None
    assert 0.25 < time.monotonic() - t0 < 3
    assert [m["type"] for _, m in channel.drain(0.5)] == ["next_task"]  # a poll is a sign of life


def test_a_waiting_poll_gets_the_task_the_moment_it_is_assigned(channel, client):
    got = {}
    t = threading.Thread(target=lambda: got.update(task=client.next_task("actor", 0, wait_s=4)))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    channel.assign("actor", {"id": 1, "kind": "train", "step": 3})
    t.join(5)
    assert got["task"] == {"id": 1, "kind": "train", "step": 3}
    assert time.monotonic() - t0 < 1.0


def test_tasks_go_to_their_role_in_order_and_repeat_until_done(channel, client):
    channel.assign("rollout", {"id": 1, "kind": "generate"})
    channel.assign("actor", {"id": 2, "kind": "train"})
    channel.assign("actor", {"id": 3, "kind": "sync"})
    assert client.next_task("actor", 0, wait_s=0)["id"] == 2
    assert client.next_task("actor", 0, wait_s=0)["id"] == 2  # not done yet: delivered again
    client.task_done("actor", 0, 2, {"metrics": {"train/loss": 0.5}})
    assert client.next_task("actor", 0, wait_s=0)["id"] == 3
    assert client.next_task("rollout", 0, wait_s=0)["id"] == 1
    done = [m for _, m in channel.drain(0.5) if m["type"] == "task_done"]
    assert done == [{"type": "task_done", "role": "actor", "rank": 0, "task_id": 2,
                     "result": {"metrics": {"train/loss": 0.5}}}]


def test_task_messages_need_the_token_and_their_fields(channel):
    bad = Client("127.0.0.1", channel.port, "wrong")
    with pytest.raises(ProtocolError, match="token"):
        bad.next_task("actor", 0)
    good = Client("127.0.0.1", channel.port, TOKEN)
    with pytest.raises(ProtocolError, match="result"):
        good.request("task_done", role="actor", rank=0, task_id=1, result="not a dict")
    good.close()
    assert channel.drain(0.3) == []
