"""Roles: one module per role, each ``python -m relax_hpc.roles.<role> RUN_DIR`` (a Slurm step or local processes).

Shared machinery is in :mod:`relax_hpc.roles.runtime` (identity, controller client, heartbeat, entry point)
and :mod:`relax_hpc.roles.comm` (rendezvous and process groups). For now each role only bootstraps its
communicators and reports; the role's real work is added in its own module.
"""
