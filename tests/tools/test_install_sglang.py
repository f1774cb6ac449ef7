"""tools/install --sglang DIR, the CPU path (CI's, the contract tests'): a real venv at DIR that holds only SGLang's
layer (requirements-sglang.txt, installed --no-deps) and reaches .venv's packages, torch's CPU build among them,
through a .pth file that puts .venv's site-packages after DIR's own. Here DIR's pip is a stand-in that records its
arguments and installs two small packages (SGLang's metadata, a ``transformers`` of another release), so nothing
is downloaded; the real install is CI's (.ci/run), judged by tests/sglang_contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement

from tests.tools.test_install_gpu import pins

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "tools" / "install"
LAYER = REPO / "requirements-sglang.txt"

FAKE_PIP = '''import json, os, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
with open(os.path.join(sys.prefix, "pip.log"), "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "saw_pth": os.path.exists(os.path.join(site, "relax-main-venv.pth"))})
            + "\\n")
info = os.path.join(site, "sglang-HAS.dist-info")
os.makedirs(info, exist_ok=True)
open(os.path.join(info, "METADATA"), "w").write("Metadata-Version: 2.1\\nName: sglang\\nVersion: HAS\\n")
os.makedirs(os.path.join(site, "transformers"), exist_ok=True)
open(os.path.join(site, "transformers", "__init__.py"), "w").write("__version__ = 'layer'\\n")
'''


def venv_with_stand_in_pip(root: Path, has: str) -> Path:
    """A real venv (this interpreter's base) whose ``python -m pip`` is FAKE_PIP, installing SGLang ``has``."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site = Path(subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "pip").mkdir()
    (site / "pip" / "__init__.py").write_text("")
    (site / "pip" / "__main__.py").write_text(FAKE_PIP.replace("HAS", has))
    return root


def install(venv: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALL), "--sglang", str(venv)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_layer_file_pins_exact_releases_and_leaves_torch_to_the_main_venv():
    names = set()
    for line in LAYER.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            r = Requirement(line)
            (spec,) = r.specifier
            assert spec.operator == "==" and not r.extras and not r.marker, line
            names.add(r.name.lower())
    # what .venv must provide (one torch for both venvs) is not in the layer; SGLang's own pin is the pins file's
    assert not names & {"torch", "numpy", "triton", "sglang"} and not names & set(pins())
    assert {"transformers", "tokenizers", "huggingface-hub", "fastapi", "uvicorn", "xgrammar"} <= names


def test_cpu_sglang_venv_layers_over_the_main_venv(tmp_path):
    v = pins()["sglang"]
    venv = venv_with_stand_in_pip(tmp_path / "sgl", v)
    p = install(venv)
    assert p.returncode == 0, p.stdout + p.stderr
    (call,) = [json.loads(x) for x in (venv / "pip.log").read_text().splitlines()]
    assert call["argv"] == ["install", "-q", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:",
                            f"sglang=={v}", "-r", "requirements-sglang.txt"]
    assert not call["saw_pth"]  # pip ran seeing DIR's own packages only
    line = f"export RELAX_SGLANG_PYTHON={venv}/bin/python"
    assert p.stdout.splitlines()[-1] == line and (venv / "relax-sglang.env").read_text().strip() == line
    main_site = str(Path(sysconfig.get_paths()["purelib"]).resolve())
    probe = ("import importlib.util, json, sys, sysconfig, torch, transformers\n"
             "print(json.dumps({'torch': torch.__file__, 'transformers': transformers.__version__, 'path': sys.path,"
             " 'site': sysconfig.get_paths()['purelib'], 'relax_hpc': importlib.util.find_spec('relax_hpc') is not None}))")
    got = json.loads(subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                                    check=True, env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, timeout=120).stdout)
    assert got["torch"].startswith(main_site)  # .venv's torch, its CPU build
    assert got["transformers"] == "layer"  # DIR's own release comes first
    assert got["path"].index(got["site"]) < got["path"].index(main_site)
    assert not got["relax_hpc"]  # .venv's own .pth files (relax_hpc's editable path) are not read: SGLang's side only
    # an SGLang of another release is refused, and no env file is written
    other = venv_with_stand_in_pip(tmp_path / "other", "0.5.20")
    p = install(other)
    assert p.returncode != 0 and f"sglang is 0.5.20, not {v}" in p.stderr
    assert not (other / "relax-sglang.env").exists()


def test_without_the_main_venv_s_torch_it_says_what_to_run_first(tmp_path):
    venv = venv_with_stand_in_pip(tmp_path / "sgl", pins()["sglang"])
    p = install(venv, RELAX_VENV=str(venv))  # a venv without torch as the "main" one
    assert p.returncode == 2 and "Fix: run tools/install first" in p.stderr, p.stderr
    assert not (venv / "pip.log").exists()


def test_a_cuda_main_venv_is_sent_to_the_gpu_path(tmp_path):
    """On a GPU machine (.venv's torch a CUDA build) the CPU-only layer would give SGLang the wrong torch: refused,
    naming --gpu --sglang."""
    info = tmp_path / "main" / "site" / f"torch-{pins()['torch']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {pins()['torch']}\n"
                                   "Requires-Dist: nvidia-nccl-cu13==2.28.3\n")
    (tmp_path / "main" / "bin").mkdir()
    (tmp_path / "main" / "bin" / "python").write_text(f'#!/bin/sh\nPYTHONPATH={info.parent} exec {sys.executable} "$@"\n')
    (tmp_path / "main" / "bin" / "python").chmod(0o755)
    venv = venv_with_stand_in_pip(tmp_path / "sgl", pins()["sglang"])
    p = install(venv, RELAX_VENV=str(tmp_path / "main"))
    assert p.returncode == 2 and "a CUDA build" in p.stderr and f"tools/install --gpu --sglang {venv}" in p.stderr
    assert not (venv / "pip.log").exists()


def test_dry_run_lists_the_layer(tmp_path):
    p = subprocess.run(["bash", str(INSTALL), "--dry-run", "--sglang", str(tmp_path / "x")], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"sglang=={pins()['sglang']}" in p.stdout and "transformers==" in p.stdout
    assert not (tmp_path / "x").exists()
