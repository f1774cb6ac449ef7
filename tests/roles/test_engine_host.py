"""Which engine a node runs for ``rollout.engine.kind`` (``roles/engine_host.py``)."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.roles.engine_host import engine_kind


def test_the_engine_kind_follows_the_recipe_and_the_node(monkeypatch):
    monkeypatch.delenv("RELAX_SGLANG_PYTHON", raising=False)
    assert engine_kind("auto") == "reference" and engine_kind("reference") == "reference"
    with pytest.raises(RuntimeError, match="RELAX_SGLANG_PYTHON is not set.*Fix:.*rollout.engine.kind: reference"):
        engine_kind("sglang")
    monkeypatch.setenv("RELAX_SGLANG_PYTHON", "/opt/sglang/bin/python")
    assert engine_kind("reference") == "reference"  # asked for by name: never SGLang
    if torch.cuda.is_available():
        assert engine_kind("auto") == engine_kind("sglang") == "sglang"
    else:  # SGLang needs a GPU on the node: auto falls back, a recipe that names it is told why
        assert engine_kind("auto") == "reference"
        with pytest.raises(RuntimeError, match="no CUDA device"):
            engine_kind("sglang")
