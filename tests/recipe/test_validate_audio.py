"""Before submit: audio needs an omni thinker's model.path; an omni thinker trains padded, on one pipeline stage,
with its audio tower frozen (model.freeze_audio: false is not wired and refused); images and audio together are
refused."""

from __future__ import annotations

import json

from relax_hpc.launch.files import check_files
from relax_hpc.recipe import recipe_from_dict


def _dirs(tmp_path):
    for name, kind in (("text", "qwen3"), ("omni", "qwen2_5_omni_thinker"), ("whole", "qwen2_5_omni")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": kind}))


def problems(tmp_path, name: str, **sections) -> dict:
    recipe = {"model": {"path": str(tmp_path / name), **sections.pop("model", {})}, **sections}
    return {k: m for k, _, m in check_files(recipe_from_dict(recipe), tmp_path)}


def test_audio_needs_an_omni_thinker_and_its_limits(tmp_path):
    _dirs(tmp_path)
    audio = {"data": {"multimodal_keys": {"audio": "audios"}}}
    assert problems(tmp_path, "omni", **audio) == {}
    assert "has no audio tower" in problems(tmp_path, "text", **audio)["data.multimodal_keys.audio"]
    assert "give its thinker's directory" in problems(tmp_path, "whole", **audio)["data.multimodal_keys.audio"]
    got = problems(tmp_path, "omni", model={"freeze_audio": False}, train={"pp": 2, "max_tokens_per_micro_batch": 8192},
                   roles={"actor": {"tasks_per_node": 2}},
                   **audio)
    assert "Fix: model.freeze_audio: true" in got["model.freeze_audio"]
    assert "Fix: train.pp: 1" in got["train.pp"]
    assert "packing is not wired for audio" in got["train.max_tokens_per_micro_batch"]
    assert problems(tmp_path, "text") == {}  # a text recipe is untouched
