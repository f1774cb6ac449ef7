"""Each config owns its checks (issue 42): the recipe's validator keeps the cross-section checks, the rest live
beside the config they check, and the floors between the packages hold.

Imports are read with ``ast`` from the source, every one counted: module level, inside functions and under
``if TYPE_CHECKING:`` (a type-only import of the recipe is still a dependency on it). What a module loads is
asked of a fresh interpreter (``sys.modules``), so an import this test process already made cannot hide one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import relax_hpc

ROOT = Path(relax_hpc.__file__).resolve().parent

# rollout's modules the recipe may import: its sections and their checks, both pure Python (no runtime, no torch)
RECIPE_MAY_IMPORT_OF_ROLLOUT = {"relax_hpc.rollout.config", "relax_hpc.rollout.checks"}
ROLLOUT_RUNTIME = ("relax_hpc.rollout.data", "relax_hpc.rollout.rewards", "relax_hpc.rollout.multiturn",
                   "relax_hpc.rollout.driver")


def _imports(path: Path, *, module_level_only: bool = False) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in a file (``from X import y`` gives ``X.y``, which names the submodule
    when y is one). ``module_level_only``: the file's top-level statements only (what importing it runs)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_the_validator_keeps_only_the_cross_section_checks():
    lines = len((ROOT / "recipe" / "validate.py").read_text().splitlines())
    assert lines <= 450, (f"relax_hpc/recipe/validate.py has {lines} lines (at most 450): a section's own check "
                          "belongs beside its config (rollout/checks.py, train/config.py, engines/config.py, ...)")


def test_the_recipe_imports_nothing_of_rollout_but_its_config_and_checks():
    bad = [f"{p.relative_to(ROOT.parent)}:{line} imports {name}" for p in _files("recipe")
           for name, line in _imports(p)
           if (name + ".").startswith("relax_hpc.rollout.")
           and not any((name + ".").startswith(ok + ".") for ok in RECIPE_MAY_IMPORT_OF_ROLLOUT)]
    assert not bad, bad


# the config-level modules: the sections, their checks, and the pure facts they read (reward names, key-file rules,
# the plugin spec grammar, the media bounds, the seed); importing one loads nothing but others of this list
CONFIG_LEVEL = ("relax_hpc.rollout.config", "relax_hpc.rollout.checks", "relax_hpc.engines.config",
                "relax_hpc.engines.keys", "relax_hpc.ops.config", "relax_hpc.train.config", "relax_hpc.algo.config",
                "relax_hpc.plugins", "relax_hpc.errors", "relax_hpc.media_bounds", "relax_hpc.seed")
CHECK_MODULES = ["rollout/config.py", "rollout/checks.py", "engines/config.py", "ops/config.py", "train/config.py",
                 "algo/config.py"]


@pytest.mark.parametrize("module", CHECK_MODULES)
def test_the_config_and_check_modules_import_only_config_level_modules(module):
    """Every import counts, inside functions too: a check that needed a runtime lookup (the reward names, the data
    reader, the key-file helpers) imported it inside the function, which hid a dependency on rollout's runtime.
    Such a fact belongs in a config-level module that the runtime imports too."""
    bad = [f"{module}:{line} imports {name}" for name, line in _imports(ROOT / module)
           if name.startswith("relax_hpc.") and not (name + ".").startswith(tuple(m + "." for m in CONFIG_LEVEL))]
    assert not bad, bad


@pytest.mark.parametrize("module", CHECK_MODULES)
def test_the_config_and_check_modules_load_no_runtime(module):
    """Asked of a fresh interpreter: what importing a config module loads is config-level (and the packages
    above it, whose ``__init__`` loads nothing)."""
    dotted = "relax_hpc." + module.removesuffix(".py").replace("/", ".")
    loaded = _loaded(f"import {dotted}")
    packages = {"relax_hpc"} | {"relax_hpc." + m.split("/")[0] for m in CHECK_MODULES}
    bad = [m for m in loaded if m not in packages and m not in CONFIG_LEVEL]
    assert not bad, bad


@pytest.mark.parametrize("package", ["rollout", "ops", "engines"])
def test_these_packages_import_nothing_of_the_recipe(package):
    bad = [f"{p.relative_to(ROOT.parent)}:{line} imports {name}" for p in _files(package)
           for name, line in _imports(p) if (name + ".").startswith("relax_hpc.recipe.")]
    assert not bad, bad


def _loaded(statement: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", f"{statement}; import sys; "
                          "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] == 'relax_hpc')))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_identity_is_light():
    loaded = _loaded("import relax_hpc.identity")
    assert len(loaded) <= 12, loaded


def test_loading_a_recipe_loads_no_rollout_runtime():
    """The login node's validation (``relax_hpc.recipe``: load, build, check) needs rollout's sections and checks,
    not its data reader, rewards, multi-turn or driver."""
    loaded = _loaded("import relax_hpc.recipe")
    assert not [m for m in loaded if m.startswith(ROLLOUT_RUNTIME)], loaded


def test_validating_a_recipe_loads_no_rollout_runtime():
    """Checking a recipe that names a built-in reward, prompt data with images and a chat template (the checks that
    once looked the reward names up in rollout.rewards and called the data reader's check) loads none of rollout's
    runtime, nor the media readers."""
    recipe = {"rollout": {"rm_type": "boxed_math"},
              "data": {"path": "p.jsonl", "multimodal_keys": {"image": "images"}, "max_image_pixels": 10 ** 6,
                       "apply_chat_template_kwargs": '{"enable_thinking": false}'}}
    loaded = _loaded(f"from relax_hpc.recipe import recipe_from_dict; recipe_from_dict({recipe!r})")
    runtime = (*ROLLOUT_RUNTIME, "relax_hpc.rollout.external", "relax_hpc.multimodal", "relax_hpc.audio")
    assert not [m for m in loaded if m.startswith(runtime)], loaded
