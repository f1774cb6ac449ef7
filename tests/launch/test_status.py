"""relax-status's join of Slurm (or the local process) with state.json, in Slurm's state words."""

from __future__ import annotations

import io
import json
import os
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
    monkeypatch.setattr(status.slurm, "job_components", lambda job_id, name=None, submitted_at=None: list(comps))


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


def test_a_log_line_with_brackets_is_shown_as_it_is_not_read_as_markup(tmp_path, monkeypatch):
    """A role's error quoting gloo (``[/pytorch/.../unbound_buffer.cc:78]``) once made relax-submit's view raise rich's
    MarkupError ("doesn't match any open tag") and exit 1 on Ctrl-C instead of cancelling."""
    rd = run_dir(tmp_path)
    err = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out [bold]"
    write_json(rd.state, {"state": "RUNNING", "step": 1, "total_steps": 2,
                          "roles": {"actor": {"phase": "train", "error": err}}})
    with_comps(monkeypatch, comp(0, "RUNNING", reason="[/x]"))
    out = io.StringIO()
    Console(file=out, width=400).print(status.render(status.collect(rd)))
    assert err in out.getvalue() and "[/x]" in out.getvalue()


def test_the_engine_registry_is_shown_and_listed_in_json(tmp_path, monkeypatch):
    from relax_hpc.controller.engines import EngineRegistry

    reg = EngineRegistry()
    reg.add("engine0", "http://node3:30000", node="node3", pid=5, job_id="8", step_id="0", state="ready",
            weight_version="3")
    reg.add("engine1", "http://node3:30001", node="node3", pid=6, job_id="8", step_id="0", state="ready")
    reg.mark_dead("engine1", "connection refused")
    rd = run_dir(tmp_path)
    teachers = {"teacher0": {"url": "http://node4:30000", "pid": 7, "node": "node4"}}  # OPD's (roles.teacher)
    write_json(rd.state, {"state": "RUNNING", "step": 3, "engines": reg.to_state(), "teachers": teachers})
    with_comps(monkeypatch, comp(0, "RUNNING"), comp(1, "RUNNING"))
    info = status.collect(rd)
    assert [(e["name"], e["state"], e["weight_version"], e["origin"], e["job_id"]) for e in info["engines"]] == [
        ("engine0", "ready", "3", "initial", "8"), ("engine1", "dead", None, "initial", "8")]
    assert info["teachers"] == [{"name": "teacher0", **teachers["teacher0"]}] and info["judges"] == []
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


def test_a_checkpoint_then_cancel_is_cancelled_though_slurm_saw_a_non_zero_exit(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)
    write_json(rd.path / "cancel.json", {"requested_at": 1, "by": "relax-cancel --checkpoint"})
    write_json(rd.state, {"state": "CANCELLED", "reason": "relax-cancel --checkpoint: stopped after a checkpoint"})
    with_comps(monkeypatch, comp(0, "FAILED", "NonZeroExitCode"), comp(1, "FAILED", "NonZeroExitCode"))
    info = status.collect(rd)
    assert info["state"] == "CANCELLED" and info["reason"] == "cancelled by relax-cancel"
    write_json(rd.state, {"state": "FAILED", "reason": "actor died"})  # a failure stays one
    assert status.collect(rd)["state"] == "FAILED"


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

    def boom(job_id, name=None, submitted_at=None):
        raise status.slurm.SlurmError("squeue: not found")
    monkeypatch.setattr(status.slurm, "job_components", boom)
    info = status.collect(rd)
    assert info["state"] == "UNKNOWN" and "cannot ask Slurm" in info["reason"]


# ---------------------------------------------------------------------------------- progress ---

