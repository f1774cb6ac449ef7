"""Multi-turn with images, end to end: a few steps of recipes/quickstart-vision-multiturn.yaml on the local
executor. The prompt shows one picture, the environment's observation a second (relax_hpc/tasks/shapes_turns.py);
both travel through the engine's ``image_data`` and the exchange into the actor's forward.

Checked: the run completes (the held-out eval too); the samples took two turns with two pictures: their tokens hold both pictures' image
pads and their loss mask is 1 on the model's two answer tokens only (token by token, as the rollout wrote them to
the exchange; the actor's count of loss tokens agrees); the actor's log-probs are the engine's, so its M-RoPE
positions and images for the observation's picture are the engine's too."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from relax_hpc.controller import run_controller

from .conftest import HERE, REPO, locally, make_run, metrics

RECIPE = REPO / "recipes" / "quickstart-vision-multiturn.yaml"
STEPS = 3
VISION_START, VISION_END, IMAGE_PAD = 6, 7, 9  # make-tiny-model's ids
PADS = 4  # a 56×56 picture: 4 image tokens

# the recipe's reward, and each sample as the rollout hands it to the exchange, one JSON line in the run directory
RECORDING_REWARD = '''
    import json
    import sys
    from pathlib import Path

    from relax_hpc.tasks.shapes_turns import reward_func


    async def recorded(args, sample, **kwargs):
        with open(Path(sys.argv[1]) / "samples.jsonl", "a") as f:  # the rollout role's argv[1]: the run directory
            f.write(json.dumps({"tokens": sample.tokens, "loss_mask": sample.loss_mask,
                                "prompt_length": len(sample.tokens) - sample.response_length,
                                "images": len(sample.multimodal_inputs["images"]),
                                "stop": sample.metadata["rollout_stop_reason"],
                                "answers": [t["output_ids"] for t in sample.metadata["rollout_traces"]]}) + "\\n")
        return await reward_func(args, sample, **kwargs)
'''


def test_vision_multiturn_trains_two_pictures_per_sample(tmp_path, tiny_vlm):
    (tmp_path / "mt_record.py").write_text(textwrap.dedent(RECORDING_REWARD))
    run = make_run(tmp_path, tiny_vlm, f"data.path={REPO / 'recipes' / 'data' / 'shapes_turns.jsonl'}",
                   f"run.steps={STEPS}", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                   "rollout.n_samples_per_eval_prompt=1", "rollout.custom_rm_path=mt_record.recorded",
                   recipe=RECIPE, name="vision-multiturn")
    path = os.pathsep.join(p for p in (str(tmp_path), str(HERE), os.environ.get("PYTHONPATH")) if p)
    with locally(PYTHONPATH=path):
        final = run_controller(run.path)
    assert final["state"] == "COMPLETED", final
    assert json.loads((run.path / "summary.json").read_text())["steps"] == STEPS

    samples = [json.loads(line) for line in (run.path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == STEPS * 16 + 2 * 16  # and the held-out set's 16 prompts, at step 0 and the last
    done = [s for s in samples if s["stop"] == "done"]
    # the rest: a sampled vision token ends a rollout (rollout/multiturn.py); the random tiny model's are rare
    assert len(done) >= 0.8 * len(samples) and {s["stop"] for s in samples} <= {"done", "vision_token"}
    obs = [VISION_START] + [IMAGE_PAD] * PADS + [VISION_END]
    for s in done:
        prompt, response = s["tokens"][: s["prompt_length"]], s["tokens"][s["prompt_length"]:]
        (a1,), (a2,) = s["answers"]
        assert s["images"] == 2 and prompt[:6] == obs and prompt.count(IMAGE_PAD) == PADS
        assert response[0] == a1 and response[1:7] == obs and response[-1] == a2, response
        assert s["loss_mask"] == [1] + [0] * (len(response) - 2) + [1]  # the observation (its pads too) is 0
    for s in samples:
        if s["stop"] == "vision_token":
            assert s["images"] == 1 and s["loss_mask"] == [1]

    rows = [r for r in metrics(run) if "train/num_loss_tokens" in r]
    assert len(rows) == STEPS and all(r["rollout/env_failures"] == 0 for r in rows), rows
    # the actor counted the loss mask it read from the exchange: one token per model turn
    assert all(r["train/num_loss_tokens"] == pytest.approx(r["rollout/turns"] * r["train/num_samples"]) for r in rows)
    # its log-probs are the engine's: the same pictures at the same M-RoPE positions
    assert all(r["train/train_rollout_logprob_abs_diff_max"] < 1e-4 for r in rows), rows
