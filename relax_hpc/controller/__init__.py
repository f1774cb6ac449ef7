"""The controller: one process per run (in the batch script under Slurm, or on this machine) that starts
the role steps, serves the control socket, watches heartbeats and exits, and writes ``state.json``.

``run_controller(run_dir)`` returns the final state or raises :class:`RunFailed` with the reason;
``python -m relax_hpc.controller RUN_DIR`` exits 0 or 1. Imports are lazy so that roles, which use
:mod:`relax_hpc.controller.protocol`, do not load the controller.
"""

from __future__ import annotations


def run_controller(run_dir, **kw):  # noqa: ANN001, ANN003, ANN201 - see relax_hpc.controller.loop.run_controller
    from relax_hpc.controller.loop import run_controller as _run

    return _run(run_dir, **kw)


def __getattr__(name: str):
    if name == "RunFailed":
        from relax_hpc.controller.loop import RunFailed

        return RunFailed
    raise AttributeError(name)


__all__ = ["RunFailed", "run_controller"]
