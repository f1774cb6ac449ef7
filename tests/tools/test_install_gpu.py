"""tools/install's GPU and SGLang paths. CI cannot download CUDA wheels, so the GPU path is tested by what pip
resolves for it (``--dry-run --report``: metadata only), against PyPI; the CPU path is installed for real by CI
(tools/test, .ci/run). The pins live in requirements-pins.txt alone."""

from __future__ import annotations

import configparser
import importlib.metadata as md
import json
import os
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from relax_hpc.engines.client import SESSION_SGLANG, update_protocol

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "tools" / "install"


def pins() -> dict[str, str]:
    out = {}
    for line in (REPO / "requirements-pins.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            r = Requirement(line)
            (spec,) = r.specifier
            assert spec.operator == "==" and not r.extras, f"{line}: a constraints file takes name==version only"
            out[r.name] = spec.version
    return out


def test_pins_in_one_place():
    """Every pinned version is said once, in requirements-pins.txt: not in tools/install nor requirements-cpu.txt
    (setup.cfg's metadata must agree with it); the SGLang pin is the release relax_hpc's wire format follows."""
    p = pins()
    assert {"torch", "megatron-core", "megatron-bridge", "transformer-engine", "sglang"} <= set(p)
    script = INSTALL.read_text()
    for name, version in p.items():
        assert version not in script, f"tools/install names {name}'s version {version}: read it from the pins"
    for line in (REPO / "requirements-cpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and Requirement(line).name in p:
            assert not Requirement(line).specifier, f"requirements-cpu.txt pins {line}: requirements-pins.txt does"
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    for line in cfg["options"]["install_requires"].split():
        r = Requirement(line)
        if r.name in p:
            assert r.specifier.contains(p[r.name]), f"setup.cfg's {line} disagrees with requirements-pins.txt"
    assert p["sglang"] == ".".join(map(str, SESSION_SGLANG)) and update_protocol(p["sglang"]) == "session"
    assert md.version("torch").split("+")[0] == p["torch"]  # the CPU path installed the pinned torch


def test_refuses_bad_arguments():
    for args, says in ((["--te"], "--te goes with --gpu"), (["--dry-run", "--report", "r.json"],
                                                             "--report goes with --gpu or --sglang"),
                       (["--sglang"], "needs a directory"), (["--cpu"], "unknown argument --cpu")):
        p = subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and says in p.stderr, (args, p.stderr)


def pypi_reachable() -> bool:
    try:
        urllib.request.urlopen(urllib.request.Request("https://pypi.org/simple/pip/", method="HEAD"), timeout=10)
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_gpu_dry_run_resolves_cuda_torch(tmp_path):
    """``tools/install --gpu --dry-run``: PyPI's CUDA wheel of the pinned torch (not a local +cpu build, which this
    machine's pip finds first), its nvidia-* CUDA libraries, and the pinned megatron-core; nothing installed."""
    if not pypi_reachable():
        pytest.skip("PyPI is not reachable from here")
    p, before = pins(), md.version("torch")
    report = tmp_path / "gpu.json"
    from tests.tools.test_install_lock import LOCKS, read_lock, uv

    exe = uv()
    out = subprocess.run(["bash", str(INSTALL), "--gpu", "--dry-run", "--report", str(report)],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, **({"RELAX_UV": exe} if exe else {})))
    assert out.returncode == 0, out.stdout + out.stderr
    got = {i["metadata"]["name"].lower(): i for i in json.loads(report.read_text())["install"]}
    torch = got["torch"]
    assert torch["metadata"]["version"] == p["torch"]  # exactly: no +cpu local label
    assert re.search(r"manylinux.*_x86_64\.whl$", torch["download_info"]["url"])
    cuda = {n for n in got if n.startswith("nvidia-")}
    assert {n for n in cuda if n.startswith(("nvidia-nccl", "nvidia-cublas", "nvidia-cudnn", "nvidia-cuda-runtime"))}
    assert len(cuda) >= 10 and "triton" in got
    requires = " ".join(torch["metadata"].get("requires_dist", []))
    assert all(n in requires.replace("_", "-").lower() for n in cuda if n.startswith("nvidia-nccl"))
    assert got["megatron-core"]["metadata"]["version"] == p["megatron-core"]
    assert f"would install: torch=={p['torch']} " in out.stdout
    assert md.version("torch") == before  # the dry run installed nothing here
    if exe:  # what tools/install --gpu installs: the GPU lock, every package of it, torch's CUDA wheel included
        plan = dict(re.findall(r"^\[install\]\s+\+ (\S+)==(\S+)$", out.stdout, re.M))
        assert plan == {n: v for n, (v, _) in read_lock(LOCKS["gpu"].read_text()).items()}, out.stdout
        assert plan["torch"] == p["torch"] and "nvidia-nccl-cu13" in plan
