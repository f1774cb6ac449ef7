"""The role tier of recovery on real runs: a forward role killed with ``kill -9`` while it holds a step's lease is
started again alone; the actor and the engine keep their processes, the lease goes back to the exchange's queue, and
the run completes with every sample consumed exactly once (docs/reliability.md, "Two tiers of recovery").

The kill lands at a known point without racing the run: ``RELAX_TEST_KILL_TASK=<role>:logprobs:<step>`` makes the
role's ranks SIGKILL themselves as they begin that step's log-probs, holding its lease, in their first life only.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
import pytest

from relax_hpc.controller import run_controller
from relax_hpc.launch.status import audit_run
from relax_hpc.rundir import RunDir

from .conftest import (REPO, follow_slurm, locally, make_run, metrics, quickstart_overrides, state,
                       submit_slurm)

STEPS, KILL_AT = 3, 2
FORWARD = ("algorithm.use_kl_loss=true", "roles.reference.enabled=true")


def _recovered(st: dict, role: str) -> dict:
    h = st["health"]
    assert h["role_restarts"] == 1 and h["global_restarts"] == 0 and h["pending"] is None, h
    (rec,) = h["recoveries"]
    # a SIGKILL: the local process's exit code -9, or srun's 137 under Slurm
    assert rec["tier"] == "role" and rec["role"] == role and re.search(r"code (-9|137)\b", rec["why"]), rec
    assert isinstance(rec["recovery_s"], float) and rec["recovery_s"] > 0
    return rec


def _trained_once(run: RunDir, role: str) -> None:
    """The journal: the killed role's lease of the step went back (released) and was leased again; every sample
    of every step consumed exactly once by every task (relax-status --audit), the step's by train once."""
    audit = audit_run(run)
    assert audit["exactly_once"] is True and audit["violations"] == [], audit["violations"]
    by_step = {s["step"]: s for s in audit["steps"]}
    assert set(by_step) == set(range(1, STEPS + 1))
    assert all(s["consumed"][t] == s["produced"] > 0 for s in by_step.values() for t in audit["tasks"])
    records = [json.loads(line) for line in (run.path / "exchange" / "journal.jsonl").read_text().splitlines()]
    released = [r for r in records if r.get("op") == "released"]
    assert len(released) == 1 and f"{role} restarted alone" in released[0]["reason"], released
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step trained and logged once
    assert [r["health/role_restarts"] for r in rows] == [0.0] + [1.0] * (STEPS - 1)
    assert "health/recovery_time" in rows[KILL_AT - 1] and rows[KILL_AT - 1]["health/recovery_time"] > 0


class PidWatch:
    """The actor's PIDs and engine0's PID as state.json shows them, every one seen while the run goes on: one life
    each means one PID set each."""

    def __init__(self, run: RunDir):
        self.run, self.actor, self.engine, self._stop = run, set(), set(), threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            st = self.run.read_json(self.run.state, {}) or {}
            pids = tuple((st.get("roles") or {}).get("actor", {}).get("pids") or ())
            if pids and all(pids):
                self.actor.add(pids)
            pid = ((st.get("engines") or {}).get("engine0") or {}).get("pid")
            if pid:
                self.engine.add(pid)

    def __enter__(self) -> "PidWatch":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


@pytest.mark.slow
def test_a_reference_killed_mid_step_is_restarted_alone(tmp_path, tiny_model):
    """The quickstart with a reference (KL loss), its reference killed as it begins step 2's log-probs: the run
    completes, the actor's and the engine's PIDs are those of the start, and step 2's data is trained once."""
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", *FORWARD, "checkpoint.max_restarts=0",
                   name="role-restart")
    with locally(RELAX_TEST_KILL_TASK=f"reference:logprobs:{KILL_AT}"), PidWatch(run) as seen:
        final = run_controller(run.path)
    assert final["state"] == "COMPLETED" and final["restarts"] == 0 and final["step"] == STEPS
    _recovered(final, "reference")
    assert seen.actor == {tuple(final["roles"]["actor"]["pids"])}, seen.actor  # the same actor processes throughout
    assert len(seen.engine) == 1 and final["engines"]["engine0"].get("restarts", 0) == 0
    log = (run.logs / "controller.log").read_text()
    assert log.count("starting actor:") == 1 and log.count("starting reference:") == 1
    assert log.count("starting reference again") == 1
    ev = [e["event"] for e in final["events"]]
    assert ev.count("role_restarted") == 1 and "step_restarted" not in ev and "resumed" not in ev
    assert "RELAX_TEST_KILL_TASK" in (run.logs / "reference.0.log").read_text()
    _trained_once(run, "reference")


