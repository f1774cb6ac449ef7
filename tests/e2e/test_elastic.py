"""Elastic rollout on a local run: relax-scale adds an engine mid-run, it joins with current weights, takes
requests, then drains and leaves; the run completes and every sample is produced and trained once.

The fully-async quickstart is held at a step (``RUN_DIR/pause``) while the engine is asked for, so the scale
operation lands at a known point; the rest waits for events in ``state.json``, never for wall time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from relax_hpc.controller import run_controller
from relax_hpc.exchange.audit import exactly_once
from relax_hpc.launch import attach
from relax_hpc.launch.scale import scale
from relax_hpc.launch.status import collect
from relax_hpc.rundir import RunDir, write_json

from .conftest import (REPO, follow_slurm, held_at, hold, make_run, metrics, quickstart_overrides, state, submit_slurm,
                       wait_until)

STEPS = 6  # held at 2 and 5 (the scale operations), then one step after the drain
SLURM_STEPS = 8  # the last hold is at step 7: one step after it
K = 1  # quickstart-async's max_staleness


def _engine(run, name):
    return (state(run).get("engines") or {}).get(name) or {}


@pytest.mark.slow
def test_scale_out_joins_with_current_weights_then_drains(tmp_path, tiny_model, local_executor):
    scale_out_kill_and_drain(tmp_path, tiny_model)


@pytest.mark.gpu
@pytest.mark.slow
def test_scale_out_and_in_with_two_real_sglang_engines(tmp_path, tiny_model, local_executor):
    """The same with SGLang on a GPU node: the run's own engine and the step engine are both real SGLang servers
    (``RELAX_SGLANG_PYTHON``: an interpreter that can ``import sglang``), sharing the GPU; the weight syncs, the
    join, the kill -9 and the drain go through SGLang's HTTP API and its NCCL weight group."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    py = os.environ.get("RELAX_SGLANG_PYTHON")
    if not py or subprocess.run([py, "-c", "import sglang"], capture_output=True).returncode != 0:
        pytest.skip("needs RELAX_SGLANG_PYTHON: an interpreter that can `import sglang`")
    scale_out_kill_and_drain(tmp_path, tiny_model,
                             'rollout.engine.args=["--mem-fraction-static", "0.25", "--disable-cuda-graph"]')


def scale_out_kill_and_drain(tmp_path, tiny_model, *extra: str) -> None:
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", *extra,
                   recipe=REPO / "recipes" / "quickstart-async.yaml", name="elastic")
    write_json(run.job, {"run": run.name, "run_dir": str(run.path), "executor": "local", "job_id": "local",
                         "pid": os.getpid(), "host": socket.gethostname()})  # as relax-submit --local writes it
    hold(run, 2)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(final=run_controller(run.path, capacity=attach)), daemon=True)
    t.start()
    try:
        wait_until(lambda: state(run).get("phase") == "paused" and state(run).get("step", 0) >= 1, 300,
                   what="the run held at step 2")
        out = scale(run, "rollout=+1")
        assert out["accepted"] and out["op"] == "s1", out
        again = scale(run, "rollout=+1")  # one operation at a time: s1 runs until its engine is ready
        assert not again["accepted"] and "s1" in again["message"], again
        assert not scale(run, "rollout=-2")["accepted"]  # would drain the run's own engine: refused

        # it joins, gets the current weights from a sync, and only then is ready
        wait_until(lambda: _engine(run, "step0").get("state") == "ready", 300, what="step0 ready")
        e = _engine(run, "step0")
        assert e["origin"] == "step" and e["job_id"] == "local" and int(e["weight_version"]) >= state(run)["step"] - 1
        ops = state(run)["scale"]
        assert ops[0]["state"] == "done" and ops[0]["ready"]["step0"] > 0, ops

        listed = {x["name"]: x for x in collect(run)["engines"]}  # relax-status --json's engines
        assert listed["step0"]["origin"] == "step" and listed["step0"]["state"] == "ready", listed

        hold(run, 5)  # steps 3-5 generate with two engines
        wait_until(lambda: _engine(run, "step0").get("requests", 0) > 0 and state(run).get("phase") == "paused"
                   and state(run).get("step", 0) >= 4, 600, what="step0 served requests")
        # kill -9 of the step engine: its host sees it die, it is gone, and a new step starts it again
        os.kill(_engine(run, "step0")["pid"], signal.SIGKILL)
        wait_until(lambda: _engine(run, "step0").get("restarts") == 1 and _engine(run, "step0").get("state") == "ready",
                   300, what="step0 started again and caught up")
        assert int(_engine(run, "step0")["weight_version"]) == state(run)["step"]  # the current weights
        out = scale(run, "rollout=-1")
        assert out["accepted"], out
        wait_until(lambda: _engine(run, "step0").get("state") == "gone", 300, what="step0 drained")
        (run.path / "pause").unlink()
        t.join(900)
    finally:
        (run.path / "pause").unlink(missing_ok=True)
        t.join(900)
    assert result["final"]["state"] == "COMPLETED"
    e = _engine(run, "step0")
    assert "drained" in e["left"], e
    # it served only with weights within the staleness bound of the step it first served
    assert e["first_step"] - 1 - K <= int(e["first_version"]), e
    ops = state(run)["scale"]
    assert [o["state"] for o in ops if o["state"] != "failed"] == ["done", "done"], ops
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert max(r["rollout/engines"] for r in rows) == 2
    assert exactly_once(run.path / "exchange" / "journal.jsonl", ["train"]) == []
    events = [x["event"] for x in state(run)["events"]]
    assert "scale" in events and "scale_done" in events and "engine_restart" in events


