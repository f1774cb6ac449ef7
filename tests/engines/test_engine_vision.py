"""The reference engine serving a vision-language model (tools/make-tiny-model --arch qwen2_5_vl): a real engine
process, requests with images in SGLang's ``image_data``, the expanded prompt and the log-probs checked against a
transformers forward of the same inputs."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch

from relax_hpc import multimodal
from tests.engines.vlm_requests import hf_logprobs, post
from tests.rollout.conftest import _tiny_model_maker

IMAGE_PAD = 9  # make-tiny-model's <|image_pad|>
MERGE = 2


def png(w: int, h: int, seed: int) -> tuple[str, object]:
    import numpy as np
    from PIL import Image

    img = Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode(), img


def prompt_ids(tiny_vlm, n_images: int = 1) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_vlm))
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": "what is it?"}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_image_request_expands_the_prompt_and_its_logprobs_are_the_models(vlm_engine, tiny_vlm):
    from relax_hpc.multimodal import encode_ids

    (b64, img), (b64_2, img_2) = png(84, 56, 0), png(56, 56, 1)  # grids 1×4×6 and 1×4×4: 6 and 4 image tokens
    ids = prompt_ids(tiny_vlm, 2)
    r = post(vlm_engine, {"input_ids": ids, "image_data": [b64, "data:image/png;base64," + b64_2],
                          "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3},
                          "return_logprob": True})
    assert r.status_code == 200, r.text
    out = r.json()
    expanded = out["meta_info"]["input_ids"]
    assert expanded.count(IMAGE_PAD) == 6 + 4 and out["meta_info"]["prompt_tokens"] == len(expanded)
    assert len(expanded) == len(ids) - 2 + 10
    assert [t for t in expanded if t != IMAGE_PAD] == [t for t in ids if t != IMAGE_PAD]
    gen = out["output_ids"]
    lps = [row[0] for row in out["meta_info"]["output_token_logprobs"]]
    assert len(gen) == len(lps) == 6

    # a transformers forward of the same inputs: the expanded prompt + the generated tokens, the same pixels
    feats = encode_ids(tiny_vlm, ids, [img, img_2])
    assert feats["input_ids"][0].tolist() == expanded
    want = hf_logprobs(tiny_vlm, expanded, gen, feats)
    torch.testing.assert_close(torch.tensor(lps), want, rtol=1e-4, atol=1e-4)
    # the image matters: another image gives other log-probs for the same tokens
    other = encode_ids(tiny_vlm, ids, [img_2, img_2])
    assert not torch.allclose(hf_logprobs(tiny_vlm, other["input_ids"][0].tolist(), gen, other), want, atol=1e-4)


def test_a_batch_with_images_of_different_sizes_and_none(vlm_engine, tiny_vlm):
    (b64, _), (b64_2, _) = png(84, 56, 0), png(112, 112, 2)  # 6 and 16 image tokens
    ids = prompt_ids(tiny_vlm)
    text_only = ids[:6] + ids[9:]  # "<|im_start|>user\n" then no <|vision_start|><|image_pad|><|vision_end|>
    assert IMAGE_PAD not in text_only
    r = post(vlm_engine, {"input_ids": [ids, ids, text_only], "image_data": [b64, [b64_2], None],
                          "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}, "return_logprob": True})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(ids) + 5, len(ids) + 15, len(text_only)]
    assert "input_ids" not in outs[2]["meta_info"]
    assert all(len(o["output_ids"]) == 3 for o in outs)


@pytest.mark.parametrize("image, why", [
    ("/no/such/picture.png", "no such file"),
    (base64.b64encode(b"this is not a picture at all, only text").decode(), "not an image"),
    ("!!!not base64 and not a file" * 4, "base64"),
])
def test_a_bad_image_is_refused_naming_it(vlm_engine, tiny_vlm, image, why):
    r = post(vlm_engine, {"input_ids": prompt_ids(tiny_vlm), "image_data": [image],
                          "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400, r.text
    assert "image_data[0]" in r.text and why in r.text


def test_placeholders_that_do_not_match_the_images_are_refused(vlm_engine, tiny_vlm):
    b64, _ = png(56, 56, 0)
    r = post(vlm_engine, {"input_ids": prompt_ids(tiny_vlm), "image_data": [b64, b64],
                          "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "image pad tokens" in r.text, r.text


def test_data_to_driver_images_reach_the_engine_and_a_bad_one_fails_its_group(vlm_engine, tiny_vlm, tmp_path):
    """From a JSONL row with an image to a generated sample: the driver sends the sample's images with its
    (expanded) prompt; the row whose image is missing fails its group without any request, the step goes on."""
    import json

    from relax_hpc.recipe.schema import Recipe
    from relax_hpc.rollout.config import RolloutConfig
    from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource
    from relax_hpc.rollout.driver import RolloutDriver
    from relax_hpc.rollout.sample import SampleStatus

    (tmp_path / "a.png").write_bytes(base64.b64decode(png(84, 56, 0)[0]))
    rows = [{"prompt": "<image>what?", "images": "a.png"}, {"prompt": "<image>and?", "images": "gone.png"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = PromptDataset(tmp_path / "d.jsonl", keys=DataKeys(input_key="prompt", label_key=None, image_key="images"),
                       tokenizer=tiny_vlm, apply_chat_template=True)
    src = RolloutDataSource(ds, rollout_batch_size=2, n_samples_per_prompt=2)
    driver = RolloutDriver(Recipe(rollout=RolloutConfig(rm_type="random", max_response_len=4, n_samples_per_prompt=2,
                                                        rollout_batch_size=2)),
                           {"vlm": vlm_engine}, tokenizer=ds.tokenizer)
    res = driver.generate_rollout_sync(src.get_samples())
    good, bad = res.samples[:2], res.samples[2:]
    for s in good:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and 1 <= s.response_length <= 4
        assert s.tokens[:s.prompt_length].count(IMAGE_PAD) == 6
        # the engine saw the image: its log-probs are the model's given these pixels
        img = multimodal.load_image(s.multimodal_inputs["images"][0])
        feats = multimodal.encode_ids(tiny_vlm, s.tokens[:s.prompt_length], [img])
        want = hf_logprobs(tiny_vlm, s.tokens[:s.prompt_length], s.tokens[s.prompt_length:], feats)
        torch.testing.assert_close(torch.tensor(s.rollout_log_probs), want, rtol=1e-4, atol=1e-4)
    for s in bad:
        assert s.status is SampleStatus.FAILED and "d.jsonl: line 2: " in s.metadata["image_error"]
        assert "gone.png" in s.metadata["image_error"] and s.reward == 0.0 and s.loss_mask == [0]


def test_image_pads_without_images_are_refused(vlm_engine, tiny_vlm):
    r = post(vlm_engine, {"input_ids": prompt_ids(tiny_vlm), "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "no image_data" in r.text, r.text


def test_qwen3_vl_in_process(tmp_path):
    """Qwen3-VL (interleaved M-RoPE, DeepStack) through the same path, the engine in this process: the expanded
    prompt and the log-probs of a transformers forward."""
    from relax_hpc.engines.model_runner import CPUEngine

    model_dir = _tiny_model_maker()(tmp_path / "qwen3_vl", arch="qwen3_vl", seed=0)
    b64, img = png(96, 64, 0)  # 32-pixel merged patches: 3×2 = 6 image tokens
    ids = prompt_ids(model_dir)
    out = CPUEngine(str(model_dir), seed=0).generate(
        {"input_ids": ids, "image_data": b64, "return_logprob": True,
         "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 1}})
    expanded, gen = out["meta_info"]["input_ids"], out["output_ids"]
    assert expanded.count(IMAGE_PAD) == 6 and len(gen) == 5
    want = hf_logprobs(model_dir, expanded, gen, multimodal.encode_ids(model_dir, ids, [img]))
    torch.testing.assert_close(torch.tensor([row[0] for row in out["meta_info"]["output_token_logprobs"]]), want,
                               rtol=1e-4, atol=1e-4)


def test_pause_and_abort_reach_a_request_with_images(vlm_engine, tiny_vlm):
    """A request with images runs outside the batches but obeys the same controls: in_place pause holds it after
    a token, /continue_generation lets it finish, /abort_request ends it aborted; the memory is not released under
    it."""
    import threading

    b64, _ = png(56, 56, 0)
    body = {"input_ids": prompt_ids(tiny_vlm), "image_data": [b64],
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}, "return_logprob": True}

    def requests_seen() -> int:
        return httpx.get(vlm_engine.url + "/server_info").json()["internal_states"][0]["num_requests"]

    def send_while_paused() -> dict:
        before, got = requests_seen(), {}
        assert httpx.post(vlm_engine.url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
        t = threading.Thread(target=lambda: got.update(post(vlm_engine, body).json()))
        t.start()
        while requests_seen() == before:  # it has arrived and runs (or waits) alone
            threading.Event().wait(0.02)
        return {"thread": t, "out": got}

    held = send_while_paused()
    r = httpx.post(vlm_engine.url + "/release_memory_occupation", json={})
    assert r.status_code == 400 and "ongoing request" in r.text
    assert httpx.post(vlm_engine.url + "/continue_generation", json={}).status_code == 200
    held["thread"].join(60)
    assert held["out"]["meta_info"]["finish_reason"]["type"] == "length" and len(held["out"]["output_ids"]) == 5

    held = send_while_paused()
    assert httpx.post(vlm_engine.url + "/abort_request", json={"abort_all": True}).status_code == 200
    held["thread"].join(60)
    httpx.post(vlm_engine.url + "/continue_generation", json={})
    out = held["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) == 1


def test_identical_requests_with_an_image_running_at_once_share_one_prefill(tiny_vlm):
    """A GRPO group sends one prompt with its image n times at once: the first request runs the prefill, the others
    take its logits and a copy of its KV cache (SGLang serves them from its cache too) and say so in
    ``cached_tokens``. Each answer is the one it gets alone: the same seed, the same tokens and log-probs, also past
    the first token (each decodes on its own copy). Deterministic: the test holds the model lock until the three
    others wait on the first's prefill. Negative control: another image is not shared."""
    import threading
    import time

    from relax_hpc.engines.model_runner import CPUEngine

    engine = CPUEngine(str(tiny_vlm), seed=0)
    b64, _ = png(56, 56, 0)
    other, _ = png(56, 56, 1)
    ids = prompt_ids(tiny_vlm)

    def body(seed: int, image: str = b64) -> dict:
        return {"input_ids": ids, "image_data": image, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": seed,
                                    "ignore_eos": True}}

    alone = [engine.generate(body(seed)) for seed in range(4)]
    assert all(a["meta_info"]["cached_tokens"] == 0 for a in alone)
    outs: dict[int, dict] = {}
    with engine.model_lock:  # the first request's prefill waits here; the others wait on it
        threads = [threading.Thread(target=lambda s=seed: outs.__setitem__(s, engine.generate(body(s))))
                   for seed in range(4)]
        threads.append(threading.Thread(target=lambda: outs.__setitem__(9, engine.generate(body(0, other)))))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sum(s.waiting for s in list(engine.prefills.values())) < 3 or len(engine.prefills) < 2:
            assert time.monotonic() < deadline, engine.prefills
            time.sleep(0.01)
    for t in threads:
        t.join(60)
    cached = sorted(outs[s]["meta_info"]["cached_tokens"] for s in range(4))
    n = len(alone[0]["meta_info"]["input_ids"])
    assert cached == [0, n, n, n]
    for s in range(4):
        assert outs[s]["output_ids"] == alone[s]["output_ids"]
        assert outs[s]["meta_info"]["output_token_logprobs"] == alone[s]["meta_info"]["output_token_logprobs"]
    assert outs[9]["meta_info"]["cached_tokens"] == 0  # another image: a prefill of its own
    assert not engine.prefills
