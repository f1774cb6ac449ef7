"""The quickstart learns: a shortened run on the local executor (and, marked slurm, as a Slurm het job).

The local test runs the quickstart recipe for 25 steps (the full quickstart runs 200; docs/quickstart.md
has its numbers) and checks what a user is told to look at: summary.json's rewards (the last 10 steps'
mean well above the first 10's), TensorBoard events with Relax's metric names, state.json's progress,
reward.png; and what the run checks on the way: every step's samples carry the weights of the step
before, every sync lands (fingerprint), engine and actor log-probs agree.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from relax_hpc.controller import run_controller
from relax_hpc.exchange.audit import exactly_once
from relax_hpc.exchange.journal import iter_ops, replay
from relax_hpc.rundir import RunDir

from .conftest import (REPO, follow_slurm, metrics, quickstart_overrides, state, submit_slurm, tensorboard_tags,
                       wait_until)

STEPS = 25
RISE = 0.15


@pytest.mark.slow
def test_quickstart_learns_locally(tmp_path, tiny_model, local_executor):
    from .conftest import make_run

    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", name="quickstart")
    t0 = time.monotonic()
    final = run_controller(run.path)
    wall = time.monotonic() - t0
    assert final["state"] == "COMPLETED"

    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["state"] == "COMPLETED"
    first, last = summary["reward_first10"], summary["reward_last10"]
    assert last > first + RISE, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    assert (run.path / "reward.png").stat().st_size > 1000

    st = state(run)
    assert st["step"] == STEPS and st["total_steps"] == STEPS and st["phase"] == "finished"
    assert st["reward"] is not None and st["reward_first10"] == first and st["reward_last10"] == last
    assert st["last_checkpoint"]["step"] == STEPS and Path(st["last_checkpoint"]["path"]).is_dir()
    # the engine registry: the run's one engine, started with it, ready, serving the last step's weights
    [(name, engine)] = st["engines"].items()
    assert name == "engine0" and engine["origin"] == "initial" and engine["state"] == "ready"
    assert engine["weight_version"] == str(STEPS) and engine["job_id"] == "local" and engine["url"].startswith("http")

    tags = tensorboard_tags(run.path / "tensorboard")
    for tag in ("rollout/raw_reward", "rollout/response_len/mean", "train/pg_loss", "train/grad_norm", "train/loss",
                "perf/rollout_time", "perf/train_time", "perf/weight_sync_time", "perf/step_time"):
        assert [s for s, _ in tags.get(tag, [])] == list(range(1, STEPS + 1)), tag
    assert tags["rollout/raw_reward"][-1][1] == pytest.approx(summary["reward_final"], abs=1e-6)

    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["rollout/weight_version"] == r["step"] - 1  # generated with the weights synced after step N-1
        assert r["weights/fingerprint_match"] == 1.0 and r["weights/versions_ok"] == 1.0
        assert r["train/train_rollout_logprob_abs_diff_max"] <= 1e-4
    # colocate is max_staleness 0: from the journal, every partition started with none uncleared (rollout
    # never ran ahead), and every sample was trained on exactly once
    journal = run.path / "exchange" / "journal.jsonl"
    starts = list(iter_ops(replay(journal), "start"))
    assert [s["step"] for s in starts] == list(range(1, STEPS + 1))
    assert all(s["min_uncleared"] is None for s in starts)
    assert exactly_once(journal, ["train"]) == []
    print(f"quickstart {STEPS} steps: reward {first:.3f} -> {last:.3f}, {wall:.0f} s")


@pytest.mark.slurm
@pytest.mark.slow
def test_quickstart_learns_on_slurm_with_four_groups_at_once(slurm_cluster, tmp_path, tiny_model):
    """relax-submit recipes/quickstart-slurm.yaml on the dev cluster: actor, rollout, reference and actor_fwd each
    in their own het component (one node each), fully async; the reward rises, and the journal shows every
    produced sample consumed exactly once by each task (train, reference, actor_fwd)."""
    recipe = REPO / "recipes" / "quickstart-slurm.yaml"
    sub = submit_slurm(recipe, tmp_path, slurm_cluster.env,
                       quickstart_overrides(tiny_model, tmp_path / "runs", f"run.steps={STEPS}"))
    job, run_dir = sub["job_id"], Path(sub["run_dir"])
    st, seen = follow_slurm(sub, tmp_path, slurm_cluster.env, 4, 1200)
    assert st.get("state") == "COMPLETED", st
    assert seen == {f"{job}+{k}" for k in range(4)}, "the four components never ran at once"
    # relax-status --json shows the engine registry: where the engine runs (the rollout component's job and step)
    [engine] = st["engines"]
    assert (engine["name"], engine["origin"], engine["state"]) == ("engine0", "initial", "ready")
    assert engine["weight_version"] == str(STEPS) and engine["job_id"].isdigit() and engine["step_id"].isdigit()
    ctl = json.loads((run_dir / "state.json").read_text())
    het = ctl["roles"]["rollout"]["het_group"]

    def own_step() -> str | None:  # the engine is a job step of its own, not the rollout driver's (accounting lags)
        out = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,JobName"], capture_output=True, text=True,
                             env=slurm_cluster.env).stdout
        names = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
        return names.get(f"{job}+{het}.{engine['step_id']}")

    wait_until(own_step, 60, every=1, what=f"engine0's step {job}+{het}.{engine['step_id']} in sacct")
    assert own_step() == "engine-engine0"
    assert ctl["executor"] == "slurm" and ctl["step"] == STEPS and ctl["mode"] == "fully_async"
    assert len({ctl["roles"][r]["het_group"] for r in ("actor", "rollout", "reference", "actor_fwd")}) == 4
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_last10"] > summary["reward_first10"] + RISE, summary
    assert exactly_once(run_dir / "exchange" / "journal.jsonl", ["train", "reference", "actor_fwd"]) == []
    rows = metrics(RunDir(run_dir))
    assert all("train/kl_loss" in r and "perf/reference_time" in r and "perf/actor_fwd_time" in r for r in rows)
    # actor_fwd follows the actor through the weight syncs (its weights checked like an engine's), so checkpoints
    # stay at checkpoint.interval (0: one, after the last step), not one per step
    assert all(r["weights/fingerprint_match"] == 1.0 for r in rows)
    saved = [e["detail"] for e in ctl["events"] if e["event"] == "checkpoint"]
    assert len(saved) == 1 and saved[0].startswith(f"step {STEPS}:"), saved
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [f"step_{STEPS:08d}"]

