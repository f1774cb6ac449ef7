"""Launch: a checked recipe becomes one Slurm heterogeneous job (or a local run), and back again for status.

Modules, one job each:
  render     recipe → sbatch script (Jinja2; every value shell-quoted)
  slurm      sinfo/squeue/sacct/scancel in JSON, Slurm's state words
  preflight  relax-submit's checks: the files the run opens, then the place (its backend's)
  places     does the recipe fit the cluster's nodes (sinfo) or this machine (CUDA)
  executors  submitit extended for het jobs; the local executor (own process group)
  backend    the launcher's half of a run's backend (Slurm or local): labels, checks, state, submit, cancel
  jobs       starting a run's job: the het job, the local process, a Slurm run's continuation job
  jobstate   a job's state from Slurm or its process, joined with state.json
  submit     relax-submit's order: check → run directory → submit → job.json
  provenance the code a run runs (version, commit, local changes): RUN_DIR/provenance.json
  runs       find a run by name, directory or job id
  status     squeue/sacct + state.json → one status; rich rendering
  follow     live view until a run ends
  cancel     scancel, or stop a local run's process group
  localproc  local process identity (PID + start time) and group stop
  cli        the relax-submit / relax-status / relax-cancel entry points
The role steps' command lines are the controller's (:mod:`relax_hpc.controller.steps`); launch imports the
controller (to run it, to talk to it), never the other way round.
Nothing here imports Megatron or SGLang.
"""
