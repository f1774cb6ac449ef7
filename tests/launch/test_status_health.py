"""relax-status shows which tier of recovery acted, why, and how long it took (state.json's ``health``)."""

from __future__ import annotations

import io
import time

from rich.console import Console

from relax_hpc.launch import status
from relax_hpc.rundir import write_json
from .test_status import comp, run_dir, with_comps


def test_the_last_recovery_and_the_role_restarts_are_shown(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)
    health = {"role_restarts": 1, "global_restarts": 0, "pending": None,
              "recoveries": [{"tier": "role", "role": "reference", "why": "reference failed: step exited with code -9",
                              "at": time.time() - 30, "recovery_s": 12.5, "try": [0, 0]}]}
    write_json(rd.state, {"state": "RUNNING", "step": 3, "total_steps": 10, "attempt": 0, "restarts": 0,
                          "health": health})
    with_comps(monkeypatch, comp(0, "RUNNING"), comp(1, "RUNNING"))
    info = status.collect(rd)
    assert info["health"] == health  # --json
    out = io.StringIO()
    Console(file=out, width=200).print(status.render(info))
    assert "1 role restart(s) alone" in out.getvalue()
    assert "last recovery: role tier (reference), 12.5s" in out.getvalue()


def test_a_state_json_whose_health_is_not_an_object_is_named(tmp_path, monkeypatch):
    rd = run_dir(tmp_path)
    write_json(rd.state, {"state": "RUNNING", "health": [1]})
    doc, error = status.read_state(rd)
    assert doc == {} and "field 'health'" in error
