"""Two pictures, two turns: the multi-turn vision task (``recipes/quickstart-vision-multiturn.yaml``).

The prompt shows picture A (:func:`relax_hpc.tasks.shapes.picture`) and asks ``<image>colour?``; the model answers
with one letter. The environment (Relax's ``BaseInteractionEnv`` form, :class:`ShapesTurnsEnv`) then shows
picture B in its observation — ``{"obs_str": "<image>and this?", "role": "user", "multi_modal_data": {"image":
[B]}}`` — and the model names B's colour. The reward (:func:`reward_func`) is the mean of the two answers' scores
(:func:`relax_hpc.tasks.shapes.score`: 1 right, 0.2 another colour, 0 otherwise; a turn not taken scores 0).

So the second answer is right only if B's pixels reached the engine in the observation's turn and the trainer
(images merged turn by turn, docs/multimodal.md "Multi-turn with images"): the text ``and this?`` says nothing
of B's colour.

``python -m relax_hpc.tasks.shapes_turns OUT.jsonl [--n N] [--seed S]`` writes N rows (default 64): ``prompt``
(``<image>colour?``), ``images`` (A as base64 PNG), ``label`` (A's colour letter) and ``metadata`` (``{"index",
"colour", "second_label", "second_colour", "second_image"}``: B as base64 PNG, which the environment shows).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path
from typing import Any

from relax_hpc.tasks.shapes import COLOURS, picture, png, score

PROMPT = "<image>colour?"
FOLLOW_UP = "<image>and this?"  # the observation: Relax's <image> marker, then the question


def rows(n: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """The dataset's rows: row ``i`` shows picture ``i`` of :func:`~relax_hpc.tasks.shapes.picture` in its prompt
    and carries picture ``n + i`` (base64 PNG) in its metadata for the environment. With ``n`` a multiple of 4 the
    two are never of the same block of four pictures (each block holds each colour once, in its own order), so B's
    colour is independent of A's and the first answer says nothing of the second."""
    out = []
    for i in range(n):
        colour_a, _, img_a = picture(seed, i)
        colour_b, _, img_b = picture(seed, n + i)
        out.append({"prompt": PROMPT, "images": [base64.b64encode(png(img_a)).decode()], "label": colour_a,
                    "metadata": {"index": i, "colour": COLOURS[colour_a][0], "second_label": colour_b,
                                 "second_colour": COLOURS[colour_b][0],
                                 "second_image": base64.b64encode(png(img_b)).decode()}})
    return out


class ShapesTurnsEnv:
    """Relax's interaction env: ``reset``, ``step(response_text) -> (obs, done, info)``, ``format_observation``."""

    def __init__(self, *, labels: list[str], second_image: Any):
        self.labels = labels
        self.second_image = second_image
        self.answers: list[str] = []

    def reset(self):
        self.answers = []
        return {"obs_str": "", "role": "user"}, {}

    def step(self, response_text: str):
        self.answers.append(response_text)
        info = {"turn": len(self.answers), "score": score(response_text, self.labels[len(self.answers) - 1])}
        if len(self.answers) >= len(self.labels):
            return {"obs_str": "", "role": "user"}, True, info
        obs = {"obs_str": FOLLOW_UP, "role": "user", "multi_modal_data": {"image": [self.second_image]}}
        return obs, False, info

    def close(self):
        pass

    def format_observation(self, obs: dict) -> dict:
        """Relax's chat form (with ``data.apply_chat_template``): the images, then the text without its marker."""
        images = (obs.get("multi_modal_data") or {}).get("image") or []
        text = obs["obs_str"].replace("<image>", "")
        return {"role": obs.get("role", "user"),
                "content": [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]}


def build_env(sample=None, args=None, **_):
    """Relax's factory: the env of ``sample`` (its label and metadata, as :func:`rows` wrote them)."""
    md = sample.metadata or {}
    return ShapesTurnsEnv(labels=[str(sample.label).strip(), str(md["second_label"])],
                          second_image=md["second_image"])


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> float:
    """The mean score of the two answers (the trace of each turn; a turn not taken scores 0)."""
    traces = sample.metadata.get("rollout_traces") or []
    labels = [sample.label, sample.metadata.get("second_label")]
    return sum(score(t["response"], lab) for t, lab in zip(traces, labels)) / len(labels)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relax_hpc.tasks.shapes_turns", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the JSONL to write (data.path)")
    p.add_argument("--n", type=int, default=64, help="rows (two pictures each)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.n < 1:
        p.error(f"--n {a.n}: at least 1 row")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for rec in rows(a.n, a.seed):
            f.write(json.dumps(rec) + "\n")
    print(f"{out}: {a.n} rows; recipe: recipes/quickstart-vision-multiturn.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
