"""Coloured shapes: a 56×56 picture of one shape, and a one-letter question about it. The vision quickstart's task.

Each picture is one filled shape — a circle, a square or a triangle — in one of four colours, at a random size and
place on a plain light background, drawn here with PIL (no download; the same pictures for the same seed). Each
picture is asked about twice, in two rows:

* ``<image>colour?`` → ``r``, ``g``, ``b`` or ``y`` (red, green, blue, yellow);
* ``<image>shape?`` → ``c``, ``s`` or ``t`` (circle, square, triangle).

Why this task: the answer is one character, one token of ``tools/make-tiny-model``'s character tokenizer, and
the text alone tells only which kind of answer is asked, so a tiny VLM beats chance only by looking. 56×56 is
4 image tokens for the tiny Qwen2.5-VL (14-pixel patches, 2×2 merge). The colour is in every patch the shape
covers, so it is the easy half; the shape needs its outline.

The reward is Relax's custom form (``rollout.custom_rm_path: relax_hpc.tasks.shapes.reward_func``):

- 1.0 if the response's first character is the answer;
- 0.2 if it is another answer to the same question (a colour letter asked for a colour): well-formed, so a
  random model's groups are rarely all equal from the first step;
- 0.0 otherwise.

``python -m relax_hpc.tasks.shapes OUT.jsonl [--n N] [--seed S] [--image-dir DIR]`` writes ``2 × N`` rows (N
pictures, default 64), one JSON object per line: ``prompt`` (with Relax's ``<image>`` marker), ``images`` (one
base64 PNG; with ``--image-dir`` a PNG file there, named relative to the JSONL), ``label`` and ``metadata``
(``{"colour", "shape", "question", "index"}``). The recipe reads them with ``data.multimodal_keys: {image:
images}`` (docs/multimodal.md, "The vision task").
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

SIZE = 56  # pixels a side: 4 image tokens of the tiny Qwen2.5-VL
BACKGROUND = (236, 236, 236)
COLOURS = {"r": ("red", (220, 30, 30)), "g": ("green", (30, 170, 40)), "b": ("blue", (30, 60, 220)),
           "y": ("yellow", (235, 200, 20))}
SHAPES = {"c": "circle", "s": "square", "t": "triangle"}
QUESTIONS = {"colour": ("<image>colour?", COLOURS), "shape": ("<image>shape?", SHAPES)}  # prompt, the answers
PARTIAL = 0.2  # another answer to the same question


def draw(colour: str, shape: str, rng: random.Random):
    """One picture: ``shape`` (a key of :data:`SHAPES`) filled with ``colour`` (a key of :data:`COLOURS`), 20 to 40
    pixels across, anywhere it fits, on :data:`BACKGROUND` (RGB, ``SIZE`` × ``SIZE``)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    d = ImageDraw.Draw(img)
    side = rng.randint(20, 40)
    x, y = rng.randint(2, SIZE - side - 2), rng.randint(2, SIZE - side - 2)
    fill = COLOURS[colour][1]
    box = (x, y, x + side - 1, y + side - 1)
    if shape == "c":
        d.ellipse(box, fill=fill)
    elif shape == "s":
        d.rectangle(box, fill=fill)
    elif shape == "t":
        d.polygon([(x + side // 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}: one of {sorted(SHAPES)}")
    return img


def picture(seed: int, index: int):
    """Picture ``index`` of the dataset made with ``seed``: (colour key, shape key, PIL image), the same every time."""
    rng = random.Random(f"shapes:{seed}:{index}")
    colour, shape = rng.choice(sorted(COLOURS)), rng.choice(sorted(SHAPES))
    return colour, shape, draw(colour, shape, rng)


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def rows(n: int = 64, seed: int = 0, image_dir: str | os.PathLike | None = None,
         relative_to: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The dataset's rows: for each of ``n`` pictures a colour question and a shape question. The image is a base64
    PNG, or, with ``image_dir``, a PNG written there and named by its path (relative to ``relative_to``, the JSONL's
    directory, if given: the data path reads relative paths from there)."""
    out = []
    for i in range(n):
        colour, shape, img = picture(seed, i)
        data = png(img)
        if image_dir is None:
            ref = base64.b64encode(data).decode()
        else:
            path = Path(image_dir) / f"shape-{seed}-{i:05d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            ref = os.path.relpath(path, relative_to) if relative_to is not None else str(path)
        meta = {"colour": COLOURS[colour][0], "shape": SHAPES[shape], "index": i}
        for question, (prompt, _) in QUESTIONS.items():
            label = colour if question == "colour" else shape
            out.append({"prompt": prompt, "images": [ref], "label": label, "metadata": {**meta, "question": question}})
    return out


def score(response: str, label: Any) -> float:
    """1.0 for the answer, :data:`PARTIAL` for another answer to the same question, else 0.0 (first character)."""
    answer = str(label).strip()
    first = (response or "")[:1]
    if first == answer:
        return 1.0
    same = next((a for _, a in QUESTIONS.values() if answer in a), {})
    return PARTIAL if first and first in same else 0.0


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> float:
    """Relax's custom reward signature: ``args`` (unused here) and the ``Sample`` (``response``, ``label``)."""
    return score(sample.response, sample.label)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relax_hpc.tasks.shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the JSONL to write (data.path)")
    p.add_argument("--n", type=int, default=64, help="pictures (two rows each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-dir", default=None, help="write PNG files here instead of base64 in the JSONL")
    a = p.parse_args(argv)
    if a.n < 1:
        p.error(f"--n {a.n}: at least 1 picture")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recs = rows(a.n, a.seed, a.image_dir, relative_to=out.parent.resolve() if a.image_dir else None)
    with open(out, "w", encoding="utf-8") as f:
        for rec in recs:
            f.write(json.dumps(rec) + "\n")
    print(f"{out}: {len(recs)} rows ({a.n} pictures); recipe: data.path={out} data.input_key=prompt "
          "data.label_key=label data.multimodal_keys={image: images} "
          "rollout.custom_rm_path=relax_hpc.tasks.shapes.reward_func")
    return 0


if __name__ == "__main__":
    sys.exit(main())
