"""A task solved only by watching: which way does the dot move? For the tiny Qwen2.5-VL (``tools/make-tiny-model
--arch qwen2_5_vl``) and the video quickstart (``recipes/quickstart-video.yaml``).

Each video is :data:`FRAMES` frames of 56×56 (the tiny model's 14-pixel patches, 2×2 merge and 2 frames a time step:
2 time steps × 4 tokens = 8 video tokens), a light square of :data:`SIDE` pixels on a dark background, crossing the
picture left, right, up or down in even steps from one edge to the other; the other coordinate drawn per video
(numpy, no download; the same frames for the same seed). Videos ``4k`` to ``4k + 3`` move each way once, in an order
drawn per block (:mod:`.balanced`): on a set of ``4k`` videos any answer that does not watch the video — whatever its
letters — is right exactly 1/4 of the time.

The prompt is ``<video>way?``; the answer one character (``l`` ``r`` ``u`` ``d``), one token of the tiny models'
character tokenizer. The reward (``rollout.custom_rm_path: relax_hpc.tasks.dots.reward_func``): 1 for the answer as
the response's first character, 0.2 for another of the four, 0 otherwise.

    python -m relax_hpc.tasks.dots data/dots.jsonl --n 128 --seed 0          # frames as base64 PNG in the rows
    python -m relax_hpc.tasks.dots data/dots.jsonl --frame-dir data/dots     # or PNG files, relative paths

Each row: ``prompt``, ``video`` (one video: the list of its frames), ``label``, ``metadata`` (``{"index", "way"}``);
the recipe reads it with ``data.multimodal_keys: {video: video}`` (docs/multimodal.md, "Videos").
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.tasks.balanced import balanced_answer, letter_score

SIZE = 56  # pixels a side: 4 tokens a time step of the tiny Qwen2.5-VL
FRAMES = 4  # 2 time steps of the processor's 2 frames
SIDE = 24  # the square's side: the way it moves shows in every token it crosses
BACKGROUND, DOT = 20, 235  # grey levels
WAYS = {"l": (-1, 0), "r": (1, 0), "u": (0, -1), "d": (0, 1)}  # answer -> (dx, dy), image rows grow downwards
PROMPT = "<video>way?"
PARTIAL = 0.2


def video(seed: int, i: int) -> tuple[str, list[np.ndarray]]:
    """Video ``i`` of a seed: (its answer, :data:`FRAMES` uint8 RGB frames [SIZE, SIZE, 3]). Deterministic."""
    answer = balanced_answer(list(WAYS), i,
                             lambda k: [int(j) for j in np.random.default_rng([seed, k, 3]).permutation(len(WAYS))])
    rng = np.random.default_rng([seed, i, 5])
    dx, dy = WAYS[answer]
    span = SIZE - SIDE
    steps = np.linspace(0, span, FRAMES).round().astype(int)  # edge to edge in even steps
    other = int(rng.integers(0, span + 1))
    frames = []
    for s in steps:
        along = s if (dx + dy) > 0 else span - s
        x, y = (along, other) if dx else (other, along)
        f = np.full((SIZE, SIZE, 3), BACKGROUND, np.uint8)
        f[y:y + SIDE, x:x + SIDE] = DOT
        frames.append(f)
    return answer, frames


def png(frame: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return buf.getvalue()


def rows(n: int = 128, seed: int = 0, frame_dir: str | os.PathLike | None = None,
         relative_to: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The dataset's rows, one per video: its frames as base64 PNG, or, with ``frame_dir``, PNG files written there
    and named by their paths (relative to ``relative_to``, the JSONL's directory, if given)."""
    out = []
    for i in range(n):
        answer, frames = video(seed, i)
        refs = []
        for j, f in enumerate(frames):
            data = png(f)
            if frame_dir is None:
                refs.append(base64.b64encode(data).decode())
                continue
            path = Path(frame_dir) / f"dot-{seed}-{i:05d}-{j}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            refs.append(os.path.relpath(path, relative_to) if relative_to is not None else str(path))
        out.append({"prompt": PROMPT, "video": refs, "label": answer, "metadata": {"index": i, "way": answer}})
    return out


def score(response: str, label: Any) -> float:
    """1.0 for the answer, :data:`PARTIAL` for another way's letter, else 0.0 (first character)."""
    return letter_score(response, label, WAYS, PARTIAL)


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> float:
    """Relax's custom reward signature: ``args`` (unused here) and the ``Sample`` (``response``, ``label``)."""
    return score(sample.response, sample.label)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relax_hpc.tasks.dots", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the JSONL to write (data.path)")
    p.add_argument("--n", type=int, default=128, help="videos (one row each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frame-dir", default=None, help="write PNG frames here instead of base64 in the JSONL")
    a = p.parse_args(argv)
    if a.n < 1:
        p.error(f"--n {a.n}: at least 1 video")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recs = rows(a.n, a.seed, a.frame_dir, relative_to=out.parent.resolve() if a.frame_dir else None)
    with open(out, "w", encoding="utf-8") as f:
        for rec in recs:
            f.write(json.dumps(rec) + "\n")
    print(f"{out}: {len(recs)} rows; recipe: data.path={out} data.input_key=prompt data.label_key=label "
          "data.multimodal_keys={video: video} rollout.custom_rm_path=relax_hpc.tasks.dots.reward_func")
    return 0


if __name__ == "__main__":
    sys.exit(main())
