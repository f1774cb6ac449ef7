"""Role step command lines: srun per het group under Slurm, N×T processes locally; argument lists, quoted for print;
and how steps are stopped."""

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from ctl_helpers import TINY, make_run
from relax_hpc.backends import LocalBackend, SlurmBackend
from relax_hpc.controller.steps import (describe_steps, engine_step_argv, executor_from_env, step_commands,
                                       stop_processes)
from relax_hpc.recipe import initial_engines, load_recipe


@pytest.fixture
def run(tmp_path):
    recipe = {**TINY, "slurm": {"mpi": "pmix", "srun_args": ["--container-image=/img/a.sqsh"],
                                "env": {"OMPI_MCA_btl": "self,tcp"}}}
    return make_run(tmp_path / "a dir", recipe)  # a space: the printed lines must quote it


def test_slurm_steps_one_srun_per_role(run):
    recipe = load_recipe(run.recipe)
    cmds = {c.role: c for c in step_commands(recipe, run.path, SlurmBackend(), python="/py")}
    assert list(cmds) == ["actor", "rollout", "reference", "actor_fwd"]
    actor = cmds["actor"].procs[0].argv
    assert actor[:2] == ["srun", "--het-group=0"] and "--overlap" not in actor
    assert "--nodes=1" in actor and "--ntasks-per-node=2" in actor and "--ntasks=2" in actor
    assert "--mpi=pmix" in actor and "--kill-on-bad-exit=1" in actor
    assert f"--output={run.path}/logs/actor.%t.log" in actor
    assert actor[-4:] == ["/py", "-m", "relax_hpc.roles.actor", str(run.path)]
    assert "--container-image=/img/a.sqsh" in actor
    fwd = cmds["actor_fwd"].procs[0].argv
    assert "--het-group=2" in fwd and "--overlap" in fwd  # shares reference's component
    env = cmds["actor"].procs[0].env
    assert env["RELAX_RENDEZVOUS"] == "mpi" and env["OMPI_MCA_btl"] == "self,tcp" and env["RELAX_LAUNCH_ID"]
    assert cmds["actor"].launch_id != cmds["rollout"].launch_id


def test_local_steps_one_process_per_rank(run):
    recipe = load_recipe(run.recipe)
    actor = step_commands(recipe, run.path, LocalBackend(), python="/py")[0]
    assert [p.env["RELAX_RANK"] for p in actor.procs] == ["0", "1"]
    assert {p.env["RELAX_WORLD_SIZE"] for p in actor.procs} == {"2"}
    assert [p.env["RELAX_LOCAL_RANK"] for p in actor.procs] == ["0", "1"]
    assert actor.procs[1].argv == ["/py", "-m", "relax_hpc.roles.actor", str(run.path)]
    assert actor.procs[1].log == run.logs / "actor.1.log"
    assert actor.procs[0].env["RELAX_RENDEZVOUS"] == "file"


def test_describe_steps_prints_shell_quoted_lines(run):
    recipe = load_recipe(run.recipe)
    lines = describe_steps(recipe, run.path, python="/py")
    assert len(lines) == 4  # no model.path: no training loop, no engine
    recipe.model.path = "/models/tiny"
    lines = describe_steps(recipe, run.path, python="/py")
    assert len(lines) == 5  # four roles, then the one engine the run starts with (a step of its own)
    assert "--job-name=engine-engine0" in lines[4] and shlex.split(lines[4])[-6:-4] == ["--name", "engine0"]
    assert "--container-image=/img/a.sqsh" in lines[4]  # slurm.srun_args: engines run in the same container
    assert shlex.split(lines[0])[-3:] == ["-m", "relax_hpc.roles.actor", str(run.path)]
    assert f"'{run.path}'" in lines[0] and "--container-image=/img/a.sqsh" in lines[0]


HET = {"SLURM_JOB_ID": "7", "SLURM_HET_SIZE": "3"}


@pytest.mark.parametrize("env,want", [({}, "local"), ({"SLURM_JOB_ID": "7"}, "local"), (HET, "slurm"),
                                      ({**HET, "RELAX_EXECUTOR": "local"}, "local")])
def test_executor_from_env(env, want):
    assert executor_from_env(env) == want


