"""Notifications through Apprise, delivered for real to a local HTTP server via Apprise's ``json://`` notifier.

Apprise's JSON plugin (apprise/plugins/custom_json.py) POSTs ``{"version", "title", "message",
"attachments", "type"}`` where ``type`` is the NotifyType's value ("info", "success", "warning", "failure").
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax_hpc.ops.notify import EVENTS, Notifier, notify_urls


def _serve(hold: threading.Event | None = None):
    """A local HTTP server that records the JSON body of every POST (answering once ``hold`` is set, if given);
    yields (json:// url, received list)."""
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if hold is not None:
                hold.wait(10)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):  # keep pytest output clean
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        yield f"json://127.0.0.1:{httpd.server_address[1]}/", received
    finally:
        if hold is not None:
            hold.set()
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def server():
    yield from _serve()


@pytest.fixture
def slow_server():
    yield from _serve(threading.Event())


def _free_port() -> int:
    """A port with nothing listening (bound then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_send_arrives_with_title_body_and_type(server):
    url, received = server
    n = Notifier([url], "grpo-7b", timeout_s=5)
    assert n.send("failed", "rollout rank 0 on node3 failed: RuntimeError: boom", level="failure") is True
    assert len(received) == 1
    msg = received[0]
    assert "grpo-7b" in msg["title"] and "failed" in msg["title"]
    assert "grpo-7b" in msg["message"] and "rollout rank 0 on node3 failed: RuntimeError: boom" in msg["message"]
    assert msg["type"] == "failure"

    assert n.send("finished", "25 steps", level="success") and received[1]["type"] == "success"
    assert n.send("preempted", "SIGUSR2", level="warning") and received[2]["type"] == "warning"
    assert n.send("started", "attempt 1") and received[3]["type"] == "info"


def test_env_urls_are_merged_and_deduplicated():
    env = {"RELAX_NOTIFY_URLS": "json://b/ ,json://a/\n  ntfy://topic,,json://b/"}
    assert notify_urls(["json://a/", "json://b/"], environ=env) == ["json://a/", "json://b/", "ntfy://topic"]
    assert notify_urls(["json://a/"], environ={}) == ["json://a/"]
    assert notify_urls([], environ={"RELAX_NOTIFY_URLS": "  "}) == []


def test_unreachable_url_returns_false_and_logs_only_the_scheme(caplog):
    port = _free_port()
    url = f"json://127.0.0.1:{port}/"
    n = Notifier([url], "r", timeout_s=3)
    with caplog.at_level(logging.WARNING, logger="relax_hpc.notify"):
        assert n.send("checkpoint", "step 10") is False
    ours = [r.getMessage() for r in caplog.records if r.name == "relax_hpc.notify"]
    assert ours and "json://" in ours[0]
    assert all(f"127.0.0.1:{port}" not in m and str(port) not in m for m in ours)


def test_a_hanging_service_costs_the_caller_at_most_timeout_s(slow_server, caplog):
    """The service holds every request until the test ends: send() can only return (False, with the
    timeout in the warning) if its own timeout cut the call short."""
    url, received = slow_server
    with caplog.at_level(logging.WARNING, logger="relax_hpc.notify"):
        assert Notifier([url], "r", timeout_s=0.3).send("requeued", "job 42") is False
    deadline = time.monotonic() + 30  # the server thread records the request; wait for that, not for a time
    while not received and time.monotonic() < deadline:
        time.sleep(0.01)
    assert received  # it reached the service, which never answered: the timeout, not a refusal
    assert any("within" in r.getMessage() for r in caplog.records if r.name == "relax_hpc.notify")


def test_check_reports_unparseable_urls_by_key_and_scheme(server):
    url, _ = server
    assert Notifier.check([url]) == []
    errors = Notifier.check([url, "json://"])
    assert len(errors) == 1
    assert "logging.notify_urls" in errors[0] and "json://" in errors[0]
    assert "github.com/caronc/apprise/wiki" in errors[0]


def test_unknown_event_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown notification event"):
        Notifier(["json://127.0.0.1:9/"], "r").send("exploded", "x")
    with pytest.raises(ValueError):
        Notifier([], "r").send("exploded", "x")  # even with nothing to send to


def test_no_urls_is_a_noop(server):
    _, received = server
    assert Notifier([], "r").send("started", "x") is False
    assert received == []


def test_events_are_the_documented_set():
    assert EVENTS == ("started", "checkpoint", "preempted", "requeued", "resumed", "step_restarted", "failed",
                      "finished", "cancelled", "scale", "scale_done", "engine_gone")
