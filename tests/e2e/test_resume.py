"""Deterministic resume, the promise: a run interrupted and brought back ends with the same per-step losses
and rewards as the same run uninterrupted.

The interrupted run goes through the real local path (:func:`interrupt.interrupted_run`: ``relax-submit --local
--detach``, whose runner starts the controller again when it asks to be requeued) and is hit twice:

1. SIGUSR2 to the controller (what Slurm sends before the time limit): the step in flight finishes, a
   checkpoint is saved, the attempt ends REQUEUED and the runner starts attempt 1, which resumes from it;
2. ``kill -9`` of the actor rank in attempt 1: the controller restarts every step from the latest periodic
   checkpoint (``checkpoint.interval``), in place.

The recipe is the mini-batch test's (:data:`interrupt.SHORT`: k updates per rollout step), so the reference, the
same recipe run straight through, is one run for both. Every step's training loss, policy-gradient loss, clip
fraction, KL, gradient norm and mean reward must match to 1e-6 (a requeued mini-batch run redoes its steps exactly
as the uninterrupted one did), each step must be logged exactly once (metrics.jsonl and TensorBoard), and
state.json must tell what happened (attempts, restarts, the failure, checkpoints).
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from relax_hpc.exchange.audit import audit, exactly_once
from relax_hpc.launch.cancel import CancelError, checkpoint_then_stop
from relax_hpc.launch.status import collect, is_final
from relax_hpc.rundir import RunDir

from . import interrupt
from .conftest import REPO, held_at, hold, metrics, quickstart_overrides, state, submit_slurm, tensorboard_tags, wait_until
from .interrupt import SHORT as SMALL
from .interrupt import STEPS, Hit

KEYS = ("train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/grad_norm", "rollout/raw_reward")


@pytest.fixture(scope="module")
def reference(uninterrupted) -> dict[int, dict]:
    """Per-step metrics of the run uninterrupted (shared with test_minibatch.py)."""
    return uninterrupted(*SMALL, steps=STEPS)


def same_steps(run: RunDir, want: dict[int, dict]) -> None:
    interrupt.same_steps(run, want, KEYS, STEPS)
    tags = tensorboard_tags(run.path / "tensorboard")
    assert [s for s, _ in tags["train/loss"]] == list(range(1, STEPS + 1))
    assert [v for _, v in tags["train/loss"]] == pytest.approx([want[s]["train/loss"] for s in range(1, STEPS + 1)],
                                                               abs=1e-6)


class Inbox(http.server.BaseHTTPRequestHandler):
    """A real Apprise target: Apprise's JSON notifier POSTs here (``json://127.0.0.1:PORT/``)."""
    got: list[dict] = []

    def do_POST(self):
        self.got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def inbox(monkeypatch):
    Inbox.got = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Inbox)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("RELAX_NOTIFY_URLS", f"json://127.0.0.1:{srv.server_address[1]}/")
    yield Inbox.got
    srv.shutdown()


@pytest.mark.slow
def test_an_interrupted_run_ends_as_if_never_interrupted(reference, tmp_path, tiny_model, local_executor, inbox):
    # 1. the time-limit warning once step 1 is done: checkpoint 1, attempt 1 resumes from it; 2. kill -9 of the actor
    # rank at step 3, a step after the periodic checkpoint of step 2: every step restarts from it
    run = interrupt.interrupted_run(tmp_path, tiny_model, SMALL, (Hit("requeue", hold=1, checkpoint=1),
                                                                  Hit("kill", hold=3, checkpoint=2)))
    st = state(run)
    assert "actor" in st["last_failure"] and ("-9" in st["last_failure"] or "signal" in st["last_failure"].lower()
                                              or "exited" in st["last_failure"])
    events = [e["event"] for e in st["events"]]
    for ev in ("started", "checkpoint", "requeued", "resumed", "step_restarted", "finished"):
        assert ev in events, (ev, events)
    # each event reached the notification target, with the run's name and the reason
    told = {m["title"].rsplit(": ", 1)[1]: m for m in inbox if run.name in m["title"]}
    for ev in ("started", "checkpoint", "requeued", "resumed", "step_restarted", "finished"):
        assert ev in told and run.name in told[ev]["message"], (ev, sorted(told))
    assert "SIGUSR2" in told["requeued"]["message"] and "code -9" in told["step_restarted"]["message"]
    assert told["step_restarted"]["type"] == "warning" and told["finished"]["type"] == "success"

    same_steps(run, reference)
    assert sorted(a for a, s in audit(run.path / "exchange" / "journal.jsonl").items() if s.cleared) == \
        list(range(1, STEPS + 1))


