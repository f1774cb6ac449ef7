"""What test_vision.py and test_video.py share: the quickstart of a picture task shortened (twice its prompts a step,
1.5 × its lr), run on a data copy with one corrupt row, and the checks that it learned to look at its media (the
held-out pass@1 far above the 1/4 of an answer that ignores them) while the bad row failed only its own sample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from relax_hpc.controller import run_controller
from relax_hpc.rundir import RunDir

from .conftest import make_run, metrics

FASTER = ("rollout.rollout_batch_size=32", "train.lr=0.0075")
RISE = 0.2  # reward first 10 -> last 10 steps
CHANCE = 0.25  # pass@1 of any answer that ignores the media, on a held-out set balanced over the four answers
LOOKED = 0.375  # held-out pass@1 at the end: 1.5 × CHANCE
BAD_ROW = 5  # 0-based: line 6 of the data copy


def one_bad_row(data: Path, tmp_path: Path, spoil: Callable[[dict], None]) -> Path:
    """A copy of ``data`` whose row :data:`BAD_ROW` is changed in place by ``spoil``."""
    rows = data.read_text().splitlines()
    bad = json.loads(rows[BAD_ROW])
    spoil(bad)
    rows[BAD_ROW] = json.dumps(bad)
    out = tmp_path / f"{data.stem}-one-bad.jsonl"
    out.write_text("\n".join(rows) + "\n")
    return out


def shortened_run(tmp_path: Path, model: Path, recipe: Path, data: Path, heldout: Path, steps: int,
                  name: str) -> RunDir:
    """``recipe`` for ``steps`` steps (:data:`FASTER`), held-out eval before training and after the last step; the
    run COMPLETED."""
    run = make_run(tmp_path, model, f"data.path={data}", f"run.steps={steps}", *FASTER,
                   f"rollout.eval_interval={steps}", f"data.eval_prompt_data.heldout={heldout}", recipe=recipe,
                   name=name)
    final = run_controller(run.path)
    assert final["state"] == "COMPLETED", final
    return run


def assert_learned_to_look(run: RunDir, steps: int) -> None:
    """The reward rose by :data:`RISE`; the held-out pass@1, below chance before training, is above :data:`LOOKED`
    at the end; the actor's log-probs are the engine's (it saw the same pixels)."""
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["steps"] == steps and summary["state"] == "COMPLETED"
    assert summary["reward_last10"] > summary["reward_first10"] + RISE, summary
    rows = metrics(run)
    evals = {r["step"]: r for r in rows if "eval/heldout-pass@1" in r}
    assert sorted(evals) == [0, steps], evals  # before training, and after the last step
    assert evals[0]["eval/heldout-pass@1"] < CHANCE, evals[0]  # the untrained model answers over its vocabulary
    assert evals[steps]["eval/heldout-pass@1"] > LOOKED, evals[steps]  # it looks: chance is 0.25 without looking
    gap = "train/train_rollout_logprob_abs_diff"
    gaps = sorted(r[gap] for r in rows if gap in r)
    assert gaps and gaps[-1] < 1e-3, gaps  # the failed sample's loss mask is 0: its placeholder log-probs are not an
    # engine's, and the gap leaves them out


def assert_only_its_sample_failed(run: RunDir, said: str, reason: str) -> None:
    """The rollout log says ``said`` for the bad row each time it was drawn (once at least), naming its line and
    ``reason``."""
    log = (run.path / "logs" / "rollout.0.log").read_text()
    failed = [line for line in log.splitlines() if said in line]
    assert len(failed) >= 1 and all(f"line {BAD_ROW + 1}:" in line and reason in line for line in failed), failed
