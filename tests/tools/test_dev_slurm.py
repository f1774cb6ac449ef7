"""tools/dev-slurm: the dev Slurm cluster is up and does what the project needs
(multi-node srun, 3-component het jobs, sacct, srun --mpi=pmix with mpi4py).

Needs the cluster: `tools/dev-slurm up` (or RELAX_DEV_SLURM_AUTO=1 as root).
Jobs of other sessions may share the cluster, so every wait is a poll with a
generous timeout, never a fixed sleep.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurm_helpers import slurm_job_states, slurm_wait_job

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
DEV_SLURM = REPO / "tools" / "dev-slurm"
NODES = [f"node{i}" for i in range(1, 5)]
BAD_NODE_STATES = ("down", "drain", "fail", "unk", "inval", "not_resp", "future", "maint", "reboot", "power")


def run(args, env, timeout=60, check=True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} -> rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def hostnames(nodelist: str, env) -> list[str]:
    return run(["scontrol", "show", "hostnames", nodelist], env).stdout.split()


@pytest.fixture(scope="module")
def dev_cluster(slurm_cluster):
    """The cluster, which must be tools/dev-slurm's (its knobs come from knobs.env)."""
    conf = Path(slurm_cluster.conf).resolve()
    knobs = conf.parent / "knobs.env"
    if conf.name != "slurm.conf" or not knobs.is_file():
        pytest.skip(f"{conf} is not a tools/dev-slurm cluster")
    env = dict(slurm_cluster.env)
    for line in knobs.read_text().splitlines():
        k, _, v = line.partition("=")
        if k.startswith("RELAX_DEV_SLURM_"):
            env[k] = v  # so tools/dev-slurm sees the very cluster that is running
    return env


