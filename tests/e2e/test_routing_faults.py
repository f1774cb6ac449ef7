"""Routing replay with an engine whose routed experts cannot be right: the tiny Qwen3-MoE, ``train.routing_replay``,
two CPU engines, the first to start answering its first generates with an expert id the model does not have, or with
one expert twice in a token's top-k (the engine's hook ``RELAX_TEST_ENGINE_BAD_OUTPUT``). Before, the first crashed
the actor (an index out of bounds naming neither the engine nor the field) and the second trained silently on a
wrong mixture. Now the engine is declared dead with the reason and started again, its requests served by the other,
the run completes, and what trained is the sound engine's routing (the trainer–engine gap stays at rounding)."""

from __future__ import annotations

import pytest

from relax_hpc.controller import run_controller

from .conftest import make_run, metrics, state

STEPS = 2


@pytest.mark.slow
@pytest.mark.parametrize("kind, what", [("expert_out_of_range", "an id outside [0, 4) (the model's num_experts)"),
                                        ("duplicate_expert", "an id repeated (a router picks top-2 distinct experts)")],
                         ids=["out_of_range", "duplicate"])
def test_an_engine_with_bad_routed_experts_is_restarted_and_the_run_completes(tmp_path, tiny_moe_model,
                                                                              local_executor, monkeypatch, kind, what):
    # the first engine to start (of two) spoils every answer until it is declared dead; not the one started again
    # in its place (the claim file exists by then)
    monkeypatch.setenv("RELAX_TEST_ENGINE_BAD_OUTPUT", f"{kind}:100000:{tmp_path / 'bad-engine-claim'}")
    run = make_run(tmp_path, tiny_moe_model, f"run.steps={STEPS}", "train.routing_replay=true",
                   "roles.rollout.tasks_per_node=2", name=f"routing-{kind}")
    final = run_controller(run.path)
    assert final["state"] == "COMPLETED", final

    st = state(run)
    restarts = [ev["detail"] for ev in st["events"] if ev["event"] == "engine_restart"]
    assert len(restarts) == 1, st["events"]
    assert "bad output: meta_info.routed_experts: token 0, layer 0 has expert ids" in restarts[0], restarts
    assert what in restarts[0], restarts
    log = (run.logs / "controller.log").read_text()
    assert "/generate failed: bad output: meta_info.routed_experts" in log

    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["rollout/engines_dead"] >= 1.0
    for r in rows:  # replayed with the sound engine's experts: the trainer scores as the engine did
        assert r["train/train_rollout_logprob_abs_diff_max"] <= 1e-4, (r["step"], r)
