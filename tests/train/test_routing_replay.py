"""MoE routing replay (``train.routing_replay``) on the tiny Qwen3-MoE (4 experts, top-2), CPU, fp32.

The reference engine answers ``return_routed_experts`` as SGLang does (``meta_info["routed_experts"]``: base64 int32
``[prompt + completion - 1, layers, top_k]``), equal to the experts transformers' router picks. Then a real gap: the
engine serves the model with its routers' weights slightly off (as after a weight update the trainer has not made,
or another kernel's rounding), so it routes some tokens elsewhere than the trainer would. On the engine's own
samples: without replay the trainer–engine log-prob gap is G0; with the engine's experts replayed in the trainer's
forward it is smaller; replaying the trainer's own routing changes nothing. A GRPO step with replay trains; one
whose samples lack the experts is refused naming the key; at EP=2 (two processes) the same numbers. The Megatron
runs' worker (``launch.py``) is this file (``python tests/train/test_routing_replay.py JOB OUT ARGS``).
"""

from __future__ import annotations

import base64
import dataclasses
import sys
from pathlib import Path

import pytest

NOISE = 0.15  # the engine's router weights: + NOISE × N(0, 1) × their std (flips ~1 in 8 of the top-2 choices here)
CFG = {"micro_batch_size": 1, "max_seq_len": 32, "max_tokens_per_micro_batch": 48, "lr": 1e-3, "clip_grad": 1.0}


def hf_routing(hf_dir: str, seqs: list[list[int]]) -> list:
    """transformers' own choice, each sequence alone: per token but the last, each layer's top-k of the float32
    softmax of its router logits (the gate's output, read by a hook), ``[len - 1, layers, k]``."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    k = hf.config.num_experts_per_tok
    seen: list = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o)) for layer in hf.model.layers]
    out = []
    for s in seqs:
        seen.clear()
        with torch.no_grad():
            hf(torch.tensor([s[:-1]]))
        out.append(torch.stack([torch.softmax(x.float(), -1).topk(k, -1).indices for x in seen], dim=1).int())
    for h in hooks:
        h.remove()
    return out


def _perturbed(hf_dir: str, out_dir: Path) -> str:
    """A copy of the model whose router (``mlp.gate``) weights are nudged: the engine's model."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, out_dir)
    w = load_file(str(out_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for name, t in w.items():
        if name.endswith("mlp.gate.weight"):
            w[name] = t + NOISE * t.std() * torch.randn(t.shape, generator=g)
    save_file(w, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return str(out_dir)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    from train.conftest import load_tiny_model_tool

    return str(load_tiny_model_tool().make_tiny_model(tmp_path_factory.mktemp("rr") / "moe", arch="qwen3_moe", seed=0))


def test_engine_returns_the_experts_transformers_routes(tiny_moe, tmp_path):
    """Batched (left-padded) generation, answered over HTTP and decoded by the client: SGLang's shape, and every
    token's experts those transformers' router picks for it. A dense model refuses the request (400)."""
    import threading

    import numpy as np

    from relax_hpc.engines.client import EngineClient, routed_experts
    from relax_hpc.engines.http import HTTPError
    from relax_hpc.engines.cpu_engine import CPUEngine, serve
    from train.conftest import load_tiny_model_tool

    engine = CPUEngine(tiny_moe, max_batch=4, batch_wait_ms=1.0, seed=0, device="cpu")
    prompts = [[5, 9, 17], [7, 8, 9, 10, 11, 12, 13], [40]]
    outs = engine.generate({"input_ids": prompts, "sampling_params": {"max_new_tokens": 6, "temperature": 1.0},
                            "return_routed_experts": [True, True, False]})
    assert "routed_experts" not in outs[2]["meta_info"]
    seqs = [p + o["output_ids"] for p, o in zip(prompts, outs)]
    want = hf_routing(tiny_moe, seqs[:2])
    for s, o, w in zip(seqs, outs, want):
        got = np.frombuffer(base64.b64decode(o["meta_info"]["routed_experts"]), dtype="<i4")
        assert got.size == (len(s) - 1) * 2 * 2
        assert got.reshape(len(s) - 1, 2, 2).tolist() == w.tolist()
    server = serve(engine)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        c = EngineClient(engine.url)
        gen = c.generate(prompts[1], {"max_new_tokens": 5, "temperature": 0.0}, extra={"return_routed_experts": True})
        ids = routed_experts(gen, layers=2, top_k=2)
        assert ids.shape == (len(prompts[1]) + len(gen.output_ids) - 1, 2, 2)
        assert ids.tolist() == hf_routing(tiny_moe, [prompts[1] + gen.output_ids])[0].tolist()
        assert routed_experts(c.generate(prompts[0], {"max_new_tokens": 2}), 2, 2) is None  # not asked: none
        with pytest.raises(ValueError, match=r"not \[.* tokens, 3 layers, top-2\]"):
            routed_experts(gen, layers=3, top_k=2)
    finally:
        server.shutdown()
        server.server_close()
    dense = CPUEngine(str(load_tiny_model_tool().make_tiny_model(tmp_path / "dense", arch="qwen3", layers=1)),
                      max_batch=2, batch_wait_ms=1.0, seed=0, device="cpu")
    with pytest.raises(HTTPError, match="no experts to route to") as e:
        dense.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}, "return_routed_experts": True})
    assert e.value.status == 400


