"""The vision quickstart's task: pictures drawn per seed, colours balanced, the committed data files, the reward in
Relax's custom form, and the rows read through the data path with their images (a tiny Qwen2.5-VL's processor)."""

import asyncio
import base64
import io
import json
from collections import Counter
from pathlib import Path

import pytest

from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.data import DataKeys, PromptDataset
from relax_hpc.rollout.rewards import RewardRunner
from relax_hpc.rollout.sample import Sample, SampleStatus
from relax_hpc.tasks import shapes

IMAGE_PAD = 9  # make-tiny-model's <|image_pad|>
DATA = Path(__file__).resolve().parents[2] / "recipes" / "data"


def pixels(img) -> Counter:
    import numpy as np

    return Counter(map(tuple, np.asarray(img).reshape(-1, 3).tolist()))


def test_pictures_are_the_same_per_seed_and_show_their_colour_and_shape():
    a = [shapes.picture(0, i) for i in range(40)]
    assert [(c, s, shapes.png(im)) for c, s, im in a] == [(c, s, shapes.png(im)) for c, s, im in
                                                         (shapes.picture(0, i) for i in range(40))]
    assert [shapes.png(im) for _, _, im in a] != [shapes.png(im) for _, _, im in (shapes.picture(1, i)
                                                                                 for i in range(40))]
    colours = [c for c, _, _ in a]
    assert all(sorted(colours[k:k + 4]) == sorted(shapes.COLOURS) for k in range(0, 40, 4))  # balanced: see below
    assert set(colours[::2]) == set(shapes.COLOURS)  # no colour tied to an index's parity (shapes_turns takes pairs)
    assert {s for _, s, _ in a} == set(shapes.SHAPES)
    import numpy as np

    for colour, shape, img in a:
        assert img.size == (shapes.SIZE, shapes.SIZE) and img.mode == "RGB"
        px = pixels(img)
        # two colours only (no antialiasing): the shape's, and a shade of it around it
        assert set(px) == {shapes.tint(colour), shapes.COLOURS[colour][1]}, (colour, shape, set(px))
        # the area says the shape: of its bounding box a square fills all, a circle ~π/4, a triangle ~1/2
        fill = shapes.COLOURS[colour][1]
        ys, xs = (np.asarray(img) == fill).all(-1).nonzero()
        box = (xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)
        ratio = px[fill] / box
        want = {"s": 1.0, "c": 0.785, "t": 0.5}[shape]
        assert ratio == pytest.approx(want, abs=0.08), (shape, ratio)
        # big: at least 40 px across, so its colour reaches every one of the 4 image tokens' 28×28 quarters
        assert xs.max() - xs.min() + 1 >= shapes.MIN_SIDE and px[fill] >= 0.2 * shapes.SIZE ** 2, (shape, px[fill])
        for qy in (0, 28):
            for qx in (0, 28):
                quarter = (np.asarray(img)[qy:qy + 28, qx:qx + 28] == fill).all(-1)
                assert quarter.any(), (colour, shape, qx, qy)


def test_rows_ask_the_colour_by_default_and_any_set_of_questions():
    recs = shapes.rows(n=8, seed=3)
    assert [r["prompt"] for r in recs] == ["<image>colour?"] * 8
    # every colour twice: an answer that ignores the image is right 1/4 of the time, whatever it is
    assert Counter(r["label"] for r in recs) == {c: 2 for c in shapes.COLOURS}
    with pytest.raises(ValueError, match="size"):
        shapes.rows(n=2, questions=("size",))
    recs = shapes.rows(n=5, seed=3, questions=("colour", "shape"))
    assert len(recs) == 10
    for colour_q, shape_q in zip(recs[::2], recs[1::2]):
        assert colour_q["prompt"] == "<image>colour?" and shape_q["prompt"] == "<image>shape?"
        assert colour_q["images"] == shape_q["images"] and len(colour_q["images"]) == 1
        assert colour_q["label"] in shapes.COLOURS and shape_q["label"] in shapes.SHAPES
        meta = colour_q["metadata"]
        assert shapes.COLOURS[colour_q["label"]][0] == meta["colour"]
        assert shapes.SHAPES[shape_q["label"]] == meta["shape"]
    assert json.loads(json.dumps(recs)) == recs


def test_the_committed_data_is_the_clis_output_and_the_eval_pictures_are_new():
    train = [json.loads(line) for line in (DATA / "shapes.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (DATA / "shapes-eval.jsonl").read_text().splitlines()]
    assert train == shapes.rows(128, 0) and held == shapes.rows(32, 1)
    assert Counter(r["label"] for r in held) == {c: 8 for c in shapes.COLOURS}  # chance is exactly 1/4
    seen = {r["images"][0] for r in train}
    # drawn apart from the training pictures; only a shape that fills the whole picture can repeat one (1 of 32)
    assert sum(r["images"][0] in seen for r in held) <= 1


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


@pytest.mark.parametrize("files", [False, True], ids=["base64", "png-files"])
def test_the_data_file_reads_through_the_data_path_with_its_images(tmp_path, tiny_vlm, files):
    from PIL import Image

    out = tmp_path / "data" / "shapes.jsonl"
    args = [str(out), "--n", "3", "--seed", "5", "--questions", "colour,shape"] \
        + (["--image-dir", str(tmp_path / "data" / "img")] if files else [])
    assert shapes.main(args) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in recs] == [r["label"] for r in shapes.rows(3, 5, questions=("colour", "shape"))]
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


def test_the_cli_refuses_an_unknown_question(tmp_path, capsys):
    with pytest.raises(SystemExit):
        shapes.main([str(tmp_path / "x.jsonl"), "--questions", "colour,size"])
    assert "--questions colour,size" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()
