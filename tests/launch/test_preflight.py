"""Checks against the cluster's nodes (sinfo) and this machine (CUDA): each names the key, the value and a fix."""

from __future__ import annotations

import pytest

from relax_hpc.launch.preflight import check_local, check_slurm, mem_mb, preflight
from relax_hpc.launch.slurm import Node
from relax_hpc.recipe import RecipeError, recipe_from_dict

GPU = [Node(f"g{i}", ("gpu", "all"), 8, 4, 64000, "idle") for i in range(4)]
CPU = [Node(f"c{i}", ("cpu", "all"), 16, 0, 32000, "idle") for i in range(2)]
NODES = GPU + CPU


def recipe(partition="gpu", **roles):
    r = {"actor": {"nodes": 1}, "rollout": {"nodes": 1}}
    for k, v in roles.items():
        r[k] = {**r.get(k, {}), **v}
    return recipe_from_dict({"slurm": {"partition": partition}, "roles": r})


def problems(rec, default="gpu"):
    return {k: (v, m) for k, v, m in check_slurm(rec, NODES, default)}


def test_fitting_recipe_passes():
    assert problems(recipe(actor={"nodes": 3, "gpus_per_node": 4, "tasks_per_node": 4})) == {}


def test_unknown_partition():
    p = problems(recipe(partition="gpus"))
    v, m = p["slurm.partition"]
    assert v == "gpus" and "no such partition" in m and "all, cpu, gpu" in m


def test_default_partition_is_used_and_named():
    rec = recipe_from_dict({"roles": {"actor": {"nodes": 3}}})
    v, m = problems(rec, default="cpu")["roles.actor.nodes"]
    assert v == 3 and "partition cpu (the cluster's default) has only 2 node(s)" in m


def test_more_nodes_than_the_partition_has():
    v, m = problems(recipe(rollout={"nodes": 5}))["roles.rollout.nodes"]
    assert v == 5 and "has only 4 node(s)" in m and "Fix" in m


def test_more_gpus_than_a_node_has():
    v, m = problems(recipe(actor={"gpus_per_node": 5, "tasks_per_node": 5}))["roles.actor.gpus_per_node"]
    assert v == 5 and "at most 4 GPUs" in m


def test_gpus_on_a_partition_without_any():
    v, m = problems(recipe(partition="cpu", rollout={"gpus_per_node": 1}))["roles.rollout.gpus_per_node"]
    assert v == 1 and "no GPUs on partition cpu" in m and "gpu" in m


def test_cpus_and_memory():
    p = problems(recipe(rollout={"cpus_per_task": 3, "tasks_per_node": 3, "mem": "100G"}))
    assert "9 CPUs per node" in p["roles.rollout.cpus_per_task"][1]
    assert "at most 64000 MB" in p["roles.rollout.mem"][1]


def test_every_need_fits_some_node_but_not_enough_nodes_fit_all():
    nodes = [Node("a", ("p",), 8, 4, 1000, "idle"), Node("b", ("p",), 32, 0, 1000, "idle")]
    rec = recipe_from_dict({"slurm": {"partition": "p"},
                            "roles": {"actor": {"nodes": 2, "gpus_per_node": 4, "tasks_per_node": 4}}})
    (key, value, msg), = check_slurm(rec, nodes, None)
    assert key == "roles.actor.nodes" and "only 1 node(s)" in msg


def test_shared_roles_are_checked_through_their_host():
    rec = recipe_from_dict({"slurm": {"partition": "gpu"}, "roles": {
        "actor": {"nodes": 2}, "reference": {"enabled": True, "share_with": "actor", "nodes": 2}}})
    assert check_slurm(rec, NODES, None) == []


def test_local_no_cuda_names_the_key():
    calls = []
    rec = recipe(actor={"gpus_per_node": 1, "tasks_per_node": 1})
    (key, value, msg), = check_local(rec, lambda: calls.append(1) or 0)
    assert key == "roles.actor.gpus_per_node" and value == 1 and "no CUDA GPU" in msg
    assert check_local(recipe(), lambda: calls.append(2) or 0) == []
    assert calls == [1]  # CUDA is only probed when GPUs are asked for


def test_local_more_gpus_than_present():
    (key, _, msg), = check_local(recipe(actor={"gpus_per_node": 4, "tasks_per_node": 4}), lambda: 2)
    assert key == "roles.actor.gpus_per_node" and "has 2 CUDA GPU(s)" in msg


def test_mem_mb():
    assert mem_mb("16G") == 16384 and mem_mb("4000") == 4000 and mem_mb("2048K") == 2 and mem_mb("1T") == 1 << 20


