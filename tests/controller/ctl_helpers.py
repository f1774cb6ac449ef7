"""Shared by the controller and role tests: a tiny recipe and a run directory made as relax-submit makes one."""

from __future__ import annotations

from pathlib import Path

import yaml

from relax_hpc.recipe import dump_recipe, load_recipe
from relax_hpc.rundir import RunDir, create_run_dir

TOKEN = "t" * 64  # a run token for tests that talk to a Channel directly

# actor 2 ranks, rollout 1, reference 1, actor_fwd sharing reference's component
TINY = {
    "run": {"name": "tiny", "steps": 1},
    "logging": {"heartbeat_s": 0.5, "heartbeat_timeout_s": 60},
    "slurm": {"mpi": "none"},
    "roles": {
        "actor": {"nodes": 1, "tasks_per_node": 2},
        "rollout": {"nodes": 1, "tasks_per_node": 1},
        "reference": {"enabled": True},
        "actor_fwd": {"enabled": True, "share_with": "reference"},
    },
}


def make_run(tmp_path: Path, recipe: dict = TINY, name: str = "tiny") -> RunDir:
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = tmp_path / f"{name}.yaml"
    src.write_text(yaml.safe_dump(recipe))
    run = create_run_dir(tmp_path / "runs", name)
    run.recipe.write_text(dump_recipe(load_recipe(src)))
    return run
