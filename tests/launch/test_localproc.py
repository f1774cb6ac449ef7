"""Local process identity and stopping a run's process tree (roles in sessions of their own included)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from relax_hpc.launch import localproc

# A "controller" that ignores SIGTERM and starts a "role" in a session of its own (as the real controller does).
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""

POLITE = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)
def stop(*_):
    child.terminate(); child.wait(); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print(child.pid, flush=True)
time.sleep(120)
"""


def start(code: str) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(p.stdout.readline())
    return p, child


def test_alive_and_start_ticks():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ticks = localproc.start_ticks(p.pid)
        assert localproc.alive(p.pid) and localproc.alive(p.pid, ticks)
        assert not localproc.alive(p.pid, ticks + 1)  # a different process with the same PID
    finally:
        p.kill()
        p.wait()
    assert not localproc.alive(p.pid)


def test_zombie_counts_as_gone():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(1.0)  # exited, not reaped yet: a zombie
    assert not localproc.alive(p.pid)
    p.wait()


def test_polite_run_is_terminated_with_its_roles():
    p, child = start(POLITE)
    assert set(localproc.run_processes(p.pid)) >= {p.pid, child}
    assert localproc.stop_group(p.pid, localproc.start_ticks(p.pid), grace_s=10) == "terminated"
    p.wait(timeout=10)
    assert not localproc.alive(child)


def test_stubborn_run_is_killed_roles_included():
    p, child = start(STUBBORN)
    assert localproc.stop_group(p.pid, localproc.start_ticks(p.pid), grace_s=1) == "killed"
    p.wait(timeout=10)
    for _ in range(50):
        if not localproc.alive(child):
            break
        time.sleep(0.1)
    assert not localproc.alive(child)


def test_pid_reuse_signals_nothing():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert localproc.stop_group(p.pid, localproc.start_ticks(p.pid) + 5) == "pid reused"
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()
    assert localproc.stop_group(p.pid, None) == "not running"
    assert os.getpgid(os.getpid())  # we were never signalled
