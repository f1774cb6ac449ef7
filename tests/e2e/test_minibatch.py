"""Mini-batch updates (``train.num_steps_per_rollout``): k optimizer steps per rollout step, π_old fixed before
the first, so from the second update on the ratio moves off 1 and clipping acts.

The run is the uninterrupted reference of tests/e2e/test_resume.py (the same recipe, :data:`interrupt.SHORT`, one
run for both); that a mini-batch run requeued mid-way (SIGUSR2, the time-limit warning) redoes its steps exactly
as the uninterrupted one did is asserted there, key by key (``train/pg_clipfrac`` and ``train/ppo_kl`` too)."""

from __future__ import annotations

import pytest

from .interrupt import SHORT, STEPS, K


@pytest.fixture(scope="module")
def reference(uninterrupted) -> dict[int, dict]:
    return uninterrupted(*SHORT, steps=STEPS)


def test_k_updates_per_rollout_step_move_the_ratio_off_one(reference):
    rows = list(reference.values())
    assert all(r["train/num_steps"] == K for r in rows)
    assert all(r["train/num_samples"] == 64 for r in rows)  # the k mini-batches together: the whole step
    assert rows[-1]["train/step"] == K * STEPS  # optimizer steps
    # with one update per rollout step the ratio is exactly 1 and both are 0; here the later updates see a
    # policy that moved since π_old
    assert max(r["train/pg_clipfrac"] for r in rows) > 0
    assert all(abs(r["train/ppo_kl"]) > 0 for r in rows)
    for r in rows:  # Relax's rollout/* means and perf/* rates (docs/metrics.md)
        assert r["rollout/log_probs"] < 0 and r["rollout/rollout_log_probs"] < 0
        assert abs(r["rollout/log_probs"] - r["rollout/rollout_log_probs"]) < 1e-4  # same weights, two engines
        assert r["rollout/advantages"] == r["rollout/returns"]
        assert r["perf/tokens_per_gpu_per_sec"] > 0 and r["perf/longest_sample_tokens_per_sec"] > 0
