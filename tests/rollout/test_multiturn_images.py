"""Multi-turn rollouts with images (relax_hpc/rollout/multiturn.py): the shapes_turns environment shows a second
picture in its observation (Relax's ``multi_modal_data``); a real CPU engine serving the tiny Qwen2.5-VL gets every
image so far with each turn, the observation's tokens hold the image pads, the loss mask is 1 on the model's tokens
only, and the exchange holds each sample's images for the trainer. A bad observation image fails only its sample;
an observation image that does not fit the context bound ends the rollout instead of being cut."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import torch

from relax_hpc import multimodal
from relax_hpc.engines.client import FinishReason, Generation, SamplingParams
from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource
from relax_hpc.rollout.driver import RolloutDriver
from relax_hpc.rollout.multiturn import MultiTurn, encode_observation, generate_multiturn
from relax_hpc.rollout.sample import Sample, SampleStatus
from relax_hpc.tasks import shapes_turns
from relax_hpc.rollout.write import write_step
from relax_hpc.train import samples as S
from relax_hpc.train.config import TrainConfig
from tests.engines.test_engine_vision import hf_logprobs


VISION_START, VISION_END, IMAGE_PAD = 6, 7, 9  # make-tiny-model's ids
PADS = 4  # a 56×56 picture: 4 image tokens
KEYS = DataKeys(input_key="prompt", label_key="label", image_key="images")
BAD = 2  # the row whose second picture is not an image


@pytest.fixture
def data(tmp_path, tiny_vlm):
    rows = shapes_turns.rows(3, seed=0)
    rows[BAD]["metadata"]["second_image"] = base64.b64encode(b"\x89PNG\r\n\x1a\n but no image").decode()
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm)
    return ds, rows


def driver(ds, engine, **over) -> RolloutDriver:
    ro = dict(custom_rm_path="relax_hpc.tasks.shapes_turns.reward_func",
              interaction_env_path="relax_hpc.tasks.shapes_turns",
              max_turns=2, max_response_len=1, turn_truncation="continue", n_samples_per_prompt=2,
              rollout_batch_size=3, reward_error_policy="skip")
    return RolloutDriver(Recipe(rollout=RolloutConfig(**{**ro, **over}), train=TrainConfig(max_seq_len=48)),
                         {"vlm": engine}, tokenizer=ds.tokenizer)


def test_both_images_reach_the_engine_the_tokens_the_mask_and_the_exchange(tmp_path, data, vlm_engine, tiny_vlm):
    ds, rows = data
    d = driver(ds, vlm_engine)
    seen: list[tuple[list[int], list | None]] = []
    real = d.request

    async def request(ids, sp, **kw):  # the driver's own request, recorded on its way to the engine
        seen.append((list(ids), kw.get("image_data")))
        return await real(ids, sp, **kw)

    d.request = request
    res = d.generate_rollout_sync(RolloutDataSource(ds, rollout_batch_size=3, n_samples_per_prompt=2).get_samples(),
                                  seed=3)
    tok = ds.tokenizer
    good = [s for s in res.samples if s.index // 2 != BAD]
    assert len(good) == 4
    obs = [VISION_START] + [IMAGE_PAD] * PADS + [VISION_END] + tok.encode("and this?", add_special_tokens=False)
    for s in good:
        row = rows[s.index // 2]
        a, b = row["images"][0], row["metadata"]["second_image"]
        assert s.status is SampleStatus.COMPLETED and s.metadata["rollout_stop_reason"] == "done", s.metadata
        first, second = (t["output_ids"] for t in s.metadata["rollout_traces"])
        prompt = s.tokens[: s.prompt_length]
        assert prompt.count(IMAGE_PAD) == PADS and len(first) == len(second) == 1
        assert s.tokens == prompt + first + obs + second  # the observation's image pads in the tokens, expanded
        assert s.loss_mask == [1] + [0] * len(obs) + [1]  # 1 on the model's two tokens only, 0 on the image pads
        assert len(s.rollout_log_probs) == s.response_length
        imgs = s.multimodal_inputs["images"]
        assert len(imgs) == 2 and multimodal.load_image(imgs[1]).tobytes() == multimodal.load_image(b).tobytes()
        assert multimodal.load_image(imgs[0]).tobytes() == multimodal.load_image(a).tobytes()
        # the second turn's request: everything so far, with both pictures, in order
        assert (s.tokens[:-1], imgs) in seen and (prompt, imgs[:1]) in seen
        assert s.reward == pytest.approx(sum(shapes_turns.score(t["response"], lab) for t, lab in
                                             zip(s.metadata["rollout_traces"], [row["label"],
                                                                                row["metadata"]["second_label"]])) / 2)
    # the engine answered the second turn having seen both pictures: its log-prob is the model's given A and B
    s = good[0]
    pics = [multimodal.load_image(x) for x in s.multimodal_inputs["images"]]
    feats = multimodal.encode_ids(tiny_vlm, s.tokens[:-1], pics)
    want = hf_logprobs(tiny_vlm, s.tokens[:-1], s.tokens[-1:], feats)
    torch.testing.assert_close(torch.tensor(s.rollout_log_probs[-1:]), want, rtol=1e-4, atol=1e-4)
    swapped = multimodal.encode_ids(tiny_vlm, s.tokens[:-1], pics[:1] * 2)
    assert not torch.allclose(hf_logprobs(tiny_vlm, s.tokens[:-1], s.tokens[-1:], swapped), want, atol=1e-4)

    # a bad observation image fails only its own samples, with the reason
    for s in res.samples:
        if s.index // 2 == BAD:
            assert s.status is SampleStatus.FAILED and set(s.loss_mask) == {0} and s.reward == 0.0
            assert "the observation's image 0 cannot be used" in s.metadata["env_error"], s.metadata
            assert len(s.multimodal_inputs["images"]) == 1  # the prompt's: nothing of the bad turn went in
    assert res.metrics["rollout/env_failures"] == 2
    # 6 first turns with the prompt's picture, 4 second turns with both (the bad row's never sent)
    assert sorted(len(im) for _, im in seen) == [1] * 6 + [2] * 4

    # the trainer's fields: both pictures' pixel rows and two grid rows per good sample (one for a failed one)
    ref = write_step(tmp_path, 1, res, model_dir=tiny_vlm)
    cols = S.read_columns([ref], ("tokens", "loss_mask", "pixel_values", "image_grid_thw"))
    for i, s in enumerate(res.samples):
        assert cols["tokens"][i].tolist() == s.tokens and cols["loss_mask"][i].tolist() == s.loss_mask
        pics = [multimodal.load_image(x) for x in s.multimodal_inputs["images"]]
        want = multimodal.encode_ids(tiny_vlm, s.tokens, pics)  # also checks each pad run against its picture
        assert cols["image_grid_thw"][i].reshape(-1, 3).tolist() == [[1, 4, 4]] * len(pics)
        torch.testing.assert_close(torch.from_numpy(cols["pixel_values"][i].copy()),
                                   want["pixel_values"].float().reshape(-1))


def test_an_observation_image_that_does_not_fit_ends_the_rollout_uncut(data, vlm_engine):
    ds, rows = data
    # prompt 13 tokens + 1 answer: the 15-token observation (6 of them the picture) has 5 tokens of room
    res = driver(ds, vlm_engine, max_context_len=20).generate_rollout_sync(
        RolloutDataSource(ds, rollout_batch_size=3, n_samples_per_prompt=2).get_samples(), seed=3)
    for s in res.samples[:4]:
        assert s.status is SampleStatus.TRUNCATED and s.metadata["rollout_stop_reason"] == "context"
        (trace,) = s.metadata["rollout_traces"]
        assert trace["obs_truncated"] == 15 and IMAGE_PAD not in s.tokens[s.prompt_length:]
        assert s.loss_mask == [1] and len(s.multimodal_inputs["images"]) == 1


def test_observation_encoding_chat_and_text_forms(tiny_vlm):
    """One picture in the observation: without a chat template at Relax's ``<image>`` marker (or first); with one,
    as format_observation's image content part; either way one pad per image token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_vlm))
    pic = multimodal.load_image(shapes_turns.rows(1)[0]["metadata"]["second_image"])
    env = shapes_turns.ShapesTurnsEnv(labels=["r", "g"], second_image=pic)
    obs = {"obs_str": "<image>and this?", "role": "user", "multi_modal_data": {"image": [pic]}}
    ids, text = encode_observation(tok, obs, env, chat=False, images=[pic])
    assert ids == [VISION_START] + [IMAGE_PAD] * PADS + [VISION_END] + tok.encode("and this?", add_special_tokens=False)
    ids_first, _ = encode_observation(tok, {**obs, "obs_str": "and this?"}, object(), chat=False, images=[pic])
    assert ids_first == ids
    ids, _ = encode_observation(tok, obs, env, chat=True, images=[pic])  # format_observation's content parts
    msg = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]}]
    whole = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
    run = [VISION_START] + [IMAGE_PAD] * PADS + [VISION_END] + tok.encode("and this?", add_special_tokens=False)
    assert ids.count(IMAGE_PAD) == PADS and any(ids[i:i + len(run)] == run for i in range(len(ids)))
    assert tok.decode(ids).replace("<|image_pad|>" * PADS, "<|image_pad|>") in whole  # the template's turn
    # no format_observation: the <image> marker of obs_str becomes the image's content part, the same tokens
    assert encode_observation(tok, obs, object(), chat=True, images=[pic])[0] == ids