def test_unknown_executor_is_refused():
    with pytest.raises(ValueError, match="RELAX_EXECUTOR"):
        executor_from_env({"RELAX_EXECUTOR": "ray"})


def test_local_roles_are_bound_to_the_cpus_relax_local_cpus_names(run, monkeypatch):
    recipe = load_recipe(run.recipe)
    monkeypatch.setenv("RELAX_LOCAL_CPUS", "actor=0;rollout=1")
    cmds = {c.role: c for c in step_commands(recipe, run.path, LocalBackend(), python="/py")}
    assert cmds["actor"].procs[1].argv == ["taskset", "-c", "0", "/py", "-m", "relax_hpc.roles.actor", str(run.path)]
    assert cmds["rollout"].procs[0].argv[:3] == ["taskset", "-c", "1"]
    assert cmds["reference"].procs[0].argv[0] == "/py"  # not named: not bound
    monkeypatch.setenv("RELAX_LOCAL_CPUS", "actor:0")
    with pytest.raises(ValueError, match="RELAX_LOCAL_CPUS"):
        step_commands(recipe, run.path, LocalBackend(), python="/py")


def test_rollout_is_one_driver_task_and_each_engine_a_step_of_its_own(run, tmp_path):
    """The rollout role is the driver: one task, --overlap (the engine steps share its nodes). The run's own engines
    are one step per task slot of roles.rollout, each with its share of the GPUs; scale-out ones avoid the nodes
    it is told to."""
    recipe = load_recipe(run.recipe)
    cmds = {c.role: c for c in step_commands(recipe, run.path, SlurmBackend(), python="/py")}
    roll = cmds["rollout"].procs[0].argv
    assert "--ntasks=1" in roll and "--nodes=1" in roll and "--overlap" in roll and "--het-group=1" in roll
    assert [len(c.procs) for c in step_commands(recipe, run.path, LocalBackend()) if c.role == "rollout"] == [1]

    g = recipe.roles.rollout
    assert initial_engines(recipe) == [f"engine{k}" for k in range(g.nodes * g.tasks_per_node)]
    big = make_run(tmp_path / "big", {**TINY, "roles": {**TINY.get("roles", {}), "rollout": {
        "nodes": 3, "tasks_per_node": 2, "gpus_per_node": 4, "cpus_per_task": 3, "elastic": {"initial": 1}}}})
    r = load_recipe(big.recipe)
    assert initial_engines(r) == ["engine0", "engine1"]  # the first node's two slots; two spare nodes
    argv = engine_step_argv(r, big.path, SlurmBackend(), "step0", "step", "s1", exclude=["node2"], python="/py")
    assert argv[:2] == ["srun", "--het-group=1"] and "--overlap" not in argv
    assert {"--nodes=1", "--ntasks=1", "--cpus-per-task=3", "--gres=gpu:2", "--exclude=node2",
            "--job-name=engine-step0"} <= set(argv)
    assert argv[-10:] == ["/py", "-m", "relax_hpc.roles.engine", str(big.path), "--name", "step0", "--origin", "step",
                          "--op", "s1"]
    assert engine_step_argv(r, big.path, LocalBackend(), "engine0", "initial", "initial", python="/py")[0] == "/py"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")  # a zombie waiting for its new parent
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_stop_processes_terminates_then_kills_and_reaches_the_group_only_when_asked():
    def start(argv):
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        return p, p.stdout.readline().strip()  # started (and its SIGTERM handling set) once it printed

    stubborn, _ = start([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                               "print('ready', flush=True); time.sleep(60)"])
    grouped, child = start(["sh", "-c", "sleep 60 & echo $!; wait"])
    alone, orphan = start(["sh", "-c", "sleep 60 & echo $!; wait"])
    try:
        stop_processes([stubborn, grouped], grace_s=0.5, group=True)
        assert stubborn.returncode == -9  # SIGTERM ignored: SIGKILL after the grace
        assert grouped.returncode == -15
        deadline = time.monotonic() + 10
        while not _gone(int(child)) and time.monotonic() < deadline:  # the group's SIGTERM reached it too
            time.sleep(0.05)
        assert _gone(int(child))
        stop_processes([alone], grace_s=5.0, group=False)
        assert alone.returncode == -15 and not _gone(int(orphan))  # only the process itself was signalled
    finally:
        for pid in (child, orphan):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
