"""Prompt data with images (``data.multimodal_keys``): paths, bytes and base64 in JSONL and Parquet, the
placeholders in the prompt, the image token bounds, and each bad image failing only its own sample."""

from __future__ import annotations

import base64
import io
import json

import pytest

from relax_hpc import multimodal
from relax_hpc.rollout.config import DataConfig, RolloutConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset, RolloutDataSource, check_dataset
from relax_hpc.rollout.checks import check_data
from relax_hpc.rollout.sample import SampleStatus

IMAGE_PAD = 9  # make-tiny-model's <|image_pad|>
KEYS = DataKeys(input_key="prompt", label_key=None, image_key="images")


def png_bytes(w: int, h: int, seed: int = 0) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def image_of(b64: str):
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64)))


def pads(sample) -> int:
    return sample.tokens.count(IMAGE_PAD)


def test_paths_base64_and_data_urls_with_text_markers_and_content_parts(tmp_path, tiny_vlm):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png_bytes(84, 56))  # 6 image tokens
    b64 = base64.b64encode(png_bytes(56, 56, 1)).decode()  # 4 image tokens
    jsonl(tmp_path / "d.jsonl", [
        {"prompt": "<image>what is it?", "images": "imgs/a.png"},
        {"prompt": "left <image> right <image>", "images": [b64, "data:image/png;base64," + b64]},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]}],
         "images": [str(tmp_path / "imgs" / "a.png")]},
        {"prompt": "no image here", "images": None},
    ])
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm, apply_chat_template=True)
    s0, s1, s2, s3 = (ds[i] for i in range(4))
    assert s0.prompt.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is it?")
    assert "left <|vision_start|><|image_pad|><|vision_end|> right <|vision_start|><|image_pad|><|vision_end|>" \
        in s1.prompt
    assert (pads(s0), pads(s1), pads(s2), pads(s3)) == (6, 8, 6, 0)
    assert [image_of(b).size for b in s1.multimodal_inputs["images"]] == [(56, 56), (56, 56)]
    assert image_of(s0.multimodal_inputs["images"][0]).mode == "RGB"
    assert s3.multimodal_inputs == {"images": []} and s3.status is SampleStatus.PENDING
    # the template keeps the references; each draw reads them (nothing held in memory)
    assert ds.samples[0].multimodal_inputs == {"images": ["imgs/a.png"]}
    # the expanded ids are the processor's
    want = multimodal.encode(tiny_vlm, s0.prompt, [image_of(s0.multimodal_inputs["images"][0])])["input_ids"][0]
    assert s0.tokens == want.tolist()


def test_bytes_in_parquet_one_or_a_list(tmp_path, tiny_vlm):
    import pyarrow as pa
    import pyarrow.parquet as pq

    a, b = png_bytes(56, 56), png_bytes(112, 56, 2)  # 4 and 8 image tokens
    table = pa.table({"prompt": ["<image>one", "<image><image>two"],
                      "images": pa.array([[a], [a, b]], type=pa.list_(pa.binary()))})
    pq.write_table(table, tmp_path / "d.parquet")
    ds = PromptDataset(tmp_path / "d.parquet", keys=KEYS, tokenizer=tiny_vlm)
    assert [pads(ds[0]), pads(ds[1])] == [4, 12]
    assert ds[1].prompt == ("<|vision_start|><|image_pad|><|vision_end|>" * 2) + "two"  # no chat template


def test_image_token_bounds_resize(tmp_path, tiny_vlm):
    (tmp_path / "big.png").write_bytes(png_bytes(112, 112))  # 16 tokens as it is
    (tmp_path / "small.png").write_bytes(png_bytes(28, 28))  # 1 token as it is
    jsonl(tmp_path / "d.jsonl", [{"prompt": "<image>", "images": "big.png"},
                                 {"prompt": "<image>", "images": "small.png"}])
    plain = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm)
    assert [pads(plain[0]), pads(plain[1])] == [16, 1]
    bounded = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm, image_min_token_num=4,
                            image_max_token_num=4)
    assert [pads(bounded[0]), pads(bounded[1])] == [4, 4]
    assert image_of(bounded[0].multimodal_inputs["images"][0]).size == (56, 56)


