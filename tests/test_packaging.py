"""relax_hpc as a package: every third-party module it imports is a declared dependency (setup.cfg: the core or
an extra), the pins stay in requirements-pins.txt, and the wheel carries what a run needs (recipe defaults, sbatch
templates): built, installed into a fresh venv outside the checkout, and used there."""

from __future__ import annotations

import ast
import configparser
import functools
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "relax_hpc"


def declared() -> dict[str, set[str]]:
    """{"core": names, extra: names} from setup.cfg (canonical names)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    out = {"core": {canonicalize_name(Requirement(x).name) for x in cfg["options"]["install_requires"].split("\n")
                    if x.strip()}}
    for extra, lines in cfg["options.extras_require"].items():
        out[extra] = {canonicalize_name(Requirement(x).name) for x in lines.split("\n") if x.strip()}
    return out


@functools.cache
def imported_modules() -> dict[str, set[str]]:
    """Every absolute import in relax_hpc/**/*.py, inside functions too: {module: files}, stdlib and relax_hpc
    itself left out. A namespace package's import keeps its second part (megatron.core, megatron.bridge)."""
    found: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "relax_hpc":
                    continue
                key = ".".join(name.split(".")[:2]) if top == "megatron" else top
                found.setdefault(key, set()).add(str(path.relative_to(REPO)))
    return found


@functools.cache
def _providers() -> dict[str, list[str]]:
    return md.packages_distributions()  # a scan of every installed distribution: once


@functools.cache
def distribution_of(module: str) -> str:
    """The installed distribution that provides ``module`` (``a`` or ``a.b`` for a namespace package)."""
    top, _, sub = module.partition(".")
    dists = _providers().get(top, [])
    if sub and len(dists) > 1:  # a namespace shared by several distributions: the one holding a/b
        dists = [d for d in dists if any(str(f).startswith(f"{top}/{sub}/") for f in md.files(d) or ())]
    assert len(set(dists)) == 1, f"{module}: provided by {dists or 'no installed distribution'}"
    return canonicalize_name(dists[0])


def test_every_import_is_a_declared_dependency():
    decl = declared()
    anywhere = set().union(*decl.values())
    mods = imported_modules()
    assert {"torch", "numpy", "PIL", "megatron.bridge", "mpi4py", "wandb"} <= set(mods)  # the walk sees them
    missing = {m: f"{d}, imported in {sorted(files)[0]}" for m, files in mods.items()
               if (d := distribution_of(m)) not in anywhere}
    assert not missing, f"imported but not declared in setup.cfg (install_requires or an extra): {missing}"


def test_every_declared_dependency_is_imported_and_installed_by_tools_install():
    """No stale names: each declared distribution provides a module relax_hpc imports (the test extra aside), and
    tools/install's CPU path installs each (requirements-cpu.txt, or torch and megatron-bridge by name)."""
    decl = declared()
    used = {distribution_of(m) for m in imported_modules()}
    for extra, names in decl.items():
        if extra != "test":
            assert names <= used, f"setup.cfg's {extra} declares {names - used}, which relax_hpc does not import"
    cpu = {canonicalize_name(Requirement(x.split("#")[0]).name)
           for x in (REPO / "requirements-cpu.txt").read_text().splitlines() if x.split("#")[0].strip()}
    missed = set().union(*decl.values()) - cpu - {"torch", "megatron-bridge"}
    assert not missed, f"declared in setup.cfg but not in requirements-cpu.txt (tools/install): {missed}"


def test_pins_only_in_requirements_pins():
    """setup.cfg names versions nowhere exactly (ranges the code needs only); the pins file is the one place."""
    for line in (REPO / "setup.cfg").read_text().splitlines():
        line = line.split("#")[0].strip()
        assert "==" not in line, f"setup.cfg pins {line!r}: requirements-pins.txt does"