class _Scripted:
    """An engine session that answers with given token ids: the real engine cannot be made to sample a vision
    token on purpose."""

    fail_on_env_error = False

    def __init__(self, tok, answers):
        self.tokenizer, self.answers, self.requests = tok, list(answers), []

    def prompt_ids(self, sample):
        return list(sample.tokens)

    async def request(self, ids, sp, *, who, image_data=None):
        self.requests.append((list(ids), image_data))
        out = self.answers.pop(0)
        return Generation("r", out, [-1.0] * len(out), FinishReason("length"), len(ids), len(out), None)

    def response_text(self, gen):
        return self.tokenizer.decode(gen.output_ids)


def test_a_sampled_vision_token_ends_the_rollout(tiny_vlm):
    """A model turn with a vision token would leave an image pad without its image in the next request (a 400 of
    the engine) and confuse the trainer's count of images: the rollout ends there, TRUNCATED."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_vlm))
    row = shapes_turns.rows(1)[0]
    ds_sample = Sample(prompt=row["prompt"], label=row["label"], metadata=row["metadata"], index=0,
                       tokens=[VISION_START] + [IMAGE_PAD] * PADS + [VISION_END] + tok.encode("colour?"),
                       multimodal_inputs={"images": row["images"]})
    mt = MultiTurn(build_env=shapes_turns.build_env, args=None, max_turns=2, max_context_len=48, step_timeout_s=10,
                   chat=False, continue_truncated=True)
    for answer, stop in (([IMAGE_PAD], "vision_token"), ([VISION_START], "vision_token"), ([40], "done")):
        session = _Scripted(tok, [answer, [41]])
        s = asyncio.run(generate_multiturn(session, mt, ds_sample.copy(), SamplingParams(max_new_tokens=1), seed=1))
        assert s.metadata["rollout_stop_reason"] == stop, (answer, s.metadata)
        assert len(session.requests) == (1 if stop == "vision_token" else 2)
        assert all(im == s.multimodal_inputs["images"][: len(im)] for _, im in session.requests)


def test_images_end():
    ids = [1, VISION_START, IMAGE_PAD, IMAGE_PAD, VISION_END, 5, VISION_START, 5, VISION_START, IMAGE_PAD, 7, 9]
    assert multimodal.images_end(ids, 0, VISION_START, IMAGE_PAD) == 0
    assert multimodal.images_end(ids, 1, VISION_START, IMAGE_PAD) == 4
    assert multimodal.images_end(ids, 2, VISION_START, IMAGE_PAD) == 10  # a vision start without pads is no image
    assert multimodal.images_end(ids, 3, VISION_START, IMAGE_PAD) == len(ids)


def test_observation_images_forms_sizes_and_errors(tmp_path, tiny_vlm, tiny_llama):
    """PIL, bytes, base64 and a path, one or a list, sized by data.image_min/max_token_num; two pictures in one
    observation get a pad run each; a bad one, or images for a text model, is the env's error."""
    from transformers import AutoTokenizer

    from relax_hpc.rollout.multiturn import EnvError, observation_images

    tok = AutoTokenizer.from_pretrained(str(tiny_vlm))
    pic = shapes_turns.picture(0, 1)[2]
    raw = shapes_turns.png(pic)
    (tmp_path / "p.png").write_bytes(raw)
    forms = [pic, raw, base64.b64encode(raw).decode(), str(tmp_path / "p.png")]
    got = observation_images({"obs_str": "x", "multi_modal_data": {"image": forms}}, object(), tok, (None, None))
    assert [im.tobytes() for im in got] == [pic.tobytes()] * 4
    one = observation_images({"obs_str": "x", "multi_modal_data": {"image": raw}}, object(), tok, (16, 16))
    assert [im.size for im in one] == [(112, 112)]  # 16 image tokens: 4 × 4 merged 28-pixel patches
    assert observation_images({"obs_str": "x"}, object(), tok, (None, None)) == []
    ids, _ = encode_observation(tok, {"obs_str": "<image>a<image>b"}, object(), chat=False, images=one + [pic])
    assert ids == [VISION_START] + [IMAGE_PAD] * 16 + [VISION_END] + tok.encode("a", add_special_tokens=False) + \
        [VISION_START] + [IMAGE_PAD] * PADS + [VISION_END] + tok.encode("b", add_special_tokens=False)
    with pytest.raises(EnvError, match="the observation's image 1 cannot be used: .*nor valid base64"):
        observation_images({"obs_str": "x", "multi_modal_data": {"image": [raw, "@@@"]}}, object(), tok, (None, None))
    with pytest.raises(EnvError, match="the model has no vision"):
        observation_images({"obs_str": "x", "multi_modal_data": {"image": [raw]}}, object(),
                           AutoTokenizer.from_pretrained(str(tiny_llama)), (None, None))