def test_the_rollout_asks_for_experts_with_routing_replay(tiny_moe, tmp_path):
    """``train.routing_replay``: the rollout driver asks the engine for routed experts, each sample keeps them (those
    transformers routes its tokens to) and the step's chunk carries them; without the key it asks for none."""
    import threading

    from relax_hpc.engines.cpu_engine import CPUEngine, serve
    from relax_hpc.recipe.schema import Recipe
    from relax_hpc.rollout.config import RolloutConfig
    from relax_hpc.rollout.driver import RolloutDriver
    from relax_hpc.rollout.sample import Sample
    from relax_hpc.train import TrainConfig
    from relax_hpc.rollout.write import write_step

    engine = CPUEngine(tiny_moe, max_batch=4, batch_wait_ms=1.0, seed=0, device="cpu")
    server = serve(engine)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        def run(replay: bool):
            recipe = Recipe(rollout=RolloutConfig(rm_type="math", max_response_len=5),
                            train=TrainConfig(routing_replay=replay))
            groups = [[Sample(group_index=0, index=i, prompt="p", label="1", tokens=[5, 9, 17]) for i in range(2)]]
            return RolloutDriver(recipe, [engine.url]).generate_rollout_sync(groups)

        res = run(True)
        want = hf_routing(tiny_moe, [s.tokens for s in res.samples])
        # kept compact from the decode on: int16 [tokens the engine ran, layers × top_k], no Python lists
        assert [(s.routed_experts.dtype.name, s.routed_experts.shape) for s in res.samples] == [
            ("int16", (len(s.tokens) - 1, 4)) for s in res.samples]
        assert [s.routed_experts.reshape(-1).tolist() for s in res.samples] == [w.reshape(-1).tolist() for w in want]
        assert "routed_experts" in write_step(tmp_path, 1, res).fields
        assert all(s.routed_experts is None for s in run(False).samples)
    finally:
        server.shutdown()
        server.server_close()


