"""The eval schedule on its own: Relax's steps, the queue the loop hands to rollout, what holds a sync, a resume."""

from __future__ import annotations

from relax_hpc.controller.eval_schedule import EvalSchedule


def test_due_at_relax_steps_before_training_every_interval_and_after_the_last():
    assert [n for n in range(6) if EvalSchedule(2, False, total=5).due(n)] == [0, 2, 4, 5]
    assert [n for n in range(6) if EvalSchedule(2, True, total=5).due(n)] == [2, 4, 5]  # skip_eval_before_train
    assert not any(EvalSchedule(None, False, total=5).due(n) for n in range(6))  # no eval_interval: never


def test_a_synced_due_step_is_owed_until_its_eval_is_done_and_holds_later_syncs_only():
    ev = EvalSchedule(2, True, total=6)
    ev.synced(1)  # not due
    assert ev.queue == [] and not ev.owed() and ev.take() is None
    ev.synced(2)
    ev.synced(4)
    assert ev.queue == [2, 4] and ev.owed(before=3) and not ev.owed(before=2)
    assert ev.take() == 2 and ev.running == 2 and ev.queue == [4]
    assert ev.owed(before=3)  # running: the engines keep step 2's weights until it is done
    ev.done()
    assert ev.running is None and not ev.owed(before=3) and ev.owed(before=5)


def test_a_resume_runs_the_checkpoint_steps_eval_again_only_when_its_row_has_none():
    for k, evaluated, want in [(0, set(), [0]),  # a fresh start: the eval before training
                               (4, set(), [4]),  # cut off by the end of the attempt: again
                               (4, {0, 2, 4}, []),  # logged: never twice
                               (3, set(), [])]:  # not due
        ev = EvalSchedule(2, False, total=6)
        ev.resume(k, evaluated)
        assert ev.queue == want, (k, evaluated)
