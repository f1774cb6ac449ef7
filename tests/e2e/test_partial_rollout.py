"""Partial rollout in a fully-async run: each step keeps the first rollout_batch_size groups to finish, aborts the
rest and continues them the next step. The buffer is rollout state, saved with the data cursor after every step
and in the checkpoint, so it survives what ends the rollout role: a requeue (SIGUSR2 at step 2: checkpoint, the
attempt ends, the next one resumes) and a kill -9 of the role at step 4 (every step restarted from the latest
checkpoint). The run completes, every step is logged once, every trained sample is consumed exactly once (partial
samples never enter the exchange until finished), buffered groups are continued from their partial tokens after
the restarts, and per epoch of an 8-prompt dataset every prompt is trained once: none lost with the buffer, none
trained twice (the journal audit, as ``relax-status --audit`` reads it)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import pytest

from relax_hpc.controller import run_controller
from relax_hpc.launch.status import audit_run
from relax_hpc.rollout.dynamic import PartialRollout

from .conftest import ARITH, REPO, held_at, hold, make_run, metrics, state, wait_until

STEPS = 6
N = 8  # prompts: step 1 draws 8 groups, each later step 4 new ones; 28 drawn in all, 3 epochs and a half


def meanwhile(run, fn) -> threading.Thread:
    """``fn`` in a thread beside the controller; if it fails, the pause goes (the run finishes instead of waiting
    for ever) and the test sees the error when it joins."""
    def go():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            t.error = e
            (run.path / "pause").unlink(missing_ok=True)

    t = threading.Thread(target=go, daemon=True)
    t.error = None
    t.start()
    return t


def joined(t: threading.Thread) -> None:
    t.join(60)
    if t.error is not None:
        raise t.error


@pytest.mark.slow
def test_partial_rollout_survives_a_requeue_and_a_killed_rollout_role(tmp_path, tiny_model, local_executor):
    data = tmp_path / "eight.jsonl"
    data.write_text("".join(ARITH.read_text().splitlines(keepends=True)[:N]))
    # responses that end at a stop token (1 in 16 of the vocabulary) or at 32 tokens: groups finish at different
    # times, so a step's end aborts the others mid-response (all of one length would finish together)
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", f"data.path={data}", "rollout.rollout_batch_size=4",
                   "rollout.n_samples_per_prompt=4", "rollout.max_response_len=32", "train.max_seq_len=48",
                   f"rollout.stop_token_ids={list(range(0, 128, 16))}", "rollout.partial_rollout=true",
                   "rollout.over_sampling_batch_size=8", "rollout.mask_offpolicy_in_partial_rollout=true",
                   # the global tier: every step from step 2's checkpoint (tests/e2e/test_role_restart.py has the
                   # rollout driver restarted alone, its buffer kept)
                   "health.max_role_restarts=0",
                   recipe=REPO / "recipes" / "quickstart-async.yaml", name="partial")

    hold(run, 2)  # attempt 0: SIGUSR2 (the time limit is near) once step 2 is done
    t = meanwhile(run, lambda: (wait_until(lambda: held_at(run, 2), 300, every=0.05, what="step 2 done, held"),
                                os.kill(os.getpid(), signal.SIGUSR2)))
    with pytest.raises(SystemExit):  # the local requeue: the runner would start the controller again
        run_controller(run.path)
    joined(t)
    assert state(run)["state"] == "REQUEUED" and state(run)["last_checkpoint"]["step"] == 2

    def kill_rollout_at_4():
        wait_until(lambda: state(run).get("attempt") == 1 and held_at(run, 4), 300, every=0.05,
                   what="attempt 1 at step 4, held")
        os.kill(state(run)["roles"]["rollout"]["pids"][0], signal.SIGKILL)
        wait_until(lambda: state(run).get("restarts") == 1 and held_at(run, 4), 300, what="the restart, held")
        (run.path / "pause").unlink()

    hold(run, 4)
    t = meanwhile(run, kill_rollout_at_4)
    final = run_controller(run.path)  # attempt 1, restarted in place from step 2's checkpoint after the kill
    joined(t)
    assert final["state"] == "COMPLETED", final.get("reason")
    assert final["attempt"] == 1 and final["restarts"] == 1

    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["train/num_samples"] == 16  # rollout_batch_size groups, however many were in flight
        assert r["rollout/partial_buffer_groups"] == 4  # over_sampling − rollout_batch_size kept back each step
    # both lives after step 2 (attempt 1, and its restart after the kill) began from step 2's saved buffer, and
    # groups aborted mid-response were trained after the restart, continued from their tokens
    restored = [line for line in (run.path / "logs" / "rollout.0.log").read_text().splitlines()
                if re.search(r"buffer restored from partial_rollout/after_00000002_\w+\.json: 4 prompt groups", line)]
    assert len(restored) == 2, restored
    assert sum(r["rollout/partial_resumed_groups"] for r in rows[2:]) > 0, rows

    info = audit_run(run)
    assert info["exactly_once"] and info["prompts_once"], info["violations"]
    assert sorted(s["step"] for s in info["steps"] if s["cleared"]) == list(range(1, STEPS + 1))
    # every prompt drawn was trained once in its epoch, or is in the buffer the run ended with
    ckpts = run.path / "checkpoints"
    end = json.loads((ckpts / "step_00000006" / "meta.json").read_text())["extra_state"]["data"]
    left = PartialRollout()
    left.load(run.path, end["partial"])
    drawn = end["sample_group_index"]
    assert drawn == 8 + 4 * (STEPS - 1)
    trained = {e["epoch"]: e["trained"] for e in info["epochs"]}
    for epoch in range(drawn // N + 1):
        in_buffer = sum(1 for g in left.buffer if g[0].group_index // N == epoch)
        assert trained.get(epoch, 0) + in_buffer == min(N, drawn - epoch * N), (epoch, info["epochs"])
    assert sum(trained[e] == N for e in trained) >= 2
    # saved buffers: those a checkpoint names stay (step 2's too), older ones are deleted
    kept = sorted(PartialRollout.file_step(p.name) for p in (run.path / "partial_rollout").iterdir())
    assert 2 in kept and 1 not in kept, kept