def test_build_refuses_replay_without_experts():
    """No Megatron: the key on a dense model, and with pipelining and recompute (a recomputed router would replay
    another micro-batch's experts), refused with the key and the fix."""
    from types import SimpleNamespace

    from relax_hpc.errors import is_permanent
    from relax_hpc.train import TrainConfig
    from relax_hpc.train.model import moe_settings

    hf = SimpleNamespace(norm_topk_prob=True)
    with pytest.raises(Exception, match=r"train.routing_replay = true but the model is dense.*Fix: "
                                        r"train.routing_replay: false") as e:
        moe_settings(SimpleNamespace(num_moe_experts=None), hf, TrainConfig(routing_replay=True), te=False)
    assert is_permanent(e.value)
    with pytest.raises(Exception, match="Fix: train.recompute: none, or pp: 1"):
        moe_settings(SimpleNamespace(num_moe_experts=4), hf, TrainConfig(routing_replay=True, pp=2, recompute="full"),
                     te=False)
    p = SimpleNamespace(num_moe_experts=4)
    moe_settings(p, hf, TrainConfig(routing_replay=True), te=False)
    assert p.moe_enable_routing_replay is True
    moe_settings(p, hf, TrainConfig(), te=False)
    assert p.moe_enable_routing_replay is False


def test_routed_experts_travel_from_the_engine_answer_to_the_micro_batch(tmp_path):
    """The sample decodes SGLang's meta_info (the latest answer: the whole sequence so far); the chunk has the field
    only when every sample has it; the plan's samples carry it flat and a micro-batch lays each token's ids out as
    its flattened tokens (padded and packed), -1 on each sample's last token and on padding. Samples with ids that
    do not fit their tokens are refused at the writer and at the trainer's door."""
    import numpy as np
    import torch

    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.rollout.driver import RolloutResult
    from relax_hpc.rollout.sample import Sample, SampleStatus
    from relax_hpc.train import plan as P
    from relax_hpc.train.batch import TrainingSample, make_micro_batch, make_packed_micro_batch
    from relax_hpc.rollout.write import write_step

    def routed(n: int, base: int) -> list[int]:  # [n tokens, 2 layers, top-2]
        return [(base + t + j) % 4 for t in range(n) for j in range(4)]

    def result(with_experts: bool = True) -> RolloutResult:
        samples = []
        for i, (prompt, resp) in enumerate([([5, 6, 7], [8]), ([5, 6, 7], [9, 2]), ([3, 4], [1, 2, 2])]):
            s = Sample(group_index=0, index=i, prompt="p", tokens=list(prompt))
            s.append_response(resp, "r", [-0.5] * len(resp))
            meta = {"finish_reason": {"type": "stop"}, "weight_version": "1"}
            if with_experts:
                ids = np.asarray(routed(len(prompt) + len(resp) - 1, i), dtype="<i4")
                meta["routed_experts"] = base64.b64encode(ids.tobytes()).decode()
            s.update_from_meta_info(meta)
            s.status = SampleStatus.COMPLETED
            samples.append(s)
        return RolloutResult(samples=samples, raw_rewards=[1.0, 0.0, 0.5], metrics={}, group_size=3)

    r = result()
    kept = r.samples[1].routed_experts
    assert kept.shape == (4, 4) and kept.reshape(-1).tolist() == routed(4, 1)
    ref = write_step(tmp_path, 1, r, seq=0)
    assert "routed_experts" in ref.fields and "routed_experts" not in write_step(tmp_path, 1, result(False), 1).fields
    batch = P.train_plan(P.read_train_columns([ref]), AlgorithmConfig(), 3).samples
    assert [s.routed_experts.tolist() for s in batch] == [routed(3, 0), routed(4, 1), routed(4, 2)]
    mb = make_micro_batch(batch, pad_id=0, train=True)  # [3 rows × 5 tokens, 4]
    assert mb.routed_experts.shape == (15, 4)
    assert mb.routed_experts[5:9].reshape(-1).tolist() == routed(4, 1) and (mb.routed_experts[9] == -1).all()
    assert (mb.routed_experts[3:5] == -1).all()  # sample 0: its last token, then padding
    packed = make_packed_micro_batch(batch, pad_id=0, train=True, multiple=8)  # 4 + 5 + 5 tokens, 2 of padding
    assert packed.routed_experts.shape == (16, 4)
    assert packed.routed_experts[4:8].reshape(-1).tolist() == routed(4, 1) and (packed.routed_experts[8] == -1).all()
    assert (packed.routed_experts[14:] == -1).all()
    assert make_micro_batch([TrainingSample.of(b.tokens, b.response_start, advantage=0.0) for b in batch],
                            pad_id=0, train=True).routed_experts is None
    bad = result()
    bad.samples[2].routed_experts = routed(3, 0)[:-1]
    with pytest.raises(ValueError, match=r"routed_experts of sample index 2 \(5 tokens\): 11 expert ids for 4 tokens"):
        write_step(tmp_path, 2, bad)
    cols = P.read_train_columns([ref])
    cols["routed_experts"].data[5] = -3
    with pytest.raises(P.UnsoundTrainData, match=r"routed_experts of sample 0 .*for 3 tokens, refused: token 1 has "
                                                 r"expert ids \[1, -3, 3, 0\]: an id below 0"):
        P.check_train_columns(cols)
    assert torch.is_tensor(batch[0].routed_experts)


