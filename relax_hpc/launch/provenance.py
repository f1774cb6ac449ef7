"""What code a run ran: relax_hpc's version and where it was imported from; when that is a git checkout (the
package runs from the working tree, as after ``tools/install``), the commit and whether the tree had local changes.

Why: a local run, and every step of a Slurm run, imports relax_hpc from the submitter's directory as it is when
the step starts. Without a record, a result cannot be tied to the code that made it. ``relax-submit`` writes
``RUN_DIR/provenance.json`` (and adds an entry on each ``--resume``); ``relax-status`` shows it (``--json``:
``provenance``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import relax_hpc
from relax_hpc.rundir import RunDir, RunFileError, read_json_file, write_json

PROVENANCE = "provenance.json"
MAX_LISTED = 20  # changed paths listed; the count says the rest


def _git(cwd: Path, *args: str) -> str | None:
    try:
        # --no-optional-locks: status must not rewrite the index (a commit running beside it would find it locked)
        p = subprocess.run(["git", "--no-optional-locks", "-C", str(cwd), *args], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung on a network filesystem
        return None
    return p.stdout if p.returncode == 0 else None


def code_provenance() -> dict[str, Any]:
    """``relax_hpc``'s version, the package's directory, the interpreter; ``source`` ``checkout`` with ``commit``,
    ``dirty`` (any change ``git status`` shows: modified, staged or untracked files) and ``changed`` (the first
    paths), or ``installed`` (a wheel: its version says what ran) when the package is not a tracked file of a git
    checkout."""
    pkg = Path(relax_hpc.__file__).resolve().parent
    out: dict[str, Any] = {"relax_hpc": relax_hpc.__version__, "package": str(pkg), "python": sys.executable,
                           "python_version": sys.version.split()[0], "source": "installed", "commit": None,
                           "dirty": None, "changed": None, "recorded_at": time.time()}
    top = _git(pkg, "rev-parse", "--show-toplevel")
    # a venv inside a checkout (site-packages/relax_hpc) is in a work tree too, but not as a tracked file
    if top is None or _git(pkg, "ls-files", "--error-unmatch", "__init__.py") is None:
        return out
    commit = _git(pkg, "rev-parse", "HEAD")
    status = _git(Path(top.strip()), "status", "--porcelain", "--untracked-files=normal")
    changed = [line[3:] for line in (status or "").splitlines() if line.strip()]
    out.update(source="checkout", checkout=top.strip(), commit=commit.strip() if commit else None,
               dirty=None if status is None else bool(changed), changed=changed[:MAX_LISTED],
               changed_count=len(changed))
    return out


def record(rd: RunDir) -> dict[str, Any]:
    """Write ``RUN_DIR/provenance.json`` for a new run; returns it."""
    doc = code_provenance()
    write_json(rd.path / PROVENANCE, doc)
    return doc


def record_resume(rd: RunDir) -> None:
    """Add this code's record to ``resumes`` (a resumed run may run other code than it was submitted with)."""
    doc = read(rd)
    if not isinstance(doc, dict) or "error" in doc:
        doc = {"relax_hpc": None, "note": "no record of the code this run was submitted with"}
    doc["resumes"] = list(doc.get("resumes") or []) + [code_provenance()]
    write_json(rd.path / PROVENANCE, doc)


def read(rd: RunDir) -> dict[str, Any] | None:
    """The run's record (None for a run submitted before runs recorded it; ``{"error": ...}`` for a damaged one)."""
    try:
        doc = read_json_file(rd.path / PROVENANCE, dict)
    except RunFileError as e:
        return None if e.missing else {"error": str(e)}
    return doc


def describe(doc: dict[str, Any] | None) -> str | None:
    """One line for relax-status: ``relax_hpc 0.1.0, checkout 1a2b3c4d (local changes: 3 files)``; the latest resume's
    code when there is one."""
    if not doc:
        return None
    if "error" in doc:
        return f"code: unknown ({doc['error']})"
    last = (doc.get("resumes") or [doc])[-1]
    if not isinstance(last, dict):
        return None
    text = f"code: relax_hpc {last.get('relax_hpc')}"
    if last.get("source") == "checkout":
        commit = str(last.get("commit") or "?")[:10]
        changes = {True: f" (local changes: {last.get('changed_count')} file(s))", False: " (clean)"}.get(
            last.get("dirty"), " (local changes unknown)")
        text += f", checkout {last.get('checkout')} at {commit}{changes}"
    else:
        text += f", installed at {last.get('package')}"
    return text + (f"; resumed {len(doc['resumes'])} time(s)" if doc.get("resumes") else "")
