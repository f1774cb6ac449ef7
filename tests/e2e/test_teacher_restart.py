"""The role tier for OPD's teacher (``roles.teacher``, recipes/quickstart-distill.yaml): a teacher that dies while
rollout's generate asks it is started again alone, and the step's generate goes again from the same data cursor; the
actor, the rollout driver and the rollout engine keep their processes, and every sample is consumed exactly once
(docs/reliability.md, "Two tiers of recovery").

Both verdicts in one run. The kills land mid-generate without racing it: ``RELAX_TEST_TEACHER_GATE`` holds the rollout's
k-th teacher call (one per generate) until the teacher refuses connections, and this test kills then:

- call 2 (step 2): ``kill -9`` of the teacher role's rank (its engine dies with it): dead, so it is started again
  alone, and step 2's generate goes to the new teacher;
- call 4 (step 3): ``kill -9`` of the new teacher's engine only, its role alive and heartbeating: the generate goes
  again twice (``TEACHER_RETRIES``), then the teacher, alive but not answering, is started again alone.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from relax_hpc.controller import run_controller
from relax_hpc.controller.training import TEACHER_RETRIES
from relax_hpc.launch.status import audit_run
from relax_hpc.rundir import RunDir

from .conftest import REPO, locally, make_run, metrics, wait_until
from .test_role_restart import PidWatch

STEPS = 3
DISTILL = REPO / "recipes" / "quickstart-distill.yaml"


class TeacherKiller:
    """Kills the teacher where the rollout's gate waits: its role's rank at call 2, its engine only at call 4."""

    def __init__(self, run: RunDir, gate: Path):
        self.run, self.gate, self.killed, self.error = run, gate, {}, None
        self._t = threading.Thread(target=self._kill, daemon=True)

    def _kill(self) -> None:
        try:
            wait_until(lambda: (self.gate / "asked-2").exists(), 600, 0.05, "step 2's teacher call")
            st = self.run.read_json(self.run.state, {})
            self.killed["role"] = st["roles"]["teacher"]["pids"][0]
            os.kill(self.killed["role"], signal.SIGKILL)
            wait_until(lambda: (self.gate / "asked-4").exists(), 600, 0.05, "step 3's teacher call")
            st = self.run.read_json(self.run.state, {})
            self.killed["engine"] = st["teachers"]["teacher0"]["pid"]
            os.kill(self.killed["engine"], signal.SIGKILL)
        except BaseException as e:  # noqa: BLE001  (reported by the test)
            self.error = e

    def __enter__(self) -> "TeacherKiller":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._t.join(timeout=5)


@pytest.mark.slow
def test_a_teacher_killed_mid_generate_is_restarted_alone(tmp_path, tiny_model):
    gate = tmp_path / "gate"
    gate.mkdir()
    # the tiny model is its own teacher: what is under test is the recovery, not what the student learns
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", f"opd.teacher_model_path={tiny_model}",
                   "checkpoint.max_restarts=0", "health.window_s=0",
                   recipe=DISTILL, name="teacher-restart")
    with locally(RELAX_TEST_TEACHER_GATE=f"2,4:{gate}"), PidWatch(run) as seen, TeacherKiller(run, gate) as killer:
        final = run_controller(run.path)
    assert killer.error is None and set(killer.killed) == {"role", "engine"}, (killer.error, killer.killed)
    assert final["state"] == "COMPLETED" and final["restarts"] == 0 and final["step"] == STEPS, final["reason"]

    h = final["health"]  # two restarts of the teacher alone, none of every step
    assert h["role_restarts"] == 2 and h["global_restarts"] == 0 and h["pending"] is None, h
    dead, alive = h["recoveries"]
    assert dead["tier"] == alive["tier"] == "role" and dead["role"] == alive["role"] == "teacher", h
    assert "code -9" in dead["why"] and "gave rollout no answer in step 3" in alive["why"], h
    assert all(isinstance(r["recovery_s"], float) and r["recovery_s"] > 0 for r in h["recoveries"]), h
    # the actor, the engine and the rollout driver: the processes of the start
    assert seen.actor == {tuple(final["roles"]["actor"]["pids"])} and len(seen.engine) == 1, (seen.actor, seen.engine)
    log = (run.logs / "controller.log").read_text()
    assert log.count("starting rollout:") == 1 and "starting rollout again" not in log
    assert log.count("starting actor:") == 1
    assert log.count("starting teacher again") == 2
    again = [e["detail"] for e in final["events"] if e["event"] == "generate_again"]
    assert len(again) == 2 + TEACHER_RETRIES, again  # step 2 once (dead), step 3 twice alive, once after
    assert again[0].startswith("step 2: ") and all(a.startswith("step 3: ") for a in again[1:]), again
    assert sum("the teacher role is alive" in a for a in again) == TEACHER_RETRIES, again
    assert final["teachers"]["teacher0"]["pid"] != killer.killed["engine"]

    audit = audit_run(run)  # nothing of a failed generate was announced; every sample consumed once, prompts too
    assert audit["exactly_once"] and audit["prompts_once"] and audit["violations"] == [], audit["violations"]
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["health/role_restarts"] for r in rows] == [0.0, 1.0, 2.0]
    assert all(r["opd/teacher_bad_samples"] == 0 and r["opd/teacher_calls"] >= 1 for r in rows)
