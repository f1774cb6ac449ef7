"""Failures at the run level: a reward that raises (skip: reported with the sample, the run goes on; fail: the
run stops with the report), an engine that dies (reported by name, its requests served by the other
engine, weight syncs go on without it), and every engine dead (the run fails fast, naming them)."""

from __future__ import annotations

import json
import re
import threading

import pytest

from relax_hpc.controller import RunFailed, run_controller

from .conftest import hold, make_run, metrics, state, wait_until

REWARD = "e2e_rewards.raise_on_ones"  # tests/e2e/e2e_rewards.py: raises for prompts "1+..."
KILLING = "e2e_rewards.raise_on_ones_killing_engines"  # the same, and kills engine1 in step 2, engine0 in step 4


@pytest.mark.slow
def test_skipped_reward_failures_and_dying_engines(tmp_path, tiny_model, local_executor):
    """Two engines (tasks_per_node 2: two engine steps), reward_error_policy skip. During step 2's generation engine1 is killed;
    during step 4's, engine0 (by the reward function, from inside the rollout: no race with the run's pace):
    the run fails with both engines named, without waiting for a timeout."""
    run = make_run(tmp_path, tiny_model, "run.steps=8", f"rollout.custom_rm_path={KILLING}", "checkpoint.max_restarts=0",
                   "rollout.engine.max_restarts=0", "rollout.reward_error_policy=skip",
                   "roles.rollout.tasks_per_node=2", "rollout.max_response_len=4", name="failures")
    with pytest.raises(RunFailed) as err:
        run_controller(run.path)

    # every engine dead: the run fails, naming the last one (at step 4's generation, or at its sync when its
    # last request was answered before the kill); the first one is marked dead in state.json
    reason = str(err.value)
    assert "no rollout engine left" in reason and "engine0" in reason, reason
    st = state(run)
    assert st["state"] == "FAILED" and st["engines"]["engine1"]["dead"]

    # engine1's death: reported by name, its requests served by engine0, steps 2 and 3 completed
    rows = metrics(run)
    # step 4 fails with its engines gone, or (when its last request was answered before the kill) step 5
    assert [r["step"] for r in rows] in ([1, 2, 3], [1, 2, 3, 4]), rows
    assert rows[0]["rollout/engines_dead"] == 0 and rows[2]["rollout/engines_dead"] == 1  # dead from step 2 (or 3,
    # if the kill landed after step 2's last request)
    for r in rows:  # the sync after engine1's death goes to engine0 alone, and lands
        assert r["weights/fingerprint_match"] == 1.0 and r["weights/versions_ok"] == 1.0
    log = (run.logs / "controller.log").read_text()
    assert "rollout engine engine1 (http://127.0.0.1:" in log and "died" in log

    # the reward that raised: each failure is logged with its sample, counted, and the run went on
    assert sum(r["rollout/reward_failed"] for r in rows) > 0
    assert "reward failed for sample index=" in log and "prompt '1+" in log and "test reward refuses" in log


@pytest.mark.slow
@pytest.mark.parametrize("checked", [True, False])
def test_a_dead_engine_is_started_again_and_rejoins_with_the_current_weights(tmp_path, tiny_model, local_executor,
                                                                             checked):
    """kill -9 of engine1 during step 2 (from inside the rollout, so it lands in that step): its requests go to
    engine0 and the run goes on, while the controller starts engine1 again as a new engine step. It takes the
    weights at the next sync (a catch-up one while the run is held after step 3: the run does not wait for it, and
    a 6-step run may end before a new engine is up) and takes requests again; the run completes. Also without the
    sync's fingerprint check, which is where the engines' versions were read from."""
    run = make_run(tmp_path, tiny_model, "run.steps=6", "rollout.custom_rm_path=e2e_rewards.kill_engine1_in_step_2",
                   "roles.rollout.tasks_per_node=2", "rollout.max_response_len=4",
                   f"logging.check_weight_sync={str(checked).lower()}", name="engine-restart")
    hold(run, 3)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(final=run_controller(run.path)), daemon=True)
    t.start()
    try:
        wait_until(lambda: (state(run).get("engines", {}).get("engine1", {}).get("restarts") == 1
                            and state(run)["engines"]["engine1"]["state"] == "ready"), 300,
                   what="engine1 started again and ready")
    finally:
        (run.path / "pause").unlink(missing_ok=True)
        t.join(600)
    assert result["final"]["state"] == "COMPLETED"
    st = state(run)
    e1, e0 = st["engines"]["engine1"], st["engines"]["engine0"]
    assert (e1["state"], e1["restarts"], e1["weight_version"], e1["dead"]) == ("ready", 1, "6", None)
    assert (e0["state"], e0["restarts"], e0["weight_version"]) == ("ready", 0, "6")
    assert any(ev["event"] == "engine_restart" and ev["detail"].startswith("engine1 dead") for ev in st["events"])
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["rollout/engines_ready"] == 2 and rows[-1]["rollout/engines_dead"] == 0
    for r in rows if checked else []:  # every sync landed on every engine it went to, the new engine1 included
        assert r["weights/fingerprint_match"] == 1.0 and r["weights/versions_ok"] == 1.0
    log = (run.logs / "controller.log").read_text()
    assert re.search(r"engine engine1 joined \(initial, local, op restart\) at http://127\.0\.0\.1:\d+; it takes "
                     r"requests after the next sync", log), log[-3000:]


@pytest.mark.slow
def test_a_reward_that_raises_stops_the_run_with_the_report(tmp_path, tiny_model, local_executor):
    run = make_run(tmp_path, tiny_model, "run.steps=3", f"rollout.custom_rm_path={REWARD}",
                   "rollout.reward_error_policy=fail", "data.shuffle=false", name="reward-fail")
    with pytest.raises(RunFailed) as err:
        run_controller(run.path)
    reason = str(err.value)
    assert reason.startswith("rollout rank 0 on localhost failed: step 1 generate: RewardError: the reward function "
                             "failed for"), reason
    # each failed sample with its index, group, prompt, response and label, and the error (the first group
    # scored with a "1+" prompt stops the run)
    assert re.search(r"sample index=\d+ group_index=\d+: reward e2e_rewards.raise_on_ones raised ValueError: "
                     r"test reward refuses '1\+\d='\n    prompt: 1\+\d=\n    response: .*\n    label: \d", reason), reason
    assert "reward_error_policy = fail" in reason
    st = state(run)
    assert st["state"] == "FAILED" and st["reason"] == reason and st["step"] == 0
    assert json.loads((run.path / "summary.json").read_text())["state"] == "FAILED"
