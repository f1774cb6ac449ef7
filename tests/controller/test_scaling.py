"""Scale operations as the controller decides them (relax_hpc.controller.elastic): absolute targets, one at a time,
the run's own engines protected, drains that wait for the tasks holding an engine, and the question/answer path
over the real control socket."""

from __future__ import annotations

import threading
import time

import pytest

from ctl_helpers import TOKEN, make_run
from relax_hpc.backends import LocalBackend
from relax_hpc.controller import channel as channel_mod
from relax_hpc.controller.channel import Channel
from relax_hpc.controller.elastic import Elastic
from relax_hpc.controller.engines import EngineRegistry
from relax_hpc.controller.protocol import Client
from relax_hpc.controller.state import RunState
from relax_hpc.launch import attach
from relax_hpc.recipe import load_recipe, role_steps


@pytest.fixture
def ch():
    c = Channel(TOKEN, bind_host="127.0.0.1")
    yield c
    c.close()


@pytest.fixture
def el(tmp_path, ch):
    run = make_run(tmp_path)
    recipe = load_recipe(run.recipe)
    state = RunState(run, recipe, role_steps(recipe), LocalBackend(), env={})
    reg = EngineRegistry()
    reg.add("engine0", "http://127.0.0.1:1", origin="initial", state="ready", weight_version="3")
    held: set[str] = set()
    e = Elastic(recipe, run, reg, state, ch, LocalBackend(), holds=lambda n: n in held, on_change=lambda: None,
                assign=ch.assign, capacity=attach)
    e.started = True
    e.held = held  # the test's handle on what "a task in flight holds it" answers
    return e


def ask(el, target, **kw):
    return el.ask({"type": "scale", "target": target, "attach": kw.get("attach"), "cancel": kw.get("cancel"),
                   "by": "test"})


def test_refusals_name_the_reason(el):
    assert "expected +N" in ask(el, "two")["message"]
    r = ask(el, "-1")
    assert not r["accepted"] and "protected" in r["message"] and "at least 1" in r["message"]
    assert ask(el, "=1") == {"accepted": True, "op": None, "message": "already 1 engine(s); nothing to do"}
    r = ask(el, "+1", attach={})
    assert not r["accepted"] and "--attach needs Slurm" in r["message"]
    assert "no scale operation" in ask(el, "", cancel="s9")["message"]
    el.started = False
    assert "not ready for scaling" in ask(el, "+1")["message"]


def test_without_a_launcher_there_are_no_attached_jobs(el):
    el.cap = None  # engine steps are the controller's own to start; attached jobs need the launcher's sbatch
    assert "without a way to submit attached jobs" in ask(el, "+1", attach={})["message"]


def test_the_runs_own_engines_are_steps_started_again_when_they_die(el):
    """start_initial starts one step per engine; one that joins is ready at once (a fresh run: the model on disk is
    step 0's weights); one whose step exits before it joined is started again, rollout.engine.max_restarts times,
    then given up with its reason; one that dies later is dead, started again, and rejoins syncing."""
    import subprocess
    import sys

    started: list[tuple[str, str, str]] = []
    exits = {"engine1": 3}  # engine1's step fails every time it starts

    def start(recipe, run_dir, executor, name, origin, op, exclude=()):
        started.append((name, origin, op))
        code = exits.get(name)
        argv = [sys.executable, "-c", f"import sys; sys.exit({code})"] if code else ["sleep", "60"]
        return subprocess.Popen(argv, start_new_session=True)

    el.start_step = start
    el.registry.engines.clear()
    el.start_initial(["engine0", "engine1"], fresh=True)
    assert started == [("engine0", "initial", "initial"), ("engine1", "initial", "initial")] and el.initial_pending()
    el.joined({"name": "engine0", "op": "initial", "url": "http://127.0.0.1:5", "origin": "initial", "node": "n1",
               "pid": 1, "slurm_step": "7.3"})
    e0 = el.registry.engines["engine0"]
    assert (e0.state, e0.weight_version, e0.job_id, e0.step_id) == ("ready", "0", "7", "3")

    limit = el.recipe.rollout.engine.max_restarts
    deadline = time.monotonic() + 30
    while el.initial_pending() and time.monotonic() < deadline:  # each failed start is seen by tick
        el.tick()
        time.sleep(0.05)
    assert not el.initial_pending()
    assert [s for s in started if s[0] == "engine1"] == [("engine1", "initial", "initial")] + \
        [("engine1", "initial", "restart")] * limit
    assert "exited with code 3 before it joined" in el.failed_starts["engine1"]
    restarts = [ev["detail"] for ev in el.state.doc["events"] if ev["event"] == "engine_restart"]
    assert len(restarts) == limit and restarts[0].startswith("engine1 dead (its step exited with code 3")

    el.lost("engine0", "found dead: connection refused")  # a later death: dead, and a new step
    assert el.registry.engines["engine0"].state == "dead" and started[-1] == ("engine0", "initial", "restart")
    el.joined({"name": "engine0", "op": "restart", "url": "http://127.0.0.1:6", "origin": "initial", "node": "n1",
               "pid": 2, "slurm_step": "7.9"})
    e0 = el.registry.engines["engine0"]
    assert (e0.state, e0.restarts, e0.url) == ("syncing", 1, "http://127.0.0.1:6")  # current weights first
    el.finish()


