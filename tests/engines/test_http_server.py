"""The bounded HTTP server of relax_hpc's engines (relax_hpc.engines.http_server), the real class with a tiny real
route table (relax_hpc.engines.http), over real sockets: issue 47's probes. A flood of unauthenticated connections
(idle ones held open, then a burst of nothing, garbage and keyless requests) holds no thread and leaves every keyed
request served; when slots run out the peer holding the most unauthenticated connections gives way; a JSON body
nested 200,000 deep is a 400."""

from __future__ import annotations

import select
import socket
import threading

import httpx
import pytest

from relax_hpc.engines.http import EngineServer, route_handler
from relax_hpc.engines.http_server import fd_budget
from tests.engines.flood import Flood, fds_for, wait_for

KEY = "flood-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def serve():
    made: list[EngineServer] = []

    def start(routes: dict | None = None, **kw) -> EngineServer:
        routes = {"/echo": lambda b: (200, b), "/health": lambda b: (200, {"ok": True}), **(routes or {})}
        server = EngineServer(("127.0.0.1", 0), route_handler(routes, KEY), **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append(server)
        return server

    yield start
    for s in made:
        s.shutdown()
        s.server_close()


def url(server: EngineServer, path: str = "/echo") -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def test_a_flood_without_the_key_holds_no_thread_and_every_keyed_request_is_served(serve):
    """2,000 unauthenticated connections (1,000 idle ones held open, then a burst of 1,000 more of every kind that
    keeps going while the keyed requests are sent) against a server holding at most 512: each of 60 keyed requests,
    half on fresh connections, half on one kept-alive connection, is answered 200 with its own body, and the server
    never had more than the keyed requests' workers (one in flight, a second one finishing), nor held more than its
    cap, though the flood filled it (connections pushed out to make room)."""
    cap, flood_n = 512, fds_for(2000 + 512) - 512  # the server's sockets and the flood's, in this one process
    server = serve(max_connections=cap)
    assert server.max_connections == cap
    with httpx.Client(headers=AUTH, timeout=60) as warm:
        assert warm.post(url(server), json={"i": -1}).json() == {"i": -1}  # a kept-alive connection, made before
        base = threading.active_count()
        flood = Flood(server.server_address[1], keep=flood_n // 2)
        try:
            flood.hold(flood_n // 2)
            wait_for(lambda: server.stats()["accepted"] >= flood_n // 2 + 1, "the idle connections to be accepted")
            assert server.stats()["pushed_out"] > 0 and server.stats()["held"] <= cap  # full: it had to make room
            flood.start()
            answers, peak_held = [], 0
            for i in range(60):
                flood.wait_made((i + 1) * (flood_n // 2) // 60)  # the keyed requests spread over the burst
                if i % 2:
                    r = warm.post(url(server), json={"i": i})
                else:
                    r = httpx.post(url(server), json={"i": i}, headers=AUTH, timeout=60)  # a fresh connection
                answers.append((r.status_code, r.json()))
                peak_held = max(peak_held, server.stats()["held"])
            flood.wait_made(flood_n // 2)
        finally:
            flood.stop()
    assert answers == [(200, {"i": i}) for i in range(60)]
    assert flood.errors == 0  # every flood connection was made: the server kept accepting
    made = 1 + flood_n // 2 + flood.made + 30  # the warm one, the idle ones, the burst's, the fresh keyed ones
    wait_for(lambda: server.stats()["accepted"] >= made, f"{made} connections accepted")
    st = server.stats()
    assert st["unauthorized"] > 0, st
    assert st["pushed_out"] + st["expired"] >= flood_n // 2 - cap, st  # the idle ones alone overflowed it
    assert st["peak_workers"] <= 2, st  # threads only for keyed requests: never one for the flood
    assert flood.max_threads <= base + 3, (base, flood.max_threads)  # the burst's thread and two workers
    assert peak_held <= cap
    r = httpx.post(url(server), json={"after": True}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json() == {"after": True}


def test_the_peer_holding_the_most_unauthenticated_connections_gives_way_first(serve):
    """8 slots: 2 idle connections from 127.0.0.2, then 10 from 127.0.0.1. Room is made from 127.0.0.1's oldest
    (answered 503 and closed), never from 127.0.0.2's; a keyed request from 127.0.0.1 gets in all the same."""
    server = serve(max_connections=8)
    other = Flood(server.server_address[1], source="127.0.0.2")
    flood = Flood(server.server_address[1])
    try:
        other.hold(2)
        flood.hold(10)
        wait_for(lambda: server.stats()["pushed_out"] >= 4, "4 connections pushed out")
        assert server.stats()["held"] == 8 and server.stats()["pushed_out"] == 4
        for s in flood.idle[:4]:  # the oldest four of the peer holding the most: answered and closed
            assert select.select([s], [], [], 30)[0] and s.recv(4096).startswith(b"HTTP/1.1 503")
        assert not select.select(flood.idle[4:] + other.idle, [], [], 0)[0]  # the rest, the other peer's: untouched
        r = httpx.post(url(server), json={"k": 1}, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json() == {"k": 1}
        assert not select.select(other.idle, [], [], 0)[0]
    finally:
        other.stop()
        flood.stop()


def test_keyless_requests_are_answered_at_the_door_and_open_paths_close_their_connection(serve):
    server = serve()
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 401") and got.endswith(b'{"error": "Unauthorized"}')
    with httpx.Client(timeout=30) as c:  # no key: /health is open, its connection closed after the answer
        r = c.get(url(server, "/health"))
        assert r.status_code == 200 and r.json() == {"ok": True} and r.headers["connection"] == "close"
    st = server.stats()
    assert st["unauthorized"] == 1 and st["peak_workers"] == 1, st  # the 401 had no thread


def test_a_keyed_request_nested_200000_deep_is_a_400(serve):
    server = serve()
    deep = b"[" * 200_000 + b"]" * 200_000
    for body in (deep, b'{"input_ids": ' + deep + b"}"):
        r = httpx.post(url(server), content=body, headers=AUTH | {"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"], r.text[:300]
    assert httpx.post(url(server), json={"x": [[1]]}, headers=AUTH, timeout=60).json() == {"x": [[1]]}


def test_the_cap_stays_below_the_file_limit():
    """A server never takes more sockets than the process's file limit leaves (the router's cap was 65,536)."""
    budget = fd_budget()
    server = EngineServer(("127.0.0.1", 0), route_handler({}, KEY), max_connections=1 << 20)
    try:
        assert budget is None or server.max_connections <= budget < (1 << 20)
    finally:
        server.server_close()


def _read_answers(s: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """``n`` HTTP answers (status, body) read off ``s`` (each with a Content-Length)."""
    got, out = b"", []
    while len(out) < n:
        head, sep, rest = got.partition(b"\r\n\r\n")
        if sep:
            length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                          if ln.lower().startswith(b"content-length"))
            if len(rest) >= length:
                out.append((int(head.split()[1]), rest[:length]))
                got = rest[length:]
                continue
        chunk = s.recv(65536)
        assert chunk, f"the server closed after {len(out)} answers"
        got += chunk
    return out


def test_a_head_in_pieces_and_pipelined_requests_are_served(serve):
    """The door reads a head that comes in pieces, and a request that came right behind another on a kept-alive
    connection is answered from what the door already read."""
    server = serve()
    key = f"Authorization: Bearer {KEY}\r\n".encode()
    req = b"POST /echo HTTP/1.1\r\nHost: x\r\n" + key + b"Content-Length: 7\r\n\r\n" + b'{"n":1}'
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=30) as s:
        s.sendall(req[:20])
        wait_for(lambda: server.stats()["accepted"] == 1, "the connection to be accepted")
        s.sendall(req[20:45])
        s.sendall(req[45:])
        assert _read_answers(s, 1) == [(200, b'{"n": 1}')]
        two = req.replace(b'{"n":1}', b'{"n":2}') + req.replace(b'{"n":1}', b'{"n":3}')
        s.sendall(two)  # two requests in one write: the second is in the door's buffer when the first is answered
        assert _read_answers(s, 2) == [(200, b'{"n": 2}'), (200, b'{"n": 3}')]
    assert server.stats()["accepted"] == 1  # all on the one connection


def test_with_every_slot_a_key_holder_s_a_keyed_request_waits_for_one_instead_of_a_503(serve):
    """4 slots, 4 keyed requests held in the route: a 5th keyed request is not refused, it waits in the listen
    backlog and is answered once a slot comes free (before: 503 too many connections)."""
    release = threading.Event()
    server = serve({"/hold": lambda b: (200, {"held": release.wait(60)})}, max_connections=4)
    answers: list[tuple[str, int]] = []

    def call(path: str) -> None:
        r = httpx.post(url(server, path), json={}, headers=AUTH | {"Connection": "close"}, timeout=60)
        answers.append((path, r.status_code))

    held = [threading.Thread(target=call, args=("/hold",)) for _ in range(4)]
    for t in held:
        t.start()
    wait_for(lambda: server.stats()["workers"] == 4, "4 requests held")
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=60) as fifth:
        fifth.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                      b"\r\nContent-Length: 7\r\n\r\n{\"n\":5}")  # connected and sent while every slot is held
        release.set()
        assert _read_answers(fifth, 1) == [(200, b'{"n": 5}')]
    for t in held:
        t.join(60)
    assert answers == [("/hold", 200)] * 4
    assert server.stats()["refused"] == 0 and server.stats()["peak_workers"] == 4
