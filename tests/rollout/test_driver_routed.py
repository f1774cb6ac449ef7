"""Routing replay trusts no engine: an engine whose ``routed_experts`` cannot be right (an expert id the model does
not have, one expert twice in a token's top-k, a row for an extra layer) is declared dead with the reason, like one
that returns a NaN log-prob; its request goes to the other engine and the rollout completes, its chunk passing the
trainer's door. Real parts: two CPU engines serving the tiny Qwen3-MoE (4 experts, top-2, 2 layers) over HTTP, one
spoiled by the engine's own test hook (``relax_hpc.engines.bad_output``)."""

from __future__ import annotations

import re
import threading

import pytest

from relax_hpc.engines.bad_output import PAST_ANY_EXPERT, BadOutput
from relax_hpc.exchange.fields import Routing, routed_experts_problem
from relax_hpc.recipe.schema import ModelConfig, Recipe
from relax_hpc.rollout.config import RolloutConfig
from relax_hpc.rollout.driver import RolloutDriver
from relax_hpc.rollout.sample import Sample
from relax_hpc.train import TrainConfig
from tests.rollout.conftest import _tiny_model_maker

TINY = Routing(layers=2, top_k=2, num_experts=4)  # tools/make-tiny-model --arch qwen3_moe


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return _tiny_model_maker()(tmp_path_factory.mktemp("moe") / "moe", arch="qwen3_moe", seed=0)


@pytest.fixture(scope="module")
def engines(tiny_moe):
    """Two in-process CPU engines of the tiny MoE, served on threads: ``good`` and ``bad`` (its hook set per test)."""
    from relax_hpc.engines.cpu_engine import CPUEngine, serve

    out, servers = {}, []
    for name in ("bad", "good"):
        engine = CPUEngine(str(tiny_moe), max_batch=4, batch_wait_ms=1.0, seed=0, device="cpu")
        server = serve(engine)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        out[name], servers = engine, servers + [server]
    yield out
    for server in servers:
        server.shutdown()
        server.server_close()


def rollout(tiny_moe, engines, replay: bool = True):
    recipe = Recipe(model=ModelConfig(path=str(tiny_moe)), rollout=RolloutConfig(rm_type="math", max_response_len=4),
                    train=TrainConfig(routing_replay=replay))
    groups = [[Sample(group_index=g, index=2 * g + i, prompt="p", label="1", tokens=[5, 9, 17 + g]) for i in range(2)]
              for g in range(2)]
    driver = RolloutDriver(recipe, {name: e.url for name, e in engines.items()})
    return driver, driver.generate_rollout_sync(groups)


SPOILED = [("expert_out_of_range", rf"token 0, layer 0 has expert ids \[{PAST_ANY_EXPERT}, \d\]: an id outside "
                                   r"\[0, 4\) \(the model's num_experts\)"),
           ("duplicate_expert", r"token 0, layer 0 has expert ids \[(\d), \1\]: an id repeated \(a router picks "
                                r"top-2 distinct experts\)"),
           ("extra_layer", r"\d+ expert ids, not (\d+) tokens × 2 layers × top-2 = \d+ \(.*8 ids a token: a row for "
                           r"an extra or a missing layer")]


@pytest.mark.parametrize("kind, reason", SPOILED, ids=[k for k, _ in SPOILED])
def test_an_engine_with_bad_routed_experts_is_declared_dead_and_the_rollout_completes(tiny_moe, engines, tmp_path,
                                                                                      kind, reason):
    from relax_hpc.train import plan as P
    from relax_hpc.rollout.write import write_step

    engines["bad"].bad_output = BadOutput(f"{kind}:100", engines["bad"].vocab_size)  # every answer it gives
    try:
        driver, res = rollout(tiny_moe, engines)
    finally:
        engines["bad"].bad_output = None
    assert list(driver.dead_engines) == ["bad"], driver.dead_engines
    said = driver.dead_engines["bad"]
    assert said.startswith("bad output: meta_info.routed_experts: ") and re.search(reason, said), said
    assert [f.name for f in res.engine_failures] == ["bad"]
    # every sample was generated on the good engine: its experts fit the model, and the chunk trains
    assert len(res.samples) == 4 and all(s.response_length > 0 for s in res.samples)
    for s in res.samples:
        assert routed_experts_problem(s.routed_experts, len(s.tokens) - 1, TINY) is None
    ref = write_step(tmp_path, 1, res, model_dir=str(tiny_moe))
    P.check_train_columns(P.read_train_columns([ref]))


def test_without_routing_replay_routed_experts_are_neither_asked_nor_judged(tiny_moe, engines):
    """The check is routing replay's: a run without it asks for no experts, so the hook has nothing to spoil."""
    engines["bad"].bad_output = BadOutput("expert_out_of_range:100", engines["bad"].vocab_size)
    try:
        driver, res = rollout(tiny_moe, engines, replay=False)
    finally:
        engines["bad"].bad_output = None
    assert driver.routing is None and driver.dead_engines == {}
    assert all(s.routed_experts is None for s in res.samples)


def test_the_driver_judges_routed_experts_by_the_model_s_config(tiny_moe, engines):
    """The model's config.json (num_hidden_layers, num_experts_per_tok, num_experts) is what answers are held to."""
    recipe = Recipe(model=ModelConfig(path=str(tiny_moe)), rollout=RolloutConfig(rm_type="math"),
                    train=TrainConfig(routing_replay=True))
    assert RolloutDriver(recipe, [engines["good"].url]).routing == TINY