def test_each_bad_image_fails_only_its_sample_with_its_row_and_reason(tmp_path, tiny_vlm, monkeypatch):
    good = png_bytes(56, 56)
    (tmp_path / "ok.png").write_bytes(good)
    (tmp_path / "text.png").write_text("not a picture")
    (tmp_path / "wide.png").write_bytes(png_bytes(300, 20))
    (tmp_path / "thin.png").write_bytes(png_bytes(1000, 2))  # aspect ratio 500: Qwen's processors take up to 200
    (tmp_path / "heavy.png").write_bytes(png_bytes(64, 64, 3) + b"\0" * 30000)
    monkeypatch.setattr(multimodal, "MAX_IMAGE_PIXELS", 5000)  # wide.png: 6000 pixels
    monkeypatch.setattr(multimodal, "MAX_IMAGE_BYTES", 30000)  # heavy.png: over it, ok.png (~9.5 kB) not
    jsonl(tmp_path / "d.jsonl", [
        {"prompt": "<image>", "images": "ok.png"},  # line 1
        {"prompt": "<image>", "images": "missing.png"},  # line 2
        {"prompt": "<image>", "images": "text.png"},  # line 3
        {"prompt": "<image>", "images": "wide.png"},  # line 4
        {"prompt": "<image>", "images": "heavy.png"},  # line 5
        {"prompt": "<image><image>", "images": "ok.png"},  # line 6: placeholders != images
        {"prompt": "<image>", "images": 42},  # line 7: not an image reference
        {"prompt": "<image>", "images": "!!!" * 30},  # line 8: neither a file nor base64
        {"prompt": "<image>", "images": "thin.png"},  # line 9: the processor refuses it
        {"prompt": "<image>", "images": "ok.png"},  # line 10
    ])
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=tiny_vlm)
    reasons = {2: "no such file", 3: "not an image", 4: "pixels, over the 5000", 5: "bytes, over the 30000 bytes",
               6: "1 image(s) but 2 image placeholder(s)", 7: "got int", 8: "nor valid base64",
               9: "aspect ratio"}
    for line in range(1, 11):
        s = ds[line - 1]
        if line not in reasons:
            assert s.status is SampleStatus.PENDING and pads(s) == 4, line
            continue
        err = s.metadata["image_error"]
        assert s.status is SampleStatus.FAILED and f"d.jsonl: line {line}: " in err and reasons[line] in err, err
        assert "'images' (data.multimodal_keys.image)" in err
        assert s.reward == 0.0 and s.loss_mask == [0] and s.response_length == 1 and s.multimodal_inputs is None
    # drawn for a step: the group of the bad row fails, the others are untouched
    src = RolloutDataSource(ds, rollout_batch_size=3, n_samples_per_prompt=2)
    groups = src.get_samples()
    assert [[s.status for s in g] for g in groups] == [[SampleStatus.PENDING] * 2] + [[SampleStatus.FAILED] * 2] * 2
    assert groups[1][0].metadata["image_error"] == groups[1][1].metadata["image_error"]


def test_the_check_before_submit(tmp_path):
    jsonl(tmp_path / "d.jsonl", [{"prompt": "<image> hi", "picture": "a.png"}])
    res = check_dataset(tmp_path / "d.jsonl", keys=KEYS)
    assert any("image column 'images' (data.multimodal_keys.image)" in p for p in res.problems), res.problems
    assert not check_dataset(tmp_path / "d.jsonl", keys=DataKeys(input_key="prompt", label_key=None,
                                                                 image_key="picture")).problems

    def problems(**kw):
        return {(k, str(v)): m for k, v, m in check_data(DataConfig(**kw), RolloutConfig())}

    assert problems(multimodal_keys={"image": "images"}, image_min_token_num=4, image_max_token_num=16) == {}
    assert "videos beside images or audio in one recipe are not wired yet" in problems(
        multimodal_keys={"video": "v", "image": "i"})[("data.multimodal_keys", str({"video": "v", "image": "i"}))]
    p = problems(multimodal_keys={"smell": "x", "image": ""})
    assert "not a modality" in p[("data.multimodal_keys.smell", "x")]
    assert "Fix: e.g. image: images" in p[("data.multimodal_keys.image", "")]
    p = problems(multimodal_keys={"image": "images"}, image_min_token_num=16, image_max_token_num=4)
    assert "below data.image_min_token_num = 16" in p[("data.image_max_token_num", "4")]
    p = problems(multimodal_keys={"image": "i"}, image_min_token_num=0)
    assert "at least 1" in p[("data.image_min_token_num", "0")]
    assert "no image column" in problems(image_max_token_num=8)[("data.image_max_token_num", "8")]
    assert "must be a mapping" in problems(multimodal_keys='{"image": "images"}')[
        ("data.multimodal_keys", '{"image": "images"}')]


def test_image_references_hf_datasets_form(tmp_path):
    """A Hugging Face ``datasets`` Image column, {"bytes", "path"}: the bytes when there are, else the path."""
    data = png_bytes(28, 28)
    (tmp_path / "x.png").write_bytes(data)
    assert multimodal.image_bytes({"bytes": data, "path": "ignored.png"}) == data
    assert multimodal.image_bytes({"bytes": None, "path": "x.png"}, tmp_path) == data
    with pytest.raises(multimodal.ImageError, match="without 'bytes' or 'path'"):
        multimodal.image_bytes({"url": "http://x"})
    assert multimodal.load_image({"bytes": data}).mode == "RGB"
