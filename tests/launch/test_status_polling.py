"""relax-status is polite to the scheduler (relax_hpc.launch.slurm): one squeue answers every run a user watches,
kept a few seconds in a private per-user cache that other processes share and other users cannot feed; the
formatted output of squeue/sacct where their JSON form is missing. The counts are Slurm's real calls, seen by a
wrapper on PATH in front of the real clients; the watch runs on a simulated clock."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from relax_hpc.launch import slurm, status
from slurm_helpers import slurm_wait_job

from .conftest import base_env, cli
from .test_status import run_dir

ME = os.geteuid()


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """A private runtime directory for the cache (what $XDG_RUNTIME_DIR is on a login node)."""
    home = tmp_path / "xdg"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home))
    monkeypatch.delenv(slurm.CACHE_ENV, raising=False)
    return home


@pytest.fixture
def sim_clock(monkeypatch):
    now = [time.time()]
    monkeypatch.setattr(slurm, "clock", lambda: now[0])
    return now


NANOS = ["date", "+%s%N"]  # a real command whose every answer differs


def test_an_answer_is_kept_for_the_period_and_shared_by_the_users_processes(cache_home, sim_clock):
    a = slurm.cached(NANOS, max_age=10)
    assert slurm.cached(NANOS, max_age=10) == a
    d = cache_home / "relax-hpc"
    assert (os.stat(d).st_mode & 0o777) == 0o700
    files = [p for p in d.iterdir() if p.suffix == ".json"]
    assert len(files) == 1 and (files[0].stat().st_mode & 0o777) == 0o600  # written private, whole (renamed)
    code = f"from relax_hpc.launch import slurm; print(slurm.cached({NANOS!r}, 1e9))"
    other = subprocess.run([sys.executable, "-c", code],
                           capture_output=True, text=True, env=base_env(XDG_RUNTIME_DIR=str(cache_home)), check=True)
    assert other.stdout.strip() == a.strip()  # another process of the user: the same answer, not its own
    sim_clock[0] += 10.5
    assert slurm.cached(NANOS, max_age=10) != a  # older than the period: asked again


def test_another_cluster_is_another_question(cache_home, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/a.conf")
    a = slurm.cached(NANOS, max_age=600)
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/b.conf")
    assert slurm.cached(NANOS, max_age=600) != a
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/a.conf")
    assert slurm.cached(NANOS, max_age=600) == a


def _plant(path, argv, out):
    path.write_text(json.dumps({"argv": argv, "at": time.time(), "out": out}))


def _entry(d):
    return next(p for p in d.iterdir() if p.suffix == ".json")


@pytest.mark.skipif(ME != 0, reason="making a file of another user needs root")
def test_another_users_cache_file_is_never_read(cache_home):
    real = slurm.cached(NANOS, max_age=600)
    path = _entry(cache_home / "relax-hpc")
    _plant(path, NANOS, "FORGED")
    assert slurm.cached(NANOS, max_age=600) == "FORGED"  # our own file: read (the plant works)
    os.chown(path, 65534, 65534)  # now nobody's
    assert slurm.cached(NANOS, max_age=600) not in ("FORGED", real)


@pytest.mark.skipif(ME != 0, reason="making a directory of another user needs root")
def test_a_cache_directory_of_another_user_or_open_to_others_is_not_used(cache_home):
    d = cache_home / "relax-hpc"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)  # someone made it first
    assert slurm.cache_dir() is None
    os.chown(d, ME, -1)
    os.chmod(d, 0o777)
    assert slurm.cache_dir() is None
    os.chmod(d, 0o700)
    assert slurm.cache_dir() == d
    a = slurm.cached(NANOS, max_age=600)
    os.chmod(d, 0o733)  # others may now write into it: answers there are not trusted any more
    assert slurm.cached(NANOS, max_age=600) != a


def test_a_link_in_place_of_a_cache_file_is_not_followed(cache_home, tmp_path):
    slurm.cached(NANOS, max_age=600)
    path = _entry(cache_home / "relax-hpc")
    forged = tmp_path / "forged.json"
    _plant(forged, NANOS, "FORGED")
    path.unlink()
    path.symlink_to(forged)
    assert slurm.cached(NANOS, max_age=600) != "FORGED"


def test_a_fifo_in_place_of_a_cache_file_does_not_hang(cache_home):
    slurm.cached(NANOS, max_age=600)
    path = _entry(cache_home / "relax-hpc")
    path.unlink()
    os.mkfifo(path)
    assert slurm.cached(NANOS, max_age=600).strip().isdigit()


# ------------------------------------------------------------------------------------- dev cluster ---

@pytest.fixture
def counted(tmp_path, monkeypatch):
    """squeue and sacct on PATH as wrappers that log each call, then run the real client. With ``refuse_json``
    squeue answers --json as a Slurm without it does."""
    shim = tmp_path / "shim"
    shim.mkdir()
    log = tmp_path / "calls.log"
    reals = {tool: shutil.which(tool) for tool in ("squeue", "sacct")}  # before the wrappers are on PATH

    def make(refuse_json: bool = False):
        log.unlink(missing_ok=True)  # counting starts now
        for tool, real in reals.items():
            refuse = ('case " $* " in *" --json "*) echo "%s: unrecognized option \'--json\'" >&2; exit 1;; esac\n'
                      % tool) if refuse_json and tool == "squeue" else ""
            (shim / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\n{refuse}exec {real} "$@"\n')
            (shim / tool).chmod(0o755)
        if not os.environ["PATH"].startswith(f"{shim}{os.pathsep}"):
            monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setattr(slurm, "_JSON_MISSING", set())
        return lambda: log.read_text().splitlines() if log.exists() else []
    return make


@pytest.fixture
def held_jobs(slurm_cluster):
    """Three real jobs that stay PENDING (held) and use no node: what runs waiting in the queue look like."""
    ids = []

    def submit(n=3):
        for _ in range(n):
            out = subprocess.run(["sbatch", "--parsable", "--hold", "-J", "relax-st", "-t", "1", "-o", "/dev/null", "--wrap", "true"],
                                 capture_output=True, text=True, check=True).stdout
            ids.append(out.strip().split(";")[0])
        return list(ids)
    yield submit
    if ids:
        subprocess.run(["scancel", *ids], check=False)


def watch(runs, minutes, clock, interval=2.0):
    """relax-status --watch of each run, simulated: a refresh of every run each ``interval`` s, as follow() does."""
    for k in range(int(minutes * 60 / interval)):
        clock[0] += interval
        for rd in runs:
            info = status.collect(rd)
            assert info["state"] == "PENDING", info


@pytest.mark.slurm
def test_watching_three_runs_asks_squeue_once_per_period(tmp_path, cache_home, sim_clock, counted, held_jobs,
                                                         monkeypatch):
    """Before: one squeue per run per refresh, 3 runs × 30 refreshes a minute = 90 calls a minute (what the
    same watch makes with the cache off). Now: 60 / CACHE_S = 6 a minute, however many runs and watchers."""
    calls = counted()
    runs = [run_dir(tmp_path / f"r{i}", job_id=j) for i, j in enumerate(held_jobs())]
    watch(runs, 1, sim_clock)
    after = len(calls())
    assert all(c.startswith("squeue --json --user") for c in calls())  # live jobs: never sacct
    assert after <= 60 / slurm.CACHE_S + 1, calls()
    monkeypatch.setenv(slurm.CACHE_ENV, "0")
    n = len(calls())
    watch(runs, 1, sim_clock)
    before = len(calls()) - n
    assert before == 3 * 30 and after * 10 < before


@pytest.mark.slurm
def test_two_relax_status_processes_share_one_squeue(tmp_path, cache_home, counted, held_jobs):
    calls = counted()
    ids = held_jobs(2)
    for i, j in enumerate(ids):
        run_dir(tmp_path / f"r{i}", job_id=j)
    env = base_env(XDG_RUNTIME_DIR=str(cache_home), PATH=os.environ["PATH"], RELAX_SLURM_CACHE_S="600",
                   RELAX_SLURM_CACHE="1")
    for i in range(2):
        rd = next((tmp_path / f"r{i}" / "runs").iterdir())
        p = cli("relax-status", "--json", str(rd), cwd=tmp_path, env=env)
        assert p.returncode == 0 and json.loads(p.stdout)["state"] == "PENDING", p.stderr
    assert len(calls()) == 1, calls()


@pytest.mark.slurm
def test_without_json_status_reads_the_formatted_output(tmp_path, cache_home, counted, held_jobs, monkeypatch):
    """The same job read from squeue's JSON, from its formatted output when forced (RELAX_SLURM_JSON=0), and
    when squeue refuses --json as an older Slurm does; sacct's two forms agree too."""
    ids = held_jobs(1)
    rd = run_dir(tmp_path, job_id=ids[0])
    calls = counted()
    monkeypatch.setenv(slurm.CACHE_ENV, "0")
    by_json = status.collect(rd)
    monkeypatch.setenv(slurm.JSON_ENV, "0")
    forced = status.collect(rd)
    assert calls()[-1].startswith("squeue --noheader --states=all")
    monkeypatch.delenv(slurm.JSON_ENV)
    calls = counted(refuse_json=True)
    refused = status.collect(rd)
    assert [c.split()[1] for c in calls()] == ["--json", "--noheader"] and "squeue" in slurm._JSON_MISSING
    keys = ("label", "state", "reason", "partition", "name", "submit_time", "time_limit_s", "het_group")
    for info in (forced, refused):
        assert info["state"] == by_json["state"] == "PENDING" and info["reason"] == by_json["reason"]
        assert [{k: c[k] for k in keys} for c in info["components"]] == \
            [{k: c[k] for k in keys} for c in by_json["components"]]
    monkeypatch.setattr(slurm, "_JSON_MISSING", set())
    done = subprocess.run(["sbatch", "--parsable", "-J", "relax-st", "-t", "1", "-o", "/dev/null", "--wrap", "true"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a job that ran: sacct's full record
    assert slurm_wait_job(done) == "COMPLETED"
    deadline = time.monotonic() + 60  # sacct's first record of an ended job may be partial (name "allocation")
    while [c.name for c in slurm.accounting([int(done)])] != ["relax-st"]:
        assert time.monotonic() < deadline, slurm.accounting([int(done)])
        time.sleep(0.5)
    sacct_json = [c.as_dict() for c in slurm.accounting([int(done)])]
    monkeypatch.setenv(slurm.JSON_ENV, "0")
    sacct_text = [c.as_dict() for c in slurm.accounting([int(done)])]
    assert sacct_text == sacct_json and sacct_json[0]["state"] == "COMPLETED" and sacct_json[0]["nodes"]
