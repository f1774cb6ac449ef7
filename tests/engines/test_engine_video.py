"""The reference engine serving a Qwen2.5-VL video (tools/make-tiny-model --arch qwen2_5_vl): a real engine process,
requests with a video in SGLang's ``video_data`` (a video a list of frames), the expanded prompt and the log-probs
checked against a transformers forward of the same inputs; a bad frame refused naming it; and from a data row with
a video through the rollout driver to a generated sample."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import torch

from relax_hpc import multimodal
from tests.engines.vlm_requests import hf_logprobs, post


def frames(seed: int, n: int = 4) -> tuple[list[str], list]:
    """``n`` 56×56 frames of a light square crossing left to right: (base64 PNGs, PIL images)."""
    from PIL import Image

    imgs = []
    for i in range(n):
        f = np.full((56, 56, 3), 20 + seed, np.uint8)
        f[10:34, 10 * i:10 * i + 24] = 235
        imgs.append(Image.fromarray(f))
    out = []
    for im in imgs:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out, imgs


def prompt_ids(tiny_vlm) -> list[int]:
    tok = multimodal._tokenizer(str(tiny_vlm))
    return tok.encode("<|im_start|>user\n" + multimodal.VIDEO_PLACEHOLDER + "way?<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)


def test_video_request_expands_the_prompt_and_its_logprobs_are_the_models(vlm_engine, tiny_vlm):
    b64s, imgs = frames(0)
    ids = prompt_ids(tiny_vlm)
    pad = multimodal.token_id(tiny_vlm, multimodal.VIDEO_PAD)
    r = post(vlm_engine, {"input_ids": ids, "video_data": [b64s], "return_logprob": True,
                          "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3}})
    assert r.status_code == 200, r.text
    out = r.json()
    expanded, gen = out["meta_info"]["input_ids"], out["output_ids"]
    assert expanded.count(pad) == 8 and len(expanded) == len(ids) + 7 and out["meta_info"]["prompt_tokens"] == \
        len(expanded)
    lps = torch.tensor([row[0] for row in out["meta_info"]["output_token_logprobs"]])
    enc = multimodal.encode_media_ids(tiny_vlm, ids, videos=[imgs])
    assert enc["input_ids"][0].tolist() == expanded
    want = hf_logprobs(tiny_vlm, expanded, gen, enc)
    torch.testing.assert_close(lps, want, rtol=1e-4, atol=1e-4)
    # the order of the frames matters: the same frames played backwards give other log-probs
    back = multimodal.encode_media_ids(tiny_vlm, ids, videos=[imgs[::-1]])
    assert not torch.allclose(hf_logprobs(tiny_vlm, expanded, gen, back), want, atol=1e-4)


def test_a_bad_frame_or_missing_video_is_refused_naming_it(vlm_engine, tiny_vlm):
    b64s, _ = frames(0)
    bad = b64s[:2] + [base64.b64encode(b"not a frame at all, only text").decode()] + b64s[3:]
    r = post(vlm_engine, {"input_ids": prompt_ids(tiny_vlm), "video_data": [bad], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "video_data[0] is not a usable video: frame 2: not an image" in r.text, r.text
    r = post(vlm_engine, {"input_ids": prompt_ids(tiny_vlm), "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "video pad tokens" in r.text and "no video_data" in r.text, r.text
    r = post(vlm_engine, {"input_ids": prompt_ids(tiny_vlm), "video_data": [b64s, b64s],
                          "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "1 video pad tokens in 1 run(s) [1] for 2 video(s)" in r.text, r.text


def test_data_to_driver_a_video_reaches_the_engine_and_a_corrupt_one_fails_its_group(vlm_engine, tiny_vlm, tmp_path):
    from relax_hpc.recipe.schema import Recipe
    from relax_hpc.rollout.config import RolloutConfig
    from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource
    from relax_hpc.rollout.driver import RolloutDriver
    from relax_hpc.rollout.sample import SampleStatus

    b64s, imgs = frames(0)
    rows = [{"prompt": "<video>way?", "video": b64s},
            {"prompt": "<video>way?", "video": b64s[:3] + [base64.b64encode(b"\x89PNG\r\n\x1a\n cut").decode()]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = PromptDataset(tmp_path / "d.jsonl", keys=DataKeys(input_key="prompt", label_key=None, video_key="video"),
                       tokenizer=tiny_vlm, apply_chat_template=True)
    src = RolloutDataSource(ds, rollout_batch_size=2, n_samples_per_prompt=2)
    driver = RolloutDriver(Recipe(rollout=RolloutConfig(rm_type="random", max_response_len=3, n_samples_per_prompt=2,
                                                        rollout_batch_size=2)),
                           {"vlm": vlm_engine}, tokenizer=ds.tokenizer)
    res = driver.generate_rollout_sync(src.get_samples())
    good, bad = res.samples[:2], res.samples[2:]
    pad = multimodal.token_id(tiny_vlm, multimodal.VIDEO_PAD)
    for s in good:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and 1 <= s.response_length <= 3
        prompt = s.tokens[:s.prompt_length]
        assert prompt.count(pad) == 8
        enc = multimodal.encode_media_ids(tiny_vlm, prompt, videos=[[multimodal.load_image(f)
                                                                     for f in s.multimodal_inputs["videos"][0]]])
        want = hf_logprobs(tiny_vlm, prompt, s.tokens[s.prompt_length:], enc)  # the engine saw these frames
        torch.testing.assert_close(torch.tensor(s.rollout_log_probs), want, rtol=1e-4, atol=1e-4)
    for s in bad:
        err = s.metadata["image_error"]
        assert s.status is SampleStatus.FAILED and "d.jsonl: line 2: " in err and "frame 3" in err, err
