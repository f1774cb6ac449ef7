"""A tiny recipe and a run directory for the backends' tests."""

from __future__ import annotations

import copy

import pytest

from relax_hpc.recipe import recipe_from_dict
from relax_hpc.rundir import create_run_dir

# actor 2 ranks, rollout 1, reference 1, actor_fwd sharing reference's component
TINY = {
    "run": {"name": "tiny", "steps": 1},
    "slurm": {"mpi": "none"},
    "roles": {
        "actor": {"nodes": 1, "tasks_per_node": 2},
        "rollout": {"nodes": 1, "tasks_per_node": 1},
        "reference": {"enabled": True},
        "actor_fwd": {"enabled": True, "share_with": "reference"},
    },
}


@pytest.fixture
def tiny_dict():
    return copy.deepcopy(TINY)


@pytest.fixture
def tiny():
    return recipe_from_dict(TINY)


@pytest.fixture
def run(tmp_path):
    return create_run_dir(tmp_path / "runs", "tiny")