def test_max_engines_bounds_scale_out(el):
    el.cfg.max_engines = 2
    r = ask(el, "=3")
    assert not r["accepted"] and "rollout.elastic.max_engines (2)" in r["message"]


def test_drain_waits_for_the_task_holding_the_engine_then_stops_it(el, ch):
    el.registry.add("step0", "http://127.0.0.1:2", origin="step", state="ready", weight_version="3")
    el.held.add("step0")  # a generate in flight was given step0
    r = ask(el, "=1")
    assert r["accepted"] and r["op"] == "s1", r
    assert el.registry.engines["step0"].state == "draining"
    assert el.run.read_json(el.run.draining) == ["step0"]  # the driver sends it nothing new
    assert not ask(el, "+1")["accepted"]  # one operation at a time
    assert "s1" in ask(el, "+1")["message"]

    host = Client("127.0.0.1", ch.port, TOKEN)
    el.tick()
    assert host.next_task("engine:step0", 0, wait_s=0.2) is None  # still held: no stop yet
    el.held.clear()  # the generate ended
    el.tick()
    task = host.next_task("engine:step0", 0, wait_s=2)
    assert task["kind"] == "stop" and task["why"] == "drained"
    host.task_done("engine:step0", 0, task["id"], {})
    for _, msg in ch.drain(2.0):
        if msg["type"] == "task_done":
            el.on_message(msg)
    host.close()
    el.tick()
    e = el.registry.engines["step0"]
    assert e.state == "gone" and e.left.startswith("drained in")
    op = el.ops[0]
    assert op.state == "done" and "step0" in op.gone and el.run.read_json(el.run.draining) == []
    assert [ev["event"] for ev in el.state.doc["events"]][-2:] == ["scale", "scale_done"]


def test_drain_timeout_stops_a_held_engine(el, ch):
    el.cfg.drain_timeout_s = 0.05
    el.registry.add("step0", "http://127.0.0.1:2", origin="step", state="ready", weight_version="3")
    el.held.add("step0")
    assert ask(el, "-1")["accepted"]
    time.sleep(0.1)
    el.tick()
    assert el.draining["step0"].cut and el.draining["step0"].stop_sent is not None
    el.lost("step0", "found dead: connection refused")  # the driver saw it die: gone, with the drain's reason
    assert el.registry.engines["step0"].state == "gone"
    assert "re-issued" in el.registry.engines["step0"].left


def test_an_engine_nobody_asked_for_is_told_to_stop(el, ch):
    el.joined({"name": "rogue", "url": "http://x", "pid": 1, "node": "n", "origin": "attached", "op": "s7",
               "slurm_step": "5.0"})
    assert "rogue" not in el.registry.engines
    assert ch._head("engine:rogue", 0.1)["kind"] == "stop"


def test_leaving_now_is_gone_and_leaving_later_drains(el):
    for n in ("a", "b"):
        el.registry.add(n, f"http://{n}", origin="attached", state="ready")
    el.left({"name": "a", "why": "SIGTERM", "now": True})
    el.left({"name": "b", "why": "SIGUSR2", "now": False})
    assert el.registry.engines["a"].state == "gone" and el.registry.engines["b"].state == "draining"
    assert any(ev["event"] == "engine_gone" for ev in el.state.doc["events"])


def test_a_question_is_answered_by_the_loop_over_the_socket(ch):
    def loop():
        for _, msg in ch.drain(5.0):
            if msg["type"] == "scale" and Channel.take(msg):
                Channel.answer(msg, {"accepted": True, "op": "s1", "message": f"got {msg['target']}"})

    t = threading.Thread(target=loop)
    t.start()
    c = Client("127.0.0.1", ch.port, TOKEN)
    assert c.scale("+2")["message"] == "got +2"
    c.close()
    t.join()


def test_a_question_nobody_takes_up_changes_nothing(ch, monkeypatch):
    monkeypatch.setattr(channel_mod, "ASK_WAIT_S", 0.2)
    c = Client("127.0.0.1", ch.port, TOKEN)
    reply = c.scale("+1")
    c.close()
    assert not reply["accepted"] and "nothing was changed" in reply["message"]
    late = [m for _, m in ch.drain(1.0) if m["type"] == "scale"]
    assert late and not Channel.take(late[0])  # the loop, late, must not act on it


