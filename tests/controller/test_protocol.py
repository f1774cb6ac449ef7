"""The control socket accepts only requests carrying the run's token (real sockets, real threads)."""

import json
import socket
import threading

import pytest

from ctl_helpers import TOKEN
from relax_hpc.controller.protocol import Client, ProtocolError, Server, encode


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


# ---------------------------------------------------------------------------- the socket under abuse ---


@pytest.fixture
def server_factory():
    """Real Servers on real sockets, with the limits a test sets; every request is recorded."""
    made = []

    def make(**limits):
        seen = []
        srv = Server(TOKEN, lambda msg: seen.append(msg) or {}, **limits).start()
        srv.seen = seen
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.close()


def wait_eof(sock: socket.socket) -> bytes:
    """Block until the server closes ``sock`` (the 30 s socket timeout is a safety net, not the test)."""
    sock.settimeout(30)
    try:
        return sock.recv(1)
    except ConnectionResetError:
        return b""


def served_soon(request, tries: int = 100):
    """``request()``, tried again while the server closes new connections at once: it does so, briefly, while
    more than ``max_unauthenticated`` pushed-out connections are still ending (a real client retries too)."""
    for i in range(tries):
        try:
            return request()
        except OSError:
            if i == tries - 1:
                raise
            threading.Event().wait(0.05)


def test_300_idle_connections_neither_take_300_threads_nor_lock_a_role_out(server_factory):
    srv = server_factory(auth_timeout_s=60)  # the idle ones stay until the end of the test
    role = Client("127.0.0.1", srv.port, TOKEN)
    role.hello("actor", 0, 1, "n1", 1)  # a role connected before the flood
    peak, flooding = [threading.active_count()], threading.Event()

    def watch():
        while not flooding.wait(0.002):
            peak.append(threading.active_count())

    watcher = threading.Thread(target=watch)
    watcher.start()
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=30))
        role.heartbeat("actor", 0, "n1", "ready")  # the connected role is still served
        late = Client("127.0.0.1", srv.port, TOKEN)  # so is one that connects now (accepted after all 300)
        served_soon(lambda: late.heartbeat("actor", 0, "n1", "ready"))
        late.close()
        peak.append(threading.active_count())
    finally:
        flooding.set()
        watcher.join()
        for s in idle:
            s.close()
        role.close()
    assert max(peak) < 80, f"{max(peak)} threads under 300 idle connections"
    assert [m["type"] for m in srv.seen] == ["hello", "heartbeat", "heartbeat"]


def test_an_unauthenticated_connection_is_closed_after_the_auth_timeout(server_factory):
    srv = server_factory(auth_timeout_s=0.5)
    authed = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    f = authed.makefile("rb")
    authed.sendall(encode({**HEARTBEAT, "token": TOKEN}))
    assert json.loads(f.readline())["ok"] is True
    with socket.create_connection(("127.0.0.1", srv.port)) as silent:  # connected after the authenticated one
        assert wait_eof(silent) == b""
    # the silent one was dropped, so more than the auth timeout has passed: the authenticated one is kept
    authed.sendall(encode({**HEARTBEAT, "token": TOKEN, "phase": "done"}))
    assert json.loads(f.readline())["ok"] is True
    authed.close()
    assert [m["phase"] for m in srv.seen] == ["ready", "done"]


