"""tools/install's CPU path: where torch's CPU build comes from. pip's own configuration first (a find-links folder
or a local index: this dev machine's /opt/wheels, and CI's), else PyTorch's CPU wheel index; where neither has one
for this platform, PyPI's default build, whose download (a CUDA build on Linux x86_64: GBs) is said, with its
size, before it starts. Checked through ``tools/install --dry-run`` (the same decision the install takes, from pip's
index listings and metadata only): nothing is installed or downloaded."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.tags import sys_tags

from tests.tools.test_install_gpu import pypi_reachable

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "tools" / "install"
PIP_KEYS = ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX")


def torch_pin() -> str:
    (line,) = [ln for ln in (REPO / "requirements-pins.txt").read_text().splitlines() if ln.startswith("torch==")]
    return line.split("==")[1].split("#")[0].strip()




def plan(env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    p = subprocess.run(["bash", str(INSTALL), "--dry-run"], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def bare_pip_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """An ordinary machine's pip: no configuration files, no find-links; its index an empty local one (nothing is
    asked of the network), unless ``extra`` names another."""
    empty = tmp_path / "empty-index"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in PIP_KEYS}
    env.update({"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": empty.as_uri(), **extra})
    return env


def cpu_index(root: Path, version: str) -> Path:
    """A PEP 503 simple index holding one torch CPU wheel for this interpreter and platform (a name only: the
    plan reads the listing, never the file)."""
    tag = next(iter(sys_tags()))
    name = f"torch-{version}+cpu-{tag.interpreter}-{tag.abi}-{tag.platform}.whl"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text(f'<html><body><a href="{name.replace("+", "%2B")}">{name}</a>'
                                               "</body></html>\n")
    return root


def test_pip_configuration_s_cpu_build_is_taken_here():
    """This machine's pip finds the CPU build (find-links): the path CI takes, with no other index asked."""
    p = plan(dict(os.environ, RELAX_TORCH_CPU_INDEX="file:///nonexistent"))
    if "pip's configuration has it" not in p.stdout:
        pytest.skip("pip's configuration here has no torch CPU build")
    assert f"torch=={torch_pin()}+cpu: pip's configuration has it" in p.stdout
    assert md.version("torch").endswith("+cpu")  # and what tools/install installed here is that build


def test_without_one_in_pip_s_configuration_pytorch_s_cpu_index_serves_it(tmp_path):
    v = torch_pin()
    index = cpu_index(tmp_path / "cpu", v)
    p = plan(bare_pip_env(tmp_path, RELAX_TORCH_CPU_INDEX=index.as_uri()))
    assert f"torch=={v}+cpu from PyTorch's CPU wheel index {index.as_uri()}" in p.stdout, p.stdout
    # a CPU index without this release: not taken (PyPI's build would be; its download is said: next test)
    other = cpu_index(tmp_path / "old", "2.0.0")
    p = subprocess.run(["bash", str(INSTALL), "--dry-run"], capture_output=True, text=True, timeout=120,
                       env=bare_pip_env(tmp_path, RELAX_TORCH_CPU_INDEX=other.as_uri()))
    assert f"no CPU build of torch {v} for this platform" in p.stdout, p.stdout + p.stderr


@pytest.mark.slow
def test_pypi_s_build_is_said_with_its_size_before_it_downloads(tmp_path):
    """No CPU build anywhere (pip's configuration bare, the CPU index unreachable): the plan lists what PyPI's torch
    brings and how big, from metadata and the files' lengths; nothing is downloaded or installed."""
    if not pypi_reachable():
        pytest.skip("PyPI is not reachable from here")
    env = bare_pip_env(tmp_path, RELAX_TORCH_CPU_INDEX="file:///nonexistent",
                       PIP_INDEX_URL="https://pypi.org/simple")
    before = md.version("torch")
    p = plan(env, timeout=300)
    v = torch_pin()
    assert f"no CPU build of torch {v} for this platform" in p.stdout
    said = [ln for ln in p.stdout.splitlines() if "GB to download" in ln]
    assert said and f"torch=={v} " in p.stdout, p.stdout
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        assert "is a CUDA build" in said[0] and "nvidia-" in p.stdout
    assert md.version("torch") == before
