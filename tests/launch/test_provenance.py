"""What code a run ran (RUN_DIR/provenance.json): relax_hpc's version, and from a git checkout its commit and
whether it had local changes. Checked on a real git work tree holding the modules provenance needs (the wheel's
case, ``source: installed``, is tests/test_packaging.py's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import relax_hpc
from relax_hpc.launch import provenance
from relax_hpc.rundir import create_run_dir

PKG = Path(relax_hpc.__file__).resolve().parent
NEEDED = ["__init__.py", "errors.py", "rundir.py", "launch/__init__.py", "launch/provenance.py"]
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]


def checkout(root: Path) -> Path:
    for rel in NEEDED:
        (root / "relax_hpc" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PKG / rel, root / "relax_hpc" / rel)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "x"]):
        subprocess.run([*GIT, "-C", str(root), *args], check=True, capture_output=True)
    return root


def recorded(root: Path, cwd: Path) -> dict:
    code = "import json; from relax_hpc.launch.provenance import code_provenance; print(json.dumps(code_provenance()))"
    env = dict(os.environ, PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_checkout_s_commit_and_its_local_changes(tmp_path):
    root = checkout(tmp_path / "repo")
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    clean = recorded(root, tmp_path)
    assert clean["source"] == "checkout" and clean["commit"] == head and clean["dirty"] is False
    assert clean["relax_hpc"] == relax_hpc.__version__ and clean["package"] == str(root / "relax_hpc")
    with open(root / "relax_hpc" / "errors.py", "a") as f:
        f.write("# changed\n")
    (root / "relax_hpc" / "new_module.py").write_text("")
    dirty = recorded(root, tmp_path)
    assert dirty["dirty"] is True and dirty["changed_count"] == 2
    assert sorted(dirty["changed"]) == ["relax_hpc/errors.py", "relax_hpc/new_module.py"]
    # a file touched, its content the same: a plain `git status` would rewrite the index (its stat data), and a
    # commit running beside the submission would find the index locked; the record leaves it alone
    index = root / ".git" / "index"
    before = index.stat().st_mtime_ns
    os.utime(root / "relax_hpc" / "rundir.py", ns=(before + 5 * 10**9, before + 5 * 10**9))
    assert recorded(root, tmp_path)["changed_count"] == 2
    assert index.stat().st_mtime_ns == before


def test_a_resume_adds_its_code_and_the_status_line_says_it(tmp_path):
    rd = create_run_dir(tmp_path / "runs", "p")
    first = provenance.record(rd)
    provenance.record_resume(rd)
    doc = provenance.read(rd)
    assert doc["commit"] == first["commit"] and len(doc["resumes"]) == 1
    line = provenance.describe(doc)
    assert line.startswith(f"code: relax_hpc {relax_hpc.__version__}") and line.endswith("resumed 1 time(s)")
    (rd.path / provenance.PROVENANCE).write_text("{not json")
    assert "error" in provenance.read(rd) and provenance.describe(provenance.read(rd)).startswith("code: unknown")
