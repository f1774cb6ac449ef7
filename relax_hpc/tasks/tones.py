"""A task solved only by listening: is a tone low, mid or high? For the tiny omni thinker (``tools/make-tiny-model
--arch qwen2_5_omni``) and the audio quickstart (``recipes/quickstart-audio.yaml``).

Each clip is 0.4 s (10 audio tokens) of one sine tone — low 280–320 Hz, mid 1000–1200 Hz, high 3000–3400 Hz, its
exact pitch and phase drawn per clip, a little noise added — synthesized with numpy, written as 8-bit WAV at 8 kHz
(small data files; the data path resamples it to the model's 16 kHz). Clips 3k…3k+2 hold the three pitches once
each, in an order drawn per block: on a set of 3k clips any answer that does not depend on the clip — whatever its
letters — is right exactly 1/3 of the time.

The prompt is ``<audio>pitch?``; the answer one character (``l`` ``m`` ``h``), one token of the tiny models'
character tokenizer. The reward (``rollout.custom_rm_path: relax_hpc.tasks.tones.reward_func``): 1 for the answer
as the response's first character, 0.2 for another of the three, 0 otherwise.

    python -m relax_hpc.tasks.tones data/tones.jsonl --n 96 --seed 0        # clips as base64 WAV in the rows
    python -m relax_hpc.tasks.tones data/tones.jsonl --audio-dir data/tones # or WAV files, relative paths
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.tasks.balanced import balanced_answer, letter_score

RATE = 8000  # the files' rate: the highest tone, 3.4 kHz, is under its 4 kHz Nyquist
SECONDS = 0.4
PITCHES = {"l": (280.0, 320.0), "m": (1000.0, 1200.0), "h": (3000.0, 3400.0)}  # answer -> Hz range
PROMPT = "<audio>pitch?"
PARTIAL = 0.2


def clip(seed: int, i: int) -> tuple[str, np.ndarray]:
    """Clip ``i`` of a seed: (its answer, float32 samples at :data:`RATE`). Deterministic."""
    answer = balanced_answer(list(PITCHES), i,
                             lambda k: [int(j) for j in np.random.default_rng([seed, k, 7]).permutation(len(PITCHES))])
    rng = np.random.default_rng([seed, i, 11])
    lo, hi = PITCHES[answer]
    f = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
    t = np.arange(int(RATE * SECONDS)) / RATE
    x = 0.5 * np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi))
    x = x + 0.01 * rng.standard_normal(t.size)
    return answer, x.astype(np.float32)


def wav(x: np.ndarray) -> bytes:
    from relax_hpc.audio import wav_bytes

    return wav_bytes(x, RATE, width=1)


def rows(n: int = 96, seed: int = 0, audio_dir: str | os.PathLike | None = None,
         relative_to: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The dataset's rows, one per clip: the clip as base64 WAV, or, with ``audio_dir``, a WAV written there and
    named by its path (relative to ``relative_to``, the JSONL's directory, if given)."""
    out = []
    for i in range(n):
        answer, x = clip(seed, i)
        data = wav(x)
        if audio_dir is None:
            ref = base64.b64encode(data).decode()
        else:
            path = Path(audio_dir) / f"tone-{seed}-{i:05d}.wav"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            ref = os.path.relpath(path, relative_to) if relative_to is not None else str(path)
        out.append({"prompt": PROMPT, "audios": [ref], "label": answer, "metadata": {"index": i, "pitch": answer}})
    return out


def score(response: str, label: Any) -> float:
    """1.0 for the answer, :data:`PARTIAL` for another pitch letter, else 0.0 (first character)."""
    return letter_score(response, label, PITCHES, PARTIAL)


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> float:
    """Relax's custom reward signature: ``args`` (unused here) and the ``Sample`` (``response``, ``label``)."""
    return score(sample.response, sample.label)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relax_hpc.tasks.tones", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the JSONL to write (data.path)")
    p.add_argument("--n", type=int, default=96, help="clips (one row each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--audio-dir", default=None, help="write WAV files here instead of base64 in the JSONL")
    a = p.parse_args(argv)
    if a.n < 1:
        p.error(f"--n {a.n}: at least 1 clip")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recs = rows(a.n, a.seed, a.audio_dir, relative_to=out.parent.resolve() if a.audio_dir else None)
    with open(out, "w", encoding="utf-8") as f:
        for rec in recs:
            f.write(json.dumps(rec) + "\n")
    print(f"{out}: {len(recs)} rows; recipe: data.path={out} data.input_key=prompt data.label_key=label "
          "data.multimodal_keys={audio: audios} rollout.custom_rm_path=relax_hpc.tasks.tones.reward_func")
    return 0


if __name__ == "__main__":
    sys.exit(main())
