"""relax_hpc.forkserver: a forked child is what Popen would have started (environment, directory, session,
descriptors, command line, exit code), it ends as an interpreter does, and the server says no to what it cannot
start faithfully, which then starts by Popen. Against the session's real server (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from relax_hpc import forkserver

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHILD = "forkserver_child"  # tests/forkserver_child.py


@pytest.fixture
def server(_forkserver, monkeypatch):
    """The session's server (tests/conftest.py), its address in this process's environment."""
    if _forkserver is None:
        pytest.skip(f"{forkserver.OFF}=1, or a machine with a GPU: no fork server")
    monkeypatch.setenv(forkserver.ENV, _forkserver)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return _forkserver


def env(**extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(HERE), str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", "FORKSERVER_TEST_FOO": "bar", **extra}


def start(tmp_path: Path, action: str, *, name: str = "child", environ: dict | None = None,
          python: str = sys.executable, prefix: tuple = ()) -> tuple:
    log = tmp_path / f"{name}.log"
    with open(log, "ab") as out:
        p = forkserver.popen([*prefix, python, "-m", CHILD, str(tmp_path / f"{name}.json"), action],
                             env=environ or env(), stdout=out)
    return p, log


def seen(tmp_path: Path, name: str = "child") -> dict:
    return json.loads((tmp_path / f"{name}.json").read_text())


def server_pid(address: str) -> int:
    return next(p.pid for p in psutil.process_iter(["cmdline"])
                if p.info["cmdline"] and p.info["cmdline"][-1:] == [address] and "relax_hpc.forkserver" in p.info["cmdline"])


def test_a_forked_child_is_what_popen_starts(server, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    forked, flog = start(tmp_path, "exit0", name="forked")
    assert isinstance(forked, forkserver.ForkedProcess) and forked.wait(60) == 0
    monkeypatch.setenv(forkserver.OFF, "1")
    plain, plog = start(tmp_path, "exit0", name="plain")
    assert isinstance(plain, subprocess.Popen) and plain.wait(60) == 0
    a, b = seen(tmp_path, "forked"), seen(tmp_path, "plain")
    assert a["ppid"] == server_pid(server) and b["ppid"] == os.getpid()  # forked by the server; started by us
    for r in (a, b):
        assert r["sid"] == r["pid"] == r["pgid"]  # a session of its own
    for key in ("cwd", "main", "foo", "stdin", "path0", "affinity"):
        assert a[key] == b[key], key
    assert a["argv"] == [b["argv"][0].replace("plain.json", "forked.json"), *b["argv"][1:]]
    assert a["title"][:2] == ["-m", CHILD] and a["title"][:2] == b["title"][:2]  # what ps shows: the module
    assert a["cwd"] == str(work) and a["stdin"] == "/dev/null" and a["foo"] == "bar"
    assert flog.read_text() == plog.read_text() == "stdout line\n"


def test_exit_codes_and_an_interpreter_s_exit(server, tmp_path):
    for action, code, text in (("exit3", 3, None), ("message", 1, "a message for stderr"),
                               ("raise", 1, "RuntimeError: raised in the child"),
                               ("interrupt", -signal.SIGINT, None)):  # as python: it dies of SIGINT
        p, log = start(tmp_path, action, name=action)
        assert isinstance(p, forkserver.ForkedProcess) and p.wait(60) == code, action
        assert text is None or text in log.read_text(), log.read_text()
    p, log = start(tmp_path, "atexit", name="atexit")
    assert p.wait(60) == 0 and log.read_text().endswith("buffered, not flushedatexit ran\n"), log.read_text()
    p, _ = start(tmp_path, "thread", name="thread")
    assert p.wait(60) == 0 and (tmp_path / "thread.json.thread").read_text() == "the thread finished"


def test_a_signal_and_a_wait_that_times_out(server, tmp_path):
    p, _ = start(tmp_path, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    assert p.poll() is None
    p.send_signal(signal.SIGKILL)
    assert p.wait(60) == -signal.SIGKILL and p.poll() == -signal.SIGKILL
    p.kill()  # as Popen: a process whose exit is known is never signalled again


def test_each_child_draws_its_own_random_numbers(server, tmp_path):
    """numpy's global generator was the server's: each child seeds its own, as a fresh process does."""
    for name in ("one", "two"):
        assert start(tmp_path, "exit0", name=name)[0].wait(60) == 0
    assert seen(tmp_path, "one")["draw"] != seen(tmp_path, "two")["draw"]


def test_the_cpu_binding_of_taskset_is_kept(server, tmp_path):
    p, _ = start(tmp_path, "exit0", prefix=("taskset", "-c", "0"))
    assert isinstance(p, forkserver.ForkedProcess) and p.wait(60) == 0
    assert seen(tmp_path)["affinity"] == [0]


@pytest.mark.parametrize("change", ["OMP_NUM_THREADS", "PYTHONHASHSEED", "shadowing folder", "other python",
                                    "options before -m", "in a Slurm job", "turned off"])
def test_what_the_server_cannot_start_faithfully_starts_by_popen(server, tmp_path, monkeypatch, change):
    """Each change gets Popen; the same request without it is forked (the negative control)."""
    kw: dict = {}
    if change in ("OMP_NUM_THREADS", "PYTHONHASHSEED"):
        kw["environ"] = env(**{change: "7"})
    elif change == "shadowing folder":  # a folder on PYTHONPATH with a module the server has imported
        (tmp_path / "numpy.py").write_text("")
        kw["environ"] = env(PYTHONPATH=os.pathsep.join([str(tmp_path), env()["PYTHONPATH"]]))
    elif change == "other python":
        kw["python"] = sys.executable + "3" if Path(sys.executable + "3").exists() else "/usr/bin/python3"
    elif change == "options before -m":
        kw["python"], kw["prefix"] = "-X", (sys.executable,)
    forked, _ = start(tmp_path, "exit0", name="control")
    assert isinstance(forked, forkserver.ForkedProcess) and forked.wait(60) == 0
    if change == "in a Slurm job":
        monkeypatch.setenv("SLURM_JOB_ID", "1")
    elif change == "turned off":
        monkeypatch.setenv(forkserver.OFF, "1")
    p, _ = start(tmp_path, "exit0", **kw)
    assert isinstance(p, subprocess.Popen), change
    p.wait(60)


def test_a_child_dies_with_the_process_named(server, tmp_path):
    """``dies_with``: SIGTERM when that process ends, as PR_SET_PDEATHSIG gives a Popen child."""
    code = ("import os, sys; from relax_hpc import forkserver; "
            f"p = forkserver.popen([sys.executable, '-m', {CHILD!r}, sys.argv[1], 'sleep'], env=dict(os.environ), "
            "stdout=sys.stderr, dies_with=os.getpid()); print(type(p).__name__, p.pid, flush=True); "
            "import threading; threading.Event().wait()")
    rank = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "child.json")], env=env(),
                            stdout=subprocess.PIPE, text=True)
    try:
        kind, pid = rank.stdout.readline().split()
        assert kind == "ForkedProcess"
        child = psutil.Process(int(pid))
        assert child.ppid() != rank.pid
        rank.kill()
        rank.wait(30)
        _, alive = psutil.wait_procs([child], timeout=60)
        assert not alive, f"{child.pid} outlived the process it was to die with"
    finally:
        rank.kill()


def test_serving_sets_the_variable_for_the_block_and_leaves_its_children(tmp_path, monkeypatch):
    monkeypatch.delenv(forkserver.OFF, raising=False)
    monkeypatch.setenv(forkserver.ENV, "/before")
    with forkserver.serving(tmp_path / "server.log", env=env()) as address:
        assert os.environ[forkserver.ENV] == address and Path(address).is_socket()
        p, _ = start(tmp_path, "sleep")
        assert isinstance(p, forkserver.ForkedProcess)
    assert os.environ[forkserver.ENV] == "/before" and not Path(address).parent.exists()
    try:
        assert psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE  # the server ended; its child did not
    finally:
        os.kill(p.pid, signal.SIGKILL)


@pytest.mark.gpu
def test_on_a_machine_with_a_gpu_nothing_is_forked(tmp_path, monkeypatch):
    """CUDA and fork do not mix: no server for a run (serving), and a server started anyway forks nothing."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.delenv(forkserver.OFF, raising=False)
    with forkserver.serving(tmp_path / "run.log") as address:
        assert address is None
    with open(tmp_path / "server.log", "ab") as log:
        server = forkserver.start(str(tmp_path / "sock"), log=log, env=env())
    try:
        monkeypatch.setenv(forkserver.ENV, str(tmp_path / "sock"))
        p, _ = start(tmp_path, "exit0")
        assert isinstance(p, subprocess.Popen) and p.wait(60) == 0
        assert "a machine with a GPU" in (tmp_path / "server.log").read_text()
    finally:
        server.stdin.close()
        server.wait(30)
