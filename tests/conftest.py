"""Shared pytest fixtures. Keep this file small; add fixtures below."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEV_SLURM = REPO / "tools" / "dev-slurm"


@dataclass(frozen=True)
class SlurmCluster:
    """A reachable Slurm cluster. ``env`` is os.environ plus SLURM_CONF: pass it to
    subprocesses (SLURM_CONF is also exported into os.environ for the session)."""

    conf: str
    env: dict = field(repr=False)
    started: bool = False  # True if this session ran tools/dev-slurm up


def _sinfo_works(conf: str | None, patience_s: float = 0.0) -> bool:
    """Whether ``sinfo`` answers with ``conf``; asks again for up to ``patience_s`` (a loaded slurmctld is slow
    to answer, which is not the same as absent)."""
    if shutil.which("sinfo") is None:
        return False
    env = dict(os.environ)
    if conf:
        env["SLURM_CONF"] = conf
    deadline = time.monotonic() + patience_s
    while True:
        try:
            if subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=30).returncode == 0:
                return True
        except (OSError, subprocess.TimeoutExpired):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(2)


def _require_slurm() -> bool:
    """CI sets RELAX_REQUIRE_SLURM=1: there a cluster that does not answer fails the slurm tests, never skips them."""
    return os.environ.get("RELAX_REQUIRE_SLURM") == "1"


def _dev_slurm_conf() -> str:
    """The SLURM_CONF of tools/dev-slurm's cluster (RELAX_DEV_SLURM_DIR honoured)."""
    out = subprocess.run([str(DEV_SLURM), "env"], capture_output=True, text=True, timeout=30).stdout
    return out.strip().removeprefix("export SLURM_CONF=")


@pytest.fixture(scope="session")
def slurm_cluster():
    """Use, in this order: $SLURM_CONF if sinfo works with it; tools/dev-slurm's
    cluster if it is already up; a fresh `tools/dev-slurm up` if root and
    RELAX_DEV_SLURM_AUTO=1. Otherwise skip, or fail with RELAX_REQUIRE_SLURM=1."""
    conf, started = os.environ.get("SLURM_CONF"), False
    patience = 180.0 if _require_slurm() else 0.0
    if not (conf and _sinfo_works(conf, patience)):
        conf = _dev_slurm_conf()
        if not (Path(conf).is_file() and _sinfo_works(conf, patience)):
            if os.geteuid() == 0 and os.environ.get("RELAX_DEV_SLURM_AUTO") == "1":
                p = subprocess.run([str(DEV_SLURM), "up"], capture_output=True, text=True, timeout=900)
                if p.returncode != 0:
                    pytest.fail(f"tools/dev-slurm up failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
                conf, started = p.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF="), True
            elif _require_slurm():
                pytest.fail(f"RELAX_REQUIRE_SLURM=1 but the Slurm cluster (SLURM_CONF={conf}) does not answer "
                            "sinfo: see tools/dev-slurm status and its logs")
            else:
                pytest.skip("dev Slurm cluster not up: run tools/dev-slurm up")
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield SlurmCluster(conf=conf, env=dict(os.environ), started=started)
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
