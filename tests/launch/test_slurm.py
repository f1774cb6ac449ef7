"""Reading Slurm: state words, het aggregation, time syntax, GRES, and squeue/sacct JSON (22.05's shape)."""

from __future__ import annotations

import time

import pytest

from relax_hpc.launch import slurm


@pytest.mark.parametrize("raw,word", [
    ("CANCELLED by 0", "CANCELLED"), ({"current": "RUNNING", "reason": "None"}, "RUNNING"),
    (["PENDING", "REQUEUED"], "PENDING"), ("completed", "COMPLETED"), ("", "UNKNOWN"), (None, "UNKNOWN"),
])
def test_state_word(raw, word):
    assert slurm.state_word(raw) == word


@pytest.mark.parametrize("states,expected", [
    (["RUNNING", "RUNNING"], "RUNNING"),
    (["PENDING", "PENDING", "PENDING"], "PENDING"),
    (["COMPLETED", "COMPLETED"], "COMPLETED"),
    (["FAILED", "COMPLETED"], "FAILED"),
    (["COMPLETED", "CANCELLED by 0"], "CANCELLED"),
    (["CANCELLED", "FAILED"], "FAILED"),
    (["TIMEOUT", "TIMEOUT"], "TIMEOUT"),
    (["COMPLETED", "RUNNING"], "RUNNING"),  # still active: not final yet
    (["COMPLETING", "COMPLETED"], "COMPLETING"),
    ([], "UNKNOWN"),
])
def test_aggregate_state(states, expected):
    assert slurm.aggregate_state(states) == expected


@pytest.mark.parametrize("text,seconds", [
    ("10", 600), ("10:30", 630), ("01:00:00", 3600), ("1-0", 86400), ("1-02:03", 93780), ("2-00:00:01", 172801),
])
def test_parse_time(text, seconds):
    assert slurm.parse_time(text) == seconds


def test_parse_time_rejects_garbage():
    with pytest.raises(ValueError):
        slurm.parse_time("soon")


def test_format_seconds():
    assert slurm.format_seconds(None) == "UNLIMITED"
    assert slurm.format_seconds(3725) == "01:02:05"
    assert slurm.format_seconds(90061) == "1-01:01:01"
    assert slurm.format_seconds(-5) == "00:00:00"


@pytest.mark.parametrize("gres,n", [
    ("gpu:4", 4), ("gpu:a100:4(S:0-1)", 4), ("gpu:a100:2,gpu:v100:2", 4), ("(null)", 0), ("", 0), (None, 0),
    ("gpu:a100:2(S:0),mps:100", 2),
])
def test_parse_gres_gpus(gres, n):
    assert slurm.parse_gres_gpus(gres) == n


SQUEUE = {"jobs": [  # 22.05 lists every job whatever -j says; a foreign job reuses nothing of ours
    {"job_id": 7, "het_job_id": 7, "het_job_offset": 0, "job_state": "RUNNING", "state_reason": "None",
     "nodes": "node[1-2]", "node_count": 2, "partition": "debug", "name": "relax-t", "submit_time": 100,
     "start_time": 1000, "end_time": 1600, "time_limit": 10, "restart_cnt": 0},
    {"job_id": 8, "het_job_id": 7, "het_job_offset": 1, "job_state": "RUNNING", "state_reason": "None",
     "nodes": "node3", "node_count": 1, "partition": "debug", "name": "relax-t", "start_time": 1000,
     "time_limit": 10},
    {"job_id": 9, "het_job_id": 0, "het_job_offset": 0, "job_state": "PENDING", "state_reason": "Resources",
     "nodes": "", "name": "other", "time_limit": None},
]}