@pytest.mark.slurm
@pytest.mark.slow
def test_actor_fwd_killed_mid_step_on_slurm_is_restarted_alone(slurm_cluster, tmp_path, tiny_model):
    """recipes/quickstart-slurm.yaml on the dev cluster (actor, rollout, reference and actor_fwd each a het component,
    fully async), actor_fwd killed as it begins step 2's log-probs: it is started again alone as a new job step of
    its het group in the same job (the actor's step and the engine's are the first ones), the actor pushes it the
    weights again, and the run completes with every sample consumed exactly once."""
    env = {**slurm_cluster.env, "RELAX_TEST_KILL_TASK": f"actor_fwd:logprobs:{KILL_AT}"}
    sub = submit_slurm(REPO / "recipes" / "quickstart-slurm.yaml", tmp_path, env,
                       quickstart_overrides(tiny_model, tmp_path / "runs", f"run.steps={STEPS}",
                                            "checkpoint.max_restarts=0"))
    run = RunDir(Path(sub["run_dir"]))
    with PidWatch(run) as seen:
        st, _ = follow_slurm(sub, tmp_path, slurm_cluster.env, 4, 900)
    ctl = state(run)
    assert st.get("state") == "COMPLETED" and ctl["state"] == "COMPLETED", (st, ctl.get("reason"))
    rec = _recovered(ctl, "actor_fwd")
    assert seen.actor == {tuple(ctl["roles"]["actor"]["pids"])} and len(seen.engine) == 1
    assert ctl["restarts"] == 0 and ctl["executor"] == "slurm"
    log = (run.logs / "controller.log").read_text()
    again = log.split("starting actor_fwd again")
    assert len(again) == 2 and f"--het-group={ctl['roles']['actor_fwd']['het_group']}" in again[1].splitlines()[0]
    assert "RELAX_TEST_KILL_TASK" in (run.logs / "actor_fwd.0.log").read_text()
    _trained_once(run, "actor_fwd")
    assert all(r["weights/fingerprint_match"] == 1.0 for r in metrics(run))  # actor_fwd's weights checked too
    print(f"actor_fwd recovered alone on the dev cluster in {rec['recovery_s']:.1f}s")


@pytest.mark.slow
def test_a_rollout_driver_killed_mid_generate_keeps_its_partial_rollout_buffer(tmp_path, tiny_model):
    """recipes/quickstart-async.yaml with partial rollout, the rollout driver killed as it begins step 2's generate:
    it is started again alone, and the generate goes again from the cursor and the buffer saved after step 1 (the
    groups the dead driver held in flight are there, none lost): every sample consumed once, every prompt of the
    epoch trained once, the actor's and the engine's processes untouched."""
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", "checkpoint.max_restarts=0",
                   "rollout.partial_rollout=true", "rollout.over_sampling_batch_size=32", name="rollout-restart",
                   recipe=REPO / "recipes" / "quickstart-async.yaml")
    with locally(RELAX_TEST_KILL_TASK=f"rollout:generate:{KILL_AT}"), PidWatch(run) as seen:
        final = run_controller(run.path)
    assert final["state"] == "COMPLETED" and final["restarts"] == 0
    _recovered(final, "rollout")
    assert seen.actor == {tuple(final["roles"]["actor"]["pids"])} and len(seen.engine) == 1
    text = (run.logs / "rollout.0.log").read_text()
    killed = text.index("RELAX_TEST_KILL_TASK")
    restored = re.search(r"partial rollout's buffer restored from partial_rollout/after_00000001_\w+\.json: "
                         r"(\d+) prompt groups", text[killed:])
    assert restored and int(restored.group(1)) > 0, text[killed:]  # what the first driver held after step 1
    audit = audit_run(run)
    assert audit["exactly_once"] and audit["prompts_once"], audit["violations"]
    assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1))
