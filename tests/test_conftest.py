"""The suite's guard against processes left running by tests (tests/conftest.py): a process carrying the session's
mark, however detached, is found at the end and stopped by its PID; one without the mark is not touched."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import SESSION_MARK, left_running, stop_left


def test_a_detached_process_of_the_session_is_found_and_stopped_and_others_are_left_alone():
    mark = f"guard-test-{os.getpid()}"
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    # a new session and no parent waiting for it: as a detached run or a leaked engine would be
    ours = subprocess.Popen(sleeper, env={**os.environ, SESSION_MARK: mark}, start_new_session=True)
    other = subprocess.Popen(sleeper, env={**os.environ, SESSION_MARK: "another-session"}, start_new_session=True)
    try:
        left = left_running(mark)
        assert list(left) == [ours.pid], left  # not `other`, nor this process (it carries the suite's mark)
        assert "time.sleep(600)" in left[ours.pid]
        stop_left(list(left), grace_s=5)
        assert ours.wait(10) is not None and other.poll() is None
        assert left_running(mark) == {}
    finally:
        for p in (ours, other):
            if p.poll() is None:
                p.kill()
                p.wait()
