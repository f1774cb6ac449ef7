"""tools/quickstart: every quickstart recipe runs with one command (tools/quickstart WHICH), which makes what the
recipe needs first; an unknown name is refused, naming the ones there are, before anything is installed."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "tools" / "quickstart"


def test_every_quickstart_recipe_has_its_name():
    listed = subprocess.run(["bash", str(QUICKSTART), "--list"], capture_output=True, text=True, timeout=30,
                            check=True).stdout.split("\n")
    pairs = dict(line.split() for line in listed if line)
    assert pairs["default"] == "quickstart.yaml" and pairs["vision"] == "quickstart-vision.yaml"
    assert sorted(pairs.values()) == sorted(p.name for p in (REPO / "recipes").glob("quickstart*.yaml"))
    assert "distill" in pairs and "slurm" in pairs


def test_an_unknown_quickstart_is_refused_naming_the_others():
    p = subprocess.run(["bash", str(QUICKSTART), "nosuch"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "no quickstart nosuch: one of default async" in p.stderr
    assert "[install]" not in p.stdout  # refused before tools/install ran
