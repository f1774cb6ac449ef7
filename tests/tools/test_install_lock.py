"""The locks tools/install installs from (requirements-lock-cpu.txt, requirements-lock-gpu.txt; tools/lock compiles
them with ``uv pip compile``): every package at one version with its files' sha256, agreeing with what setup.cfg and
requirements-cpu.txt declare and with requirements-pins.txt, and what tools/install really installs (this venv's
packages, and uv's own dry run of the install)."""

from __future__ import annotations

import configparser
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCKS = {"cpu": REPO / "requirements-lock-cpu.txt", "gpu": REPO / "requirements-lock-gpu.txt"}
# pinned, but not in a lock: Transformer Engine (--te: built on the GPU node), SGLang (its own venv), uv (installs it)
NOT_LOCKED = {"transformer-engine", "sglang", "uv"}


def read_lock(text: str) -> dict[str, tuple[str, int]]:
    """{name: (version, number of sha256 hashes)} of a ``uv pip compile --generate-hashes`` file."""
    out: dict[str, tuple[str, int]] = {}
    name = None
    for line in text.splitlines():
        body = line.split("#")[0].strip()
        if not body:
            continue
        if not line[0].isspace():
            req = body.rstrip("\\").strip()
            name, _, version = req.partition("==")
            assert version and re.fullmatch(r"[A-Za-z0-9._+!-]+", version), f"not name==version: {line!r}"
            name = canonicalize_name(name)
            assert name not in out, f"{name} twice"
            out[name] = (version, 0)
        else:
            assert name is not None and body.startswith("--hash=sha256:"), line
            out[name] = (out[name][0], out[name][1] + body.count("--hash=sha256:"))
    return out


def declared() -> list[Requirement]:
    """setup.cfg's install_requires and extras (the test extra too: CI installs it) and requirements-cpu.txt."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].split("\n")
    lines += [x for v in cfg["options.extras_require"].values() for x in v.split("\n")]
    lines += [x.split("#")[0] for x in (REPO / "requirements-cpu.txt").read_text().splitlines()]
    return [Requirement(x.strip()) for x in lines if x.strip()]


def pins() -> dict[str, str]:
    out = {}
    for line in (REPO / "requirements-pins.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = version
    return out


def problems(lock: dict[str, tuple[str, int]], kind: str) -> list[str]:
    """What is wrong with a lock: a declared dependency missing or outside its range, a pin not kept, a package
    without hashes, a CUDA library in the CPU lock or a CPU torch in the GPU one."""
    bad = []
    for req in declared():
        name = canonicalize_name(req.name)
        if name not in lock:
            bad.append(f"{name} is declared but not locked")
        elif not req.specifier.contains(Version(lock[name][0]), prereleases=True):
            bad.append(f"{name}=={lock[name][0]} is outside the declared {req}")
    for name, version in pins().items():
        if name in NOT_LOCKED:
            continue
        got = lock.get(name, ("absent", 0))[0]
        if Version(got if got != "absent" else "0").public != Version(version).public:
            bad.append(f"{name} is locked at {got}, pinned at {version}")
    bad += [f"{name}=={v} has no hash" for name, (v, n) in lock.items() if n == 0]
    torch = Version(lock.get("torch", ("0", 0))[0])
    cuda = sorted(n for n in lock if n.startswith("nvidia-"))
    if kind == "cpu" and (cuda or torch.local != "cpu"):
        bad.append(f"the CPU lock holds torch {torch} and CUDA libraries {cuda}")
    if kind == "gpu" and (torch.local is not None or len(cuda) < 10):
        bad.append(f"the GPU lock holds torch {torch} and CUDA libraries {cuda}")
    return bad


@pytest.mark.parametrize("kind", sorted(LOCKS))
def test_the_lock_agrees_with_the_declared_dependencies_and_the_pins(kind):
    lock = read_lock(LOCKS[kind].read_text())
    assert not problems(lock, kind), problems(lock, kind)
    assert {"megatron-bridge", "triton", "torch", "megatron-core", "transformers"} <= set(lock)
    # and it could say otherwise: a transformers 5, a torch off the pin, a missing package, a line without hashes
    worse = dict(lock, transformers=("5.0.0", 1), torch=("2.12.0", 1), **{"megatron-bridge": ("0.3.1", 0)})
    del worse["h5py"]
    found = " | ".join(problems(worse, kind))
    for says in ("transformers==5.0.0 is outside", "torch is locked at 2.12.0", "h5py is declared but not locked",
                 "megatron-bridge==0.3.1 has no hash"):
        assert says in found, found
    other = "gpu" if kind == "cpu" else "cpu"
    assert any("torch" in p and "CUDA" in p for p in problems(lock, other))  # the two locks are not the same


def test_this_venv_holds_the_cpu_lock():
    """tools/install (CI's) installed exactly the CPU lock: each locked package at its locked version."""
    lock = read_lock(LOCKS["cpu"].read_text())
    if md.version("torch").split("+")[0] != lock["torch"][0].split("+")[0] or not md.version("torch").endswith("+cpu"):
        pytest.skip(f"this venv's torch is {md.version('torch')}: not a CPU install by tools/install")
    wrong = {}
    for name, (version, _) in lock.items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have is None or Version(have) != Version(version):
            wrong[name] = f"{have} (locked {version})"
    assert not wrong, f"this venv is not the lock (rerun tools/install): {wrong}"


def uv() -> str | None:
    here = Path(sys.executable).with_name("uv")
    return str(here) if here.exists() else os.environ.get("RELAX_UV") or shutil.which("uv")


def test_the_install_takes_the_lock_and_nothing_else(tmp_path):
    """``tools/install --dry-run``: uv's own plan for the CPU install into an empty venv lists exactly the lock's
    packages at their versions (torch aside: installed first, by its own path), with nothing resolved."""
    exe = uv()
    if exe is None:
        pytest.skip("no uv here: tools/install puts it in the venv (rerun it)")
    p = subprocess.run(["bash", str(REPO / "tools" / "install"), "--dry-run"], env=dict(os.environ, RELAX_UV=exe),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    plan = dict(re.findall(r"^\[install\]\s+\+ (\S+)==(\S+)$", p.stdout, re.M))
    lock = read_lock(LOCKS["cpu"].read_text())
    want = {name: v for name, (v, _) in lock.items() if name != "torch"}
    assert {canonicalize_name(n): v for n, v in plan.items()} == want, p.stdout
    assert "from requirements-lock-cpu.txt with uv (--no-deps --require-hashes)" in p.stdout
