"""The vision quickstart's task: pictures drawn per seed, the data file, the reward in Relax's custom form, and the
rows read through the data path with their images (a tiny Qwen2.5-VL's processor)."""

import asyncio
import base64
import io
import json
from collections import Counter

import pytest

from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset
from relax_hpc.rollout.rewards import RewardRunner
from relax_hpc.rollout.sample import Sample, SampleStatus
from relax_hpc.tasks import shapes
from tests.rollout.conftest import _tiny_model_maker

IMAGE_PAD = 9  # make-tiny-model's <|image_pad|>


def pixels(img) -> Counter:
    import numpy as np

    return Counter(map(tuple, np.asarray(img).reshape(-1, 3).tolist()))


def test_pictures_are_the_same_per_seed_and_show_their_colour_and_shape():
    a = [shapes.picture(0, i) for i in range(40)]
    assert [(c, s, shapes.png(im)) for c, s, im in a] == [(c, s, shapes.png(im)) for c, s, im in
                                                         (shapes.picture(0, i) for i in range(40))]
    assert [shapes.png(im) for _, _, im in a] != [shapes.png(im) for _, _, im in (shapes.picture(1, i)
                                                                                 for i in range(40))]
    assert {c for c, _, _ in a} == set(shapes.COLOURS) and {s for _, s, _ in a} == set(shapes.SHAPES)
    import numpy as np

    for colour, shape, img in a:
        assert img.size == (shapes.SIZE, shapes.SIZE) and img.mode == "RGB"
        px = pixels(img)
        # two colours only (no antialiasing): the background and the shape's
        assert set(px) == {shapes.BACKGROUND, shapes.COLOURS[colour][1]}, (colour, shape, set(px))
        # the area says the shape: of its bounding box a square fills all, a circle ~π/4, a triangle ~1/2
        fill = shapes.COLOURS[colour][1]
        ys, xs = (np.asarray(img) == fill).all(-1).nonzero()
        box = (xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)
        ratio = px[fill] / box
        want = {"s": 1.0, "c": 0.785, "t": 0.5}[shape]
        assert ratio == pytest.approx(want, abs=0.08), (shape, ratio)


def test_rows_ask_colour_and_shape_of_each_picture():
    recs = shapes.rows(n=5, seed=3)
    assert len(recs) == 10
    for colour_q, shape_q in zip(recs[::2], recs[1::2]):
        assert colour_q["prompt"] == "<image>colour?" and shape_q["prompt"] == "<image>shape?"
        assert colour_q["images"] == shape_q["images"] and len(colour_q["images"]) == 1
        assert colour_q["label"] in shapes.COLOURS and shape_q["label"] in shapes.SHAPES
        meta = colour_q["metadata"]
        assert shapes.COLOURS[colour_q["label"]][0] == meta["colour"]
        assert shapes.SHAPES[shape_q["label"]] == meta["shape"]
    assert json.loads(json.dumps(recs)) == recs


@pytest.mark.parametrize("response, label, want", [
    ("r", "r", 1.0), ("rgb", "r", 1.0), ("g", "r", shapes.PARTIAL), ("y", "b", shapes.PARTIAL),
    ("c", "r", 0.0), ("t", "t", 1.0), ("s", "c", shapes.PARTIAL), ("r", "s", 0.0), ("", "c", 0.0),
    (" c", "c", 0.0), ("R", "r", 0.0), (None, "r", 0.0),
])
def test_score(response, label, want):
    assert shapes.score(response, label) == pytest.approx(want)


def test_reward_func_works_unchanged_through_relax_custom_rm_path():
    recipe = Recipe(rollout=RolloutConfig(custom_rm_path="relax_hpc.tasks.shapes.reward_func", n_samples_per_prompt=3,
                                          rollout_batch_size=1, max_response_len=1))
    runner = RewardRunner(recipe)
    group = [Sample(prompt="<image>shape?", label="t", response=r) for r in ("t", "s", "9")]
    failures = asyncio.run(runner.score_group(group))
    assert failures == [] and [s.reward for s in group] == [1.0, shapes.PARTIAL, 0.0]


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return _tiny_model_maker()(tmp_path_factory.mktemp("vlm") / "qwen2_5_vl", arch="qwen2_5_vl", seed=0)


@pytest.mark.parametrize("files", [False, True], ids=["base64", "png-files"])
def test_the_data_file_reads_through_the_data_path_with_its_images(tmp_path, tiny_vlm, files):
    from PIL import Image

    out = tmp_path / "data" / "shapes.jsonl"
    args = [str(out), "--n", "3", "--seed", "5"] + (["--image-dir", str(tmp_path / "data" / "img")] if files else [])
    assert shapes.main(args) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in recs] == [r["label"] for r in shapes.rows(3, 5)]
    if files:
        assert recs[0]["images"] == ["img/shape-5-00000.png"]  # relative to the JSONL
    ds = PromptDataset(out, keys=DataKeys(input_key="prompt", label_key="label", image_key="images"),
                       tokenizer=tiny_vlm, apply_chat_template=True)
    for i, rec in enumerate(recs):
        s = ds[i]
        assert s.status is SampleStatus.PENDING and s.label == rec["label"]
        assert s.tokens.count(IMAGE_PAD) == 4  # 56×56: 16 patches, 2×2 merged
        (got,) = s.multimodal_inputs["images"]
        img = Image.open(io.BytesIO(base64.b64decode(got)))
        assert img.size == (56, 56) and shapes.png(img.convert("RGB")) == shapes.png(shapes.picture(5, i // 2)[2])
        assert s.prompt.endswith(("colour?<|im_end|>\n<|im_start|>assistant\n",
                                  "shape?<|im_end|>\n<|im_start|>assistant\n")), s.prompt
