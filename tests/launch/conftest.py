"""Helpers for the launch tests: run the CLIs as a user would (subprocess, own working directory), hide
Slurm from PATH, and list the cluster's job ids (to prove that nothing was submitted)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
SMOKE = REPO / "recipes" / "smoke.yaml"
SLURM_TOOLS = ("sbatch", "srun", "squeue", "sacct", "sinfo", "scancel", "scontrol", "salloc")


def base_env(**extra: str) -> dict[str, str]:
    """os.environ + PYTHONPATH with this checkout (and tests/, for the stub tasks) first."""
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS)] + ([old] if old else []))
    env.update(extra)
    return env


def cli(name: str, *args: str, cwd: Path, env: dict | None = None, timeout: float = 120,
        input: str | None = None) -> subprocess.CompletedProcess:
    """Run relax-submit/-status/-cancel through its entry point function, in a fresh interpreter."""
    func = {"relax-submit": "submit_main", "relax-status": "status_main", "relax-cancel": "cancel_main"}[name]
    code = f"import sys; from relax_hpc.launch.cli import {func}; sys.exit({func}(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env or base_env(),
                          capture_output=True, text=True, timeout=timeout, input=input)


@pytest.fixture
def no_slurm_env(tmp_path_factory) -> dict[str, str]:
    """An environment whose PATH has no Slurm client: directories holding one are replaced by a copy made of
    symlinks to everything else in them."""
    shadow_root = tmp_path_factory.mktemp("path")
    dirs = []
    for i, d in enumerate(os.environ.get("PATH", "").split(os.pathsep)):
        if not d or not os.path.isdir(d):
            continue
        if not any(os.path.exists(os.path.join(d, t)) for t in SLURM_TOOLS):
            dirs.append(d)
            continue
        shadow = shadow_root / f"d{i}"
        shadow.mkdir()
        for entry in os.scandir(d):
            if entry.name not in SLURM_TOOLS:
                (shadow / entry.name).symlink_to(entry.path)
        dirs.append(str(shadow))
    env = base_env(PATH=os.pathsep.join(dirs))
    assert shutil.which("sbatch", path=env["PATH"]) is None
    return env


def unique_job_name() -> str:
    """A job name no one else uses: other developers submit to the same cluster at the same time, so "no new
    job" can only be checked for jobs of our own name."""
    return f"relax-t{uuid.uuid4().hex[:10]}"


def jobs_named(name: str) -> set[str]:
    """Ids of jobs called ``name`` that squeue shows (recent finished ones too) or sacct knows."""
    ids = set(subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True).stdout.split())
    acct = subprocess.run(["sacct", "-n", "-X", "-P", "--name", name, "-o", "JobID", "-S", "now-1days"],
                          capture_output=True, text=True)
    return ids | set(acct.stdout.split())