def _cli(tool: str, *args: str, env: dict, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / ".venv" / "bin" / tool), *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def _status(sub: dict, env: dict, cwd) -> dict:
    p = _cli("relax-status", "--json", sub["run"], env=env, cwd=cwd)
    return json.loads(p.stdout) if p.returncode == 0 else {}


def _listed(st: dict, name: str) -> dict:
    return next((e for e in st.get("engines", []) if e["name"] == name), {})


def _squeue_ids(env: dict) -> set[str]:
    return set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env).stdout.split())


@pytest.mark.slurm
@pytest.mark.slow
def test_attached_jobs_join_drain_and_survive_scancel_on_slurm(slurm_cluster, tmp_path, tiny_model):
    """The 4-group fully-async quickstart on the dev cluster: relax-scale --attach adds an engine as a second Slurm
    job, which joins with current weights and serves; relax-scale -1 drains it and its job ends; a second attached
    engine is scancelled while the run goes: it is gone, not a failure, and the run completes with every sample
    produced and trained once and no step restarted."""
    env = slurm_cluster.env
    sub = submit_slurm(REPO / "recipes" / "quickstart-slurm.yaml", tmp_path, env,
                       quickstart_overrides(tiny_model, tmp_path / "runs", f"run.steps={SLURM_STEPS}"))
    run = RunDir(Path(sub["run_dir"]))
    hold(run, 2)
    wait_until(lambda: state(run).get("phase") == "paused", 300, what="the run held at step 2")

    p = _cli("relax-scale", sub["run"], "rollout=+1", "--attach", "--time", "00:10:00", "--json", "--wait", "240",
             env=env, cwd=tmp_path)
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["accepted"] and out["operation"]["state"] == "done", (p.stdout, p.stderr)
    job = out["job_id"]
    assert job in _squeue_ids(env) and job != sub["job_id"]  # a second Slurm job
    e = _listed(_status(sub, env, tmp_path), "s1-0")
    assert e["origin"] == "attached" and e["state"] == "ready" and e["job_id"] == job, e

    hold(run, 5)
    # waits read state.json (relax-status, a process of its own, is asked once the awaited state is there)
    wait_until(lambda: _engine(run, "s1-0").get("requests", 0) > 0 and held_at(run, 5), 600,
               what="the attached engine served requests")
    assert _listed(_status(sub, env, tmp_path), "s1-0")["requests"] > 0
    p = _cli("relax-scale", sub["run"], "rollout=-1", "--json", "--wait", "120", env=env, cwd=tmp_path)
    assert p.returncode == 0 and json.loads(p.stdout)["operation"]["state"] == "done", p.stdout
    assert _listed(_status(sub, env, tmp_path), "s1-0")["state"] == "gone"
    wait_until(lambda: job not in _squeue_ids(env), 120, every=0.5, what=f"attached job {job} ended")

    p = _cli("relax-scale", sub["run"], "rollout=+1", "--attach", "--json", "--wait", "240", env=env, cwd=tmp_path)
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["operation"]["state"] == "done", p.stdout
    hold(run, 7)  # it serves steps 6-7; the run then waits, so the scancel lands before the run could end
    wait_until(lambda: _engine(run, "s3-0").get("requests", 0) > 0, 600,
               what="the second attached engine served requests")
    assert _listed(_status(sub, env, tmp_path), "s3-0")["requests"] > 0
    subprocess.run(["scancel", out["job_id"]], env=env, check=True)
    wait_until(lambda: _engine(run, "s3-0").get("state") == "gone", 300, what="the scancelled engine declared gone")
    assert _listed(_status(sub, env, tmp_path), "s3-0")["state"] == "gone"
    (run.path / "pause").unlink()

    st, _ = follow_slurm(sub, tmp_path, env, 4, 900)
    assert st.get("state") == "COMPLETED", st
    ctl = state(run)
    assert ctl["restarts"] == 0, ctl.get("last_failure")  # capacity leaving is not a failure
    e1, e3 = ctl["engines"]["s1-0"], ctl["engines"]["s3-0"]
    assert "drained" in e1["left"] and e3["left"], (e1, e3)
    for e in (e1, e3):  # each served first with weights within the staleness bound of that step
        assert e["first_step"] - 1 - K <= int(e["first_version"]), e
    assert [o["state"] for o in ctl["scale"]] == ["done", "done", "done"], ctl["scale"]
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, SLURM_STEPS + 1))
    assert exactly_once(run.path / "exchange" / "journal.jsonl", ["train"]) == []


