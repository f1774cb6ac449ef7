"""``slurm.layout: single`` on the dev cluster, with ``slurm.mpi: none`` (the file rendezvous, no MPI): the 4-group
fully-async quickstart as ONE plain Slurm job of 4 nodes, each role's step on its own node (srun --relative), the
engine on rollout's. One run serves every check: an engine attached as a job of its own joins, serves and drains;
then the batch shell's warning signal (``scancel -b -s USR2``) checkpoints and ``scontrol requeue``s the job (same
id, SLURM_RESTART_COUNT=1), which resumes and completes with every sample trained, and seen by reference and
actor_fwd, exactly once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from relax_hpc.exchange.audit import exactly_once
from relax_hpc.rundir import RunDir

from .conftest import REPO, ended_state, held_at, hold, metrics, quickstart_overrides, state, submit_slurm, wait_until
from .interrupt import SHORT, STEPS

ROLES = ("actor", "rollout", "reference", "actor_fwd")


def _cli(tool: str, *args: str, env: dict, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / ".venv" / "bin" / tool), *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def _engine(run: RunDir, name: str) -> dict:
    return (state(run).get("engines") or {}).get(name) or {}


def _squeue(env: dict, *args: str) -> list[list[str]]:
    out = subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, env=env).stdout
    return [line.split() for line in out.splitlines()]


@pytest.mark.slurm
@pytest.mark.slow
def test_single_layout_without_mpi_attaches_requeues_resumes_and_trains_exactly_once(slurm_cluster, tmp_path,
                                                                                      tiny_model):
    env = slurm_cluster.env
    sub = submit_slurm(REPO / "recipes" / "quickstart-slurm.yaml", tmp_path, env,
                       quickstart_overrides(tiny_model, tmp_path / "runs", *SHORT, "slurm.layout=single",
                                            "slurm.mpi=none"))
    run, job = RunDir(Path(sub["run_dir"])), sub["job_id"]
    script = (run.path / "job.sbatch").read_text()
    assert "#SBATCH hetjob" not in script and "#SBATCH --nodes=4" in script
    hold(run, 1)
    try:
        wait_until(lambda: held_at(run, 1), 600, every=0.5, what="step 1 done, the run held")
        assert _squeue(env, "-j", job, "-o", "%i %D %T") == [[job, "4", "RUNNING"]]  # one plain job, 4 nodes
        ctl = state(run)
        nodes = {r: ctl["roles"][r]["het_nodelist"] for r in ROLES}
        assert len(set(nodes.values())) == 4 and all("," not in n for n in nodes.values()), nodes
        assert _engine(run, "engine0")["node"] == nodes["rollout"]  # the engine step on rollout's node
        for role in ROLES:  # the step went where it was put, and found its peers without MPI
            log = (run.logs / f"{role}.srun.log").read_text() + (run.logs / "controller.log").read_text()
            assert "--mpi" not in log and f"[{role}:0@{nodes[role]}] ready" in (run.logs / f"{role}.0.log").read_text()

        # elastic attach: unchanged by the layout (an engine is a job of its own)
        p = _cli("relax-scale", sub["run"], "rollout=+1", "--attach", "--time", "00:10:00", "--json", "--wait", "240",
                 env=env, cwd=tmp_path)
        out = json.loads(p.stdout)
        assert p.returncode == 0 and out["operation"]["state"] == "done", (p.stdout, p.stderr)
        attached = out["job_id"]
        assert attached != job and _engine(run, "s1-0").get("state") == "ready"
        hold(run, 2)
        wait_until(lambda: _engine(run, "s1-0").get("requests", 0) > 0 and held_at(run, 2), 600, every=0.5,
                   what="the attached engine served step 2")
        p = _cli("relax-scale", sub["run"], "rollout=-1", "--json", "--wait", "120", env=env, cwd=tmp_path)
        assert p.returncode == 0 and json.loads(p.stdout)["operation"]["state"] == "done", p.stdout
        wait_until(lambda: not _squeue(env, "-j", attached), 120, every=0.5, what=f"attached job {attached} ended")
        assert "drained" in (_engine(run, "s1-0").get("left") or ""), _engine(run, "s1-0")

        # requeue and resume: the warning signal to the batch shell, as before a time limit
        subprocess.run(["scancel", "-b", "-s", "USR2", job], check=True, env=env)
        wait_until(lambda: state(run).get("attempt") == 1 and held_at(run, 2), 600, every=0.5,
                   what="attempt 1 resumed and held")
        (run.path / "pause").unlink()
        wait_until(lambda: ended_state(state(run)), 600, every=0.5, what="the run ended, its last event written")
    finally:
        if state(run).get("state") != "COMPLETED":
            subprocess.run(["scancel", job], env=env)
    st = state(run)
    assert st["slurm_restart_count"] == 1 and st["job_id"] == job and st["step"] == STEPS
    events = [e["event"] for e in st["events"]]
    assert st["state"] == "COMPLETED" and events[-1] == "finished", " ".join(events)
    assert events.index("requeued") < events.index("resumed"), " ".join(events)
    assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1))
    assert exactly_once(run.path / "exchange" / "journal.jsonl", ["train", "reference", "actor_fwd"]) == []
