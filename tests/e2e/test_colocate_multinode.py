"""Multi-node colocate on the dev cluster: recipes/quickstart-slurm-colocate-2node.yaml, the actor on 2 nodes (one
rank each) and one CPU engine on each of them (``roles.rollout.share_with: actor``). Each node's engine gets its
weights on its own node from that node's actor rank (``/update_weights_from_tensor``, shared memory), hands its
memory over while the actor trains; the run learns, and every sample is trained on exactly once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from relax_hpc.launch.status import audit_run
from relax_hpc.rundir import RunDir

from .conftest import REPO, follow_slurm, metrics, quickstart_overrides, submit_slurm

RECIPE = REPO / "recipes" / "quickstart-slurm-colocate-2node.yaml"
STEPS = 10  # the run's start (Megatron on 2 ranks, 2 engines) is most of its minute; the reward moves in 10 steps
RISE = 0.04  # the last 3 steps' mean reward over the first 3's (measured: 0.037 -> 0.127)


def calls(log: Path) -> str:
    """An engine's control calls as letters: g generate, r release, m resume, t a tensor bucket, v the version, d a
    group's broadcast."""
    found = re.findall(r"INFO call (/\w+)", log.read_text())
    return "".join({"/generate": "g", "/release_memory_occupation": "r", "/resume_memory_occupation": "m",
                    "/update_weights_from_tensor": "t", "/update_weight_version": "v",
                    "/update_weights_from_distributed": "d"}.get(c, "") for c in found)


@pytest.mark.slurm
@pytest.mark.slow
def test_two_node_colocate_learns_with_each_nodes_weights_handed_over_on_that_node(slurm_cluster, tmp_path, tiny_model):
    sub = submit_slurm(RECIPE, tmp_path, slurm_cluster.env,
                       quickstart_overrides(tiny_model, tmp_path / "runs", f"run.steps={STEPS}", recipe=RECIPE))
    st, _ = follow_slurm(sub, tmp_path, slurm_cluster.env, 1, 600)
    run = RunDir(Path(sub["run_dir"]))
    assert st.get("state") == "COMPLETED", st
    ctl = json.loads((run.path / "state.json").read_text())
    # an engine on each of the actor's two nodes (fake nodes: Slurm's node names, the hosts are one)
    nodes = {n: e["node"] for n, e in ctl["engines"].items()}
    assert sorted(nodes) == ["engine0", "engine1"] and len(set(nodes.values())) == 2, nodes
    # who sends to whom, as the actor's rank 0 told the controller: each node's engine from that node's rank
    [route] = [e["detail"] for e in ctl["events"] if e["event"] == "weights"]
    assert "shared memory" in route and (f"{nodes['engine0']} <- actor rank 0: engine0; "
                                         f"{nodes['engine1']} <- actor rank 1: engine1") in route, route
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    reward = [r["rollout/raw_reward"] for r in rows]
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + RISE, reward
    for r in rows:  # rank 0 checked both engines after every sync: both nodes' engines had theirs
        assert r["weights/fingerprint_match"] == 1.0 and r["weights/versions_ok"] == 1.0, r
        assert r["rollout/weight_version"] == r["step"] - 1 and "perf/engine_release_time" in r
    audit = audit_run(run)
    assert audit["exactly_once"] and audit["prompts_once"], audit["violations"]
    # each engine, from its own log: generates, gives its memory up while the actor trains, takes it back, gets the
    # new weights by tensor (never a group), every step
    for name in nodes:
        seen = calls(run.path / "logs" / f"{name}.log")
        assert re.fullmatch(r"(t+v)?(g+rmt+v){%d}" % STEPS, seen), (name, seen)