def test_tokens_no_engine_ran_get_minus_one_rows_and_the_step_goes_on(tmp_path):
    """A multi-turn sample whose observation was appended after its last engine call, and a sample that failed
    before any generation (an environment error: only the prompt and a placeholder token): the rollout role gives
    their unrun tokens -1 rows (no recorded routing), the writer and the trainer's door accept them (a -2 is still
    refused), and the micro-batch carries them to the router (which then chooses itself: test_replay_* below).
    Without any width (no sample reached an engine, none known) nothing is made up."""
    import json

    import numpy as np
    import torch

    from relax_hpc.algo import AlgorithmConfig
    from relax_hpc.rollout.driver import RolloutResult
    from relax_hpc.rollout.generator import routed_rows
    from relax_hpc.rollout.sample import Sample, SampleStatus
    from relax_hpc.train import plan as P
    from relax_hpc.train.batch import make_micro_batch
    from relax_hpc.rollout.write import write_step

    def answer(s: Sample, resp: list[int], base: int) -> None:  # one engine call: SGLang's meta_info for it
        ran = len(s.tokens) + len(resp) - 1
        ids = np.asarray([(base + t + j) % 4 for t in range(ran) for j in range(4)], dtype="<i4")
        s.append_response(resp, "r", [-0.5] * len(resp))
        s.update_from_meta_info({"finish_reason": {"type": "stop"}, "prompt_tokens": len(s.tokens) - len(resp),
                                 "completion_tokens": len(resp), "routed_experts": base64.b64encode(ids).decode()})

    def samples() -> list:
        one = Sample(group_index=0, index=0, prompt="p", tokens=[5, 6, 7])
        answer(one, [8], 0)
        multi = Sample(group_index=0, index=1, prompt="p", tokens=[5, 6, 7])
        answer(multi, [9, 2], 1)
        multi.append_response([40, 41], "obs", [0.0, 0.0], loss_mask_value=0)  # turn 2's observation
        answer(multi, [3], 1)  # the engine ran everything so far: 7 tokens
        multi.append_response([42, 43, 44], "obs", [0.0] * 3, loss_mask_value=0)  # after the last call: never ran
        failed = Sample(group_index=0, index=2, prompt="p", tokens=[3, 4])
        failed.append_response([0], "", [0.0], loss_mask_value=0)  # env error before any generation
        failed.status = SampleStatus.FAILED
        return [one, multi, failed]

    s = samples()
    assert s[1].routed_experts.shape == (7, 4) and s[2].routed_experts is None
    saved = Sample.from_dict(json.loads(json.dumps(s[1].to_dict())))  # partial rollout's buffer: JSON lists
    assert np.array_equal(np.asarray(saved.routed_experts), s[1].routed_experts)
    assert routed_rows(s) == 4
    assert [x.routed_experts.dtype.name for x in s] == ["int16"] * 3
    multi = s[1].routed_experts
    assert multi.shape == (10, 4) and (multi[7:] == -1).all() and (multi[:7] >= 0).all()
    assert s[2].routed_experts.tolist() == [[-1] * 4] * 2 and s[0].routed_experts.shape == (3, 4)
    result = RolloutResult(samples=s, raw_rewards=[1.0, 0.0, 0.0], metrics={}, group_size=3)
    ref = write_step(tmp_path, 1, result)
    cols = P.read_train_columns([ref])
    P.check_train_columns(cols)  # -1 is "no recorded routing", not a bad id
    batch = P.train_plan(cols, AlgorithmConfig(), 3).samples
    mb = make_micro_batch(batch, pad_id=0, train=True)  # [3 rows × 11 tokens, 4]
    rows = mb.routed_experts.reshape(3, 11, 4)
    assert (rows[1, :7] == torch.as_tensor(multi[:7]).long()).all() and (rows[1, 7:] == -1).all()
    assert (rows[2] == -1).all()
    cols["routed_experts"].data[0] = -2
    with pytest.raises(P.UnsoundTrainData, match=r"token 0 has expert ids \[-2, .*\]: an id below 0 and not a whole "
                                                 r"-1 row"):
        P.check_train_columns(cols)
    cols["routed_experts"].data[0] = -1  # a token's ids -1 only in part: not "no recorded routing"
    with pytest.raises(P.UnsoundTrainData, match=r"token 0 has expert ids \[-1, .*\]: an id below 0"):
        P.check_train_columns(cols)
    nobody = samples()[2:]
    assert routed_rows(nobody) is None and nobody[0].routed_experts is None  # no width: nothing made up
    assert routed_rows(nobody, 4) == 4 and nobody[0].routed_experts.tolist() == [[-1] * 4] * 2  # an earlier width
    # a sample with loss tokens but no ids (its engine returns none) is not trained without replay: still refused
    deaf = samples()
    deaf[0].routed_experts = None
    routed_rows(deaf)
    assert deaf[0].routed_experts is None and deaf[2].routed_experts.shape == (2, 4)
    with pytest.raises(ValueError, match="routed_experts: 2 of 3 samples carry it, sample 0"):
        write_step(tmp_path, 2, RolloutResult(samples=deaf, raw_rewards=[1.0, 0.0, 0.0], metrics={}, group_size=3))


