"""Validation: every bad value is refused with its key, its value and a fix, all problems at once."""

import pytest

from relax_hpc.recipe import RecipeError, recipe_from_dict


def problems(data) -> dict[str, str]:
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(data)
    return {k: m for k, _, m in e.value.problems}


def test_defaults_are_valid():
    r = recipe_from_dict({})
    assert r.mode == "colocate" and r.roles.actor.enabled


@pytest.mark.parametrize("data,key,text", [
    ({"run": {"steps": "ten"}}, "run.steps", "integer"),
    ({"run": {"steps": True}}, "run.steps", "integer"),
    ({"roles": {"actor": {"nodes": 1.5}}}, "roles.actor.nodes", "integer"),
    ({"slurm": {"requeue": "yes"}}, "slurm.requeue", "true or false"),
    ({"slurm": {"sbatch_extra": "--exclusive"}}, "slurm.sbatch_extra", "list"),
    ({"slurm": "debug"}, "slurm", "mapping"),
    ({"mode": "async"}, "mode", "one of"),
    ({"slurm": {"mpi": "pmi2"}}, "slurm.mpi", "one of"),
])
def test_wrong_types(data, key, text):
    assert text in problems(data)[key]


def test_unknown_keys_suggest():
    p = problems({"roles": {"actor": {"nodse": 2}}, "slrum": {}})
    assert "did you mean 'nodes'" in p["roles.actor.nodse"]
    assert "did you mean 'slurm'" in p["slrum"]


def test_all_problems_reported_at_once():
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"run": {"steps": "x", "seed": "y"}, "bogus": 1})
    assert len(e.value.problems) == 3
    text = str(e.value)
    assert "run.steps = 'x'" in text and "nothing was submitted" in text


@pytest.mark.parametrize("key,value", [
    ("partition", "debug; rm -rf /"), ("account", "$(whoami)"), ("qos", "a`id`"),
    ("constraint", "a|b"), ("job_name", "x y"), ("time", "1:00 && id"),
])
def test_shell_metacharacters_refused(key, value):
    msg = problems({"slurm": {key: value}})[f"slurm.{key}"]
    assert "Fix:" in msg


def test_metacharacters_in_lists_and_names():
    p = problems({"slurm": {"sbatch_extra": ["--exclusive", "--comment=a;b"],
                            "srun_args": ["$(id)"], "env": {"A B": "x"}},
                  "run": {"name": "../evil"}, "roles": {"actor": {"mem": "4G; id"}}})
    assert set(p) == {"slurm.sbatch_extra[1]", "slurm.srun_args[0]", "slurm.env.A B", "run.name", "roles.actor.mem"}
    assert "';'" in p["slurm.sbatch_extra[1]"]


def test_env_values_may_hold_spaces_but_not_newlines():
    assert recipe_from_dict({"slurm": {"env": {"X": "a b; c"}}}).slurm.env["X"] == "a b; c"
    assert "newlines" in problems({"slurm": {"env": {"X": "a\nb"}}})["slurm.env.X"]


def test_tp_pp_must_divide_actor_ranks():
    msg = problems({"train": {"tp": 3}, "roles": {"actor": {"nodes": 2, "tasks_per_node": 4}}})["train.tp"]
    assert "= 3 does not divide the actor's 8 ranks" in msg


def test_share_with_rules():
    p = problems({"roles": {"actor_fwd": {"enabled": True, "share_with": "reference"}}})
    assert "disabled" in p["roles.actor_fwd.share_with"]
    p = problems({"roles": {"rollout": {"share_with": "rollout"}}})
    assert "another role" in p["roles.rollout.share_with"]


def test_sharing_role_cannot_exceed_host_nodes():
    p = problems({"roles": {"reference": {"enabled": True, "nodes": 2, "share_with": "actor"}}})
    assert "at most its 1 node" in p["roles.reference.nodes"]


def test_resource_minimums_and_actor_required():
    p = problems({"roles": {"actor": {"enabled": False}, "rollout": {"nodes": 0, "gpus_per_node": -1}}})
    assert {"roles.actor.enabled", "roles.rollout.nodes", "roles.rollout.gpus_per_node"} <= set(p)


def test_colocate_is_on_policy():
    assert "fully_async" in problems({"max_staleness": 2})["max_staleness"]
    assert recipe_from_dict({"mode": "fully_async", "max_staleness": 2}).max_staleness == 2


def test_section_checks_are_prefixed():
    p = problems({"train": {"lr": -1.0}, "algorithm": {"eps_clip": 2.0}})
    assert "train.lr" in p and "algorithm.eps_clip" in p


def test_survival_knobs_and_notification_urls():
    p = problems({"checkpoint": {"keep": 0, "max_restarts": -1}, "slurm": {"max_requeues": -2},
                  "logging": {"notify_urls": ["json://127.0.0.1:9/", "nonsense://token@host"]}})
    assert {"checkpoint.keep", "checkpoint.max_restarts", "slurm.max_requeues"} <= set(p)
    assert "Apprise" in p["logging.notify_urls[1]"] and "logging.notify_urls[0]" not in p