def _pins() -> dict[str, str]:
    out = {}
    for line in (REPO / "requirements-pins.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = version
    return out


def _pin_problems(pins: dict[str, str]) -> tuple[int, list[str]]:
    """(ranges checked, pins outside a range) over what megatron-core's and megatron-bridge's metadata declare."""
    from packaging.version import Version

    checked, bad = 0, []
    for owner in ("megatron-core", "megatron-bridge"):
        for text in md.requires(owner) or []:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if name in pins and req.specifier:
                checked += 1
                if Version(pins[name]) not in req.specifier:
                    bad.append(f"{name}=={pins[name]} is outside {owner} {pins[owner]}'s {req}")
    return checked, bad


def test_the_pins_satisfy_what_the_pinned_packages_declare():
    """Each pin is inside every range the other pinned packages' own metadata declares for it (extras included:
    megatron-core's dev extra and megatron-bridge both name Transformer Engine), so the pinned set is one that
    its makers allow; TE 2.12.0 (the pin before) is caught."""
    pins = _pins()
    for owner in ("megatron-core", "megatron-bridge"):
        assert md.version(owner) == pins[owner], f"{owner}: installed {md.version(owner)}, pinned {pins[owner]}"
    checked, bad = _pin_problems(pins)
    assert checked >= 3 and not bad, bad  # TE from both, torch from megatron-core at least
    _, old = _pin_problems({**pins, "transformer-engine": "2.12.0"})
    assert len(old) == 1 and "megatron-core" in old[0], old


def test_tools_install_pins_nothing_by_hand():
    """tools/install takes versions from requirements-pins.txt (`pin NAME` or `-c`), never a literal `pkg==x`."""
    import re

    text = (REPO / "tools" / "install").read_text()
    literal = [m.group(0) for m in re.finditer(r"\b(triton|transformer-engine|torch|sglang|megatron-\w+)==[0-9][\w.]*",
                                                    text)]
    assert not literal, f"tools/install pins by hand: {literal} (put them in requirements-pins.txt)"


def _source_tree(dest: Path) -> Path:
    """What the wheel is built from (setup.cfg, pyproject.toml, README.md, relax_hpc/), copied: the build leaves
    nothing in the checkout (build/, egg-info) and sees no file outside the package."""
    dest.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(PKG, dest / "relax_hpc", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.mark.slow
def test_the_wheel_installs_outside_the_checkout_and_submits_a_recipe(tmp_path):
    """pip wheel (no download: no build isolation, no index), the wheel into a fresh venv (--no-deps; the
    dependencies come from this venv's site-packages through a .pth, so nothing downloads), then relax-submit
    --local --dry-run there on a recipe that names a packaged default (cluster/dev-slurm), and the render-only dry
    run, which prints the batch script from the packaged template."""
    src = _source_tree(tmp_path / "src")
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    quiet = ["-q", "--disable-pip-version-check", "--no-index"]
    subprocess.run([*pip, "wheel", *quiet, "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
                   check=True, cwd=tmp_path, timeout=300)
    (wheel,) = wheels.glob("relax_hpc-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {"relax_hpc/configs/cluster/dev-slurm.yaml", "relax_hpc/configs/algorithm/grpo.yaml",
            "relax_hpc/sbatch/hetjob.sbatch.j2", "relax_hpc/sbatch/attach.sbatch.j2"} <= names
    requires = {canonicalize_name(Requirement(line.split(":", 1)[1].split(";")[0]).name)
                for line in meta.splitlines() if line.startswith("Requires-Dist:")}
    assert requires == set().union(*declared().values())  # the metadata is setup.cfg's

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(py), "install", *quiet, "--no-deps", str(wheel)], check=True,
                   timeout=300)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # this venv's packages, not its .pth files: the checkout's editable relax_hpc stays out of sight
    Path(site, "deps-from-checkout-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy2(REPO / "recipes" / "smoke.yaml", work / "smoke.yaml")  # defaults: [cluster/dev-slurm]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"  # no Slurm client: the local fallback
    code = "import json; from relax_hpc.launch.provenance import code_provenance; print(json.dumps(code_provenance()))"
    prov = json.loads(subprocess.run([str(py), "-c", code], cwd=work, env=env, capture_output=True, text=True,
                                     check=True).stdout)
    assert prov["package"].startswith(site), prov  # the wheel's relax_hpc, not the checkout's
    assert prov["source"] == "installed" and prov["commit"] is None  # a run records the wheel's version only

    p = subprocess.run([str(venv / "bin" / "relax-submit"), "--local", "--dry-run", "smoke.yaml"], cwd=work,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Executor: local" in p.stdout and f"{py} -m relax_hpc.roles.actor" in p.stdout
    p = subprocess.run([str(venv / "bin" / "relax-submit"), "--dry-run", "--render-only", "smoke.yaml"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("#SBATCH hetjob") == 2 and "#SBATCH --partition=debug" in p.stdout  # dev-slurm's
    assert not (work / "runs").exists()
