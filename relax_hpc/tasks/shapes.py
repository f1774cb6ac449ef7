"""Coloured shapes: a 56×56 picture of one big shape, and a one-letter question about it. The vision quickstart's task.

Each picture is one filled shape — a circle, a square or a triangle — in one of four colours, 40 to 56 pixels
across, anywhere it fits, on a light shade of its own colour (:func:`tint`), drawn here with PIL (no download; the
same pictures for the same seed). Pictures ``4k`` to ``4k + 3`` hold each colour once (in a drawn order), so on a
set of ``4k`` pictures an answer that ignores the image — whatever its distribution over the letters — is right
exactly 1/4 of the time; only looking beats that. The shape is random. Questions
(``rows(questions=...)``, the CLI's ``--questions``; the quickstart asks only the colour):

* ``<image>colour?`` → ``r``, ``g``, ``b`` or ``y`` (red, green, blue, yellow);
* ``<image>shape?`` → ``c``, ``s`` or ``t`` (circle, square, triangle).

Why this picture: 56×56 is 4 image tokens for the tiny Qwen2.5-VL (14-pixel patches, 2×2 merge), and its vision
tower is random. With a small shape on a grey background (this task's first form) the four tokens' features
barely differ between colours, and GRPO learned only each question's answer alphabet (docs/multimodal.md, "The
vision quickstart"); with the colour in every patch — the shape's or its shade — the tiny model learns to read it.
Why one character: one token of ``tools/make-tiny-model``'s character tokenizer.

The reward is Relax's custom form (``rollout.custom_rm_path: relax_hpc.tasks.shapes.reward_func``):

- 1.0 if the response's first character is the answer;
- 0.2 if it is another answer to the same question (a colour letter asked for a colour): well-formed, so a
  random model's groups are rarely all equal from the first step. Answering validly without looking earns
  0.2 + 0.8 / 4 = 0.4 on a colour-balanced set.
- 0.0 otherwise.

``python -m relax_hpc.tasks.shapes OUT.jsonl [--n N] [--seed S] [--questions colour,shape] [--image-dir DIR]``
writes one row per picture and question (N pictures, default 64), one JSON object per line: ``prompt`` (with
Relax's ``<image>`` marker), ``images`` (one base64 PNG; with ``--image-dir`` a PNG file there, named relative to
the JSONL), ``label`` and ``metadata`` (``{"colour", "shape", "question", "index"}``). The recipe reads them with
``data.multimodal_keys: {image: images}`` (docs/multimodal.md, "The vision task").
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax_hpc.tasks.balanced import balanced_answer

SIZE = 56  # pixels a side: 4 image tokens of the tiny Qwen2.5-VL
BACKGROUND = (236, 236, 236)
COLOURS = {"r": ("red", (220, 30, 30)), "g": ("green", (30, 170, 40)), "b": ("blue", (30, 60, 220)),
           "y": ("yellow", (235, 200, 20))}
SHAPES = {"c": "circle", "s": "square", "t": "triangle"}
QUESTIONS = {"colour": ("<image>colour?", COLOURS), "shape": ("<image>shape?", SHAPES)}  # prompt, the answers
PARTIAL = 0.2  # another answer to the same question
MIN_SIDE = 40  # pixels across, at least: the shape reaches every image token's 28×28 quarter
TINT = 0.5  # the background: this much of the shape's colour mixed into BACKGROUND


def tint(colour: str) -> tuple[int, int, int]:
    """The background of a ``colour`` picture: a light shade of it (RGB)."""
    return tuple(round(TINT * c + (1 - TINT) * b) for c, b in zip(COLOURS[colour][1], BACKGROUND))


def draw(colour: str, shape: str, rng: random.Random):
    """One picture: ``shape`` (a key of :data:`SHAPES`) filled with ``colour`` (a key of :data:`COLOURS`),
    :data:`MIN_SIDE` to ``SIZE`` pixels across, anywhere it fits, on ``tint(colour)`` (RGB, ``SIZE`` × ``SIZE``)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), tint(colour))
    d = ImageDraw.Draw(img)
    side = rng.randint(MIN_SIDE, SIZE)
    x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
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
    """Picture ``index`` of the dataset made with ``seed``: (colour key, shape key, PIL image), the same every time.
    Pictures ``4k`` to ``4k + 3`` hold the four colours once each, in an order drawn from ``seed`` and ``k`` (balanced,
    and no colour bound to an index's parity); the shape, size and place are drawn from ``seed`` and ``index``."""
    def order(k: int) -> list[int]:  # each aligned run of 4 pictures: the 4 colours in an order drawn per run
        perm = list(range(len(COLOURS)))
        random.Random(f"shapes:{seed}:colours:{k}").shuffle(perm)
        return perm

    rng = random.Random(f"shapes:{seed}:{index}")
    colour, shape = balanced_answer(sorted(COLOURS), index, order), rng.choice(sorted(SHAPES))
    return colour, shape, draw(colour, shape, rng)


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def rows(n: int = 64, seed: int = 0, image_dir: str | os.PathLike | None = None,
         relative_to: str | os.PathLike | None = None, questions: Sequence[str] = ("colour",)) -> list[dict[str, Any]]:
    """The dataset's rows: for each of ``n`` pictures one row per question (keys of :data:`QUESTIONS`, in order).
    The image is a base64 PNG, or, with ``image_dir``, a PNG written there and named by its path (relative to
    ``relative_to``, the JSONL's directory, if given: the data path reads relative paths from there)."""
    unknown = [q for q in questions if q not in QUESTIONS]
    if unknown or not questions:
        raise ValueError(f"questions {list(questions)!r}: one or more of {sorted(QUESTIONS)}")
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
        for question in questions:
            prompt, _ = QUESTIONS[question]
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
    p.add_argument("--n", type=int, default=64, help="pictures (one row each per question)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-dir", default=None, help="write PNG files here instead of base64 in the JSONL")
    p.add_argument("--questions", default="colour",
                   help=f"comma-separated, one row each per picture: {','.join(QUESTIONS)} (default colour)")
    a = p.parse_args(argv)
    if a.n < 1:
        p.error(f"--n {a.n}: at least 1 picture")
    questions = a.questions.split(",")
    if not questions or any(q not in QUESTIONS for q in questions):
        p.error(f"--questions {a.questions}: comma-separated names from {','.join(QUESTIONS)}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recs = rows(a.n, a.seed, a.image_dir, relative_to=out.parent.resolve() if a.image_dir else None,
                questions=questions)
    with open(out, "w", encoding="utf-8") as f:
        for rec in recs:
            f.write(json.dumps(rec) + "\n")
    print(f"{out}: {len(recs)} rows ({a.n} pictures, {a.questions}); recipe: data.path={out} data.input_key=prompt "
          "data.label_key=label data.multimodal_keys={image: images} "
          "rollout.custom_rm_path=relax_hpc.tasks.shapes.reward_func")
    return 0


if __name__ == "__main__":
    sys.exit(main())