def test_squeue_job_filters_and_orders(monkeypatch):
    monkeypatch.setattr(slurm, "run_json", lambda argv, timeout=60: SQUEUE)
    comps = slurm.squeue_job(7, "relax-t")
    assert [c.label for c in comps] == ["7+0", "7+1"]
    assert [c.job_id for c in comps] == [7, 8]
    assert comps[0].nodes == "node[1-2]" and comps[0].time_limit_s == 600
    assert comps[0].time_left_s(now=1100) == 500
    assert slurm.squeue_job(7, "someone-else") == []  # a reused id with another name is not ours
    plain = slurm.squeue_job(9)
    assert plain[0].label == "9+0" and plain[0].reason == "Resources" and plain[0].time_left_s() is None


def test_sacct_job(monkeypatch):
    data = {"jobs": [
        {"job_id": 7, "het": {"job_id": 7, "job_offset": 0}, "state": {"current": "CANCELLED", "reason": "None"},
         "nodes": "node[1-2]", "allocation_nodes": 2, "partition": "debug", "name": "relax-t",
         "time": {"submission": 1, "start": 2, "end": 3, "limit": 10}, "exit_code": {"return_code": 0}},
        {"job_id": 8, "het": {"job_id": 7, "job_offset": 1}, "state": {"current": "CANCELLED", "reason": "None"},
         "nodes": "node3", "name": "relax-t", "time": {"limit": None}},
    ]}
    monkeypatch.setattr(slurm, "run_json", lambda argv, timeout=60: data)
    comps = slurm.sacct_job(7)
    assert [c.state for c in comps] == ["CANCELLED", "CANCELLED"] and comps[0].source == "sacct"
    assert comps[1].time_limit_s is None


def test_sacct_nothing_found_is_empty(monkeypatch):
    def boom(argv, timeout=60):
        raise slurm.SlurmError("sacct --json -j 5 failed (exit 1): Nothing found")
    monkeypatch.setattr(slurm, "run_json", boom)
    assert slurm.sacct_job(5) == []


def test_run_never_uses_a_shell(monkeypatch):
    seen = {}

    def fake_run(argv, **kw):
        seen.update(kw, argv=argv)

        class P:
            returncode, stdout, stderr = 0, "{}", ""
        return P()
    monkeypatch.setattr(slurm.subprocess, "run", fake_run)
    slurm.run(["squeue", "--json"])
    assert isinstance(seen["argv"], list) and not seen.get("shell")


def test_missing_client_is_a_clear_error():
    with pytest.raises(slurm.SlurmError, match="not found on PATH"):
        slurm.run(["no-such-slurm-client-xyz"])


@pytest.mark.slurm
def test_dev_cluster_nodes(slurm_cluster):
    nodes = slurm.sinfo_nodes()
    debug = [n for n in nodes if "debug" in n.partitions]
    assert len(debug) == 4 and all(n.gpus == 4 and n.cpus == 4 for n in debug)
    assert slurm.default_partition() == "debug"


@pytest.mark.slurm
def test_a_requeue_that_slurm_accepted_is_not_reported_as_refused(slurm_cluster, tmp_path):
    """scontrol can be killed by the teardown of the job that calls it (exit -15) after Slurm accepted the
    requeue; a continuation job on that report would run the run twice. A failed ``scontrol requeue`` counts
    only when the job's Restarts did not grow."""
    import subprocess

    job = subprocess.run(["sbatch", "--parsable", "--requeue", "-o", "/dev/null", "--wrap", "sleep 600"],
                         capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
    try:
        deadline = time.monotonic() + 60
        while slurm.run(["squeue", "-j", job, "-h", "-o", "%T"]).strip() != "RUNNING":
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.2)
        assert slurm.job_restarts(job) == 0
        slurm.scontrol_requeue(job, restart_count=0)  # a real requeue: the job goes back to PENDING
        assert slurm.job_restarts(job) == 1
        # scontrol now fails (the job is pending), but Restarts grew past what the caller had: done
        slurm.scontrol_requeue(job, restart_count=0)
        with pytest.raises(slurm.SlurmError, match="pending") as e:  # nothing grew since 1: a real refusal
            slurm.scontrol_requeue(job, restart_count=1)
        assert e.value.returncode == 1
    finally:
        subprocess.run(["scancel", job], check=False)
    assert slurm.job_restarts("999999") == -1
