"""The smoke recipe on the dev cluster, end to end: relax-submit → one het job (squeue shows J+0..J+K) →
relax-status per component and role → COMPLETED; two runs at once; relax-cancel → CANCELLED."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from relax_hpc.recipe import load_recipe
from relax_hpc.recipe.layout import het_groups

from .conftest import SMOKE, cli

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROLES = {"actor", "rollout", "reference", "actor_fwd"}


def submit(cwd, *overrides) -> dict:
    p = cli("relax-submit", "--json", str(SMOKE), *overrides, cwd=cwd)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def status(cwd, run) -> dict:
    p = cli("relax-status", "--json", run, cwd=cwd)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def wait_for(cwd, run, states, timeout=300.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        d = status(cwd, run)
        if d["state"] in states:
            return d
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run} still {d['state']} after {timeout:.0f} s: {d}")
        time.sleep(1)


def squeue_ids(job_id: str) -> set[str]:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i"], capture_output=True, text=True).stdout
    return {x for x in out.split() if x.startswith(f"{job_id}+")}


def submitted(cwd, ncomp: int) -> dict:
    """relax-submit, then what squeue and relax-status show at once: one het job J+0..J+K, its roles."""
    d = submit(cwd)
    job = d["job_id"]
    assert job.isdigit() and d["executor"] == "slurm" and (cwd / "runs" / d["run"] / "job.sbatch").exists()
    assert squeue_ids(job) == {f"{job}+{k}" for k in range(ncomp)}
    s = status(cwd, d["run"])
    assert s["run"] == d["run"] and s["job_id"] == job and s["state"] in ("PENDING", "RUNNING", "COMPLETED")
    assert [c["label"] for c in s["components"]] == [f"{job}+{k}" for k in range(ncomp)]
    assert set(s["roles"]) == ROLES and s["roles"]["actor_fwd"]["het_group"] == s["roles"]["reference"]["het_group"]
    return d


def test_two_runs_at_once_submit_show_their_status_and_complete(slurm_cluster, tmp_path):
    """Each submitted run is one het job with its components and roles in relax-status; the second is submitted
    while the first is queued or going, and both complete (every component, every role done)."""
    ncomp = len(het_groups(load_recipe(SMOKE)))
    a = submitted(tmp_path, ncomp)
    b = submitted(tmp_path, ncomp)
    assert a["run"] != b["run"] and a["job_id"] != b["job_id"]
    for d in (a, b):
        s = wait_for(tmp_path, d["run"], {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=400)
        assert s["state"] == "COMPLETED", s
        assert all(c["state"] == "COMPLETED" for c in s["components"])
        assert all(r["phase"] == "done" for r in s["roles"].values()), s["roles"]
        assert s["components"][0]["nodes"]  # the nodes it ran on


def test_cancel_running_job(slurm_cluster, tmp_path):
    d = submit(tmp_path)
    wait_for(tmp_path, d["run"], {"RUNNING", "COMPLETED", "FAILED"})
    c = cli("relax-cancel", d["run"], cwd=tmp_path)
    assert c.returncode == 0, c.stderr
    s = wait_for(tmp_path, d["run"], {"CANCELLED", "COMPLETED", "FAILED", "TIMEOUT"}, timeout=120)
    assert s["state"] == "CANCELLED", s
    assert s["reason"] == "cancelled by relax-cancel"
