"""Find a run from what a user types: a run name, a run directory, a job id, or nothing (the latest run).

``relax-status`` and ``relax-cancel`` take the same argument; the run directory's ``job.json`` (written by
``relax-submit``) is what ties a name to a job id and an executor.
"""

from __future__ import annotations

from pathlib import Path

from relax_hpc.rundir import RunDir

DEFAULT_RUNS_ROOT = "./runs"


class RunNotFound(LookupError):
    pass


def load_job(rd: RunDir) -> dict:
    job = rd.read_json(rd.job)
    if not isinstance(job, dict):
        raise RunNotFound(f"{rd.path}: no job.json (was it submitted with relax-submit?)")
    return job


def _submitted(rd: RunDir) -> list[tuple[float, RunDir]]:
    job = rd.read_json(rd.job)
    if not isinstance(job, dict):
        return []
    return [(float(job.get("submitted_at") or rd.job.stat().st_mtime), rd)]


def list_runs(runs_root: str | Path) -> list[RunDir]:
    """Submitted runs under ``runs_root``, oldest first."""
    root = Path(runs_root).expanduser()
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.is_dir():
            found += _submitted(RunDir(d.resolve()))
    return [rd for _, rd in sorted(found, key=lambda t: (t[0], t[1].name))]


def find_run(arg: str | None, runs_root: str | Path = DEFAULT_RUNS_ROOT) -> RunDir:
    """The run ``arg`` names; raises :class:`RunNotFound` with what exists instead."""
    root = Path(runs_root).expanduser()
    if not arg:
        runs = list_runs(root)
        if not runs:
            raise RunNotFound(f"no runs under {root.resolve()} (use --runs-root, or name a run directory)")
        return runs[-1]
    direct = Path(arg).expanduser()
    for cand in (direct, root / arg):
        if (cand / "job.json").is_file():
            return RunDir(cand.resolve())
    job_id = arg.split("+", 1)[0]
    if job_id.isdigit():
        matches = [rd for rd in list_runs(root) if str(load_job(rd).get("job_id")) == job_id]
        if matches:
            return matches[-1]
    names = [rd.name for rd in list_runs(root)][-5:]
    hint = f" Recent runs: {', '.join(names)}." if names else ""
    raise RunNotFound(f"no run or job id {arg!r} under {root.resolve()}.{hint}")
