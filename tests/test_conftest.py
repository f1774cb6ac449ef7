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


def test_each_test_s_cpu_seconds_include_the_processes_it_starts(tmp_path):
    """tools/test's per-test CPU accounting: a test whose child process burns CPU is charged with it, a test that
    sleeps is not (needs root and cgroup v1's cpuacct, as tools/test does)."""
    import json

    import pytest

    if os.getuid() != 0 or not os.path.isdir("/sys/fs/cgroup/cpuacct"):
        pytest.skip("per-test CPU accounting needs root and a cpuacct cgroup")
    (tmp_path / "test_inner.py").write_text(
        "import subprocess, sys, time\n"
        "def test_burns():\n"
        "    subprocess.run([sys.executable, '-c', 't = __import__(\"time\").process_time()\\n"
        "while __import__(\"time\").process_time() - t < 1.0: pass'], check=True)\n"
        "def test_sleeps():\n"
        "    time.sleep(1.0)\n")
    log = tmp_path / "cpu.jsonl"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                        "--rootdir", str(tmp_path), "-c", os.devnull, "-p", "tests.conftest", str(tmp_path)],
                       env={**os.environ, "RELAX_TEST_CPU_LOG": str(log)}, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    got = {json.loads(line)["test"].split("::")[-1]: json.loads(line) for line in log.read_text().splitlines()}
    assert got["test_burns"]["cpu_s"] >= 0.9, got  # the child's second of CPU, charged to the test that started it
    assert got["test_sleeps"]["cpu_s"] < 0.5 and got["test_sleeps"]["wall_s"] >= 1.0, got
