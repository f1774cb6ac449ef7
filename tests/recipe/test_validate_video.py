"""Before submit: a video column needs a Qwen2.5-VL model.path (megatron-bridge 0.3.1's Qwen3-VL takes no videos;
a text or omni model has no video path), and the video quickstart recipe passes the checks."""

from __future__ import annotations

import json

from relax_hpc.launch.files import check_files
from relax_hpc.recipe import load_recipe, recipe_from_dict
from tests.rollout.conftest import REPO


def problems(tmp_path, name: str, **sections) -> dict:
    recipe = {"model": {"path": str(tmp_path / name)}, **sections}
    return {k: m for k, _, m in check_files(recipe_from_dict(recipe), tmp_path)}


def test_video_needs_a_qwen2_5_vl(tmp_path):
    for name, kind in (("vl", "qwen2_5_vl"), ("vl3", "qwen3_vl"), ("text", "qwen3"), ("omni", "qwen2_5_omni_thinker")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": kind}))
    video = {"data": {"multimodal_keys": {"video": "video"}}}
    assert problems(tmp_path, "vl", **video) == {}
    for name in ("vl3", "text", "omni"):
        got = problems(tmp_path, name, **video)["data.multimodal_keys.video"]
        assert "takes no videos here" in got and "Fix: a Qwen2.5-VL model.path" in got, got
    assert problems(tmp_path, "vl3") == {}  # a Qwen3-VL recipe without videos is untouched


def test_the_video_quickstart_recipe_is_valid(tmp_path):
    from relax_hpc.recipe.validate import check

    r = load_recipe(REPO / "recipes" / "quickstart-video.yaml")  # refuses a recipe with problems
    assert r.data.multimodal_keys == {"video": "video"} and r.data.video_max_frames == 4
    assert check(r) == []
