"""relax-status's join of Slurm (or the local process) with state.json, in Slurm's state words."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest
from rich.console import Console

from relax_hpc.launch import localproc, status
from relax_hpc.launch.slurm import Component
from relax_hpc.recipe import dump_recipe, recipe_from_dict
from relax_hpc.rundir import create_run_dir, write_json, write_private

RECIPE = {"run": {"name": "st"}, "roles": {"actor": {"nodes": 2}, "rollout": {"nodes": 1},
                                           "reference": {"enabled": True, "share_with": "actor", "nodes": 1}}}


def run_dir(tmp_path, executor="slurm", **job):
    rd = create_run_dir(tmp_path / "runs", "st")
    write_private(rd.recipe, dump_recipe(recipe_from_dict(RECIPE)))
    write_json(rd.job, {"run": rd.name, "run_dir": str(rd.path), "executor": executor, "job_id": "7",
                        "job_name": "relax-st", "submitted_at": time.time(), **job})
    return rd


def comp(offset, state, reason=None, nodes="node1"):
    return Component(het_job_id=7, het_offset=offset, job_id=7 + offset, state=state, reason=reason, nodes=nodes,
                     node_count=1, partition="debug", name="relax-st", submit_time=1, start_time=int(time.time()),
                     end_time=None, time_limit_s=600)


def with_comps(monkeypatch, *comps):
    monkeypatch.setattr(status.slurm, "job_components", lambda job_id, name=None: list(comps))


def test_slurm_running_joins_state_json(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)
    write_json(rd.state, {"state": "RUNNING", "step": 3, "total_steps": 10, "attempt": 0,
                          "roles": {"actor": {"phase": "train", "nodes": ["node1", "node2"], "ranks": 2,
                                              "last_heartbeat": time.time() - 2}}})
    with_comps(monkeypatch, comp(0, "RUNNING", nodes="node[1-2]"), comp(1, "RUNNING", nodes="node3"))
    info = status.collect(rd)
    assert info["state"] == "RUNNING" and info["step"] == 3 and info["total_steps"] == 10
    assert [c["label"] for c in info["components"]] == ["7+0", "7+1"]
    assert info["components"][0]["roles"] == ["actor", "reference"]  # reference shares the actor's nodes
    assert info["roles"]["actor"]["phase"] == "train" and 1 <= info["roles"]["actor"]["heartbeat_age_s"] < 10
    assert info["roles"]["rollout"]["het_group"] == 1 and info["roles"]["reference"]["shared"] is True
    assert 590 <= info["time_left_s"] <= 600
    out = io.StringIO()
    Console(file=out, width=140).print(status.render(info))
    assert "RUNNING" in out.getvalue() and "train" in out.getvalue()


def test_the_engine_registry_is_shown_and_listed_in_json(tmp_path, monkeypatch):
    from relax_hpc.controller.engines import EngineRegistry

    reg = EngineRegistry()
    reg.add("engine0", "http://node3:30000", node="node3", pid=5, job_id="8", step_id="0", state="ready",
            weight_version="3")
    reg.add("engine1", "http://node3:30001", node="node3", pid=6, job_id="8", step_id="0", state="ready")
    reg.mark_dead("engine1", "connection refused")
    rd = run_dir(tmp_path)
    write_json(rd.state, {"state": "RUNNING", "step": 3, "engines": reg.to_state()})
    with_comps(monkeypatch, comp(0, "RUNNING"), comp(1, "RUNNING"))
    info = status.collect(rd)
    assert [(e["name"], e["state"], e["weight_version"], e["origin"], e["job_id"]) for e in info["engines"]] == [
        ("engine0", "ready", "3", "initial", "8"), ("engine1", "dead", None, "initial", "8")]
    json.dumps(info)  # relax-status --json prints it
    out = io.StringIO()
    Console(file=out, width=160).print(status.render(info))
    text = out.getvalue()
    assert "engine0" in text and "8.0" in text and "dead (connection refused)" in text


def test_pending_reason(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)
    with_comps(monkeypatch, comp(0, "PENDING", "Resources", None), comp(1, "PENDING", "Resources", None))
    info = status.collect(rd)
    assert info["state"] == "PENDING" and info["reason"] == "Resources"
    assert info["components"][1]["reason"] == "Resources"


def test_failed_reason_comes_from_the_controller(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)
    write_json(rd.state, {"state": "FAILED", "reason": "rollout rank 0 on node3 failed: OOM"})
    with_comps(monkeypatch, comp(0, "FAILED"), comp(1, "COMPLETED"))
    info = status.collect(rd)
    assert info["state"] == "FAILED" and "OOM" in info["reason"]


def test_clean_exit_but_failed_run_is_failed(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)
    write_json(rd.state, {"state": "FAILED", "reason": "x"})
    with_comps(monkeypatch, comp(0, "COMPLETED"), comp(1, "COMPLETED"))
    assert status.collect(rd)["state"] == "FAILED"


def test_cancelled_says_so(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)
    write_json(rd.path / "cancel.json", {"requested_at": 1})
    with_comps(monkeypatch, comp(0, "CANCELLED", "Resources"), comp(1, "CANCELLED", "Resources"))
    info = status.collect(rd)
    assert info["state"] == "CANCELLED" and info["reason"] == "cancelled by relax-cancel"


def test_slurm_forgot_the_job(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)
    with_comps(monkeypatch)
    info = status.collect(rd)
    assert info["state"] == "UNKNOWN" and "sacct" in info["reason"]
    assert [c["het_group"] for c in info["components"]] == [0, 1]  # still one entry per component
    write_json(rd.state, {"state": "COMPLETED"})
    assert status.collect(rd)["state"] == "COMPLETED"


def test_slurm_unreachable(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)

    def boom(job_id, name=None):
        raise status.slurm.SlurmError("squeue: not found")
    monkeypatch.setattr(status.slurm, "job_components", boom)
    info = status.collect(rd)
    assert info["state"] == "UNKNOWN" and "cannot ask Slurm" in info["reason"]


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


def test_local_running_then_completed(tmp_path, sleeper):
    rd = run_dir(tmp_path, "local", job_id=str(sleeper.pid), pid=sleeper.pid,
                 pid_start=localproc.start_ticks(sleeper.pid))
    write_json(rd.state, {"state": "RUNNING", "step": 1, "total_steps": 2, "roles": {"actor": {"phase": "train"}}})
    info = status.collect(rd)
    assert info["state"] == "RUNNING" and info["executor"] == "local"
    assert [c["label"] for c in info["components"]] == ["local", "local"]
    sleeper.kill()
    sleeper.wait()
    write_json(rd.state, {"state": "COMPLETED"})
    assert status.collect(rd)["state"] == "COMPLETED"


def test_local_died_without_a_word_is_failed(tmp_path, sleeper):
    rd = run_dir(tmp_path, "local", job_id=str(sleeper.pid), pid=sleeper.pid,
                 pid_start=localproc.start_ticks(sleeper.pid))
    sleeper.kill()
    sleeper.wait()
    info = status.collect(rd)
    assert info["state"] == "FAILED" and "without a result" in info["reason"]
    write_json(rd.path / "cancel.json", {"requested_at": 1})
    assert status.collect(rd)["state"] == "CANCELLED"


def test_a_full_disk_is_named_in_the_reason_of_a_run_it_ended(tmp_path, sleeper, small_disk):
    """A controller that could not write its end (state.json still says RUNNING): relax-status names the full
    disk instead of "ended without a result"; one that could, says it itself."""
    disk = small_disk(8)
    rd = run_dir(disk.path, "local", job_id=str(sleeper.pid), pid=sleeper.pid,
                 pid_start=localproc.start_ticks(sleeper.pid))
    write_json(rd.state, {"state": "RUNNING", "step": 2})
    sleeper.kill()
    sleeper.wait()
    disk.fill()
    info = status.collect(rd)
    assert info["state"] == "FAILED" and f"no space left on {disk.path}" in info["reason"], info["reason"]
    assert f"relax-submit --resume {rd.path}" in info["reason"]
    disk.free()
    assert "without a result" in status.collect(rd)["reason"]
    reason = f"controller failed: no space left on {disk.path} (writing {rd.state}). Fix: ..."
    write_json(rd.state, {"state": "FAILED", "reason": reason, "last_failure": reason})
    info = status.collect(rd)
    assert info["state"] == "FAILED" and info["reason"] == reason
    out = io.StringIO()
    Console(file=out, width=400).print(status.render(info))
    assert f"reason: {reason}" in out.getvalue()


def test_local_pid_reuse_is_not_mistaken_for_the_run(tmp_path, sleeper):
    rd = run_dir(tmp_path, "local", job_id=str(sleeper.pid), pid=sleeper.pid,
                 pid_start=localproc.start_ticks(sleeper.pid) - 1)  # recorded start differs: another process
    assert status.collect(rd)["state"] == "FAILED"


# ----------------------------------------------------------------------------------- --audit ---

AUDIT_RECIPE = {"run": {"name": "st"}, "algorithm": {"use_kl_loss": True},
                "roles": {"actor": {"nodes": 1}, "rollout": {"nodes": 1},
                          "reference": {"enabled": True, "share_with": "actor", "nodes": 1}}}


def audited_run(tmp_path, finish: bool = True):
    """A run whose journal a real Broker wrote, with the training loop's tasks (train + reference, from the
    recipe): step 1 clean; step 2's first chunk truncated after its announce, quarantined at hand-out,
    the step regenerated and (with ``finish``) consumed by both tasks."""
    from relax_hpc.exchange import Broker, write_chunk

    rd = run_dir(tmp_path)
    write_private(rd.recipe, dump_recipe(recipe_from_dict(AUDIT_RECIPE)))
    root = rd.path / "exchange"
    b = Broker(root, tasks={"train": ["tokens"], "reference": ["tokens"]})
    fields = {"tokens": [[1, 2, 3], [4, 5]]}

    def put(step):  # as in a run: the rollout role writes at the seq the controller gave it, the controller announces
        ref = write_chunk(root, step, "rollout", b.next_seq("rollout"), fields)
        b.announce(ref)
        return ref

    b.start_step(1)
    put(1)
    b.end_step(1)
    for task in ("reference", "train"):
        b.ack(b.request(task, step=1, batch_size=10).id)
    b.start_step(2)
    bad = put(2)
    b.end_step(2)
    with open(bad.path, "r+b") as f:
        f.truncate(bad.size // 2)
    assert b.request("reference", step=2, batch_size=10) is None  # quarantined at hand-out
    b.regenerate(2, "quarantined")
    b.start_step(2)
    put(2)
    b.end_step(2)
    for task in ("reference", "train") if finish else ("reference",):
        b.ack(b.request(task, step=2, batch_size=10).id)
    b.close()
    return rd, bad


def test_audit_json_per_step_with_the_quarantined_chunk(tmp_path, capsys):
    from relax_hpc.launch.cli import status_main

    rd, bad = audited_run(tmp_path)
    assert status_main([str(rd.path), "--audit", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exactly_once"] is True and out["tasks"] == ["train", "reference"]
    assert [(s["step"], s["produced"], s["consumed"], s["quarantined"], s["regenerated"]) for s in out["steps"]] == [
        (1, 2, {"train": 2, "reference": 2}, [], 0), (2, 2, {"train": 2, "reference": 2}, [bad.id], 1)]
    assert status_main([str(rd.path), "--audit"]) == 0
    text = capsys.readouterr().out
    assert "exactly once: yes" in text  # (the table wraps on a narrow terminal: its cells are checked in JSON)


def test_audit_is_not_exactly_once_while_a_task_has_not_consumed_a_step(tmp_path, capsys):
    from relax_hpc.launch.cli import status_main

    rd, _ = audited_run(tmp_path, finish=False)
    assert status_main([str(rd.path), "--audit", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["exactly_once"] is False
    assert out["violations"] == ["step 2: 2 samples produced, 0 consumed by train"]
    assert out["steps"][1]["consumed"] == {"train": 0, "reference": 2}
