"""The launcher's whole SGLang command line, for every recipe that runs SGLang, parsed by SGLang's own server-argument
parser: the roles' composition (:func:`relax_hpc.roles.engine_host.start_node_engine`: ``--weight-version``,
``--random-seed``, ``rollout.engine.args``, ``--enable-return-routed-experts`` with routing replay) through
:func:`relax_hpc.engines.launcher.start_engine`'s real process start, its ``SGLANG_LAUNCHER`` code run by SGLang's
interpreter with the API key in the environment (sglang_side/parse_launch.py). This machine has no GPU: the one
stand-in is ``has_cuda`` (the node check before choosing SGLang)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from contract_support import SIDE
from relax_hpc.recipe import load_recipe
from relax_hpc.rundir import RunDir

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def sglang_recipes() -> list[str]:
    return sorted(p.name for p in RECIPES.glob("*.yaml") if "kind: sglang" in p.read_text())


def launch(sglang_python, tmp_path, monkeypatch, recipe_name: str, overrides=(),
           key: str | None = None) -> tuple[int, dict, object, str]:
    """Start the rollout engine of ``recipe_name`` as the engine role does; SGLang's parser reads its arguments.
    ``key``: the run's API key (else the run makes one, as a run does)."""
    from relax_hpc.roles import engine as engine_role
    from relax_hpc.roles import engine_host

    wrapper = tmp_path / "sglang-python"
    wrapper.write_text(f'#!/bin/sh\nunset PYTHONPATH\nexec "{sglang_python}" "{SIDE / "parse_launch.py"}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "parsed.json"
    monkeypatch.setenv("RELAX_SGLANG_PYTHON", str(wrapper))
    monkeypatch.setenv("RELAX_CONTRACT_OUT", str(out))
    monkeypatch.setattr(engine_host, "has_cuda", lambda: True)
    recipe = load_recipe(RECIPES / recipe_name, list(overrides))
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True, exist_ok=True)
    if key is not None:
        run.api_key_file.write_text(key + "\n")
    h = engine_host.start_node_engine(run, recipe.roles.rollout, recipe.model.path, name="engine0", local=True,
                                      local_rank=0, seed=recipe.run.seed, sglang_args=engine_role._sglang_args(recipe),
                                      kind=recipe.rollout.engine.kind)
    rc = h._proc.wait(300)
    return rc, (json.loads(out.read_text()) if out.exists() else {}), h, run.api_key()


@pytest.mark.parametrize("recipe_name", sglang_recipes())
def test_recipe_command_parses_with_sglang(sglang_python, tmp_path, monkeypatch, recipe_name):
    rc, a, h, key = launch(sglang_python, tmp_path, monkeypatch, recipe_name)
    recipe = load_recipe(RECIPES / recipe_name)
    assert rc == 0, f"SGLang's parser refused the launcher's command for {recipe_name}:\n{h.log_tail(15)}"
    group = recipe.roles.rollout
    seen = f"SGLang's ServerArgs {a}; command {h.command[3:]}"
    assert a["tp_size"] == group.gpus_per_node // group.tasks_per_node and a["weight_version"] == "0", seen
    assert a["random_seed"] == recipe.run.seed and a["host"] == "127.0.0.1" and a["port"] > 0, seen
    args = list(recipe.rollout.engine.args)
    assert a["mem_fraction_static"] == float(args[args.index("--mem-fraction-static") + 1]), seen
    # the API key reached SGLang's ServerArgs through the environment only
    assert a["api_key"] == key and not a["key_left_in_env"] and not a["key_on_cmdline"], seen
    assert key not in " ".join(h.command) and "--api-key" not in h.command


def test_routing_replay_flag_parses(sglang_python, tmp_path, monkeypatch):
    name = sglang_recipes()[0]
    rc, a, h, _ = launch(sglang_python, tmp_path, monkeypatch, name, ["train.routing_replay=true"])
    assert rc == 0, h.log_tail(15)
    assert a["enable_return_routed_experts"] is True


def test_misspelled_flag_fails(sglang_python, tmp_path, monkeypatch):
    """Negative control: a misspelled rollout.engine.args flag is refused by SGLang's parser."""
    name = sglang_recipes()[0]
    rc, a, h, _ = launch(sglang_python, tmp_path, monkeypatch, name,
                         ['rollout.engine.args=["--mem-fractoin-static", "0.8"]'])
    assert rc == 2 and a == {}
    assert "unrecognized arguments: --mem-fractoin-static 0.8" in h.log_tail(5)


def test_api_key_starting_with_a_dash_reaches_sglang(sglang_python, tmp_path, monkeypatch):
    """The run's key is ``secrets.token_urlsafe``: 1 in 64 begins with '-'. The launcher hands it over as one
    ``--api-key=KEY`` word; as two words SGLang's parser took such a key for an option and refused to start
    ("argument --api-key: expected one argument"), the flake of this file's launch tests."""
    name = sglang_recipes()[0]
    rc, a, h, key = launch(sglang_python, tmp_path, monkeypatch, name, key="-k3y-" + "x" * 38)
    assert key.startswith("-") and rc == 0, h.log_tail(5)
    assert a["api_key"] == key and not a["key_on_cmdline"]