def test_an_observation_image_path_obeys_the_datas_rules(tmp_path, tiny_vlm):
    """An env may pass a row's paths on (the two-turn task does): such a path is read under the data's rules, as the
    prompt's images are (the data file's directory and data.media_roots, the pixel budget), never from anywhere."""
    from transformers import AutoTokenizer

    from relax_hpc.media import MediaPolicy
    from relax_hpc.rollout.multiturn import EnvError, observation_images

    tok = AutoTokenizer.from_pretrained(str(tiny_vlm))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.png").write_bytes(shapes_turns.png(shapes_turns.picture(0, 1)[2]))
    (tmp_path / "secret.png").write_bytes(shapes_turns.png(shapes_turns.picture(1, 1)[2]))
    rules = MediaPolicy(base_dir=tmp_path / "data")
    obs = lambda ref: {"obs_str": "x", "multi_modal_data": {"image": ref}}  # noqa: E731
    assert len(observation_images(obs("p.png"), object(), tok, (None, None), rules)) == 1
    for ref in (str(tmp_path / "secret.png"), "../secret.png"):
        with pytest.raises(EnvError, match="is outside the dataset's directory"):
            observation_images(obs(ref), object(), tok, (None, None), rules)
    with pytest.raises(EnvError, match="data.max_image_pixels"):
        observation_images(obs("p.png"), object(), tok, (None, None), rules, max_image_pixels=100)
    # without rules (a MultiTurn built by hand, not from a recipe) a path is read wherever it is
    assert len(observation_images(obs(str(tmp_path / "secret.png")), object(), tok, (None, None))) == 1
