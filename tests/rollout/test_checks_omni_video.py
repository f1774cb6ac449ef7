"""relax_hpc.rollout.checks: video and audio in one recipe (Qwen2.5-Omni's thinker takes both; relax_hpc's omni actor
does not yet) are refused before submit, naming the key, the value and why: the actor's 1-D positions and missing
vision tower, not only that a row reads one modality."""

from __future__ import annotations

from relax_hpc.rollout.checks import check_data
from relax_hpc.rollout.config import DataConfig, RolloutConfig


def _media(mk: dict) -> list[tuple[str, object, str]]:
    return [p for p in check_data(DataConfig(path="x.jsonl", multimodal_keys=mk), RolloutConfig())
            if p[0] == "data.multimodal_keys"]


def test_video_with_audio_is_refused_naming_why():
    mk = {"video": "video", "audio": "audios"}
    (key, value, why), = _media(mk)
    assert key == "data.multimodal_keys" and value == mk
    assert "3-D M-RoPE positions" in why and "no vision tower" in why and "relax_hpc.train.omni" in why, why
    assert "Fix: video alone (a Qwen2.5-VL model.path) or audio alone (an omni thinker)" in why, why
    (_, _, why), = _media({"video": "video", "image": "images"})  # no omni actor involved: the row's reason only
    assert "a row reads one modality)" in why and "M-RoPE" not in why, why
    assert _media({"video": "video"}) == [] and _media({"audio": "audios"}) == []
