"""The control socket accepts only requests carrying the run's token (real sockets, real threads)."""

import json
import socket

import pytest

from ctl_helpers import TOKEN
from relax_hpc.controller.protocol import Client, ProtocolError, encode


def raw(port: int, payload: bytes) -> tuple[dict, bytes]:
    """Send one line; return the reply and whatever follows it (b'' when the server closed the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        f = s.makefile("rb")
        reply = json.loads(f.readline())
        return reply, f.read()


HEARTBEAT = {"type": "heartbeat", "role": "actor", "rank": 0, "node": "n1", "phase": "ready", "info": {}}


@pytest.mark.parametrize("token", [None, "", "b" * 64, TOKEN[:-1], TOKEN + "0", 12345])
def test_heartbeat_without_the_run_token_is_rejected_and_not_recorded(channel, token):
    msg = dict(HEARTBEAT) if token is None else {**HEARTBEAT, "token": token}
    reply, rest = raw(channel.port, encode(msg) + encode({**HEARTBEAT, "token": TOKEN}))
    assert reply["ok"] is False and "token" in reply["error"]
    assert rest == b""  # connection closed: the valid request after it was never read
    assert channel.drain(0.3) == []


def test_error_message_with_a_wrong_token_cannot_fail_the_run(channel):
    c = Client("127.0.0.1", channel.port, "wrong")
    with pytest.raises(ProtocolError, match="token"):
        c.error("rollout", 0, "n1", "Traceback...\nRuntimeError: forged")
    assert channel.drain(0.3) == []


def test_heartbeat_with_the_run_token_is_recorded(channel):
    c = Client("127.0.0.1", channel.port, TOKEN)
    c.hello("actor", 1, 2, "n1", 4242)
    c.heartbeat("actor", 1, "n1", "ready", {"collective_ok": True})
    got = [m for _, m in channel.drain(1.0)]
    assert [m["type"] for m in got] == ["hello", "heartbeat"]
    assert got[1]["info"] == {"collective_ok": True} and "token" not in got[1]
    c.close()


def test_publish_and_lookup_need_the_token(channel):
    good = Client("127.0.0.1", channel.port, TOKEN)
    good.publish("cross_group", {"host": "n1", "port": 1234, "world": 3})
    assert good.lookup("cross_group") == {"host": "n1", "port": 1234, "world": 3}
    with pytest.raises(TimeoutError):
        good.lookup("missing", wait_s=0.2)
    with pytest.raises(ProtocolError, match="token"):
        Client("127.0.0.1", channel.port, "x").lookup("cross_group")


@pytest.mark.parametrize("line", [b"not json\n", b"[1, 2]\n", encode({"type": "nope", "token": TOKEN}),
                                  encode({"type": "heartbeat", "token": TOKEN, "role": "actor"})])
def test_malformed_requests_are_refused(channel, line):
    reply, _ = raw(channel.port, line)
    assert reply["ok"] is False
    assert channel.drain(0.2) == []


def test_a_client_reconnects_after_the_server_dropped_it(channel):
    c = Client("127.0.0.1", channel.port, TOKEN)
    c.heartbeat("actor", 0, "n1", "bootstrap")
    c._sock.close()  # simulate a dropped connection
    c.heartbeat("actor", 0, "n1", "ready")
    assert [m["phase"] for _, m in channel.drain(1.0)] == ["bootstrap", "ready"]
