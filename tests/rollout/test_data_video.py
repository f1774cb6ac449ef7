"""Videos through the data (data.multimodal_keys.video, a Qwen2.5-VL model.path): a video is a list of frames (paths
relative to the data file, base64, data: URLs) or an animated GIF; Relax's <video> marker or chat content parts; the
frames read when drawn, sampled by data.video_fps / data.video_max_frames, kept as base64 PNG (SGLang's video_data)
and the <|video_pad|> expanded to the video's tokens; a bad frame fails only its sample, naming the line, the
frame and the reason; the checks before submit."""

from __future__ import annotations

import base64
import io
import json
import logging

import numpy as np

from relax_hpc.rollout.config import DataConfig, RolloutConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset
from relax_hpc.rollout.checks import check_data
from relax_hpc.rollout.sample import SampleStatus

KEYS = DataKeys(input_key="prompt", label_key=None, video_key="video")
CANARY = "CANARY-9b2c-contents-of-a-secret"


def png(seed: int, h: int = 56, w: int = 56) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def runs(tokens, pad: int) -> list[int]:
    return [len(r) for r in "".join("v" if t == pad else " " for t in tokens).split()]


def test_frames_paths_base64_markers_content_parts_and_sampling(tmp_path, tiny_vlm):
    from relax_hpc.multimodal import VIDEO_PAD, token_id

    pad = token_id(tiny_vlm, VIDEO_PAD)
    for i in range(4):
        (tmp_path / f"f{i}.png").write_bytes(png(i))
    b64 = [base64.b64encode(png(10 + i)).decode() for i in range(6)]
    jsonl(tmp_path / "d.jsonl", [
        {"prompt": "<video>way?", "video": [f"f{i}.png" for i in range(4)]},  # frame paths, relative to the file
        {"prompt": "<video>and<video>?", "video": [b64[:2], ["data:image/png;base64," + b64[0]] + b64[1:]]},
        {"prompt": "no video"},
    ])
    ds = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=str(tiny_vlm))
    one, two, none = ds[0], ds[1], ds[2]
    assert one.status is not SampleStatus.FAILED and runs(one.tokens, pad) == [8]  # 4 frames: 2 steps × 4 tokens
    assert runs(two.tokens, pad) == [4, 12]  # 2 frames: 1 step; 6 frames: 3 steps
    assert len(one.multimodal_inputs["videos"][0]) == 4 and base64.b64decode(one.multimodal_inputs["videos"][0][1]) \
        .startswith(b"\x89PNG")
    assert runs(none.tokens, pad) == [] and not none.multimodal_inputs["videos"]
    fast = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=str(tiny_vlm), video_fps=4.0)
    assert len(fast[0].multimodal_inputs["videos"][0]) == 2 and runs(fast[0].tokens, pad) == [4]  # frames 0, 2
    capped = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=str(tiny_vlm), video_max_frames=3)
    assert len(capped[0].multimodal_inputs["videos"][0]) == 3 and runs(capped[0].tokens, pad) == [8]  # 3 → 2 steps
    chat = PromptDataset(tmp_path / "d.jsonl", keys=KEYS, tokenizer=str(tiny_vlm), apply_chat_template=True)
    assert "<|vision_start|><|video_pad|><|vision_end|>way?" in chat.samples[0].prompt
    assert runs(chat[0].tokens, pad) == [8]


