"""Must-show 2: GRPO on a fixed batch lowers the loss and moves log-probs the way the advantages point;
TP=2, DP=2 (DistributedOptimizer over two ranks) and PP=2 give TP=1's losses within 1e-5, also when each DP
rank builds only its share of the batch (the actor role's path)."""

from __future__ import annotations

import pytest

from train.conftest import part

TOL = 1e-5


def _show(key: str, r: dict) -> str:
    return f"{key}: loss " + " ".join(f"{s['loss']:+.6f}" for s in r["steps"]) + \
        " | grad_norm " + " ".join(f"{s['grad_norm']:.6f}" for s in r["steps"]) + f" | {r['step_s'] * 1e3:.0f} ms/step"


@pytest.mark.timeout(300)
def test_grpo_lowers_loss_and_follows_advantages(single_run):
    r = part(single_run, "train")["tp1_pp1_dp1"]
    print(_show("tp1", r))
    losses = [s["loss"] for s in r["steps"]]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.01, losses
    for adv, change in zip(r["advantage"], r["logprob_change"]):
        assert change * adv > 0, (adv, change)  # up for positive advantages, down for negative
    assert all(s["grad_norm"] > 0 for s in r["steps"])
    n = len(r["advantage"])  # micro_batch_size 2: each step shows progress once per micro-batch
    assert r["progress_calls"] == len(r["steps"]) * -(-n // 2), r["progress_calls"]
    # the first update, of a batch without π_old: its forward's log-probs, handed back for every sample, are π_old
    # (a pass of its own with the same weights), and its ratio is 1 (nothing clipped, no KL to π_old)
    assert r["fused_n"] == n and r["fused_max_diff"] <= TOL, r["fused_max_diff"]
    assert r["steps"][0]["pg_clipfrac"] == 0 and r["steps"][0]["ppo_kl"] == 0


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["tp2_pp1_dp1", "tp1_pp1_dp2", "tp1_pp2_dp1"])
def test_layouts_match_tp1(single_run, multi_run, layout):
    ref = part(single_run, "train")["tp1_pp1_dp1"]
    got = part(multi_run, "train")[layout]
    print(_show(layout, got))
    worst = max(abs(a[k] - b[k]) for a, b in zip(ref["steps"], got["steps"]) for k in ("loss", "grad_norm"))
    print(f"{layout}: max |diff| vs tp1 over losses and grad norms = {worst:.2e}")
    for a, b in zip(ref["steps"], got["steps"]):
        for k in ("loss", "pg_loss", "ppo_kl", "entropy_loss"):
            assert abs(a[k] - b[k]) <= TOL, (layout, k, a[k], b[k])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL * max(1.0, a["grad_norm"]), (layout, a, b)
    for a, b in zip(ref["logprob_change"], got["logprob_change"]):
        assert abs(a - b) <= TOL
    # the actor role's DP-share path: π_old of its own share equals the gathered global pass, and the
    # engine gap all-reduced over DP equals one process's over the whole batch
    assert got["share_max_diff"] <= TOL and got["share_n"] == (4 if layout.endswith("dp2") else 8)
    assert got["gap_max"] == pytest.approx(ref["gap_max"], abs=1e-6) and ref["gap_max"] == pytest.approx(0.008, abs=1e-5)
    # Relax's rollout/log_probs: the mean over all samples of each one's token mean, whatever the layout
    assert got["mean_lp"] == pytest.approx(got["mean_lp_want"], abs=1e-6) and got["mean_keys"] == ["old_log_probs"]
