"""After a weight sync the engine serves exactly the actor's weights, tagged with the new version, and the
log-probs it returns for the tokens it sampled are the ones the actor recomputes (≤ 1e-4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def parity(tiny_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("parity") / "result.json"
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}  # as the actor role on a CPU: no compile at the first step
    p = subprocess.run([sys.executable, str(HERE / "parity_worker.py"), str(tiny_model), str(out)],
                       capture_output=True, text=True, timeout=400, env=env)
    assert out.exists(), f"worker wrote nothing (rc {p.returncode}):\n{p.stderr[-4000:]}"
    res = json.loads(out.read_text())
    assert p.returncode == 0, f"worker failed (rc {p.returncode}):\n{p.stderr[-4000:]}\n{res}"
    return res


def test_engine_weights_equal_the_actors_after_a_sync(parity):
    assert parity["fingerprint_engine_start"] == parity["fingerprint_actor_start"]  # both loaded the files
    assert parity["fingerprint_actor_trained"] != parity["fingerprint_actor_start"]  # training moved the actor
    assert parity["fingerprint_engine_synced"] == parity["fingerprint_actor_synced"] == parity["fingerprint_actor_trained"]


def test_engine_and_samples_carry_the_new_version(parity):
    assert parity["engine_version"] == "1"
    assert parity["sample_versions"] == ["1"]


def test_engine_logprobs_match_the_actors_recomputed_logprobs(parity):
    assert parity["n_samples"] == 32 and parity["n_tokens"] > 32  # several response tokens per sample
    assert parity["logprob_max_abs_diff"] <= 1e-4, parity["logprob_max_abs_diff"]
