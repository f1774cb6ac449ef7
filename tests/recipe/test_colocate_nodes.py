"""Multi-node colocate, before anything is submitted: engines on every actor node (each ``engineK`` on the actor's
node ``K // tasks_per_node``, also in a het job, where ``--overlap`` alone would put them all on the first node), and
what the per-node hand-over cannot do refused at validation, naming the key."""

from __future__ import annotations

from pathlib import Path

from relax_hpc.backends.slurm import SlurmBackend
from relax_hpc.controller.steps import engine_lines
from relax_hpc.recipe import load_recipe, recipe_from_dict
from relax_hpc.recipe.errors import RecipeError
from relax_hpc.recipe.layout import engine_node
from relax_hpc.recipe.validate import check

REPO = Path(__file__).resolve().parents[2]
TWO_NODES = REPO / "recipes" / "quickstart-slurm-colocate-2node.yaml"


def problems(d: dict) -> dict[str, str]:
    """{key: why} of every problem validation finds in ``d`` ({} when it is valid)."""
    try:
        recipe_from_dict(d)
    except RecipeError as e:
        return {k: why for k, _, why in e.problems}
    return {}


def test_the_two_node_recipe_validates_and_puts_one_engine_on_each_actor_node(tmp_path):
    r = load_recipe(TWO_NODES)
    assert check(r) == []
    assert (r.roles.actor.nodes, r.roles.rollout.nodes, r.roles.rollout.share_with) == (2, 2, "actor")
    assert [engine_node(r, n) for n in ("engine0", "engine1", "step3", "attached-1")] == [0, 1, None, None]
    # one component (the actor's): a plain job whatever slurm.layout says; with a reference on nodes of its own,
    # a het job whose first component holds the actor and its engines
    with_ref = load_recipe(TWO_NODES, ["roles.reference.enabled=true", "algorithm.use_kl_loss=true"])
    for rec, layout, lead in ((r, "hetjob", "srun --relative={k} --overlap --nodes=1 "),
                              (r, "single", "srun --relative={k} --overlap --nodes=1 "),
                              (with_ref, "hetjob", "srun --het-group=0 --relative={k} --overlap --nodes=1 ")):
        rec.slurm.layout = layout
        lines = engine_lines(rec, tmp_path, SlurmBackend())
        assert len(lines) == 2 and all(line.startswith(lead.format(k=k)) for k, line in enumerate(lines)), lines


def test_engines_of_a_component_of_their_own_are_left_where_slurm_puts_them(tmp_path):
    r = recipe_from_dict({"model": {"path": "/models/m"}, "slurm": {"layout": "hetjob"},
                          "roles": {"rollout": {"nodes": 2}}})
    assert not any("--relative" in line for line in engine_lines(r, tmp_path, SlurmBackend()))


def test_what_the_per_node_hand_over_cannot_do_is_refused_naming_the_key():
    two = {"actor": {"nodes": 2}}
    p = problems({"roles": {**two, "rollout": {"share_with": "actor", "nodes": 1}}})
    assert "every actor node" in p["roles.rollout.nodes"] and "roles.rollout.nodes: 2" in p["roles.rollout.nodes"]
    p = problems({"roles": two, "rollout": {"engine": {"offload": True}}})  # engines on nodes of their own
    assert "share_with: actor" in p["rollout.engine.offload"] and "offload: false" in p["rollout.engine.offload"]
    # accepted: engines on every actor node; one node as before; fully async may share fewer nodes
    assert not {"roles.rollout.nodes", "rollout.engine.offload"} & set(problems(
        {"roles": {**two, "rollout": {"share_with": "actor", "nodes": 2}}, "rollout": {"engine": {"offload": True}}}))
    assert not {"roles.rollout.nodes", "rollout.engine.offload"} & set(problems({"rollout": {"engine": {"offload": True}}}))
    assert "roles.rollout.nodes" not in problems({"mode": "fully_async", "max_staleness": 1,
                                                  "roles": {**two, "rollout": {"share_with": "actor", "nodes": 1}}})
