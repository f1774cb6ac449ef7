"""Non-finite values are stopped where they enter: a reward of 1e39 (inf in the float32 raw_reward column) and an
engine returning NaN log-probs, in a run with ``use_tis`` (where either would turn the loss, then every weight,
NaN). The run completes; the bad engine is declared dead with the reason and started again, its requests served
by the other engine; the reward failure is counted; and no value in the final checkpoint is NaN or infinite."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from relax_hpc.controller import run_controller

from .conftest import make_run, metrics, state

STEPS = 4


def checkpoint_tensors(step_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint (model and optimizer), read whole with torch.distributed.checkpoint
    in this process (no process group): what a resume would load."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "checkpoint.pt"
    dcp_to_torch_save(step_dir, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, x) -> None:
        if isinstance(x, torch.Tensor):
            flat[prefix] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", torch.load(out, weights_only=False))
    return flat


@pytest.mark.slow
def test_a_huge_reward_and_nan_logprobs_never_train(tmp_path, tiny_model, local_executor, monkeypatch):
    # the first engine to start (of two) answers its first 3 generates with a NaN log-prob; not the one started
    # again in its place (the claim file exists by then)
    monkeypatch.setenv("RELAX_TEST_ENGINE_BAD_OUTPUT", f"nan_logprobs:3:{tmp_path / 'bad-engine-claim'}")
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", "algorithm.use_tis=true",
                   "rollout.custom_rm_path=e2e_rewards.huge_reward_in_step_2", "rollout.reward_error_policy=skip",
                   "roles.rollout.tasks_per_node=2", name="nonfinite")
    final = run_controller(run.path)
    assert final["state"] == "COMPLETED", final

    # the engine: declared dead with what was wrong, and started again; its requests went to the other engine
    st = state(run)
    restarts = [ev["detail"] for ev in st["events"] if ev["event"] == "engine_restart"]
    assert len(restarts) == 1, st["events"]
    assert "bad output: the log-prob of output token 0" in restarts[0] and "is nan" in restarts[0], restarts
    bad = restarts[0].split(" ", 1)[0]
    engine = st["engines"][bad]  # in the registry: dead with the reason, or already back (a new engine takes ~20 s)
    assert (engine["state"] == "dead" and "bad output: the log-prob" in engine["dead"]) or engine["restarts"] == 1
    log = (run.logs / "controller.log").read_text()
    assert f"step 1: rollout engine {bad} (http://" in log and "/generate failed: bad output: the log-prob" in log

    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["rollout/engines_dead"] >= 1.0  # counted at the step it died in
    # the reward: refused as inf in float32, counted, the sample given 0 (skip); the run went on
    assert [r["rollout/reward_failed"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert "not a finite number in float32" in log and "reward failed for sample index=" in log
    for r in rows:  # neither reached the loss
        for k in ("rollout/raw_reward", "train/loss", "train/pg_loss", "train/grad_norm",
                  "train/train_rollout_logprob_abs_diff_max"):
            assert math.isfinite(r[k]), (r["step"], k, r[k])
        assert r["train/train_rollout_logprob_abs_diff_max"] <= 1e-4  # the engine's log-probs that trained are real

    # the final checkpoint: every weight and optimizer value finite
    tensors = checkpoint_tensors(Path(st["last_checkpoint"]["path"]), tmp_path)
    weights = [k for k in tensors if not k.startswith("optimizer.")]
    assert {"embedding.word_embeddings.weight", "output_layer.weight"} <= set(weights), sorted(tensors)
    bad_tensors = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    assert bad_tensors == [], bad_tensors
