"""train.nonfinite on real Megatron: a step whose loss and grad norm are NaN (a NaN advantage) is never applied.

Under ``skip`` no weight, main param or Adam state tensor moves (Adam's step count included), the metrics say
``nonfinite_skipped`` = 1 with the NaN loss kept, and the next good step trains; ``max_nonfinite_skips``
consecutive skips pass and one more fails; under ``fail`` the first fails. Both failures are permanent and name
the step, what was not finite and the keys. TP=1 here (the ``single_run`` launch); DP=2 with the optimizer state
sharded and PP=2 (the loss only on the last stage, so the ranks must agree) in the slow ``multi_run`` launch."""

from __future__ import annotations

import math

import pytest

from train.conftest import part


def _check(r: dict) -> None:
    assert r["first"]["nonfinite_skipped"] == 0.0 and math.isfinite(r["first"]["loss"])
    skip = r["skip"]
    assert skip["unchanged"], "a skipped step changed a weight or the optimizer state"
    assert skip["nonfinite_skipped"] == 1.0 and skip["update_successful"] == 0.0
    assert r["loss_is_nan"] and math.isnan(skip["pg_loss"]) and not math.isfinite(skip["grad_norm"])
    assert skip["step"] == 2.0  # the slot is used: checkpoint names stay unique, the lr schedule moves on
    assert skip["why"].startswith("loss = nan") and "grad_norm = " in skip["why"]
    nxt = r["next"]
    assert nxt["changed"] and nxt["finite"] and nxt["nonfinite_skipped"] == 0.0 and nxt["why"] is None
    assert math.isfinite(nxt["loss"])
    assert r["streak"] == [1.0, 1.0] and r["streak_permanent"] and r["streak_unchanged"]
    err = r["streak_error"]
    assert "rollout step 9, optimizer step" in err and "loss = nan" in err and "3 consecutive" in err
    assert "train.max_nonfinite_skips = 2" in err and "train.nonfinite = skip" in err
    assert r["fail_type"] == "NonFiniteError" and r["fail_permanent"] and r["fail_unchanged"]
    err = r["fail_error"]
    assert err.startswith("rollout step 12, optimizer step ") and "loss = nan" in err
    assert "train.nonfinite = fail" in err and "train.max_nonfinite_skips" in err and "Fix:" in err


@pytest.mark.timeout(300)
def test_nonfinite_step_is_skipped_or_fails_tp1(single_run):
    _check(part(single_run, "nonfinite")["tp1_pp1_dp1"])


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["tp1_pp1_dp2", "tp1_pp2_dp1"])
def test_nonfinite_step_is_skipped_alike_on_every_rank(multi_run, layout):
    _check(part(multi_run, "nonfinite")[layout])