def test_the_autoscaler_decides_on_streaks_within_its_bounds_and_cooldowns(el):
    from relax_hpc.controller.elastic import Autoscaler

    c = el.cfg.autoscale
    c.enabled, c.max, c.window, c.scale_out_cooldown_s, c.scale_in_cooldown_s = True, 2, 2, 0.0, 0.0
    a = Autoscaler(el)
    el.cfg.max_engines = 1  # decisions only: the ask is refused (rollout.elastic.max_engines), so no engine starts
    assert a.after_step(1, actor_wait=0.9, rollout_idle=0.0) is None  # one step is not a streak
    reply = a.after_step(2, actor_wait=0.9, rollout_idle=0.0)
    assert reply is not None and not reply["accepted"] and a.out_streak == 0  # asked (+1), and the streak restarts
    assert a.after_step(3, actor_wait=0.1, rollout_idle=0.0) is None  # under scale_out_wait_ratio (0.2)
    # scale-in: never below min (the engines the run started with: 1)
    assert a.after_step(4, actor_wait=0.0, rollout_idle=0.9) is None
    assert a.after_step(5, actor_wait=0.0, rollout_idle=0.9) is None and a.in_streak == 2
    el.registry.add("step0", "http://127.0.0.1:2", origin="step", state="ready", weight_version="5")
    reply = a.after_step(6, actor_wait=0.0, rollout_idle=0.9)
    assert reply["accepted"] and el.ops[-1].by.startswith("autoscaler (step 6: rollout sat idle")
    assert el.registry.engines["step0"].state == "draining"
    assert a.after_step(7, actor_wait=0.0, rollout_idle=0.9) is None  # an operation runs: nothing more
    c.max = 1
    el.ops[-1].state = "done"
    a.out_streak = 5
    assert a.after_step(8, actor_wait=0.9, rollout_idle=0.0) is None  # at max


def test_the_autoscaler_scales_out_on_the_request_queue(el):
    """With ``scale_out_queue_per_engine`` set, requests queued per engine are a scale-out signal of their own
    (the trainer need not wait); without it, the queue changes nothing."""
    from relax_hpc.controller.elastic import Autoscaler

    c = el.cfg.autoscale
    c.enabled, c.max, c.window, c.scale_out_cooldown_s = True, 3, 2, 0.0
    el.cfg.max_engines = 1  # decisions only (asks refused: no engine starts)
    asked, ask_ = [], el.ask
    el.ask = lambda m: (asked.append(m), ask_(m))[1]
    a = Autoscaler(el)
    assert a.after_step(1, actor_wait=0.0, rollout_idle=0.0, queue=50.0) is None and a.out_streak == 0  # off
    c.scale_out_queue_per_engine = 4.0
    assert a.after_step(2, actor_wait=0.0, rollout_idle=0.0, queue=6.0) is None and a.out_streak == 1
    assert a.after_step(3, actor_wait=0.0, rollout_idle=0.0, queue=None) is None and a.out_streak == 0  # not measured
    assert a.after_step(4, actor_wait=0.0, rollout_idle=0.0, queue=6.0) is None
    assert a.after_step(5, actor_wait=0.0, rollout_idle=0.0, queue=3.9) is None and a.out_streak == 0  # under it
    assert a.after_step(6, actor_wait=0.0, rollout_idle=0.0, queue=6.0) is None
    assert a.after_step(7, actor_wait=0.0, rollout_idle=0.0, queue=8.5) is not None
    assert [(m["target"], m["why"]) for m in asked] == [
        ("+1", "step 7: 8.5 requests per engine waited for a free slot, over 4, for 2 step(s)")]
    # a long queue while rollout sits idle at the staleness gate: the trainer is the bottleneck, no scale-out
    a.last_action, before = 0.0, len(asked)
    for n in (8, 9, 10):
        a.after_step(n, actor_wait=0.0, rollout_idle=0.9, queue=50.0)
    assert a.out_streak == 0 and a.in_streak == 3 and not [m for m in asked[before:] if m["target"].startswith("+")]


def test_the_autoscaler_waits_out_its_cooldown(el):
    from relax_hpc.controller.elastic import Autoscaler

    c = el.cfg.autoscale
    c.enabled, c.max, c.window, c.scale_out_cooldown_s = True, 3, 1, 3600.0
    el.cfg.max_engines = 1
    a = Autoscaler(el)
    a.last_action = time.time()  # just acted
    assert a.after_step(1, actor_wait=0.9, rollout_idle=0.0) is None
