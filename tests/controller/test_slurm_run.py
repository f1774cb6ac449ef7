"""On the real (dev) Slurm cluster: the controller inside a het job's batch script starts one
``srun --het-group=K`` per role; every step bootstraps (MPI rendezvous, gloo group, check collective,
cross-role group) on its own component's nodes.

Het components of one job never share a node, so on the 4-node dev cluster a job has at most 4 node
slots (smoke's actor on 2 nodes + 3 single-node components would pend for ever): FOUR has 4
components with a 2-rank actor on one node; THREE has a 2-node actor and actor_fwd sharing reference's
component (``--overlap``). Different jobs do share nodes, which is what the concurrency test needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ctl_helpers import make_run
from relax_hpc.recipe import load_recipe
from relax_hpc.recipe.layout import het_groups
from slurm_helpers import slurm_wait_job

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
CLUSTER = {"defaults": [str(REPO / "relax_hpc" / "configs" / "cluster" / "dev-slurm.yaml")],
           "logging": {"heartbeat_s": 1, "heartbeat_timeout_s": 60}}
FOUR = {**CLUSTER, "roles": {
    "actor": {"nodes": 1, "tasks_per_node": 2}, "rollout": {"nodes": 1},
    "reference": {"enabled": True, "nodes": 1}, "actor_fwd": {"enabled": True, "nodes": 1}}}
THREE = {**CLUSTER, "roles": {
    "actor": {"nodes": 2, "tasks_per_node": 2}, "rollout": {"nodes": 1},
    "reference": {"enabled": True, "nodes": 1}, "actor_fwd": {"enabled": True, "share_with": "reference"}}}


def submit(tmp_path: Path, recipe: dict, name: str, env: dict, extra_env: str = "") -> tuple[str, Path]:
    """A minimal het-job script (one block per component) whose batch step runs the controller."""
    run = make_run(tmp_path / name, recipe, name=name)
    r = load_recipe(run.recipe)
    blocks = [f"#SBATCH --partition=debug --nodes={s.nodes} --ntasks-per-node={s.tasks_per_node} --cpus-per-task=1"
              for s in het_groups(r)]
    script = "\n".join([
        "#!/bin/bash", f"#SBATCH --job-name=relax-ctl-{name}", f"#SBATCH --output={run.logs}/batch.out",
        "#SBATCH --time=00:05:00", "\n#SBATCH hetjob\n".join(blocks),
        f"export RELAX_EXECUTOR=slurm PYTHONPATH={REPO} {extra_env}",
        f"exec {sys.executable} -m relax_hpc.controller {run.path}", ""])
    run.script.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", str(run.script)], env=env, capture_output=True, text=True,
                         timeout=30, check=True)
    return out.stdout.strip().split(";")[0], run.path


def hostnames(nodelist: str, env: dict) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def component_nodes(job: str, env: dict) -> dict[int, str]:
    """sacct's NodeList per het component (an independent view of what the controller recorded)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "JobID,NodeList"], env=env,
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split("|") for line in out.splitlines() if "+" in line]
    return {int(jid.split("+")[1]): nodes for jid, nodes in rows}


def check_completed(job: str, run_dir: Path, env: dict) -> dict:
    state = json.loads((run_dir / "state.json").read_text())
    log = (run_dir / "logs" / "batch.out").read_text()
    assert state["state"] == "COMPLETED", f"{state['reason']}\n{log}"
    assert state["executor"] == "slurm" and state["job_id"] == job
    sacct_nodes = component_nodes(job, env)
    for name, role in state["roles"].items():
        allowed = hostnames(role["het_nodelist"], env)
        assert role["het_nodelist"] == sacct_nodes[role["het_group"]], name
        assert role["ranks_ready"] == role["ranks"] and role["collective_ok"] is True, name
        # each rank ran on its own component's nodes, and (in these layouts) every node of it has ranks
        assert len(role["nodes"]) == role["ranks"] and set(role["nodes"]) == set(allowed), (name, role["nodes"])
    assert state["cross_group"] == {"world": 4, "ok": True}
    return state


def test_two_het_jobs_at_once_bootstrap_on_their_components(tmp_path, slurm_cluster):
    env = slurm_cluster.env
    jobs = [submit(tmp_path, FOUR, "four", env), submit(tmp_path, THREE, "three", env)]
    finals = [slurm_wait_job(job, timeout=400, env=env) for job, _ in jobs]
    states = [check_completed(job, run_dir, env) for job, run_dir in jobs]
    assert finals == ["COMPLETED", "COMPLETED"]
    four, three = states
    assert len({four["roles"][r]["het_nodelist"] for r in four["roles"]}) == 4  # 4 components, 4 node sets
    actor = three["roles"]["actor"]
    assert Counter(actor["nodes"]) == {n: 2 for n in hostnames(actor["het_nodelist"], env)}  # 2 nodes × 2 ranks
    assert three["roles"]["actor_fwd"]["het_nodelist"] == three["roles"]["reference"]["het_nodelist"]
    # both ran at the same time (every listener on port 0: no collisions on the shared fake nodes)
    (a0, a1), (b0, b1) = [(s["started_at"], s["updated_at"]) for s in states]
    assert a0 < b1 and b0 < a1


def test_a_failing_role_fails_the_job_with_its_error_in_the_controller_log(tmp_path, slurm_cluster):
    env = slurm_cluster.env
    # one restart (new steps in the same job) fails too: no more left
    job, run_dir = submit(tmp_path, {**THREE, "checkpoint": {"max_restarts": 1}, "health": {"max_role_restarts": 0}},
                          "fail", env,
                          extra_env="RELAX_TEST_FAIL_ROLE=rollout")
    assert slurm_wait_job(job, timeout=400, env=env) == "FAILED"
    state = json.loads((run_dir / "state.json").read_text())
    assert state["state"] == "FAILED" and state["restarts"] == 1
    assert state["reason"].startswith("rollout rank 0 on ") and "injected failure" in state["reason"]
    for log in ("batch.out", "controller.log"):
        text = (run_dir / "logs" / log).read_text()
        assert "log of the failed role rollout" in text and "RELAX_TEST_FAIL_ROLE=rollout" in text, log
    assert state["updated_at"] - state["started_at"] < 60
