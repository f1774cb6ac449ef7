"""Hostile rows in a vision dataset fail their own samples and the run completes: one step of the vision quickstart
(recipes/quickstart-vision.yaml, train.max_seq_len 48) over the first rows of its data plus a row naming
``/etc/shadow``, one naming a file outside the dataset's directory (a canary), a 62-megapixel PNG, and a row of
4 images of 112×112 whose 64 image tokens make it longer than the trainer takes (it failed the run at the trainer
with "a sample has 80 tokens", naming no row). Every row is drawn in the step; the canary's contents appear in no
file of the run directory."""

from __future__ import annotations

import io
import json
import re

import pytest

from relax_hpc.controller import run_controller

from .conftest import REPO, make_run, make_tiny_model

RECIPE = REPO / "recipes" / "quickstart-vision.yaml"
DATA = REPO / "recipes" / "data" / "shapes.jsonl"
CANARY = "CANARY-9c41-a-file-no-row-may-read"
GOOD = 4  # rows of the quickstart's data kept as they are


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("e2e-vlm") / "tiny-qwen2_5_vl", arch="qwen2_5_vl", seed=0)


def png(w: int, h: int, mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (w, h), 1 if mode == "1" else (10, 200, 10)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.slow
def test_hostile_vision_rows_fail_alone_and_the_run_completes(tmp_path, tiny_vlm, local_executor):
    ds, secret = tmp_path / "ds", tmp_path / "secret"
    ds.mkdir()
    secret.mkdir()
    (secret / "canary.png").write_text(CANARY)
    (ds / "big.png").write_bytes(png(7900, 7900, mode="1"))  # 62.4 Mpx, ~23 kB
    (ds / "112.png").write_bytes(png(112, 112))  # 16 image tokens
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:GOOD]]
    rows += [{**rows[0], "images": ["/etc/shadow"]},  # line 5
             {**rows[0], "images": ["../secret/canary.png"]},  # line 6
             {**rows[0], "images": ["big.png"]},  # line 7
             {**rows[0], "prompt": "<image><image><image><image>colour?", "images": ["112.png"] * 4}]  # line 8
    (ds / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    run = make_run(tmp_path, tiny_vlm, f"data.path={ds / 'd.jsonl'}", "data.shuffle=false", "run.steps=1",
                   f"rollout.rollout_batch_size={len(rows)}", "rollout.n_samples_per_prompt=2",
                   "rollout.eval_interval=null", recipe=RECIPE, name="vision-rows")
    final = run_controller(run.path)
    assert final["state"] == "COMPLETED", final

    log = (run.path / "logs" / "rollout.0.log").read_text()
    failed = {n: [line for line in log.splitlines() if "its images cannot be used" in line and f"line {n}:" in line]
              for n in range(1, len(rows) + 1)}
    assert not any(failed[n] for n in range(1, GOOD + 1)), failed
    assert failed[5] and all("'/etc/shadow' is outside the dataset's directory" in x for x in failed[5]), failed[5]
    assert failed[6] and all("'../secret/canary.png'" in x and "is outside" in x for x in failed[6]), failed[6]
    assert failed[7] and all("7900×7900 = 62410000 pixels, over the 12544 pixels an image may have" in x
                             for x in failed[7]), failed[7]
    assert failed[8] and all("(64 of them the images'), more than the 47 a sample's prompt may have" in x
                             for x in failed[8]), failed[8]
    # no file of the run quotes the canary (its first 8 bytes were quoted before) or /etc/shadow ("root:...")
    shadow = re.compile(rb"(?<!\w)root:")  # not runs_root:
    for f in run.path.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert CANARY[:8].encode() not in data and not shadow.search(data), f
