"""The run directory's recipe copy and its secrets (RUN/recipe.yaml masked, RUN/secrets.json 0600): what relax-submit
writes, what the roles and relax-status read, what the controller loads on every attempt (a requeue, a resume, a
continuation job included), and the command lines it builds, which carry no secret in any form a step can take:
local, srun with pyxis, srun or local with Apptainer, an attached job's script, the dry run's lines and the batch
script. (Apptainer and pyxis cannot run here: their rendered argv is what is checked; tests/launch/test_container.py
runs a local Apptainer-style step, tests/e2e/test_secrets.py a whole local run.)"""

from __future__ import annotations

import dataclasses
import sys

import pytest

from relax_hpc.backends import backend_for
from relax_hpc.controller import recipe_copy
from relax_hpc.controller.steps import describe_steps, engine_step_argv, step_commands
from relax_hpc.launch.attach import AttachOptions, render_attach
from relax_hpc.launch.render import render_script
from relax_hpc.recipe import load_recipe, recipe_from_dict
from relax_hpc.rundir import RunDir, create_run_dir

CANARY = "canary-0b9d4e21"


def secret_recipe(runtime: str | None = None):
    slurm = {"env": {"HF_TOKEN": f"{CANARY}-env", "OMPI_MCA_btl": "self,tcp"}}
    if runtime:
        slurm["container"] = {"runtime": runtime, "image": "/i.sif" if runtime == "apptainer" else "i.sqsh",
                              "env": {"MY_API_KEY": f"{CANARY}-ct", "NCCL_DEBUG": "INFO"}}
    return recipe_from_dict({"run": {"name": "r"}, "model": {"path": "/m"}, "roles": {"rollout": {"gpus_per_node": 2}}, "slurm": slurm,
                             "logging": {"notify_urls": [f"json://relax:{CANARY}-url@localhost/hook"]}})


def saved(tmp_path, recipe) -> RunDir:
    run = create_run_dir(tmp_path / "runs", "r")
    recipe_copy.save(run, recipe)
    return run


def test_the_copy_is_masked_and_the_controller_loads_the_values(tmp_path):
    r = secret_recipe("apptainer")
    run = saved(tmp_path, r)
    assert CANARY not in run.recipe.read_text() and CANARY in run.secrets_file.read_text()
    assert run.secrets_file.stat().st_mode & 0o777 == 0o600
    copy = load_recipe(run.recipe)  # as a role and relax-status read it: it loads (the masked URL passes too)
    assert copy.slurm.env == {"HF_TOKEN": "***", "OMPI_MCA_btl": "***"}
    assert copy.slurm.container.env == {"MY_API_KEY": "***", "NCCL_DEBUG": "INFO"}
    assert copy.logging.notify_urls == ["json://***"]
    # every attempt of the controller (a requeue, a resume, a continuation job) loads it with its secrets
    assert recipe_copy.load(run) == r
    assert recipe_copy.job_env(run) == {"HF_TOKEN": f"{CANARY}-env", "OMPI_MCA_btl": "self,tcp"}


@pytest.mark.parametrize("runtime", [None, "pyxis", "apptainer"])
def test_no_step_command_line_holds_a_secret_and_every_step_environment_does(tmp_path, runtime, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = saved(tmp_path, secret_recipe(runtime))
    r = recipe_copy.load(run)  # what a resumed controller builds its steps from
    for executor in ("slurm", "local") if runtime != "pyxis" else ("slurm",):
        if executor == "local" and runtime == "apptainer":
            (tmp_path / "apptainer").write_text("#!/bin/sh\nexit 1\n")  # on PATH, never run
            (tmp_path / "apptainer").chmod(0o755)
            monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
        procs = [p for sc in step_commands(r, run.path, backend_for(executor), sys.executable) for p in sc.procs]
        for p in procs:
            assert not any(CANARY in a for a in p.argv), p.argv
            assert p.env["HF_TOKEN"] == f"{CANARY}-env"  # slurm.env: in the step's environment
            if runtime == "pyxis":  # srun passes its environment on; --container-env names the variable
                assert p.env["MY_API_KEY"] == f"{CANARY}-ct"
                assert "--container-env=PYTHONPATH,MY_API_KEY,NCCL_DEBUG" in p.argv
            elif runtime == "apptainer":
                assert p.env["APPTAINERENV_MY_API_KEY"] == f"{CANARY}-ct" and "apptainer" in p.argv
        engine = engine_step_argv(r, run.path, backend_for(executor), "e0", "initial", "initial", python=sys.executable)
        assert not any(CANARY in a for a in engine), engine
        assert CANARY not in "\n".join(describe_steps(r, run.path, sys.executable, backend_for(executor)))  # the dry run's lines
    script = render_script(r, run.path, [sys.executable, "-m", "x"], "/repo")  # relax-submit's and resubmit's
    assert CANARY not in script and "self,tcp" not in script
    attached = render_attach(r, run.path, "op1", "att-", 1, AttachOptions())  # relax-scale --attach's job
    assert CANARY not in attached


def test_a_run_made_without_a_secrets_file_keeps_its_values(tmp_path):
    """A run directory from before the secrets file (or made by hand): its copy holds the values, and loads as is."""
    r = secret_recipe()
    run = create_run_dir(tmp_path / "runs", "old")
    from relax_hpc.recipe import dump_recipe

    run.recipe.write_text(dump_recipe(r))
    assert recipe_copy.load(run) == r and recipe_copy.job_env(run) == {}
    assert dataclasses.asdict(load_recipe(run.recipe)) == dataclasses.asdict(r)


def test_the_dry_run_shows_no_secret(tmp_path):
    """relax-submit --dry-run's output (the batch script where the backend has one, the step lines) names the
    variables and holds none of their values."""
    import json
    from pathlib import Path

    from relax_hpc.launch.submit import dry_run, plan

    smoke = Path(__file__).resolve().parents[2] / "recipes" / "smoke.yaml"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: [{smoke}]\nslurm:\n  env: {{HF_TOKEN: {CANARY}}}\n"
                      f"logging:\n  notify_urls: ['json://relax:{CANARY}@localhost/hook']\n")
    out = json.dumps(dry_run(plan(recipe, [f"run.runs_root={tmp_path / 'runs'}"], "local")))
    assert CANARY not in out and "RELAX_RANK" in out
    script = render_script(plan(recipe, [], "local").recipe, tmp_path / "r1", [sys.executable, "-m", "x"], "/repo")
    assert "# slurm.env: OMPI_MCA_btl HF_TOKEN (set by the controller" in script and CANARY not in script