def test_a_drip_fed_first_request_does_not_buy_more_time(server_factory):
    srv = server_factory(auth_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(encode({**HEARTBEAT, "token": TOKEN})[:20])  # a request begun, never finished
        assert wait_eof(s) == b""
    assert srv.seen == []


def test_beyond_max_connections_a_new_connection_is_closed_at_once(server_factory):
    srv = server_factory(max_connections=3)
    clients = [Client("127.0.0.1", srv.port, TOKEN) for _ in range(3)]
    for c in clients:
        c.heartbeat("actor", 0, "n1", "ready")
    with socket.create_connection(("127.0.0.1", srv.port)) as extra:
        assert wait_eof(extra) == b""
    clients[0].heartbeat("actor", 0, "n1", "done")  # the three keep their threads
    for c in clients:
        c.close()
    assert len(srv.seen) == 4


def test_a_newer_connection_pushes_out_the_oldest_unauthenticated_one(server_factory):
    srv = server_factory(max_unauthenticated=2, auth_timeout_s=60)
    first = socket.create_connection(("127.0.0.1", srv.port))
    second = socket.create_connection(("127.0.0.1", srv.port))
    c = Client("127.0.0.1", srv.port, TOKEN)
    c.heartbeat("actor", 0, "n1", "ready")  # a third waiting connection: the first goes
    assert wait_eof(first) == b""
    c.heartbeat("actor", 0, "n1", "done")  # authenticated: no longer pushed out by newer ones
    for s in (second, socket.create_connection(("127.0.0.1", srv.port))):
        s.close()
    c.close()
    assert [m["phase"] for m in srv.seen] == ["ready", "done"]


@pytest.mark.parametrize("line", [b"[" * 100000 + b"\n", b'{"a":' * 100000 + b"\n"])
def test_deeply_nested_json_is_an_error_reply_and_the_server_goes_on(channel, line):
    reply, _ = raw(channel.port, line)
    assert reply["ok"] is False and "nested too deeply" in reply["error"]
    c = Client("127.0.0.1", channel.port, TOKEN)
    c.heartbeat("actor", 0, "n1", "ready")
    c.close()
    assert [m["type"] for _, m in channel.drain(1.0)] == ["heartbeat"]


@pytest.mark.parametrize("info, key", [
    ({"cross_group": "x"}, "cross_group"), ({"cross_group": {"ok": "yes"}}, "cross_group"),
    ({"collective_ok": "true"}, "collective_ok"), ({"collective_ok": 1}, "collective_ok"),
    ({"nodes": "n1"}, "nodes"), ({"nodes": ["n1", 2]}, "nodes"),
    ({"task": "generate"}, "task"), ({"task": {"id": "1", "kind": "generate", "progress": 0}}, "task"),
    ({"task": {"id": 1, "kind": "generate"}}, "task"),
    ({"task": {"id": 1, "kind": "generate", "progress": 0, "step": "7"}}, "task"),
])
def test_a_heartbeat_with_wrong_typed_info_is_refused_and_never_reaches_the_loop(channel, info, key):
    reply, rest = raw(channel.port, encode({**HEARTBEAT, "token": TOKEN, "info": info}))
    assert reply["ok"] is False and f"info[{key!r}]" in reply["error"]
    assert channel.drain(0.3) == []
    good = {"cross_group": {"world": 2, "ok": True}, "collective_ok": None, "nodes": ["n1"],
            "task": {"id": 1, "kind": "generate", "step": 7, "progress": 3}}
    c = Client("127.0.0.1", channel.port, TOKEN)
    c.heartbeat("actor", 0, "n1", "ready", good)  # the same fields, well typed, pass
    c.heartbeat("actor", 0, "n1", "ready", {"task": None})
    c.close()
    assert [m["info"] for _, m in channel.drain(1.0)] == [good, {"task": None}]


def test_an_error_carries_its_verdict_and_reason_and_a_wrong_verdict_is_refused(channel):
    c = Client("127.0.0.1", channel.port, TOKEN)
    c.error("rollout", 0, "n1", "Traceback...\nDataError: bad", verdict="permanent")
    c.error("actor", 0, "n1", "Traceback...\nOSError: [Errno 28]", verdict="no_space", reason="no space left on /x")
    c.error("actor", 1, "n1", "Traceback...\nRuntimeError: gloo")  # none: a restart may help
    got = [m for _, m in channel.drain(1.0)]
    assert [(m.get("verdict"), m.get("reason")) for m in got] == [
        ("permanent", None), ("no_space", "no space left on /x"), (None, None)]
    with pytest.raises(ProtocolError, match="verdict must be one of permanent, no_space"):
        c.error("actor", 0, "n1", "x", verdict="transient")
    assert channel.drain(0.3) == []
