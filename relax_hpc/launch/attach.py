"""Attached jobs: the Slurm side of elastic rollout beyond the run's own allocation.

Why here: the controller decides when capacity comes and goes (:mod:`relax_hpc.controller.elastic`); this module
(its ``Capacity``, handed to the controller by the launcher, so the controller never imports the launcher) only
knows how to ask Slurm for a separate job: render ``relax_hpc/sbatch/attach.sbatch.j2`` and submit it; its tasks run
:mod:`relax_hpc.roles.engine` and join the run. Engines inside the run's own allocation are job steps the
controller starts itself (:func:`relax_hpc.controller.steps.start_engine_step`), like the role steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from relax_hpc.backends import container
from relax_hpc.controller.steps import engine_argv, pythonpath
from relax_hpc.launch import slurm
from relax_hpc.launch.render import PACKAGE_ROOT, SBATCH_DIR, make_environment
from relax_hpc.recipe import Recipe
from relax_hpc.rollout.config import ATTACH_OPTIONS, AttachDefaults

ATTACH_TEMPLATE = "attach.sbatch.j2"


class AttachOptions(AttachDefaults):
    """An attached job's sbatch options: the fields of the recipe's ``rollout.elastic.attach`` (said there once,
    :data:`ATTACH_OPTIONS` and ``extra``), read from relax-scale's request and merged with the recipe's."""

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "AttachOptions":
        d = dict(d or {})
        unknown = set(d) - set(ATTACH_OPTIONS) - {"extra"}
        if unknown:
            raise ValueError(f"unknown attach option(s) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(ATTACH_OPTIONS)}, extra")
        for k, v in d.items():
            if k != "extra" and v is not None and (not isinstance(v, str) or "\n" in v):
                raise ValueError(f"attach option {k}={v!r}: must be one line of text")
        extra = d.pop("extra", None) or []
        if not isinstance(extra, list) or not all(isinstance(x, str) and x.startswith("--") and "\n" not in x
                                                  for x in extra):
            raise ValueError(f"attach option extra={extra!r}: must be a list of sbatch options like '--reservation=r'")
        return cls(**d, extra=list(extra))

    def merged(self, defaults: "AttachOptions") -> "AttachOptions":
        """These options, with ``defaults`` (the recipe's ``rollout.elastic.attach``) where unset."""
        out = {k: getattr(self, k) if getattr(self, k) is not None else getattr(defaults, k) for k in ATTACH_OPTIONS}
        return AttachOptions(**out, extra=[*defaults.extra, *self.extra])


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the run's own ``SLURM_*`` job variables (the controller runs inside
    the het job: a job submitted or a step started from here must not inherit them), with relax_hpc importable."""
    keep = {"SLURM_CONF"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) or k in keep}
    env["PYTHONPATH"] = pythonpath(env.get("PYTHONPATH"))
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **(extra or {})}


def render_attach(recipe: Recipe, run_dir: Path, op: str, names_prefix: str, n: int, opts: AttachOptions,
                  python: str = sys.executable) -> str:
    g, s = recipe.roles.rollout, recipe.slurm
    ctx = {
        "run": run_dir.name, "op": op,
        "job_name": f"{s.job_name or 'relax-' + recipe.run.name}-attach-{op}",
        "output": str(run_dir / "logs" / f"attach-{op}-%j.out"),
        "task_output": str(run_dir / "logs" / f"{names_prefix}%t.host.log"),
        "signal_lead_s": s.signal_lead_s,
        "partition": opts.partition or s.partition, "account": opts.account or s.account,
        "qos": opts.qos, "constraint": opts.constraint or s.constraint, "time": opts.time or s.time,
        "ntasks": n, "ntasks_per_node": g.tasks_per_node, "cpus_per_task": g.cpus_per_task,
        "gpus_per_node": g.gpus_per_node, "mem": opts.mem or g.mem, "extra": list(opts.extra),
        "env": {}, "pythonpath": str(PACKAGE_ROOT),  # slurm.env's values are secrets: sbatch's environment has them
        "command": [*container.srun_options(recipe, run_dir),  # slurm.container, as the run's own engine steps
                    *container.command(recipe, run_dir, engine_argv(run_dir, names_prefix, "attached", op, python))],
    }
    return make_environment([SBATCH_DIR]).get_template(ATTACH_TEMPLATE).render(ctx)


def submit_attached(recipe: Recipe, run_dir: Path, op: str, names_prefix: str, n: int,
                    attach: dict[str, Any]) -> tuple[str, str | None]:
    """Submit an attached job of ``n`` engines (names ``<names_prefix><task>``) with the sbatch options ``attach``
    (relax-scale's; ``rollout.elastic.attach`` where unset); (its Slurm job id, its partition). The script is kept
    as ``RUN_DIR/attach/<op>.sbatch``. ValueError for bad options, SlurmError if sbatch refused."""
    from dataclasses import asdict

    opts = AttachOptions.from_dict(attach).merged(AttachOptions.from_dict(asdict(recipe.rollout.elastic.attach)))
    text = render_attach(recipe, run_dir, op, names_prefix, n, opts)
    path = run_dir / "attach" / f"{op}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    try:
        out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60,
                             env=_clean_env({**recipe.slurm.env, **container.step_env(recipe)}), check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise slurm.SlurmError(f"sbatch {path}: {e}") from None
    if out.returncode != 0:
        raise slurm.SlurmError(f"sbatch {path} failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()}",
                               out.returncode)
    return out.stdout.strip().split(";")[0], opts.partition or recipe.slurm.partition


def attached_state(job_id: str) -> tuple[str, str | None, bool]:
    """(Slurm state, reason, finished) of an attached job; ("UNKNOWN", why, False) when Slurm cannot say."""
    try:
        comps = slurm.job_components(job_id)
    except slurm.SlurmError as e:
        return "UNKNOWN", str(e), False
    if not comps:
        return "UNKNOWN", "not known to squeue or sacct", False
    return comps[0].state, comps[0].reason, slurm.is_finished(comps[0].state)


def cancel_attached(job_id: str) -> str | None:
    """scancel an attached job; None, or why it failed."""
    try:
        slurm.scancel(job_id)
        return None
    except slurm.SlurmError as e:
        return str(e)
