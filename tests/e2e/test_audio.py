"""The audio quickstart learns to listen: a run of recipes/quickstart-audio.yaml on the local executor.

A tiny Qwen2.5-Omni thinker (tools/make-tiny-model --arch qwen2_5_omni) is trained with GRPO to name a tone's pitch
(relax_hpc/tasks/tones.py): the clips travel from the data (8-bit 8 kHz WAV, resampled to 16 kHz) through the
engine's ``audio_data`` and the exchange (the feature extractor's frames, written once) into the actor's forward
(the frozen HF audio tower inside the Megatron model). One run (a module fixture) serves every check: the reward
rises; the listening itself, on the recipe's held-out set (30 clips of another seed, each pitch 10 times): an answer
that does not depend on the clip, whatever its letters, is right on 1/3 of them, so a pass@1 far above that is the
answer depending on the audio; every step's weights reach the engine; the actor's log-probs are the engine's; one
row whose clip is corrupt fails its own sample only, with its line and reason, while the run completes.
"""

from __future__ import annotations

import base64
import json
import time

import pytest

from relax_hpc.controller import run_controller

from .conftest import REPO, make_run, make_tiny_model, metrics

RECIPE = REPO / "recipes" / "quickstart-audio.yaml"
DATA = REPO / "recipes" / "data" / "tones.jsonl"
HELDOUT = REPO / "recipes" / "data" / "tones-eval.jsonl"
STEPS = 50  # the recipe has 60; the listening shows from ~40 on (docs/multimodal.md, "The audio quickstart")
RISE = 0.2  # reward, first 10 steps -> last 10
CHANCE = 1 / 3  # pass@1 of any answer that does not listen, on the pitch-balanced held-out set
LISTENED = 0.45  # held-out pass@1 at the end: ~4 sd (0.03 over its 240 samples) above a non-listening 1/3
BAD_ROW = 5  # 0-based: line 6 of the data copy


@pytest.fixture(scope="module")
def audio_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e-audio")
    model = make_tiny_model(tmp / "tiny-qwen2_5_omni", arch="qwen2_5_omni", seed=0)
    rows = DATA.read_text().splitlines()
    bad = json.loads(rows[BAD_ROW])
    bad["audios"] = [base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt but then no audio at all").decode()]
    rows[BAD_ROW] = json.dumps(bad)
    data = tmp / "tones-one-bad.jsonl"
    data.write_text("\n".join(rows) + "\n")
    run = make_run(tmp, model, f"data.path={data}", f"run.steps={STEPS}", f"rollout.eval_interval={STEPS}",
                   f"data.eval_prompt_data.heldout={HELDOUT}", recipe=RECIPE, name="audio")
    t0 = time.monotonic()
    final = run_controller(run.path)
    print(f"[audio quickstart] {STEPS} steps in {time.monotonic() - t0:.0f} s")
    return run, final


@pytest.mark.slow
def test_the_audio_quickstart_completes_and_learns(audio_run):
    run, final = audio_run
    assert final["state"] == "COMPLETED", final
    summary = json.loads((run.path / "summary.json").read_text())
    print(f"[audio quickstart] reward first 10 {summary['reward_first10']:.3f} -> last 10 "
          f"{summary['reward_last10']:.3f}")
    assert summary["steps"] == STEPS and summary["state"] == "COMPLETED"
    assert summary["reward_last10"] > summary["reward_first10"] + RISE, summary


@pytest.mark.slow
def test_it_listens_on_held_out_clips(audio_run):
    run, _ = audio_run
    evals = {r["step"]: r for r in metrics(run) if "eval/heldout-pass@1" in r}
    assert sorted(evals) == [0, STEPS], evals  # before training, and after the last step
    print(f"[audio quickstart] held-out pass@1 {evals[0]['eval/heldout-pass@1']:.3f} -> "
          f"{evals[STEPS]['eval/heldout-pass@1']:.3f}")
    assert evals[0]["eval/heldout-pass@1"] < CHANCE, evals[0]  # the untrained model answers over its vocabulary
    assert evals[STEPS]["eval/heldout-pass@1"] > LISTENED, evals[STEPS]  # it listens: 1/3 without


@pytest.mark.slow
def test_weights_reach_the_engine_and_the_actor_hears_what_the_engine_heard(audio_run):
    run, _ = audio_run
    rows_m = [r for r in metrics(run) if "weights/fingerprint_match" in r]
    assert len(rows_m) >= STEPS - 1 and all(r["weights/fingerprint_match"] == 1.0 for r in rows_m), rows_m
    gaps = sorted(r["train/train_rollout_logprob_abs_diff"] for r in metrics(run)
                  if "train/train_rollout_logprob_abs_diff" in r)
    assert gaps and gaps[-1] < 1e-3, gaps  # the actor's audio features are the engine's


@pytest.mark.slow
def test_a_corrupt_clip_fails_only_its_sample(audio_run):
    run, _ = audio_run
    log = (run.path / "logs" / "rollout.0.log").read_text()
    failed = [line for line in log.splitlines() if "its audio cannot be used" in line]
    assert len(failed) >= 1, "the bad row was never drawn"
    assert all(f"line {BAD_ROW + 1}:" in line and "data.multimodal_keys.audio" in line and "not a WAV file" in line
               for line in failed), failed
