"""The two-turn vision task's data (relax_hpc/tasks/shapes_turns.py): the committed files are what the module
writes, and the second picture's colour is independent of the first's (the first answer does not give away the
second)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from relax_hpc.tasks import shapes_turns

DATA = Path(__file__).resolve().parents[2] / "recipes" / "data"


def test_the_committed_rows_are_the_modules():
    for name, n, seed in (("shapes_turns.jsonl", 64, 0), ("shapes_turns-eval.jsonl", 16, 1)):
        got = [json.loads(line) for line in (DATA / name).read_text().splitlines()]
        assert got == shapes_turns.rows(n, seed), name


def test_the_second_colour_is_independent_of_the_first():
    rows = shapes_turns.rows(64, 0)
    pairs = Counter((r["label"], r["metadata"]["second_label"]) for r in rows)
    same = sum(c for (a, b), c in pairs.items() if a == b)
    assert 4 <= same <= 28, pairs  # about a quarter of 64 rows; never 0, as when both came from one block of four
    assert set(Counter(r["label"] for r in rows).values()) == {16}  # each colour 16 times in the prompts
    assert set(Counter(r["metadata"]["second_label"] for r in rows).values()) == {16}
