"""tools/chaos keeps working: one short local trial (a kill -9 of a random rank) against the uninterrupted run.
The recipe is the resume tests' (:data:`interrupt.SHORT`), so the uninterrupted run is the session's one for it
(``--reference``) instead of a run of the tool's own. The soak itself (20 local trials, 10 on the dev cluster) is
in docs/reliability.md, not in CI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ARITH, QUICKSTART, REPO, machinery_overrides
from .interrupt import SHORT, STEPS


@pytest.mark.slow
def test_one_chaos_trial_survives(tmp_path, tiny_model, uninterrupted_run):
    reference = uninterrupted_run(*SHORT, steps=STEPS)
    p = subprocess.run(
        [sys.executable, str(REPO / "tools" / "chaos"), "--local", str(QUICKSTART), "--trials", "1", "--seed", "3",
         "--faults", "kill-rank", "--runs-root", str(tmp_path / "runs"), "--timeout", "600",
         "--reference", str(reference.path), f"model.path={tiny_model}", f"data.path={ARITH}",
         *machinery_overrides(), *SHORT],  # the reference's settings (reference_run's)
        capture_output=True, text=True, timeout=1500, cwd=REPO)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0, p.stdout + p.stderr
    assert lines[0] == f"reference: {reference.path} ({STEPS} steps, uninterrupted)", p.stdout
    assert lines[-1] == "1/1 trials survived", p.stdout
    assert "trial 1/1: kill-rank" in p.stdout and "kill -9" in p.stdout and "exactly-once" in p.stdout
    assert "equal to the uninterrupted run" in p.stdout, p.stdout
