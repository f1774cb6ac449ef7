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


def test_routing_replay_asks_sglang_for_the_routed_experts(monkeypatch):
    """SGLang returns routed experts only when started with its flag; the reference engine whenever asked (no
    flag: it would say SGLang's arguments are not its own)."""
    from relax_hpc.recipe import recipe_from_dict
    from relax_hpc.roles import engine_host
    from relax_hpc.roles.engine import _sglang_args

    assert _sglang_args(recipe_from_dict({"train": {"routing_replay": True},
                                          "rollout": {"engine": {"kind": "reference"}}})) == []
    monkeypatch.setenv("RELAX_SGLANG_PYTHON", "/x/python")
    monkeypatch.setattr(engine_host, "has_cuda", lambda: True)  # no GPU here: the branch a GPU node takes
    assert _sglang_args(recipe_from_dict({"train": {"routing_replay": True}})) == ["--enable-return-routed-experts"]
    assert _sglang_args(recipe_from_dict({})) == []
