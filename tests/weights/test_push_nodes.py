"""Multi-node colocate: each node's engines get their weights on their own node, from that node's first actor rank.

- :func:`plan_nodes`: which actor rank sends to which engine.
- Two actor ranks in their own processes (a gloo world), told they are on ``nodeA`` and ``nodeB``, with one real
  engine placed on each: each rank releases, resumes and hands over to its own node's engine by
  ``/update_weights_from_tensor`` (shared memory on CPU; CUDA IPC on a GPU: the ``gpu`` variant), rank 0 checks both.
- A rank whose connect fails makes every rank fail, naming it (none waits in a collective for it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax_hpc.engines.client import EngineClient
from relax_hpc.weights import engine_fingerprint, fingerprint
from relax_hpc.weights.push import plan_nodes

from .conftest import ENGINE_ARGS

WORKER = Path(__file__).with_name("nodes_worker.py")
STEPS = 2
N_ENGINES = 1  # the `engines` fixture: the failure test needs one that answers
pytestmark = pytest.mark.slow


def test_each_engine_is_sent_from_its_nodes_first_actor_rank():
    ranks = ["n1", "n1", "n2", "n2"]
    engines = {"engine0": "u0", "engine1": "u1", "engine2": "u2", "spare": "u3", "elsewhere": "u4"}
    nodes = {"engine0": "n1", "engine1": "n2", "engine2": "n2", "elsewhere": "n9"}
    assert plan_nodes(ranks, engines, nodes) == {0: {"engine0": "u0", "spare": "u3", "elsewhere": "u4"},
                                                 2: {"engine1": "u1", "engine2": "u2"}}
    # one node (or nodes unknown): every engine from rank 0, as before
    assert plan_nodes(["", ""], engines, {}) == {0: engines}
    assert plan_nodes(["localhost"], {"engine0": "u0"}, {"engine0": "localhost"}) == {0: {"engine0": "u0"}}


def _calls(log: Path) -> str:
    """The engine's control calls as letters: r release, m resume, t a tensor bucket, v the version, d a group's."""
    calls = re.findall(r"INFO call (/\w+)", log.read_text())
    return "".join({"/release_memory_occupation": "r", "/resume_memory_occupation": "m",
                    "/update_weights_from_tensor": "t", "/update_weight_version": "v",
                    "/update_weights_from_distributed": "d"}.get(c, "") for c in calls)


def _run_ranks(tmp_path: Path, plan: dict, nodes: list[str], device: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    store = tmp_path / "store"
    procs = []
    for rank, node in enumerate(nodes):
        log = open(tmp_path / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(rank), str(len(nodes)), node, str(store),
                                       str(tmp_path), json.dumps(plan)], stdout=log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for rank in range(len(nodes)):
        f = tmp_path / f"rank{rank}.json"
        assert f.exists(), (tmp_path / f"rank{rank}.log").read_text()[-3000:]
        out.append(json.loads(f.read_text()))
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC)")])])
def test_each_nodes_engines_get_their_weights_from_that_nodes_actor_rank(tiny_model, tmp_path, device):
    from transformers import AutoModelForCausalLM

    from relax_hpc.engines.launcher import start_engine

    handles = [start_engine("reference", tiny_model, log_path=tmp_path / f"engine{i}.log",
                            extra_args=[*ENGINE_ARGS, "--device", device]) for i in range(2)]
    try:
        for h in handles:
            h.wait_ready(180)
        urls = {f"engine{i}": h.url for i, h in enumerate(handles)}
        plan = {"model": str(tiny_model), "engines": urls, "nodes": {"engine0": "nodeA", "engine1": "nodeB"},
                "seed": 5, "steps": STEPS}
        r0, r1 = _run_ranks(tmp_path, plan, ["nodeA", "nodeB"], device)
        assert "error" not in r0 and "error" not in r1, (r0.get("trace"), r1.get("trace"))
        # each node's first rank holds a sender for its own node's engine, and only that one
        assert (r0["mine"], r0["sender_engines"]) == (["engine0"], [urls["engine0"]])
        assert (r1["mine"], r1["sender_engines"]) == (["engine1"], [urls["engine1"]])
        assert "nodeA <- actor rank 0: engine0" in r0["route"] and "nodeB <- actor rank 1: engine1" in r0["route"]
        assert ("CUDA IPC" if device == "cuda" else "shared memory") in r0["route"], r0["route"]
        # the hand-over per node: each rank released its own node's engine before every "training"
        assert all("perf/engine_release_time" in m for r in (r0, r1) for m in r["released"])
        # the step's sync is done when both nodes' engines have theirs: rank 0 checked both, after the barrier
        for m in r0["synced"]:
            assert m["weights/fingerprint_match"] == 1.0 and m["weights/versions_ok"] == 1.0, m
        assert r0["versions"] == {"engine0": str(STEPS), "engine1": str(STEPS)}
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        g = torch.Generator().manual_seed(plan["seed"])
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        want = fingerprint(model.state_dict())
        for i, h in enumerate(handles):
            c = EngineClient(h.url)
            assert engine_fingerprint(c, list(model.state_dict())) == want and c.weight_version() == str(STEPS)
            c.close()
            # from its engine's own log: released, resumed, then the tensors and the version, every step; no group
            assert re.fullmatch(r"(rmt+v){%d}" % STEPS, _calls(tmp_path / f"engine{i}.log")), _calls(
                tmp_path / f"engine{i}.log")
    finally:
        for h in handles:
            h.stop()


def test_a_rank_that_cannot_connect_fails_every_rank(tiny_model, engines, tmp_path):
    """The engine placed on nodeB does not answer: nodeB's rank fails to connect, and rank 0, whose own engine is
    fine, fails too, naming rank 1 and the engine, instead of walking into the next collective alone."""
    dead = "http://127.0.0.1:9"  # discard: nothing listens
    plan = {"model": str(tiny_model), "engines": {"engine0": engines[0].url, "engine1": dead},
            "nodes": {"engine0": "nodeA", "engine1": "nodeB"}, "seed": 5, "steps": 1}
    r0, r1 = _run_ranks(tmp_path, plan, ["nodeA", "nodeB"], "cpu")
    assert dead in r1["error"], r1
    assert "connecting the weight sync failed on actor rank(s) 1" in r0["error"] and dead in r0["error"], r0
    assert r0["restartable"] is True  # an engine that does not answer: a restart may meet it alive