@pytest.mark.slurm
@pytest.mark.slow
def test_a_requeued_slurm_job_resumes_and_ends_as_if_never_interrupted(reference, slurm_cluster, tmp_path,
                                                                        tiny_model):
    """The warning signal to the batch shell (``scancel -b -s USR2``): checkpoint, ``scontrol requeue`` (same job
    id, SLURM_RESTART_COUNT=1), resume; then preemption by a job in the higher-priority partition ``urgent``
    (SIGTERM, KillWait 5 s, Slurm requeues: SLURM_RESTART_COUNT=2), resume from the last periodic
    checkpoint. The steps match the uninterrupted local run."""
    recipe = REPO / "recipes" / "quickstart-slurm-colocate.yaml"
    sub = submit_slurm(recipe, tmp_path, slurm_cluster.env, quickstart_overrides(tiny_model, tmp_path / "runs", *SMALL))
    run = RunDir(Path(sub["run_dir"]))
    hold(run, 1)  # before the job has even started its engines
    try:
        wait_until(lambda: held_at(run, 1), 600, every=0.2, what="step 1 done, the run held")
        subprocess.run(["scancel", "-b", "-s", "USR2", sub["job_id"]], check=True, env=slurm_cluster.env)
        wait_until(lambda: state(run).get("attempt") == 1 and held_at(run, 1), 600, every=0.2,
                   what="attempt 1 running")
        hold(run, 3)  # the periodic checkpoint of step 2, then step 3 (lost to the preemption, done again)
        wait_until(lambda: held_at(run, 3), 600, every=0.2, what="step 3 done, the run held")
        assert state(run)["last_checkpoint"]["step"] == 2
        subprocess.run(["sbatch", "-p", "urgent", "-N", "4", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 2"],
                       check=True, env=slurm_cluster.env, capture_output=True)
        wait_until(lambda: state(run).get("attempt") == 2 and held_at(run, 3), 900, every=0.2,
                   what="attempt 2 running, held")
        (run.path / "pause").unlink()
        wait_until(lambda: state(run).get("state") == "COMPLETED", 900, every=0.5, what="attempt 2 completed")
    finally:
        if state(run).get("state") != "COMPLETED":
            subprocess.run(["scancel", sub["job_id"]], env=slurm_cluster.env)
    st = state(run)
    assert st["slurm_restart_count"] == 2 and st["job_id"] == sub["job_id"]
    assert [h["state"] for h in st["history"][-2:]] == ["REQUEUED", "CANCELLED"]
    assert "SIGTERM" in st["history"][-1]["reason"]
    events = [e["event"] for e in st["events"]]
    assert events.count("resumed") == 2 and "preempted" in events and "requeued" in events
    same_steps(run, reference)
    assert exactly_once(run.path / "exchange" / "journal.jsonl", ["train"]) == []


def trained_exactly_once(run: RunDir, upto: int) -> list[str]:
    """The journal audit's violations for steps 1..``upto`` (a run stopped with a checkpoint may have generated
    the next step, never trained: a resume voids and makes it again)."""
    bad = exactly_once(run.path / "exchange" / "journal.jsonl", ["train"])
    return [v for v in bad if not v.startswith("step ") or int(v.split()[1].rstrip(":")) <= upto]


def ended(run: RunDir) -> bool:
    """The run's job has left the queue too (relax-status's view), not only its controller's state."""
    return is_final(collect(run))


def stop_with_a_checkpoint(run: RunDir, after_step: int, timeout: float = 900) -> dict:
    """``relax-cancel --checkpoint`` once the run has trained past ``after_step``; returns the final state.
    A time-limit warning may win the race for the attempt in flight (it ends REQUEUED instead): ask the next
    attempt again."""
    deadline = time.monotonic() + timeout
    while True:
        wait_until(lambda: state(run).get("state") == "RUNNING" and state(run).get("step", 0) > after_step,
                   max(1.0, deadline - time.monotonic()), every=0.5, what=f"a step after {after_step}")
        try:
            out = checkpoint_then_stop(run, "checkpoint_cancel", wait_s=max(1.0, deadline - time.monotonic()))
        except CancelError:  # the attempt ended between our look and the message: ask the next one
            continue
        if out["state"] == "CANCELLED":
            wait_until(lambda: ended(run), max(1.0, deadline - time.monotonic()), every=1.0, what="the job's end")
            return state(run)
        after_step = state(run).get("step", 0)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_time_limited_job_checkpoints_before_the_kill_and_goes_on(slurm_cluster, tmp_path, tiny_model):
    """A real time limit (slurm.time 2 min, the warning 80 s before it; Slurm sends it early by up to a
    minute): every attempt checkpoints on the warning and requeues itself before the limit kills it (a
    TIMEOUT is never requeued by Slurm). The run has more steps than it will ever do, so the warning always
    comes first; once an attempt after a requeue has trained a step, relax-cancel --checkpoint ends it. No
    step is lost or logged twice."""
    recipe = REPO / "recipes" / "quickstart-slurm-colocate.yaml"
    sub = submit_slurm(recipe, tmp_path, slurm_cluster.env, quickstart_overrides(
        tiny_model, tmp_path / "runs", "run.steps=100000", "slurm.time=00:02:00", "slurm.signal_lead_s=80",
        "slurm.max_requeues=15", "rollout.rollout_batch_size=8"))
    run = RunDir(Path(sub["run_dir"]))
    try:
        wait_until(lambda: state(run).get("attempt", 0) >= 1, 600, every=0.5, what="a requeued attempt")
        st = stop_with_a_checkpoint(run, after_step=state(run)["history"][-1]["step"])
    finally:
        if state(run).get("state") in ("RUNNING", "REQUEUED"):
            subprocess.run(["scancel", sub["job_id"]], env=slurm_cluster.env)
    assert st["state"] == "CANCELLED" and "relax-cancel --checkpoint" in st["reason"], st.get("reason")
    assert st["attempt"] >= 1 and st["slurm_restart_count"] == st["attempt"]  # requeued by Slurm, no continuation
    ends = {h["attempt"]: h for h in st["history"]}  # each earlier attempt's last entry: how it ended
    assert sorted(ends) == list(range(st["attempt"]))
    assert all(h["state"] == "REQUEUED" and "SIGUSR2" in h["reason"] for h in ends.values()), st["history"]
    assert st["last_checkpoint"]["step"] == st["step"]
    assert [r["step"] for r in metrics(run)] == list(range(1, st["step"] + 1))
    assert trained_exactly_once(run, st["step"]) == []


@pytest.mark.slurm
@pytest.mark.slow
def test_requeue_refused_cancel_and_resume_on_slurm(slurm_cluster, tmp_path, tiny_model):
    """The recovery paths an operator drives, on the dev cluster, in one run that would train for ever:
    ``relax-cancel --requeue`` on a job Slurm will not requeue (``--no-requeue``): a continuation job takes the
    run on; ``relax-cancel --checkpoint`` ends it CANCELLED; ``relax-submit --resume`` brings it back as a
    new job, from the checkpoint. No step is lost or logged twice."""
    recipe = REPO / "recipes" / "quickstart-slurm-colocate.yaml"
    sub = submit_slurm(recipe, tmp_path, slurm_cluster.env, quickstart_overrides(
        tiny_model, tmp_path / "runs", "run.steps=100000", "rollout.rollout_batch_size=8",
        "slurm.sbatch_extra=[--no-requeue]"))
    run = RunDir(Path(sub["run_dir"]))
    jobs = [sub["job_id"]]
    try:
        wait_until(lambda: state(run).get("step", 0) >= 2, 600, every=0.5, what="step 2")
        # the engine on the cluster serves only callers with the run's API key
        url = state(run)["engines"]["engine0"]["url"]
        assert httpx.get(f"{url}/server_info", timeout=30).status_code == 401
        assert httpx.get(f"{url}/server_info", timeout=30,
                         headers={"Authorization": f"Bearer {run.api_key()}"}).status_code == 200
        out = checkpoint_then_stop(run, "checkpoint_requeue", wait_s=300)
        assert out["state"] == "REQUEUED", out
        job = wait_until(lambda: run.read_json(run.job, {}).get("previous_job_ids") and run.read_json(run.job), 120,
                         what="the continuation job")
        jobs.append(job["job_id"])
        assert job["previous_job_ids"] == [sub["job_id"]]
        wait_until(lambda: state(run).get("attempt") == 1, 600, every=0.5, what="attempt 1")
        st = stop_with_a_checkpoint(run, after_step=out["step"])
        cancelled_at = st["step"]
        p = subprocess.run([str(REPO / ".venv" / "bin" / "relax-submit"), "--json", "--resume", str(run.path)],
                           capture_output=True, text=True, cwd=tmp_path, env=slurm_cluster.env, timeout=120)
        assert p.returncode == 0, p.stderr
        jobs.append(json.loads(p.stdout)["job_id"])
        wait_until(lambda: state(run).get("attempt") == 2, 600, every=0.5, what="the resumed attempt")
        st = stop_with_a_checkpoint(run, after_step=cancelled_at)
    finally:
        if state(run).get("state") in ("RUNNING", "REQUEUED"):
            subprocess.run(["scancel", *jobs], env=slurm_cluster.env)
    assert "scontrol requeue" in (run.logs / "controller.log").read_text()  # it was asked, and refused
    assert [h["state"] for h in st["history"]] == ["REQUEUED", "CANCELLED"]
    assert st["job_id"] == jobs[2] and len(set(jobs)) == 3
    assert [e["event"] for e in st["events"]].count("resumed") == 2
    assert [r["step"] for r in metrics(run)] == list(range(1, st["step"] + 1))
    assert trained_exactly_once(run, st["step"]) == []
