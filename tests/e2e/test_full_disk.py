"""Failures a restart cannot fix end the run at once, saying why: a full disk, and bad data.

A full disk: the quickstart on a small filesystem of its own (a real tmpfs; mounting needs root, which CI has),
held after step 1 and its checkpoint, then the disk filled. The controller's next write of state.json fails; it
frees the run directory's reserve and ends the run FAILED, naming the disk in state.json and in ``relax-status``
(a role's write that fails the same way: tests/controller/test_failure_classes.py). A resume is refused while the
disk is still full; with the filler removed, ``relax-submit --resume`` completes the run from its checkpoint,
every step logged once.

Bad data: a dataset whose rows lack the prompt key fails the run at once with the file, line and key, with no
restart (restarts are for what a restart can fix), in seconds instead of three tries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from relax_hpc.controller import RunFailed, run_controller
from relax_hpc.launch.cancel import cancel
from relax_hpc.launch.status import collect

from .conftest import REPO, held_at, hold, make_run, metrics, state, submit_detached, wait_until

STEPS = 2


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    code = "import sys; from relax_hpc.launch.cli import {0}; sys.exit({0}(sys.argv[1:]))"
    main = "status_main" if args[0] == "relax-status" else "submit_main"
    return subprocess.run([sys.executable, "-c", code.format(main), *args[1:]], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "COLUMNS": "1000"})  # no wrapped lines


@pytest.mark.slow
def test_a_full_disk_fails_the_run_naming_it_and_a_resume_completes(tiny_model, local_executor, small_disk):
    disk = small_disk(64)
    run = submit_detached(disk.path, tiny_model, f"run.steps={STEPS}", "checkpoint.interval=1",
                          "rollout.rollout_batch_size=8")
    try:
        hold(run, 1)
        wait_until(lambda: held_at(run, 1) and (state(run).get("last_checkpoint") or {}).get("step") == 1, 300,
                   every=0.1, what="step 1 checkpointed, the run held")
        assert run.reserve.exists()
        disk.fill()  # the controller's next write of state.json (within a second: heartbeats) finds no space
        wait_until(lambda: collect(run)["state"] == "FAILED", 120, every=0.2, what="the run's end")
    finally:
        if state(run).get("state") in (None, "RUNNING"):  # a failed assertion: leave no processes
            cancel(run, grace_s=5)
    st = state(run)
    where = f"no space left on {disk.path}"
    assert st["state"] == "FAILED" and where in st["reason"], st["reason"]
    assert f"relax-submit --resume {run.path}" in st["reason"]
    assert st["restarts"] == 0 and [e["event"] for e in st["events"]][-1] == "failed"  # not restarted into it
    shown = cli("relax-status", str(run.path))
    assert shown.returncode == 0 and "FAILED" in shown.stdout and "reason: " in shown.stdout, shown
    assert where in shown.stdout and f"relax-submit --resume {run.path}" in shown.stdout, shown.stdout

    assert (run.path / "summary.json").exists()  # the end's writes landed in the space the reserve held
    assert "no space left" in (run.logs / "controller.log").read_text()

    refused = cli("relax-submit", "--resume", "--detach", str(run.path))  # still full: said so, nothing started
    if refused.returncode == 0:
        cancel(run, grace_s=5)
    assert refused.returncode != 0 and f"relax-submit --resume: {where} (" in refused.stderr, refused.stderr
    disk.free()
    (run.path / "pause").unlink()
    again = cli("relax-submit", "--resume", str(run.path), "--json", timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["state"] == "COMPLETED", again.stdout
    st = state(run)
    assert st["state"] == "COMPLETED" and st["attempt"] == 1 and where in st["history"][-1]["reason"]
    assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1)), "a step logged twice or missing"
    assert run.reserve.exists()  # made again for the next full disk


@pytest.mark.slow
def test_bad_data_fails_the_run_at_once_without_a_restart(tmp_path, tiny_model, local_executor):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"question": f"{a}+1=", "label": str(a + 1)}) + "\n" for a in range(4)))
    run = make_run(tmp_path, tiny_model, f"data.path={bad}", "checkpoint.max_restarts=2", name="bad-data")
    with pytest.raises(RunFailed) as err:
        run_controller(run.path)
    want = (f"rollout rank 0 on localhost failed: DataError: {bad}: line 1: missing key 'prompt' (data.input_key); "
            "the record has keys 'question', 'label'. Fix: set data.input_key to the field that holds the prompt")
    assert str(err.value) == want
    st = state(run)
    assert st["state"] == "FAILED" and st["reason"] == want
    assert st["restarts"] == 0 and [e["event"] for e in st["events"]] == ["started", "failed"]