def job_replay(args: dict, out: Path) -> dict:
    """The trainer's log-probs of the engine's samples without replay, with the engine's experts, with its own
    routing (packed micro-batches, and padded ones of 3 rows for the [B, S] → [S, B] order); a GRPO step with
    replay, and one refused for samples without experts."""
    import torch

    from relax_hpc.train import MegatronActor, TrainConfig, cpu_compat, init_parallel
    from relax_hpc.train.batch import TrainingSample
    from relax_hpc.train.logprobs import compute_log_probs
    from relax_hpc.train.step import RoutingReplayError

    from worker import _algo

    cpu_compat.compile_eagerly()  # as relax_hpc.train.build does
    data = torch.load(args["data"])
    init_parallel(1, 1, seed=1, ep=args["ep"])
    actor = MegatronActor.from_hf(args["hf"], TrainConfig(ep=args["ep"], seed=1, routing_replay=True, **CFG),
                                  _algo(eps_clip=0.2))
    plain = [TrainingSample.of(t, s, advantage=a) for t, s, a in zip(data["tokens"], data["starts"], [1.0, -1.0] * 8)]
    engine = [dataclasses.replace(x, routed_experts=r) for x, r in zip(plain, data["engine_routed"])]
    own = [dataclasses.replace(x, routed_experts=r) for x, r in zip(plain, data["own_routed"])]
    # tokens no engine ran (-1 rows: the last 3 of each sample's, as an observation after the last engine call, and
    # a whole sample, as one that failed before any generation): the router's own choice there, the engine's elsewhere
    def tail(r: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        r = r.clone().reshape(-1, 4)
        r[-3:] = fill.reshape(-1, 4)[-3:]
        return r.reshape(-1)

    unrun = [dataclasses.replace(x, routed_experts=tail(x.routed_experts, torch.full_like(x.routed_experts, -1)))
             for x in engine]
    unrun[1].routed_experts = torch.full_like(engine[1].routed_experts, -1)
    own_there = [dataclasses.replace(x, routed_experts=tail(x.routed_experts, o))
                 for x, o in zip(engine, data["own_routed"])]
    own_there[1].routed_experts = data["own_routed"][1]
    res = {"none": actor.compute_log_probs(plain), "engine": actor.compute_log_probs(engine),
           "own": actor.compute_log_probs(own), "unrun": actor.compute_log_probs(unrun),
           "own_there": actor.compute_log_probs(own_there)}
    res["engine_padded"] = compute_log_probs(actor.model, engine, mbs=3, pad_id=0)
    res = {k: [x.tolist() for x in v] for k, v in res.items()}
    # the step: the engine's log-probs beside, and sample 0 failed (loss mask 0, placeholder engine log-probs 0): it
    # adds nothing to the trainer-engine gap
    batch = [dataclasses.replace(x, old_log_probs=torch.tensor(o), rollout_log_probs=r)
             for x, o, r in zip(unrun, res["unrun"], data["rollout"])]
    batch[0] = dataclasses.replace(batch[0], loss_mask=torch.zeros(len(res["unrun"][0])), rollout_log_probs=torch.zeros(
        len(res["unrun"][0])))
    step = actor.train_step(batch)
    res["step"] = {k: step[k] for k in ("loss", "grad_norm", "ppo_kl", "train_rollout_logprob_abs_diff")}
    try:
        actor.train_step([dataclasses.replace(x, old_log_probs=torch.tensor(o)) for x, o in zip(plain, res["none"])])
        res["refused"] = None
    except RoutingReplayError as e:
        res["refused"] = str(e)
    return res


@pytest.fixture(scope="module")
def replay_run(tiny_moe, tmp_path_factory) -> dict:
    """The engine (router weights nudged) samples 8 responses with log-probs and routed experts; the trainer (the
    HF weights) scores them in one Megatron process."""
    import torch

    from relax_hpc.engines.client import parse_generation, routed_experts
    from relax_hpc.engines.cpu_engine import CPUEngine
    from train import launch

    root = tmp_path_factory.mktemp("replay")
    engine = CPUEngine(_perturbed(tiny_moe, root / "engine"), max_batch=8, batch_wait_ms=1.0, seed=0, device="cpu")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(6, 128, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    outs = engine.generate({"input_ids": prompts, "return_logprob": True, "return_routed_experts": True,
                            "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}})
    gens = [parse_generation("local", o, return_logprob=True) for o in outs]
    tokens = [p + gen.output_ids for p, gen in zip(prompts, gens)]
    data = {"tokens": [torch.tensor(t) for t in tokens], "starts": [len(p) for p in prompts],
            "rollout": [torch.tensor(gen.output_logprobs) for gen in gens],
            "engine_routed": [torch.from_numpy(routed_experts(gen, 2, 2).copy()).reshape(-1) for gen in gens],
            "own_routed": [r.reshape(-1) for r in hf_routing(tiny_moe, tokens)]}
    torch.save(data, root / "data.pt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WORKER", Path(__file__).resolve())
        res = launch.run_job("replay", {"hf": tiny_moe, "data": str(root / "data.pt"), "ep": 1}, nproc=1,
                             out_dir=root / "ep1", timeout=240)
        ep2 = launch.run_job("replay", {"hf": tiny_moe, "data": str(root / "data.pt"), "ep": 2}, nproc=2,
                             out_dir=root / "ep2", timeout=240)
    return {"data": data, "ep2": ep2, **res}


def _gap(lps: list, rollout: list) -> tuple[float, float]:
    """max and mean |trainer − engine| over every response token."""
    import torch

    d = torch.cat([(torch.tensor(a) - b).abs() for a, b in zip(lps, rollout)])
    return float(d.max()), float(d.mean())


@pytest.mark.timeout(300)
def test_replay_closes_the_trainer_engine_gap(replay_run):
    import torch

    r, data = replay_run, replay_run["data"]
    flips = sum(int((a.reshape(-1, 2, 2).sort(-1).values != b.reshape(-1, 2, 2).sort(-1).values).any(-1).sum())
                for a, b in zip(data["engine_routed"], data["own_routed"]))
    total = sum(a.numel() // 2 for a in data["engine_routed"])
    g0, g1 = _gap(r["none"], data["rollout"]), _gap(r["engine"], data["rollout"])
    print(f"[routing replay] engine routed {flips} of {total} (token, layer) pairs elsewhere than the trainer; "
          f"trainer-engine log-prob gap max/mean: without replay {g0[0]:.3e}/{g0[1]:.3e}, with replay "
          f"{g1[0]:.3e}/{g1[1]:.3e}")
    assert flips > 0  # a real routing difference
    assert g1[0] < g0[0] and g1[1] < g0[1] / 2
    def diff(x: str, y: str) -> float:
        return max(float((torch.tensor(a) - torch.tensor(b)).abs().max()) for a, b in zip(r[x], r[y]))

    own, padded = diff("own", "none"), diff("engine_padded", "engine")
    print(f"[routing replay] own routing replayed vs none: max |Δ| {own:.1e}; padded vs packed: {padded:.1e}")
    assert own == 0.0
    assert padded <= 1e-5
    # -1 rows (tokens no engine ran, a sample that reached none) are the router's own choice: the same log-probs as
    # its own ids replayed there, exactly; not experts 0..k-1 (which moves them: the engine's tail rows differ)
    unrun = diff("unrun", "own_there")
    print(f"[routing replay] -1 rows vs the trainer's own ids there: max |Δ| {unrun:.1e}")
    assert unrun == 0.0
    assert r["unrun"][1] == r["none"][1]  # a sample all -1: as without replay


def test_replay_at_ep2_is_replay_at_ep1(replay_run):
    """Two processes, each holding 2 of the 4 experts: the replayed tokens dispatched by the all-to-all to the rank
    of the engine's experts give EP=1's log-probs; the same GRPO step."""
    import torch

    ep1, ep2 = replay_run, replay_run["ep2"]
    for k in ("none", "engine", "own"):
        d = max(float((torch.tensor(a) - torch.tensor(b)).abs().max()) for a, b in zip(ep2[k], ep1[k]))
        assert d <= 1e-5, (k, d)
    print(f"[routing replay ep2] step {ep2['step']} vs ep1 {ep1['step']}")
    for k, v in ep1["step"].items():
        assert abs(ep2["step"][k] - v) <= 1e-5 * max(1.0, abs(v)), (k, ep1["step"], ep2["step"])


def test_replay_trains_and_refuses_samples_without_experts(replay_run):
    import torch

    step = replay_run["step"]
    assert step["grad_norm"] > 0 and all(v == v for v in step.values())
    # train_rollout_logprob_abs_diff as Relax reports it (its sum_of_sample_mean over the step's 8 micro-batches of
    # one sample, divided by the samples): each sample's mean |Δ| over its loss tokens; sample 0 (loss mask 0, engine
    # log-probs 0) adds 0 and counts
    lps, rollout = replay_run["unrun"][1:], replay_run["data"]["rollout"][1:]
    want = sum(float((torch.tensor(a) - b).abs().mean()) for a, b in zip(lps, rollout)) / 8
    assert step["train_rollout_logprob_abs_diff"] == pytest.approx(want, rel=1e-2), (step, want)
    msg = replay_run["refused"]
    assert msg and "train.routing_replay = true but 8 of 8 samples" in msg and "Fix:" in msg


if __name__ == "__main__":  # the Megatron process of the run above
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import worker

    worker.run(replay=job_replay)
