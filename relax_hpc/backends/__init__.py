"""Where a run runs: one :class:`~.base.Backend` per place, each with both of its halves in one class and one
file (like submitit's ``slurm/slurm.py`` over its core's abstract bases): :mod:`.slurm` and :mod:`.local`.
The controller picks its backend once per attempt (:func:`backend_from_env`), the launcher from ``job.json``'s
``executor`` or relax-submit's choice (:func:`relax_hpc.launch.tools.launcher_for`); both then pass the Backend
on and ask it, never its name. :mod:`.container` is the container around a step, which both backends wrap.
"""

from __future__ import annotations

import os
from typing import Mapping

from relax_hpc.backends.base import (Backend, CancelError, LaunchTools, Proc, RequeueJob, Resubmit,  # noqa: F401
                                     stop_processes, task_log_pattern)
from relax_hpc.backends.local import LocalBackend
from relax_hpc.backends.slurm import SlurmBackend

BACKENDS: dict[str, type[Backend]] = {"slurm": SlurmBackend, "local": LocalBackend}
EXECUTORS = tuple(BACKENDS)


def backend_for(executor: str | None, launch: LaunchTools | None = None) -> Backend:
    """The backend named ``executor`` (None, a job.json from before the field existed, is Slurm), with the
    launcher's tools ``launch`` for its submit half (:class:`~.base.LaunchTools`; the controller needs none)."""
    name = executor or "slurm"
    if name not in BACKENDS:
        raise ValueError(f"unknown executor {name!r}; known: {', '.join(EXECUTORS)}")
    return BACKENDS[name](launch)


def executor_from_env(env: Mapping[str, str] | None = None) -> str:
    """``RELAX_EXECUTOR`` if set, else ``slurm`` inside a het job's batch script, else ``local``."""
    env = os.environ if env is None else env
    chosen = env.get("RELAX_EXECUTOR")
    if chosen:
        if chosen not in EXECUTORS:
            raise ValueError(f"RELAX_EXECUTOR={chosen!r}: must be one of {', '.join(EXECUTORS)}")
        return chosen
    return "slurm" if env.get("SLURM_JOB_ID") and env.get("SLURM_HET_SIZE") else "local"


def backend_from_env(env: Mapping[str, str] | None = None) -> Backend:
    """The backend this controller runs on (:func:`executor_from_env`)."""
    return backend_for(executor_from_env(env))
