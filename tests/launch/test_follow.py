"""Following a run without a terminal (a log, CI, a pipe): a line every few steps with the progress, at once when
the state or a failure changes; not a line per step. The run moves one step each time the follower polls (its
``stop`` callback writes the next step), so the test waits for nothing."""

from __future__ import annotations

import io
import json
import math

from rich.console import Console

from relax_hpc.launch import follow as follow_mod
from relax_hpc.rundir import write_json

from .test_status import comp, metrics_rows, run_dir, with_comps

TOTAL = 100
ROLES = {"actor": {"phase": "train"}, "rollout": {"phase": "generate"}}


def test_a_log_gets_a_line_every_few_steps_with_the_progress(tmp_path, monkeypatch):
    monkeypatch.setattr(follow_mod, "LOG_EVERY_S", math.inf)  # steps alone decide: no clock in the test
    rd = run_dir(tmp_path)
    with_comps(monkeypatch, comp(0, "RUNNING"), comp(1, "RUNNING"))
    at = {"step": 0}

    def write(step: int, **extra) -> None:
        write_json(rd.state, {"state": "RUNNING", "step": step, "total_steps": TOTAL, "roles": ROLES, **extra})
        metrics_rows(rd, range(1, step + 1))

    write(0)

    def advance(info: dict) -> bool:  # follow's stop(): called once per poll; the run moves one step
        if info["state"] == "COMPLETED":
            return True
        at["step"] += 1
        s = at["step"]
        if s == TOTAL:
            write_json(rd.state, {"state": "COMPLETED", "step": s, "total_steps": TOTAL, "roles": ROLES})
            metrics_rows(rd, range(1, s + 1))
            with_comps(monkeypatch, comp(0, "COMPLETED"), comp(1, "COMPLETED"))
        else:
            write(s, **({"last_failure": "actor rank 1 on node2 failed: NCCL timeout"} if s >= 37 else {}))
        return False

    out = io.StringIO()
    info = follow_mod.follow(rd, Console(file=out, width=400), interval=0, stop=advance)
    assert info["state"] == "COMPLETED"
    text = out.getvalue()
    assert f"{rd.name}  job 7 (slurm)  COMPLETED" in text  # the full view, once, at the end
    lines = [ln for ln in text.splitlines() if ln.startswith(rd.name) and "  job 7 " not in ln]
    steps = [int(ln.split("step ")[1].split("/")[0]) for ln in lines]
    # every 5 steps (100 / 20), the failure at once (step 37) and 5 steps on from there, the end: 22 lines where a
    # line per step gave 100
    assert steps == [*range(0, 36, 5), *range(37, 98, 5), TOTAL], steps
    mid = lines[steps.index(42)]
    assert "RUNNING  step 42/100  reward 0.420 (mean 0.375 over 10 steps)  2.0s/step  1m56s left" in mid, mid
    assert "actor=train" in mid and mid.endswith("last failure: actor rank 1 on node2 failed: NCCL timeout")
    assert "COMPLETED" in lines[-1] and "left" not in lines[-1]


def test_json_lines_carry_the_progress(tmp_path, monkeypatch, capsys):
    rd = run_dir(tmp_path)
    write_json(rd.state, {"state": "COMPLETED", "step": 4, "total_steps": 4})
    metrics_rows(rd, range(1, 5))
    with_comps(monkeypatch, comp(0, "COMPLETED"), comp(1, "COMPLETED"))
    follow_mod.follow(rd, Console(file=io.StringIO()), interval=0, json_lines=True)
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["progress"]["reward_last"] == 0.04


def test_log_every():
    assert [follow_mod.log_every(t) for t in (None, 1, 19, 20, 100, 3000)] == [1, 1, 1, 1, 5, 150]