@pytest.mark.slurm
def test_preflight_against_dev_cluster(slurm_cluster):
    base = {"slurm": {"partition": "debug"}, "roles": {"actor": {"nodes": 2}}}
    preflight(recipe_from_dict(base), "slurm")
    with pytest.raises(RecipeError) as e:
        preflight(recipe_from_dict({"slurm": {"partition": "debug"},
                                    "roles": {"actor": {"nodes": 5}, "rollout": {"gpus_per_node": 5}}}), "slurm")
    keys = {k for k, _, _ in e.value.problems}
    assert keys == {"roles.actor.nodes", "roles.rollout.gpus_per_node"}


def test_het_components_never_share_nodes():
    """2+1+1+1 nodes on a 4-node partition can never start (Slurm puts each component on its own nodes)."""
    rec = recipe_from_dict({"slurm": {"partition": "gpu"}, "roles": {
        "actor": {"nodes": 2}, "rollout": {"nodes": 1}, "reference": {"enabled": True, "nodes": 1},
        "actor_fwd": {"enabled": True, "nodes": 1}}})
    (key, value, msg), = check_slurm(rec, NODES, None)
    assert key == "roles.actor_fwd.nodes" and "2+1+1+1 = 5 nodes" in msg and "share_with" in msg
    rec = recipe_from_dict({"slurm": {"partition": "gpu"}, "roles": {
        "actor": {"nodes": 2}, "rollout": {"nodes": 1}, "reference": {"enabled": True, "nodes": 1},
        "actor_fwd": {"enabled": True, "nodes": 1, "share_with": "actor"}}})
    assert check_slurm(rec, NODES, None) == []


def test_preflight_checks_the_files_first_and_reports_everything_at_once(tmp_path, monkeypatch):
    """Missing prompts and a too-long generation are refused by preflight, with the machine's problems."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"max_position_embeddings": 128}')
    rec = recipe_from_dict({"data": {"path": "missing.jsonl"}, "model": {"path": "model"},
                            "rollout": {"max_response_len": 256},
                            "roles": {"actor": {"gpus_per_node": 1, "tasks_per_node": 1}}})
    with pytest.raises(RecipeError) as e:
        preflight(rec, "local")
    keys = {k: v for k, v, _ in e.value.problems}
    assert keys.get("data.path") == "missing.jsonl" and keys.get("rollout.max_response_len") == 256
    assert "nothing was submitted" in str(e.value)


def test_dry_run_refuses_a_bad_recipe_and_creates_nothing(tmp_path, monkeypatch, capsys):
    """``relax-submit --dry-run`` goes through the same plan() as a submission: the checks refuse it there."""
    from relax_hpc.launch.cli import EXIT_REFUSED, submit_main

    monkeypatch.chdir(tmp_path)
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("run: {steps: 1}\n")
    bad = ["rollout.rm_type=ifbench", "slurm.env.SUBMITIT_LOCAL_NTASKS=2", "run.runs_root=runs-%j"]
    assert submit_main(["--local", "--dry-run", str(recipe_file), *bad]) == EXIT_REFUSED
    err = capsys.readouterr().err
    for text in ("rollout.rm_type = 'ifbench'", "slurm.env.SUBMITIT_LOCAL_NTASKS = ***", "run.runs_root = 'runs-%j'"):
        assert text in err
    for override, text in (("num_rollout=10", "Relax's --num-rollout is `run.steps` here"),
                           ("data.path=prompts.jsonl", "data.path = 'prompts.jsonl': "),
                           ("slurm.partition=|\n  debug\n", "slurm.partition = 'debug\\n': ends in a newline")):
        assert submit_main(["--local", "--dry-run", str(recipe_file), override]) == EXIT_REFUSED
        assert text in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]  # no run directory, no runs root


def test_checks_against_the_place_skip_what_the_validator_refused(tmp_path, monkeypatch):
    """relax-submit runs these on a recipe the validator refused too (both are reported at once): a refused
    string is not opened or looked up again, and a refused share_with skips the layout checks."""
    from relax_hpc.launch.preflight import preflight_problems

    monkeypatch.chdir(tmp_path)
    rec = recipe_from_dict({})
    rec.model.path = "/x/" + "a" * 300  # too long to stat: an OSError if it were looked at
    rec.slurm.template = "/dev/null/" + "b" * 300
    rec.roles.actor.mem = "lots"  # not Slurm memory syntax: check_slurm cannot read it
    refused = {"model.path", "slurm.template", "roles.actor.mem"}
    assert preflight_problems(rec, "local", refused) == []
    assert check_slurm(rec, NODES, "gpu") == []  # the bad mem is the validator's to name
    assert rec.model.path.startswith("/x/")  # the caller's recipe is left as it was
    rec.roles.reference.enabled, rec.roles.reference.share_with = True, "nobody"
    assert preflight_problems(rec, "local", refused | {"roles.reference.share_with"}) == []
