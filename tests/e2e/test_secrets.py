"""A recipe's secrets in a whole local run (docs/controller.md, "Secrets"): a canary token set in ``slurm.env`` and a
notification URL's password, given in the recipe file as a user would, reach the steps through their environment and
appear in no file of the run directory but ``RUN/secrets.json`` (W&B's offline files included: they are uploaded
later), and on no process's command line while the run goes. The quickstart, two steps, submitted as a user submits
it (relax-submit --local --detach); W&B offline."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_hpc.launch.localproc import run_processes
from relax_hpc.rundir import RunDir

from .conftest import ARITH, QUICKSTART, REPO, state

pytest.importorskip("wandb")

CANARY = "canary-5c1d0e77"


def cmdlines() -> dict[int, bytes]:
    """Every process's command line this user can see (pid -> its NUL-separated argv)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:  # gone meanwhile
                pass
    return out


def environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def files_holding(root: Path, text: str) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and text.encode() in p.read_bytes())


@pytest.mark.slow
def test_a_canary_token_reaches_the_steps_and_nothing_else(tmp_path, tiny_model):
    recipe = tmp_path / "secret-quickstart.yaml"
    recipe.write_text(f"defaults: [{QUICKSTART}]\n"
                      f"slurm:\n  env: {{HF_TOKEN: {CANARY}-env}}\n"
                      "logging:\n"
                      f"  notify_urls: ['json://relax:{CANARY}-url@127.0.0.1:9/hook']\n"  # nothing listens: refused
                      "  wandb: {project: secrets, mode: offline}\n")
    out = subprocess.run([sys.executable, "-m", "relax_hpc.launch.cli", "--local", "--detach", "--json", str(recipe),
                          f"model.path={tiny_model}", f"data.path={ARITH}", f"run.runs_root={tmp_path / 'runs'}",
                          "run.steps=2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert CANARY not in out.stdout + out.stderr
    run = RunDir(Path(json.loads(out.stdout)["run_dir"]))

    # while the run goes: no command line holds the canary; the roles' processes have it in their environment
    on_cmdline: dict[int, bytes] = {}
    roles_env: dict[int, bool] = {}
    deadline = time.monotonic() + 540
    while time.monotonic() < deadline:
        for pid, argv in cmdlines().items():
            if CANARY.encode() in argv:
                on_cmdline[pid] = argv
            if b"relax_hpc.roles." in argv and str(run.path).encode() in argv and pid not in roles_env:
                env = environ(pid)
                if env:
                    roles_env[pid] = f"HF_TOKEN={CANARY}-env".encode() in env.split(b"\0")
        st = state(run)
        if st.get("state") not in (None, "RUNNING") and (st.get("events") or [{}])[-1].get("event") in (
                "finished", "failed", "cancelled"):
            break
        time.sleep(0.05)
    st = state(run)
    assert st.get("state") == "COMPLETED", st.get("reason")
    assert not on_cmdline, on_cmdline
    assert roles_env and all(roles_env.values()), roles_env  # every role process seen had the token
    job = json.loads(run.job.read_text())
    for _ in range(600):  # the run's processes gone before its files are read (W&B writes its last on the way out)
        if not run_processes(job["pgid"]):
            break
        time.sleep(0.1)

    secrets = run.path / "secrets.json"
    assert files_holding(run.path, CANARY) == [secrets]
    assert secrets.stat().st_mode & 0o777 == 0o600
    wandb_dir = run.path / "wandb"
    assert list(wandb_dir.rglob("*.wandb")) and list(wandb_dir.rglob("debug*.log"))  # W&B's files were looked at
    # the copies hold masks where the values were (what relax-status --json and a bug report show)
    copy = (run.recipe).read_text()
    assert "HF_TOKEN: '***'" in copy and "json://***" in copy