@pytest.mark.slurm
@pytest.mark.slow
def test_spare_nodes_take_a_new_step_of_the_same_job(slurm_cluster, tmp_path, tiny_model):
    """roles.rollout.elastic: rollout's component holds 2 nodes and the role starts on 1; relax-scale +1 (no
    --attach) starts the engine as a new step of the same het job, on the spare node, where it joins and serves."""
    env = slurm_cluster.env
    sub = submit_slurm(REPO / "recipes" / "quickstart-slurm-colocate.yaml", tmp_path, env,
                       quickstart_overrides(tiny_model, tmp_path / "runs", "run.steps=4", "roles.rollout.nodes=2",
                                            "roles.rollout.elastic.initial=1"))
    run = RunDir(Path(sub["run_dir"]))
    hold(run, 1)
    wait_until(lambda: state(run).get("phase") == "paused", 300, what="the run held at step 1")
    p = _cli("relax-scale", sub["run"], "rollout=+1", "--json", "--wait", "240", env=env, cwd=tmp_path)
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["operation"]["state"] == "done" and out["job_id"] is None, p.stdout
    (run.path / "pause").unlink()
    st, _ = follow_slurm(sub, tmp_path, env, 2, 600)
    assert st.get("state") == "COMPLETED", st
    ctl = state(run)
    e, first = ctl["engines"]["step0"], ctl["engines"]["engine0"]
    assert e["origin"] == "step" and e["job_id"] == sub["job_id"] and e["step_id"] not in (None, first["step_id"])
    assert e["node"] != first["node"] and e["requests"] > 0, (e, first)  # the spare node, and it served

    def in_sacct() -> bool:  # sacct shows the step, on that node (accounting may lag the job's end: poll)
        steps = subprocess.run(["sacct", "-n", "-P", "-j", sub["job_id"], "-o", "JobID,NodeList"], capture_output=True,
                               text=True, env=env).stdout
        return any(line.split("|")[0].endswith(f".{e['step_id']}") and line.split("|")[1] == e["node"]
                   for line in steps.splitlines())

    wait_until(in_sacct, 60, every=1, what=f"step {e['step_id']} in sacct")


@pytest.mark.slow
def test_the_autoscaler_scales_out_when_the_trainer_waits_for_samples(tmp_path, tiny_model, local_executor):
    """A fully-async run whose trainer waits for rollout (the tiny model trains in a blink; generation is the work):
    with rollout.elastic.autoscale on, the autoscaler adds an engine by itself, the decision is a ``scale`` event
    whose author carries the reason, and the engine joins, serves and the run completes exactly-once."""
    a = "rollout.elastic.autoscale"
    run = make_run(tmp_path, tiny_model, "run.steps=6", f"{a}.enabled=true", f"{a}.max=2", f"{a}.window=1",
                   f"{a}.scale_out_wait_ratio=0.0", f"{a}.scale_out_cooldown_s=0", f"{a}.scale_in_cooldown_s=1e9",
                   recipe=REPO / "recipes" / "quickstart-async.yaml", name="autoscale")
    hold(run, 2)  # the decision comes after step 1's sync; the run waits for the engine, not the test for time
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(final=run_controller(run.path, capacity=attach)), daemon=True)
    t.start()
    try:
        wait_until(lambda: _engine(run, "step0").get("state") == "ready", 300, what="the autoscaler's engine ready")
    finally:
        (run.path / "pause").unlink(missing_ok=True)
        t.join(900)
    assert result["final"]["state"] == "COMPLETED"
    ctl = state(run)
    op = ctl["scale"][0]
    assert op["spec"] == "+1" and op["by"].startswith("autoscaler (step ") and "the trainer waited" in op["by"], op
    assert op["state"] == "done" and op["ready"]["step0"] > 0, op
    assert any(e["event"] == "scale" and "by autoscaler" in e["detail"] for e in ctl["events"])
    e = ctl["engines"]["step0"]
    assert e["origin"] == "step" and e["requests"] > 0 and e["first_step"] - 1 - K <= int(e["first_version"]), e
    rows = metrics(run)
    assert all(0.0 <= r["perf/actor_wait_ratio"] for r in rows) and rows[-1]["rollout/engines"] == 2
    assert exactly_once(run.path / "exchange" / "journal.jsonl", ["train"]) == []
