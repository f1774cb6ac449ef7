"""The Slurm backend (relax_hpc.backends.slurm): its steps inside the job (srun), and the job from outside."""

from relax_hpc.backends import SlurmBackend
from relax_hpc.controller.state import RunState
from relax_hpc.controller.steps import describe_steps, step_commands
from relax_hpc.launch.tools import launcher_for
from relax_hpc.recipe import recipe_from_dict, role_steps


def test_where_it_runs(run, tiny):
    env = {"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n7", "SLURM_JOB_NODELIST_HET_GROUP_0": "n[7-8]",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "n9"}
    slurm = SlurmBackend()
    assert (slurm.control_host(env), slurm.bind_host) == ("n7", "0.0.0.0")
    doc = RunState(run, tiny, role_steps(tiny), slurm, env=env).doc
    assert doc["executor"] == "slurm"
    assert {r: v["het_nodelist"] for r, v in doc["roles"].items()} == {
        "actor": "n[7-8]", "rollout": "n9", "reference": "localhost", "actor_fwd": "localhost"}  # group 2: unset


def test_a_role_is_one_srun_step_around_its_own_command(run, tiny):
    steps = {c.role: c for c in step_commands(tiny, run.path, SlurmBackend(), python="/py")}
    own = ["/py", "-m", "relax_hpc.roles.actor", str(run.path.resolve())]
    assert steps["actor"].procs[0].argv[0] == "srun" and steps["actor"].procs[0].argv[-4:] == own
    assert "RELAX_RANK" not in steps["actor"].procs[0].env  # srun tells each task its rank
    assert describe_steps(tiny, run.path, "/py")[0].startswith("srun --het-group=0 ")  # the dry run's default


def test_room_for_more_engines(tiny_dict):
    r = recipe_from_dict({**tiny_dict, "roles": {**tiny_dict["roles"], "rollout": {
        "nodes": 3, "tasks_per_node": 2, "elastic": {"initial": 1}}}})
    slurm = SlurmBackend()
    assert slurm.spare_engines(r, used=0, count=2) == 4 and slurm.spare_engines(r, used=3, count=5) == 1
    assert slurm.spares_apart(r) and slurm.attaches
    plain = recipe_from_dict(tiny_dict)
    assert slurm.spare_engines(plain, used=0, count=1) == 0 and not slurm.spares_apart(plain)  # no spare nodes


def test_the_job_from_outside():
    s = launcher_for("slurm")
    assert s.job_label({"job_id": "12"}) == "Slurm job 12" and s.component_label({"job_id": "12"}, 1) == "12+1"
    assert s.job_id_ok("12+1") and not s.job_id_ok("abc")
    assert (s.batch_script, s.follows, s.time_limited, s.queued) == (True, False, True, True)


def test_the_checks_of_its_place_ask_sinfo(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo to ask
    rec = recipe_from_dict({"roles": {"actor": {"gpus_per_node": 1}}})
    [(key, _, message)] = launcher_for("slurm").place_problems(rec, layout=True)
    assert key == "<cluster>" and message.startswith("cannot check the recipe against the cluster: ")
    assert message.endswith("Fix: check that Slurm answers (sinfo), or run with --local")
    assert launcher_for("slurm").place_problems(rec, layout=False)[0][0] == "<cluster>"  # asked even without one
