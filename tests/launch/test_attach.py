"""The attached job's script (relax_hpc/sbatch/attach.sbatch.j2) and relax-scale's request parsing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from relax_hpc.launch.attach import AttachOptions, render_attach
from relax_hpc.launch.scale import ScaleError, parse_spec
from relax_hpc.recipe import recipe_from_dict


def script(opts: AttachOptions, **slurm) -> str:
    r = recipe_from_dict({"run": {"name": "t"}, "slurm": {"partition": "debug", "time": "00:10:00", **slurm},
                          "roles": {"rollout": {"tasks_per_node": 2, "cpus_per_task": 3}}})
    return render_attach(r, Path("/runs/t-1"), "s4", "s4-", 3, opts, python="/venv/bin/python")


def test_the_script_asks_for_one_task_per_engine_and_joins_the_run(tmp_path):
    text = script(AttachOptions(partition="preempt", time="01:00:00", qos="low", extra=["--reservation=r 1"]))
    lines = text.splitlines()
    for want in ("#SBATCH --partition=preempt", "#SBATCH --time=01:00:00", "#SBATCH --qos=low", "#SBATCH --ntasks=3",
                 "#SBATCH --ntasks-per-node=2", "#SBATCH --cpus-per-task=3", "#SBATCH --no-requeue",
                 "#SBATCH --signal=USR2@120", "#SBATCH '--reservation=r 1'"):
        assert want in lines, (want, text)
    last = lines[-1]
    assert last.startswith("exec srun ") and "relax_hpc.roles.engine /runs/t-1 --name s4- --origin attached " \
                                               "--op s4" in last
    path = tmp_path / "a.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0  # valid shell


def test_unset_options_fall_back_to_the_run_and_the_recipe_defaults():
    text = script(AttachOptions().merged(AttachOptions(qos="scavenger")), account="proj")
    assert "#SBATCH --partition=debug" in text and "#SBATCH --time=00:10:00" in text
    assert "#SBATCH --qos=scavenger" in text and "#SBATCH --account=proj" in text


@pytest.mark.parametrize("bad, text", [({"partition": "a\nb"}, "one line"), ({"nodes": "2"}, "unknown attach option"),
                                       ({"extra": ["-p x"]}, "sbatch options like")])
def test_bad_attach_options_are_refused(bad, text):
    with pytest.raises(ValueError, match=text):
        AttachOptions.from_dict(bad)


def test_targets():
    assert [parse_spec(s) for s in ("rollout=+2", "rollout=-1", "rollout=3", "rollout==3")] == ["+2", "-1", "=3", "=3"]
    with pytest.raises(ScaleError, match="expected rollout="):
        parse_spec("actor=+1")
