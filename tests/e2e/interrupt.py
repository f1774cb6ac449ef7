"""The interrupt-and-compare harness: a run hit while it goes (the time-limit warning, a killed rank) must end with
the same per-step rows as the same recipe run straight through.

:func:`interrupted_run` submits the quickstart with the real local path (``relax-submit --local --detach``:
submitit's local runner, which starts the controller again when it asks to be requeued) and lands each
:class:`Hit` at a known point: ``RUN_DIR/pause`` holds rollout after a step, the hit lands once the run is held
there, and the next attempt (or the restarted steps) is held again until the last hit. :func:`same_steps` then
compares the rows with the uninterrupted run's (the ``uninterrupted`` fixture of conftest.py: one run per recipe
and overrides in the session, so tests of one recipe share it) and audits the journal: every step trained
exactly once.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from relax_hpc.exchange.audit import exactly_once
from relax_hpc.launch.cancel import cancel
from relax_hpc.rundir import RunDir

from .conftest import QUICKSTART, held_at, hold, metrics, state, submit_detached, wait_until


@dataclass(frozen=True)
class Hit:
    """One interruption. ``how``: ``"requeue"`` (SIGUSR2 to the controller, what Slurm sends before the time limit:
    the step in flight finishes, a checkpoint, the attempt ends REQUEUED and the next one resumes from it) or
    ``"kill"`` (``kill -9`` of actor rank 0: every step restarts from the latest checkpoint, in place).

    No rollout step after ``hold`` starts; the hit lands once step ``held`` (default ``hold``) is synced and the run
    paused, and the run comes back held at step ``after`` (default ``held``). ``checkpoint``: the step of the last
    checkpoint, in the next attempt (requeue) or before the kill."""

    how: str
    hold: int
    checkpoint: int
    held: int | None = None
    after: int | None = None


def interrupted_run(tmp_path: Path, model: Path, overrides: tuple[str, ...], hits: tuple[Hit, ...],
                    recipe: Path = QUICKSTART, timeout: float = 600) -> RunDir:
    """The quickstart with ``overrides``, submitted detached, hit by each of ``hits`` in turn, then let run to its end
    (the final event written); asserts each hit did what it says. The run directory."""
    run = submit_detached(tmp_path, model, *overrides, recipe=recipe)
    attempts = restarts = 0
    try:
        for hit in hits:
            held = hit.held if hit.held is not None else hit.hold
            after = hit.after if hit.after is not None else held
            hold(run, hit.hold)
            wait_until(lambda: held_at(run, held), timeout, every=0.05, what=f"step {held} done, the run held")
            if hit.how == "requeue":
                os.kill(run.read_json(run.controller_addr)["pid"], signal.SIGUSR2)
                attempts += 1
                wait_until(lambda: state(run).get("attempt") == attempts and held_at(run, after), timeout,
                           what=f"attempt {attempts} running, held")
                last = state(run)["history"][-1]
                assert last["state"] == "REQUEUED" and "SIGUSR2" in last["reason"], last
                assert state(run)["last_checkpoint"]["step"] == hit.checkpoint
            else:
                assert hit.how == "kill", hit
                assert state(run)["last_checkpoint"]["step"] == hit.checkpoint
                os.kill(state(run)["roles"]["actor"]["pids"][0], signal.SIGKILL)
                restarts += 1
                wait_until(lambda: state(run).get("restarts") == restarts and held_at(run, after), timeout,
                           what="the restart, held")
        (run.path / "pause").unlink()
        wait_until(lambda: state(run).get("state") not in (None, "RUNNING", "REQUEUED")
                   and state(run)["events"][-1]["event"] in ("finished", "failed", "cancelled"), timeout, every=0.5,
                   what="the run's end")
    finally:
        if state(run).get("state") in (None, "RUNNING", "REQUEUED"):  # a failed assertion: leave no processes
            cancel(run, grace_s=5)
    st = state(run)
    assert st["state"] == "COMPLETED", st.get("reason")
    assert st["attempt"] == attempts and st.get("restarts", 0) == restarts
    return run


def same_steps(run: RunDir, want: dict[int, dict], keys: tuple[str, ...], steps: int) -> None:
    """Each step logged exactly once, each of ``keys`` equal to the uninterrupted run's (to 1e-6), each step trained
    exactly once (the exchange's journal)."""
    got = metrics(run)
    assert [r["step"] for r in got] == list(range(1, steps + 1)), "a step logged twice or missing"
    for r in got:
        for k in keys:
            assert r[k] == pytest.approx(want[r["step"]][k], abs=1e-6), (r["step"], k, r[k], want[r["step"]][k])
    assert exactly_once(run.path / "exchange" / "journal.jsonl", ["train"]) == []


# the recipe the resume and mini-batch tests share (one uninterrupted run for both): the quickstart, short, with k
# optimizer steps per rollout step (train.num_steps_per_rollout) and a periodic checkpoint for a kill to go back to
STEPS = 4
K = 4
SHORT = (f"run.steps={STEPS}", f"train.num_steps_per_rollout={K}", "checkpoint.interval=2", "checkpoint.keep=3",
         "rollout.rollout_batch_size=8")
