"""How often the controller asks Slurm about its jobs (relax_hpc.controller.scheduler_polls.SchedulerPolls, used by
relax_hpc.controller.elastic for attached jobs): over 10 minutes of simulated time, at most every 30 s, sooner
only after a change, slower while slurmctld is slow. The figure docs/slurm.md gives is the one counted here."""

from __future__ import annotations

import time

import pytest

from ctl_helpers import TOKEN, make_run
from relax_hpc.backends import SlurmBackend
from relax_hpc.controller.scheduler_polls import SchedulerPolls
from relax_hpc.controller.channel import Channel
from relax_hpc.controller.elastic import CHECK_JOBS_S, Elastic
from relax_hpc.controller.engines import EngineRegistry
from relax_hpc.controller.state import RunState
from relax_hpc.recipe import load_recipe, role_steps

MINUTES = 10


class CountingCapacity:
    """The launcher's side of attached jobs (relax_hpc.launch.attach), counting the questions to Slurm: the
    job stays PENDING the whole time (a busy partition), the worst case for polling."""

    def __init__(self) -> None:
        self.questions: list[str] = []
        self.jobs = 0

    def submit_attached(self, recipe, run_dir, op, names_prefix, n, attach):
        self.jobs += 1
        return str(100 + self.jobs), "debug"

    def attached_state(self, job_id):
        self.questions.append(job_id)
        return "PENDING", "Resources", False

    def cancel_attached(self, job_id):
        return None


@pytest.fixture
def el(tmp_path):
    ch = Channel(TOKEN, bind_host="127.0.0.1")
    run = make_run(tmp_path)
    recipe = load_recipe(run.recipe)
    recipe.rollout.elastic.join_timeout_s = 24 * 3600  # the attached job stays pending: no join timeout here
    state = RunState(run, recipe, role_steps(recipe), SlurmBackend(), env={})
    reg = EngineRegistry()
    reg.add("engine0", "http://127.0.0.1:1", origin="initial", state="ready", weight_version="3")
    e = Elastic(recipe, run, reg, state, ch, SlurmBackend(), holds=lambda n: False, on_change=lambda: None,
                assign=ch.assign, capacity=CountingCapacity())
    e.started = True
    yield e
    ch.close()


def scale_out(el, n):
    r = el.ask({"type": "scale", "target": f"+{n}", "attach": {}, "cancel": None, "by": "test"})
    assert r["accepted"], r


def simulate(el, minutes=MINUTES, every_s=CHECK_JOBS_S, events=()):
    """The controller's checks of pending attached jobs every ``every_s`` s of simulated time (the loop's
    cadence: CHECK_JOBS_S), ``events`` ({second: callable}) at their time; Slurm's questions per minute."""
    t0 = time.time()
    events = dict(events)
    for k in range(int(minutes * 60 / every_s) + 1):
        t = k * every_s
        for at in [a for a in events if a <= t]:
            events.pop(at)()
        el._check_pending(t0 + t)
    return len(el.cap.questions) / minutes


def test_a_ten_minute_run_asks_slurm_at_most_every_30_s(el):
    """Two attached jobs of two engines each, pending for 10 minutes: before, each engine's job was looked up
    every CHECK_JOBS_S = 5 s (4 engines × 12 = 48 questions a minute); now one question per job per 30 s, and
    one more soon after the second job is submitted (a change)."""
    scale_out(el, 2)
    el.ops[-1].state = "done"  # one operation at a time: let the second one in (its engines stay expected)
    per_minute = simulate(el, events={300: lambda: scale_out(el, 2)})
    assert set(el.cap.questions) == {"101", "102"}
    first = el.cap.questions.count("101")
    assert first <= MINUTES * 60 / SchedulerPolls.every_s + 1  # 21: every 30 s, the first at once
    assert per_minute <= 2 * (60 / SchedulerPolls.every_s) + 0.5, el.cap.questions  # two jobs: ~4 a minute
    assert per_minute < 48 / 4  # a quarter of the old rate at most


def test_after_a_change_slurm_is_asked_at_the_next_check():
    p = SchedulerPolls()
    assert p.due(0.0)
    p.done(0.0, took_s=0.1)
    assert not p.due(29.0) and p.due(30.0)
    p.changed()
    assert not p.due(4.9) and p.due(5.0)  # soon, but never twice within min_gap_s
    p.done(5.0, took_s=0.1)
    assert not p.due(34.0) and p.due(35.0)


def test_a_slow_slurmctld_is_asked_less_often_then_normally_again():
    p = SchedulerPolls()
    now, gaps = 0.0, []
    for took in (8.0, 8.0, 8.0, 8.0, 8.0, 0.2, 0.2):  # five slow answers, then quick ones
        assert p.due(now)
        p.done(now, took_s=took)
        gaps.append(p.next_at - now)
        now = p.next_at
    assert gaps == [60.0, 120.0, 240.0, 300.0, 300.0, 30.0, 30.0]
    p.done(now, took_s=0.1, ok=False)  # no answer at all (a timeout): also slower
    assert p.next_at - now == 60.0
