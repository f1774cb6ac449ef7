"""Videos (relax_hpc/multimodal.py): a row's video (a list of frames, or an animated GIF/PNG/WebP PIL reads; other
video files refused naming the fix), the frames the model sees (sampled to multimodal.MODEL_FPS, at most
data.video_max_frames), each frame checked as an image is, and the processor's video tokens and values, checked
against transformers' own video path of the image processor."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from relax_hpc import multimodal
from relax_hpc.media import MediaPolicy


def frame(seed: int, h: int = 56, w: int = 56):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def b64(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_frames_are_sampled_at_the_models_rate_then_capped():
    assert multimodal.sample_frames(5, 2.0) == [0, 1, 2, 3, 4]  # at the model's rate: every frame
    assert multimodal.sample_frames(5, 1.0) == [0, 1, 2, 3, 4]  # slower: every frame too (none invented)
    assert multimodal.sample_frames(12, 6.0) == [0, 3, 6, 9]  # 6 fps shown at 2: every third
    assert multimodal.sample_frames(10, 2.0, 4) == [0, 3, 6, 9]  # at most 4, evenly, first and last kept
    assert multimodal.sample_frames(10, 2.0, 1) == [0]
    assert len(multimodal.sample_frames(5000, 2.0)) == multimodal.MAX_VIDEO_FRAMES
    assert multimodal.sample_frames(0, 2.0) == []


def test_a_row_video_column_forms():
    assert multimodal.video_refs(None) == []
    assert multimodal.video_refs(["a.png", "b.png"]) == [["a.png", "b.png"]]  # one video: its frames
    assert multimodal.video_refs([["a.png"], ["b.png", "c.png"]]) == [["a.png"], ["b.png", "c.png"]]
    assert multimodal.video_refs("clip.gif") == ["clip.gif"]  # one file
    assert multimodal.video_refs(7).startswith("\0bad:must be a video")


def test_load_video_keeps_the_sampled_frames_and_names_a_bad_one(tmp_path):
    frames = [b64(frame(i)) for i in range(6)]
    got = multimodal.load_video(frames, None, fps=4.0)  # shown at 2 fps: frames 0, 2, 4
    assert len(got) == 3 and np.array_equal(np.asarray(got[1]), np.asarray(frame(2)))
    bad = list(frames)
    bad[2] = base64.b64encode(b"\x89PNG\r\n\x1a\n then nothing").decode()
    with pytest.raises(multimodal.ImageError, match=r"^frame 2: not an image PIL can read"):
        multimodal.load_video(bad, None)
    assert len(multimodal.load_video(bad, None, fps=4.0, max_frames=2)) == 2  # frame 2 is not among 0 and 5
    with pytest.raises(multimodal.ImageError, match="must be one size"):
        multimodal.load_video([frames[0], b64(frame(1, 56, 84))], None)
    with pytest.raises(multimodal.ImageError, match="frame 0: .* over the 100 pixels"):
        multimodal.load_video(frames, None, max_pixels=100, budget="x")
    (tmp_path / "f0.png").write_bytes(base64.b64decode(frames[0]))
    policy = MediaPolicy(base_dir=tmp_path / "data")  # a row's relative frame path that leads out is refused
    with pytest.raises(multimodal.ImageError, match="outside"):
        multimodal.load_video(["../f0.png"], policy)


def test_video_files_an_animated_gif_is_read_an_mp4_is_refused_naming_the_fix(tmp_path):
    imgs = [frame(i).convert("P") for i in range(4)]
    buf = io.BytesIO()
    imgs[0].save(buf, format="GIF", save_all=True, append_images=imgs[1:], duration=250, loop=0)  # 4 fps
    refs, fps = multimodal.video_frame_refs(buf.getvalue())
    assert len(refs) == 4 and fps == pytest.approx(4.0)
    assert len(multimodal.load_video(buf.getvalue())) == 2  # 4 fps shown at 2: every other frame
    with pytest.raises(multimodal.ImageError, match=r"a video file \(\.mp4\).*Fix: extract its frames"):
        multimodal.video_frame_refs("clip.mp4")
    mp4 = b"\x00\x00\x00\x18ftypisom" + b"\x00" * 64
    with pytest.raises(multimodal.ImageError, match=r"an MP4/QuickTime file \(76 bytes\).*Fix: give the row"):
        multimodal.video_frame_refs(mp4)


def test_video_values_are_the_processors_and_pads_expand(tiny_vlm):
    frames = [frame(i, 56, 84) for i in range(3)]  # odd: the processor repeats the last into its 2nd time step
    got = multimodal.video_values(tiny_vlm, [frames])
    want = multimodal.image_processor(str(tiny_vlm))(images=None, videos=[frames], return_tensors="pt")
    assert got["video_grid_thw"].tolist() == want["video_grid_thw"].tolist() == [[2, 4, 6]]
    assert np.array_equal(got["pixel_values_videos"].numpy(), want["pixel_values_videos"].numpy())
    assert got["second_per_grid_ts"].tolist() == [2 / multimodal.MODEL_FPS]
    assert multimodal.video_grid(tiny_vlm, 3, 56, 84) == (2, 4, 6)

    pad = multimodal.token_id(tiny_vlm, multimodal.VIDEO_PAD)
    start = multimodal.token_id(tiny_vlm, multimodal.VISION_START)
    ids, videos = multimodal.read_videos([[b64(f) for f in frames]], [1, start, pad, 2], tiny_vlm, MediaPolicy())
    assert ids == [1, start] + [pad] * 12 + [2] and len(videos) == 1 and len(videos[0]) == 3
    enc = multimodal.encode_media_ids(tiny_vlm, [1, start, pad, 2], videos=[frames])
    assert enc["input_ids"][0].tolist() == ids  # the engine's and the trainer's expansion are the data's
    with pytest.raises(multimodal.ImageError, match=r"1 video pad tokens in 1 run\(s\) \[1\] for 2 video\(s\)"):
        multimodal.read_videos([[b64(f) for f in frames]] * 2, [1, start, pad, 2], tiny_vlm, MediaPolicy())
    with pytest.raises(multimodal.ImageError, match=r"^video 0: frame 0"):
        multimodal.read_videos([["no-such-frame.png"]], [pad], tiny_vlm, MediaPolicy())


def test_expand_pads_is_one_rule_for_images_and_audio():
    from relax_hpc import audio

    assert multimodal.expand_pads([5, 9, 6, 9], [2, 3], 9) == [5, 9, 9, 6, 9, 9, 9]
    assert multimodal.expand_pads([9, 9, 6, 9, 9, 9], [2, 3], 9) == [9, 9, 6, 9, 9, 9]  # already expanded
    assert audio.expand_audio([5, 9, 6, 9], [2, 3], 9) == [5, 9, 9, 6, 9, 9, 9]
    with pytest.raises(audio.AudioError, match=r"audio pad tokens .* one <\|AUDIO\|> per clip"):
        audio.expand_audio([9, 9], [3], 9)
    with pytest.raises(multimodal.ImageError, match=r"image pad tokens .* one <\|image_pad\|> per image"):
        multimodal.expand_placeholders([9, 9], [[1, 2, 2]], 9, 2)
