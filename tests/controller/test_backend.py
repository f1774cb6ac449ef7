"""The controller's backend (relax_hpc.controller.backend): one interface, a Slurm and a local implementation,
chosen once from the environment; what each answers for where the steps run, engine room and the way back."""

import pytest

from ctl_helpers import TINY, make_run
from relax_hpc.controller.backend import (LOCAL_REQUEUE_EXIT, LOCAL_STEPS, LocalBackend, SlurmBackend, backend_for,
                                          backend_from_env)
from relax_hpc.controller.state import RunState
from relax_hpc.controller.steps import describe_steps, step_commands
from relax_hpc.recipe import load_recipe, role_steps


@pytest.mark.parametrize("env, want", [
    ({}, LocalBackend),
    ({"SLURM_JOB_ID": "5", "SLURM_HET_SIZE": "3"}, SlurmBackend),
    ({"SLURM_JOB_ID": "5"}, LocalBackend),  # a plain (non-het) allocation is not a relax_hpc batch script
    ({"SLURM_JOB_ID": "5", "SLURM_HET_SIZE": "3", "RELAX_EXECUTOR": "local"}, LocalBackend),
])
def test_the_backend_is_chosen_once_from_the_environment(env, want):
    b = backend_from_env(env)
    assert type(b) is want and b.name == {SlurmBackend: "slurm", LocalBackend: "local"}[want]
    assert backend_for(b) is b  # a backend passes through; a name is looked up
    assert type(backend_for(b.name)) is want


def test_an_unknown_executor_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown executor 'ray'; known: slurm, local"):
        backend_for("ray")


def test_where_it_runs(tmp_path):
    run = make_run(tmp_path)
    recipe = load_recipe(run.recipe)
    env = {"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n7", "SLURM_JOB_NODELIST_HET_GROUP_0": "n[7-8]",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "n9"}
    slurm, local = SlurmBackend(), LocalBackend()
    assert (slurm.control_host(env), slurm.bind_host) == ("n7", "0.0.0.0")
    assert (local.control_host(env), local.bind_host) == ("127.0.0.1", "127.0.0.1")
    doc = RunState(run, recipe, role_steps(recipe), slurm, env=env).doc
    assert doc["executor"] == "slurm"
    assert {r: v["het_nodelist"] for r, v in doc["roles"].items()} == {
        "actor": "n[7-8]", "rollout": "n9", "reference": "localhost", "actor_fwd": "localhost"}  # group 2: unset
    doc = RunState(run, recipe, role_steps(recipe), local, env=env).doc
    assert doc["executor"] == "local" and {v["het_nodelist"] for v in doc["roles"].values()} == {"localhost"}


def test_the_backend_wraps_each_role_s_own_command(tmp_path):
    run = make_run(tmp_path)
    recipe = load_recipe(run.recipe)
    slurm = {c.role: c for c in step_commands(recipe, run.path, SlurmBackend(), python="/py")}
    local = {c.role: c for c in step_commands(recipe, run.path, LocalBackend(), python="/py")}
    own = ["/py", "-m", "relax_hpc.roles.actor", str(run.path.resolve())]
    assert slurm["actor"].procs[0].argv[0] == "srun" and slurm["actor"].procs[0].argv[-4:] == own
    assert [p.argv for p in local["actor"].procs] == [own, own]  # one process per rank, told its rank
    assert [p.env["RELAX_RANK"] for p in local["actor"].procs] == ["0", "1"]
    assert "RELAX_RANK" not in slurm["actor"].procs[0].env  # srun tells each task its rank
    lines = describe_steps(recipe, run.path, "/py", LocalBackend())
    assert lines[0].startswith("RELAX_LOCAL_RANK=0 RELAX_NODE=localhost RELAX_RANK=0 ") and lines[0].endswith(
        " ".join(own))
    assert describe_steps(recipe, run.path, "/py")[0].startswith("srun --het-group=0 ")  # the dry run's default


def test_room_for_more_engines(tmp_path):
    spare = make_run(tmp_path / "a", {**TINY, "roles": {**TINY["roles"], "rollout": {
        "nodes": 3, "tasks_per_node": 2, "elastic": {"initial": 1}}}})
    r = load_recipe(spare.recipe)
    slurm, local = SlurmBackend(), LocalBackend()
    assert slurm.spare_engines(r, used=0, count=2) == 4 and slurm.spare_engines(r, used=3, count=5) == 1
    assert slurm.spares_apart(r) and not local.spares_apart(r)
    plain = load_recipe(make_run(tmp_path / "b").recipe)
    assert slurm.spare_engines(plain, used=0, count=1) == 0 and not slurm.spares_apart(plain)  # no spare nodes
    assert local.spare_engines(plain, used=1, count=2) == LOCAL_STEPS - 1
    capped = load_recipe(make_run(tmp_path / "c", {**TINY, "rollout": {"elastic": {"max_engines": 3}}}).recipe)
    assert local.spare_engines(capped, used=0, count=2) == 1
    assert (slurm.attaches, local.attaches) == (True, False)


def test_a_local_attempt_comes_back_through_submitit_s_requeue_exit(tmp_path):
    run = make_run(tmp_path)
    called = []
    with pytest.raises(SystemExit) as e:
        LocalBackend().come_back(run, load_recipe(run.recipe), called.append, called.append)
    assert e.value.code == LOCAL_REQUEUE_EXIT == 144 and called == []  # neither scontrol nor a continuation job