def test_status_exits_0_and_env_prints_conf(dev_cluster):
    p = run([DEV_SLURM, "status"], dev_cluster, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "up and healthy" in p.stdout
    for daemon in ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd-node4", "kicker"):
        assert daemon in p.stdout
    env_line = run([DEV_SLURM, "env"], dev_cluster).stdout.strip()
    assert env_line == f"export SLURM_CONF={dev_cluster['SLURM_CONF']}"


def test_sinfo_json_four_nodes_with_four_gpus(dev_cluster):
    import json

    nodes = json.loads(run(["sinfo", "--json"], dev_cluster).stdout)["nodes"]
    by_name = {n["name"]: n for n in nodes}
    assert sorted(by_name) == NODES
    for name, n in by_name.items():
        state = " ".join([str(n["state"])] + [str(f) for f in n.get("state_flags", [])]).lower()
        assert not any(bad in state for bad in BAD_NODE_STATES), f"{name}: {state}"
        assert n["gres"].split("(")[0] == "gpu:4", f"{name}: gres={n['gres']}"
        assert n["cpus"] == 4
        assert {"debug", "urgent"} <= set(n["partitions"])


def test_srun_two_nodes(dev_cluster):
    p = run(["srun", "-N2", "-n2", "--ntasks-per-node=1", "--time=2", "-J", "devslurm-srun",
             "bash", "-c", "echo $SLURM_PROCID $SLURMD_NODENAME"], dev_cluster, timeout=300)
    lines = sorted(p.stdout.split("\n")[:-1])
    assert [ln.split()[0] for ln in lines] == ["0", "1"], p.stdout
    names = {ln.split()[1] for ln in lines}
    assert len(names) == 2 and names <= set(NODES), p.stdout


HET_SCRIPT = """\
#!/bin/bash
#SBATCH --job-name=devslurm-het
#SBATCH --output={out}/batch-%j.out
#SBATCH --time=5
#SBATCH -N2 --ntasks-per-node=1 --cpus-per-task=1
#SBATCH hetjob
#SBATCH -N1 -n1 --cpus-per-task=1 --gpus=4
#SBATCH hetjob
#SBATCH -N1 -n1 --cpus-per-task=1
# wait for the test to have seen every component RUNNING in squeue (<= 120 s)
for i in $(seq 1 1200); do [ -e {out}/go ] && break; sleep 0.1; done
for k in 0 1 2; do
  srun --het-group=$k bash -c "echo \\$SLURM_PROCID \\$SLURMD_NODENAME \\$SLURM_JOB_NODELIST_HET_GROUP_$k \\${{CUDA_VISIBLE_DEVICES:-none}}" > {out}/g$k.out &
done
wait
"""


def test_het_job_three_components(dev_cluster, tmp_path):
    script = tmp_path / "het.sbatch"
    script.write_text(HET_SCRIPT.format(out=tmp_path))
    job = run(["sbatch", "--parsable", script], dev_cluster).stdout.strip().split(";")[0]
    assert job.isdigit(), job
    want = {f"{job}+{k}" for k in range(3)}
    seen_running: set[str] = set()
    try:
        end = time.monotonic() + 300
        while seen_running != want:
            assert time.monotonic() < end, f"het job {job} not RUNNING in squeue; saw {seen_running}"
            out = run(["squeue", "-h", "-j", job, "-o", "%i %T"], dev_cluster).stdout
            rows = dict(ln.split() for ln in out.splitlines() if ln.strip())
            assert rows or not seen_running, f"het job {job} left the queue early"
            seen_running = {i for i, st in rows.items() if st == "RUNNING"}
            if seen_running != want:
                time.sleep(0.2)
        assert set(rows) == want  # J+0..J+2, nothing else
    finally:
        (tmp_path / "go").touch()

    assert slurm_wait_job(job, timeout=180) == "COMPLETED", (tmp_path / f"batch-{job}.out").read_text()
    assert set(slurm_job_states(job)) == want

    counts = {0: 2, 1: 1, 2: 1}
    for k, ntasks in counts.items():
        lines = (tmp_path / f"g{k}.out").read_text().split("\n")[:-1]
        assert len(lines) == ntasks, lines
        group_nodes = None
        for ln in lines:
            rank, node, nodelist, cuda = ln.split()
            group_nodes = group_nodes or hostnames(nodelist, dev_cluster)
            assert len(group_nodes) == ntasks
            assert node in group_nodes, f"group {k}: task on {node}, group nodes {group_nodes}"
            if k == 1:
                assert cuda == "0,1,2,3"
        if k == 0:
            assert {ln.split()[1] for ln in lines} == set(group_nodes)


MPI_HELLO = """\
import os
from mpi4py import MPI
c = MPI.COMM_WORLD
print(c.Get_rank(), c.Get_size(), os.environ["SLURMD_NODENAME"], c.allreduce(c.Get_rank() + 1, op=MPI.SUM), flush=True)
"""


def test_srun_mpi_pmix_mpi4py_allreduce(dev_cluster, tmp_path):
    pytest.importorskip("mpi4py")
    mpis = run(["srun", "--mpi=list"], dev_cluster).stdout + run(["srun", "--mpi=list"], dev_cluster).stderr
    assert "pmix" in mpis, f"no pmix in srun --mpi=list (Open MPI installed after slurmd started?):\n{mpis}"
    hello = tmp_path / "mpi_hello.py"
    hello.write_text(MPI_HELLO)
    env = dict(dev_cluster, OMPI_MCA_btl="self,tcp")  # fake nodes share one host: no vader shm
    p = run(["srun", "--mpi=pmix", "-N2", "-n2", "--ntasks-per-node=1", "--time=3", "-J", "devslurm-mpi",
             sys.executable, hello], env, timeout=300)
    rows = sorted(ln.split() for ln in p.stdout.split("\n")[:-1])
    assert [r[0] for r in rows] == ["0", "1"], p.stdout + p.stderr
    assert all(r[1] == "2" and r[3] == "3" for r in rows), p.stdout
    assert len({r[2] for r in rows}) == 2, p.stdout


def test_up_again_is_a_noop(dev_cluster):
    if os.geteuid() != 0:
        pytest.skip("tools/dev-slurm up needs root")
    pidfile = Path(dev_cluster["SLURM_CONF"]).parent.parent / "run" / "slurmctld.pid"
    before = pidfile.read_text().strip()
    p = run([DEV_SLURM, "up"], dev_cluster, timeout=120)
    assert "nothing to do" in p.stderr, p.stderr
    assert p.stdout.strip().splitlines()[-1] == f"export SLURM_CONF={dev_cluster['SLURM_CONF']}"
    assert pidfile.read_text().strip() == before  # not restarted (how long it takes is a benchmark's business)