def metrics_rows(rd, steps, t0=1000.0, dt=2.0, reward=lambda s: s / 100):
    """metrics.jsonl as the controller writes it (relax_hpc.ops.metrics): step 0's eval row (no reward), then one
    row per step, ``dt`` seconds apart."""
    rows = [{"step": 0, "time": t0, "eval/arith": 0.1}]
    rows += [{"step": s, "time": t0 + dt * s, "rollout/raw_reward": reward(s), "perf/step_time": 1.5} for s in steps]
    (rd.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_progress_reward_step_time_and_time_left(tmp_path, monkeypatch):
    """The step, the last step's reward and the mean of the last 10, the time per step (wall time between the rows,
    not perf/step_time) and the time left at that pace: in --json, the rich view and the log line."""
    rd = run_dir(tmp_path)
    write_json(rd.state, {"state": "RUNNING", "step": 12, "total_steps": 100, "reward": 0.12,
                          "last_failure": "rollout rank 0 on node3 failed: OOM",
                          "roles": {"actor": {"phase": "train"}, "rollout": {"phase": "generate"}}})
    metrics_rows(rd, range(1, 13))
    with_comps(monkeypatch, comp(0, "RUNNING"), comp(1, "RUNNING"))
    info = status.collect(rd)
    prog = info["progress"]
    assert prog["reward_last"] == 0.12 and prog["reward_window"] == 10 and prog["metrics_step"] == 12
    assert prog["reward_mean"] == pytest.approx(sum(range(3, 13)) / 1000)  # steps 3..12
    assert prog["step_time_s"] == pytest.approx(2.0) and prog["eta_s"] == pytest.approx(88 * 2.0)
    json.dumps(info)
    words = ["step 12/100", "reward 0.120 (mean 0.075 over 10 steps)", "2.0s/step", "2m56s left"]
    out = io.StringIO()
    Console(file=out, width=160).print(status.render(info))
    assert all(w in out.getvalue() for w in words), out.getvalue()
    assert "12%" in out.getvalue() and "last failure: rollout rank 0" in out.getvalue()
    line = status.summary_line(info)
    assert all(w in line for w in words) and "actor=train reference=- rollout=generate" in line
    assert line.endswith("last failure: rollout rank 0 on node3 failed: OOM")

    write_json(rd.state, {"state": "COMPLETED", "step": 100, "total_steps": 100})
    metrics_rows(rd, range(1, 101))
    with_comps(monkeypatch, comp(0, "COMPLETED"), comp(1, "COMPLETED"))
    prog = status.collect(rd)["progress"]
    assert prog["eta_s"] is None and prog["reward_last"] == 1.0  # an ended run has no time left


def test_progress_reads_the_controller_s_own_metrics_file(tmp_path, monkeypatch):
    """What RunMetrics writes (an eval amended into step 0, rewards, a NaN one), a cut last line, and no file."""
    from relax_hpc.ops.metrics import REWARD, RunMetrics

    rd = run_dir(tmp_path)
    write_json(rd.state, {"state": "RUNNING", "step": 3, "total_steps": 10})
    with_comps(monkeypatch, comp(0, "RUNNING"), comp(1, "RUNNING"))
    assert status.collect(rd)["progress"]["reward_last"] is None  # no metrics.jsonl yet
    m = RunMetrics(rd.path, tensorboard=False)
    m.log(1, {REWARD: 0.25, "train/loss": 1.0})
    m.amend(0, {"eval/arith": 0.1})
    m.log(2, {REWARD: 0.75})
    m.log(3, {REWARD: float("nan")})  # a NaN reward stays in the metrics; it is not a number to average
    m.close()
    with open(rd.path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "time": 12')  # a kill mid-write
    prog = status.collect(rd)["progress"]
    assert prog["reward_last"] == 0.75 and prog["reward_mean"] == 0.5 and prog["reward_window"] == 2
    assert prog["step_time_s"] is not None and prog["step_time_s"] >= 0 and prog["eta_s"] is not None


def test_a_finished_run_s_engines_are_stopped_and_its_heartbeats_not_aged(tmp_path, monkeypatch):
    """state.json keeps the engines as last seen (ready, with a URL): once the run ended they are ``stopped``, their
    URL is not shown, and no heartbeat age grows; while it runs they are what the controller says."""
    rd = run_dir(tmp_path)
    doc = {"step": 3, "total_steps": 3, "roles": {"rollout": {"phase": "done", "last_heartbeat": time.time() - 3600}},
           "engines": {"engine0": {"url": "http://node3:30000", "state": "ready", "node": "node3"},
                       "engine1": {"url": "http://node3:30001", "state": "dead", "dead": "connection refused"}}}
    write_json(rd.state, {"state": "RUNNING", **doc})
    with_comps(monkeypatch, comp(0, "RUNNING"), comp(1, "RUNNING"))
    info = status.collect(rd)
    assert [e["state"] for e in info["engines"]] == ["ready", "dead"]
    assert info["roles"]["rollout"]["heartbeat_age_s"] >= 3600
    write_json(rd.state, {"state": "COMPLETED", **doc})
    with_comps(monkeypatch, comp(0, "COMPLETED"), comp(1, "COMPLETED"))
    info = status.collect(rd)
    assert [(e["state"], e.get("last_state")) for e in info["engines"]] == [("stopped", "ready"), ("dead", None)]
    assert info["roles"]["rollout"]["heartbeat_age_s"] is None
    out = io.StringIO()
    Console(file=out, width=160).print(status.render(info))
    assert "stopped" in out.getvalue() and "http://node3:30000" not in out.getvalue()
    assert "ago" not in out.getvalue()


def test_the_code_a_run_ran_is_in_its_status(tmp_path, monkeypatch, capsys):
    """relax-submit's provenance.json (relax_hpc's version, the checkout's commit): in --json and the view."""
    import relax_hpc
    from relax_hpc.launch import provenance
    from relax_hpc.launch.cli import status_main

    rd = run_dir(tmp_path)
    write_json(rd.state, {"state": "COMPLETED"})
    with_comps(monkeypatch, comp(0, "COMPLETED"), comp(1, "COMPLETED"))
    assert status.collect(rd)["provenance"] is None  # a run submitted before runs recorded it
    doc = provenance.record(rd)
    assert status_main([str(rd.path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["provenance"]
    assert got["relax_hpc"] == relax_hpc.__version__ and got["commit"] == doc["commit"]
    assert status_main([str(rd.path)]) == 0
    assert f"code: relax_hpc {relax_hpc.__version__}" in capsys.readouterr().out


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


# ------------------------------------------------------------------------------- damaged run directories ---

def _unreadable(path):
    """A state.json that cannot be read: mode 000 (a user's own file made unreadable); as root, who reads any
    mode, a link that loops on itself (ELOOP), unreadable for everyone."""
    if os.geteuid() != 0:
        path.chmod(0)
        return
    path.unlink()
    path.symlink_to(path.name)


def _truncated(path):
    path.write_bytes(path.read_bytes()[:25])


DAMAGE = {  # name: (what is done to the run directory, the file named, words the line must have)
    "binary garbage": (lambda rd: rd.state.write_bytes(b"\x00\xff\xfe\x93garbage\x80"), "state.json",
                       "not UTF-8"),
    "JSON array": (lambda rd: rd.state.write_text("[1, 2, 3]"), "state.json", "holds an array where a JSON object"),
    "JSON string": (lambda rd: rd.state.write_text('"COMPLETED"'), "state.json", "holds a string"),
    "JSON number": (lambda rd: rd.state.write_text("42"), "state.json", "holds a number"),
    "wrong-typed fields": (lambda rd: write_json(rd.state, {"state": "COMPLETED", "roles": ["actor"], "step": "two",
                                                            "scale": [{"id": "s1"}], "engines": {"e0": 3}}),
                           "state.json", "field 'roles' is ['actor'], not an object of objects"),
    "unreadable file": (lambda rd: _unreadable(rd.state), "state.json", "cannot be read"),
    "a directory in its place": (lambda rd: (rd.state.unlink(), rd.state.mkdir()), "state.json",
                                 "is a directory, not a regular file"),
    "garbage job.json": (lambda rd: rd.job.write_bytes(b"{\"job_id\": \x01\x02"), "job.json", "not valid JSON"),
    "truncated state.json": (lambda rd: _truncated(rd.state), "state.json",
                             "ends early: truncated?"),
    "empty state.json": (lambda rd: rd.state.write_bytes(b""), "state.json", "is empty"),
    "missing state.json": (lambda rd: rd.state.unlink(), "state.json",
                           "missing, though the local process"),
    "a FIFO in its place": (lambda rd: (rd.state.unlink(), os.mkfifo(rd.state)), "state.json",
                            "is a FIFO (named pipe), not a regular file"),
}


@pytest.fixture
def completed_local_run(tmp_path):
    """A local run that ended well: its process gone, submitit's result "success", state.json COMPLETED."""
    from submitit.core import utils as submitit_utils

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    start = localproc.start_ticks(dead.pid)
    dead.wait()
    rd = run_dir(tmp_path, "local", job_id=str(dead.pid), pid=dead.pid, pid_start=start or 1,
                 submitit_folder=str(tmp_path / "runs" / "submitit"))
    pickle = submitit_utils.JobPaths(tmp_path / "runs" / "submitit", job_id=str(dead.pid), task_id=0).result_pickle
    pickle.parent.mkdir(parents=True, exist_ok=True)
    submitit_utils.cloudpickle_dump(("success", None), pickle)
    write_json(rd.state, {"state": "COMPLETED", "step": 2, "total_steps": 2, "attempt": 0,
                          "roles": {"actor": {"phase": "done"}}})
    return rd


def test_a_completed_local_run_reads_completed(completed_local_run, capsys):
    from relax_hpc.launch.cli import status_main

    assert status_main([str(completed_local_run.path)]) == 0
    assert "COMPLETED" in capsys.readouterr().out
    assert status_main([str(completed_local_run.path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "COMPLETED" and out["error"] is None


@pytest.mark.timeout(60)  # a FIFO that blocks the read fails here instead of hanging the suite
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_run_directory_is_one_line_naming_the_file_and_a_non_zero_exit(completed_local_run, capsys, case):
    """The 12 damaged run directories of issue 28: relax-status prints one line on stderr naming the file and what
    is wrong, nothing else, exits non-zero, never hangs, and never says COMPLETED (submitit's "success" says only
    that the process returned), with --json and --watch too."""
    from relax_hpc.launch.cli import status_main

    rd = completed_local_run
    damage, name, words = DAMAGE[case]
    damage(rd)
    for argv in ([str(rd.path)], [str(rd.path), "--watch", "--interval", "0.01"], [rd.name, "--runs-root",
                                                                                  str(rd.path.parent)]):
        code = status_main(argv)
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert code != 0 and out == "" and len(lines) == 1, (code, out, err)
        assert lines[0].startswith(f"relax-status: {rd.path / name}: ") and words in lines[0], lines[0]
        assert "Traceback" not in err and "COMPLETED" not in err.replace("Slurm says the job COMPLETED", "")
    if name == "state.json":  # --json: the same line, and a status that says UNKNOWN with the reason
        assert status_main([str(rd.path), "--json"]) == 1
        out, err = capsys.readouterr()
        info = json.loads(out)
        assert info["state"] == "UNKNOWN" and info["error"] == info["reason"] == err.strip()[len("relax-status: "):]


def test_a_missing_state_json_with_no_result_or_an_error_still_says_what_was_read(completed_local_run):
    """Without state.json, a process that left no result, or raised, ended the run (FAILED, its last words);
    only a clean return is no evidence of how the run ended."""
    from submitit.core import utils as submitit_utils

    rd = completed_local_run
    rd.state.unlink()
    job = json.loads(rd.job.read_text())
    pickle = submitit_utils.JobPaths(job["submitit_folder"], job_id=job["job_id"], task_id=0).result_pickle
    submitit_utils.cloudpickle_dump(("error", "Traceback ...\nValueError: data.path is not set"), pickle)
    info = status.collect(rd)
    assert info["state"] == "FAILED" and info["reason"] == "ValueError: data.path is not set" and not info["error"]
    pickle.unlink()
    info = status.collect(rd)
    assert info["state"] == "FAILED" and "without a result" in info["reason"] and not info["error"]
    os.mkfifo(pickle)  # the result's place taken by a FIFO: read as unreadable, not waited on
    assert status.collect(rd)["state"] == "FAILED"


def test_slurm_completed_without_state_json_is_unknown_not_completed(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)
    with_comps(monkeypatch, comp(0, "RUNNING"), comp(1, "RUNNING"))
    assert status.collect(rd)["state"] == "RUNNING"  # before the controller writes: no error
    with_comps(monkeypatch, comp(0, "COMPLETED"), comp(1, "COMPLETED"))
    info = status.collect(rd)
    assert info["state"] == "UNKNOWN" and info["error"].startswith(f"{rd.state}: missing, though Slurm says")


@pytest.mark.parametrize("job, words", [
    ({"job_id": None}, "field 'job_id' is missing"),
    ({"job_id": "7; rm -rf ~"}, "field 'job_id' is '7; rm -rf ~', not a Slurm job id (digits)"),
    ({"job_id": "7; rm", "executor": None}, "field 'job_id' is '7; rm', not a Slurm job id (digits)"),  # null: Slurm
    ({"executor": "cloud"}, "field 'executor' is 'cloud', not \"slurm\" or \"local\""),
    ({"executor": "local", "pid": "123"}, "field 'pid' is '123', not a process id"),
    ({"executor": "local"}, "field 'pid' is missing"),
    ({"submitted_at": "yesterday"}, "field 'submitted_at' is 'yesterday', not a number"),
])
def test_a_job_json_with_a_wrong_field_is_named(tmp_path, capsys, job, words):
    from relax_hpc.launch.cli import status_main

    rd = run_dir(tmp_path, **job)
    code = status_main([str(rd.path)])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and f"{rd.job}: " in err and words in err, err
