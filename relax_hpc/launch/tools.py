"""The launcher's backend: :func:`relax_hpc.backends.backend_for` with launch's modules handed in
(:class:`~relax_hpc.backends.base.LaunchTools`), which a backend's submit half works with: starting a job
(:mod:`.jobs`), its state (:mod:`.jobstate`), the checks of a place (:mod:`.places`), Slurm's commands
(:mod:`.slurm`), a local process group (:mod:`.localproc`). They cannot live below the backends: starting a job
imports the controller it starts, and the controller imports the backends."""

from __future__ import annotations

from relax_hpc.backends import Backend, LaunchTools, backend_for
from relax_hpc.launch import jobs, jobstate, localproc, places, slurm

TOOLS = LaunchTools(jobs=jobs, jobstate=jobstate, places=places, slurm=slurm, localproc=localproc)


def launcher_for(executor: str | None) -> Backend:
    """The backend named ``executor`` (None, a job.json from before the field existed, is Slurm), able to submit."""
    return backend_for(executor, TOOLS)