def test_a_corrupt_frame_fails_only_its_sample_with_its_line(tmp_path, tiny_vlm, caplog):
    ds_dir = tmp_path / "ds"
    ds_dir.mkdir()
    (tmp_path / "secret.png").write_bytes(png(0))
    for i in range(2):
        (ds_dir / f"f{i}.png").write_bytes(png(i))
    (ds_dir / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + CANARY.encode() * 4)
    (ds_dir / "clip.mp4").write_bytes(b"\0\0\0\x18ftypisom" + b"\0" * 32)
    (ds_dir / "wide.png").write_bytes(png(3, 56, 84))
    jsonl(ds_dir / "d.jsonl", [
        {"prompt": "<video>?", "video": ["f0.png", "f1.png"]},  # line 1
        {"prompt": "<video>?", "video": ["f0.png", "corrupt.png"]},  # line 2
        {"prompt": "<video>?", "video": ["f0.png", "../secret.png"]},  # line 3: outside the dataset
        {"prompt": "<video>?", "video": "clip.mp4"},  # line 4: a video file no dependency decodes
        {"prompt": "<video>?", "video": ["f0.png", "wide.png"]},  # line 5: frames of two sizes
        {"prompt": "<video><video>?", "video": ["f0.png", "f1.png"]},  # line 6: two placeholders, one video
        {"prompt": "<video>?", "video": 7},  # line 7: not a video
        {"prompt": "<video>?", "video": ["f0.png", "f1.png"]},  # line 8: fine again
    ])
    ds = PromptDataset(ds_dir / "d.jsonl", keys=KEYS, tokenizer=str(tiny_vlm))
    with caplog.at_level(logging.ERROR):
        got = [ds[i] for i in range(len(ds))]
    assert [s.status is SampleStatus.FAILED for s in got] == [False, True, True, True, True, True, True, False]
    want = {2: "video 0: frame 1: not an image PIL can read", 3: "frame 1: '../secret.png'",
            4: "a video file (.mp4): only frame lists and animated GIF/PNG/WebP are read", 5: "must be one size",
            6: "2 video pad tokens in 2 run(s) [1, 1] for 1 video(s)", 7: "must be a video"}
    for line, why in want.items():
        s = got[line - 1]
        assert s.loss_mask == [0] and s.multimodal_inputs is None
        err = s.metadata["image_error"]
        assert f"line {line}: key 'video' (data.multimodal_keys.video)" in err and why in err, err
    assert "is outside the dataset's directory" in got[2].metadata["image_error"]
    assert CANARY not in caplog.text and all(CANARY not in s.metadata.get("image_error", "") for s in got)
    short = PromptDataset(ds_dir / "d.jsonl", keys=KEYS, tokenizer=str(tiny_vlm), max_prompt_len=6)
    assert "with its videos the prompt has" in short[0].metadata["image_error"]
    small = PromptDataset(ds_dir / "d.jsonl", keys=KEYS, tokenizer=str(tiny_vlm), max_prompt_pixels=5000)
    assert "2 frames of 56×56 = 6272 pixels, over the 5000 pixels a video's kept frames may have " \
           "(data.max_prompt_pixels)" in small[0].metadata["image_error"]  # judged from the headers
    tiny = PromptDataset(ds_dir / "d.jsonl", keys=KEYS, tokenizer=str(tiny_vlm), max_image_pixels=3000)
    assert "frame 0: 56×56 = 3136 pixels, over the 3000 pixels a video frame may have (data.max_image_pixels)" in \
        tiny[0].metadata["image_error"]


def test_the_check_before_submit():
    ok = check_data(DataConfig(path="x.jsonl", multimodal_keys={"video": "video"}, video_fps=30.0,
                                 video_max_frames=16, media_roots=["/data/frames"], max_image_pixels=10 ** 6),
                      RolloutConfig())
    assert ok == [], ok
    bad = check_data(DataConfig(path="x.jsonl", multimodal_keys={"video": "v"}, video_fps=0,
                                  video_max_frames=10 ** 6), RolloutConfig())
    text = "\n".join(map(str, bad))
    assert "data.video_fps" in text and "more than 0" in text
    assert "data.video_max_frames" in text and "1 to 768 frames" in text
    both = check_data(DataConfig(path="x.jsonl", multimodal_keys={"video": "v", "image": "i"}), RolloutConfig())
    assert any("videos beside images or audio" in str(p) for p in both), both
    lone = check_data(DataConfig(path="x.jsonl", video_fps=30.0, video_max_frames=8), RolloutConfig())
    assert sum("samples a row's video frames, but data.multimodal_keys has no video column" in str(p)
               for p in lone) == 2, lone
