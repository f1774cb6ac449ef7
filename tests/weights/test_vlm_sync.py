"""Weight sync of a vision-language model to a real reference engine (tiny Qwen2.5-VL).

The actor sends the HF checkpoint's names (megatron-bridge's export gives back exactly the names and tensors of the
HF file: tests/train/test_vlm_parity.py), ``model.layers.*`` and ``visual.*``; transformers 4.57 holds them as
``model.language_model.*`` and ``model.visual.*``. The engine renames them as transformers does when it loads, so
every tensor lands, vision tower included: after a sync of another seed's weights through :class:`ActorSync` (the
actor's path), the engine's log-probs of a generation with an image are that model's, and the spot check
(``logging.check_weight_sync``) passes. With ``freeze_vision`` the vision tower is not sent and stays as it was.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file

from relax_hpc.engines.client import EngineClient
from relax_hpc.engines.receiver import checkpoint_key_mapping, rename_key
from relax_hpc.multimodal import encode_ids
from relax_hpc.weights import ActorSync, WeightSender, WeightSyncError, engine_fingerprint, fingerprint
from relax_hpc.weights.push import vision_weight
from tests.engines.test_engine_vision import hf_logprobs, png, prompt_ids

from tests.weights.conftest import ENGINE_ARGS, make_tiny_model  # absolute: this file is also a worker script


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    """Three tiny Qwen2.5-VL directories, seeds 0 (the engine's), 1 and 2 (what the actor sends)."""
    root = tmp_path_factory.mktemp("vlm-sync")
    return [make_tiny_model(root / f"seed{s}", arch="qwen2_5_vl", seed=s) for s in range(3)]


@pytest.fixture(scope="module")
def engine(vlms, tmp_path_factory):
    from relax_hpc.engines.launcher import start_engine

    h = start_engine("reference", vlms[0], log_path=tmp_path_factory.mktemp("vlm-sync-engine") / "engine.log",
                     extra_args=ENGINE_ARGS)
    try:
        yield h.wait_ready(180)
    finally:
        h.stop()


def weights(model_dir) -> dict[str, torch.Tensor]:
    """The HF file's tensors under its names: what the bridge's export of that model sends."""
    return load_file(str(model_dir / "model.safetensors"))


class Export:
    """The actor's export stand-in (``named_hf_weights``, nothing in place)."""

    def __init__(self, named: dict[str, torch.Tensor]):
        self.named = named

    def named_hf_weights(self):
        yield from self.named.items()

    def in_place(self):
        return None


def sync(url: str, named: dict[str, torch.Tensor], version: str, *, freeze_vision: bool = False):
    s = ActorSync(0, None, None, address=lambda: "127.0.0.1", freeze_vision=freeze_vision)
    s.connect({"engine0": url}, {})
    try:
        return s.sync(version, None, Export(named), progress=lambda: None, check=True)
    finally:
        s.close()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_the_checkpoint_names_map_onto_the_loaded_model_as_transformers_maps_them(arch, tmp_path):
    from transformers import AutoModelForImageTextToText

    d = make_tiny_model(tmp_path / arch, arch=arch, seed=0)
    model = AutoModelForImageTextToText.from_pretrained(str(d))
    mapping = checkpoint_key_mapping(model)
    names = list(weights(d))
    assert sorted(rename_key(n, mapping) for n in names) == sorted(model.state_dict())  # one to one, none left
    assert any(vision_weight(n) for n in names) and not all(vision_weight(n) for n in names)
    if arch == "qwen2_5_vl":  # the checkpoint's old names; Qwen3-VL's are the modules'
        assert rename_key("model.layers.0.mlp.up_proj.weight", mapping) == \
            "model.language_model.layers.0.mlp.up_proj.weight"
        assert rename_key("visual.blocks.0.attn.qkv.weight", mapping) == "model.visual.blocks.0.attn.qkv.weight"
        assert rename_key("lm_head.weight", mapping) == "lm_head.weight"
    else:
        assert mapping == {}


def test_a_sync_lands_every_tensor_and_the_engine_generates_with_the_new_model(engine, vlms, world):
    new = weights(vlms[1])
    assert any(n.startswith("visual.") for n in new) and any(n.startswith("model.layers.") for n in new)
    done = sync(engine.url, new, "1")
    m = done.metrics
    assert m["weights/fingerprint_match"] == 1.0 and m["weights/versions_ok"] == 1.0, m
    assert m["perf/weight_sync_tensors"] == len(new)
    c = EngineClient(engine.url)
    assert engine_fingerprint(c, list(new)) == fingerprint(new)  # every tensor, whole, by the names sent
    # generation with an image: the log-probs are seed 1's transformers forward of the same ids and pixels
    b64, img = png(56, 56, 4)
    ids = prompt_ids(vlms[1])
    r = httpx.post(engine.url + "/generate", timeout=120, json={
        "input_ids": ids, "image_data": [b64], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 5}})
    assert r.status_code == 200, r.text
    out = r.json()
    gen, lps = out["output_ids"], torch.tensor([row[0] for row in out["meta_info"]["output_token_logprobs"]])
    assert out["meta_info"]["weight_version"] == "1" and len(gen) == 6
    feats = encode_ids(vlms[1], ids, [img])
    expanded = feats["input_ids"][0].tolist()
    assert out["meta_info"]["input_ids"] == expanded
    torch.testing.assert_close(lps, hf_logprobs(vlms[1], expanded, gen, feats), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(lps, hf_logprobs(vlms[0], expanded, gen, feats), atol=1e-3), "the weights changed"
    c.close()


def test_a_frozen_vision_tower_is_not_sent_and_stays_as_it_was(engine, vlms, world):
    old, new = weights(vlms[1]), weights(vlms[2])
    sync(engine.url, old, "2")  # the engine holds seed 1 whole
    done = sync(engine.url, new, "3", freeze_vision=True)
    vision = [n for n in new if vision_weight(n)]
    text = [n for n in new if not vision_weight(n)]
    assert vision and all(n.startswith("visual.") for n in vision)
    m = done.metrics
    assert m["perf/weight_sync_tensors"] == len(text) and m["weights/fingerprint_match"] == 1.0, m
    c = EngineClient(engine.url)
    assert engine_fingerprint(c, text) == fingerprint({n: new[n] for n in text})  # the language model is seed 2's
    assert engine_fingerprint(c, vision) == fingerprint({n: old[n] for n in vision})  # the tower still seed 1's
    assert fingerprint({n: old[n] for n in vision}) != fingerprint({n: new[n] for n in vision})
    assert c.weight_version() == "3"
    c.close()


def test_a_name_the_model_does_not_have_is_refused_naming_it(engine, vlms):
    good = weights(vlms[1])
    s = WeightSender()
    s.connect([engine.url], "127.0.0.1")
    try:
        with pytest.raises(WeightSyncError) as e:
            s.push([*good.items(), ("visual.blocks.7.attn.qkv.weight", torch.zeros(96, 32))], version="bad")
    finally:
        s.close()
    msg = str(e.value)
    assert "unknown parameter 'visual.blocks.7.attn.qkv.weight'" in msg and "model.visual.blocks.7" in msg, msg
    c = EngineClient(engine.url)
    assert c.weight_version() != "bad"  # nothing of the refused update was loaded (all names checked first)
    c.close()


def test_freeze_vision_with_a_text_model_is_refused_before_submit(vlms, tmp_path):
    import json

    from relax_hpc.launch.files import check_files
    from relax_hpc.recipe import recipe_from_dict

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))

    def problems(path, freeze):
        return [(k, v, m) for k, v, m in check_files(recipe_from_dict(
            {"model": {"path": str(path), "freeze_vision": freeze}}), tmp_path)]

    (key, value, msg), = problems(tmp_path / "text", True)
    assert key == "model.freeze_vision" and value is True, (key, value)
    assert "is a text model (model_type 'qwen3')" in msg and "Fix: model.freeze_vision: false" in msg, msg
    assert problems(tmp_path / "text", False) == [] and problems(vlms[0], True) == []


def job_vlm_freeze(args: dict, out) -> dict:
    """One rank: the actor's build (``MegatronActor.from_hf``, as ``build_megatron`` calls it) with
    ``freeze_vision``, then one optimizer step on a response's log-probs given an image."""
    import torch

    from relax_hpc.train import TrainConfig, cpu_compat
    from relax_hpc.train.actor import MegatronActor
    from relax_hpc.train.parallel import destroy_parallel, init_parallel
    from relax_hpc.train.vlm import encode, vision_tower, vlm_log_probs

    cpu_compat.compile_eagerly()  # as relax_hpc.train.build does
    init_parallel(1, 1, seed=0)
    actor = MegatronActor.from_hf(args["model"], TrainConfig(tp=1, pp=1, seed=0, lr=1e-2, weight_decay=0.1),
                                  freeze_vision=True)
    model = actor.model[0]
    tower = {id(p) for p in vision_tower(model).parameters()}
    in_opt = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    named = dict(model.module.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    _, img = png(56, 56, 9)
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>shape?<|im_end|>\n<|im_start|>assistant\n"
    enc = encode(args["model"], prompt + "t<|im_end|>", [img])
    start = encode(args["model"], prompt, [img])["input_ids"].shape[1]
    model.zero_grad_buffer()
    actor.optimizer.zero_grad()
    (lp,) = vlm_log_probs(model, enc["input_ids"], enc["pixel_values"], enc["image_grid_thw"], start)
    (-lp.sum()).backward()
    ok, grad_norm, _ = actor.optimizer.step()
    vision_names = {n for n, p in named.items() if id(p) in tower}
    changed = {n for n, p in named.items() if not torch.equal(p.detach(), before[n])}
    res = {"tower": len(tower), "tower_trainable": sum(p.requires_grad for p in vision_tower(model).parameters()),
           "tower_in_optimizer": len(tower & in_opt), "in_optimizer": len(in_opt), "stepped": bool(ok),
           "grad_norm": float(grad_norm), "vision_changed": sorted(vision_names & changed),
           "text_changed": len(changed - vision_names), "text": len(set(named) - vision_names)}
    destroy_parallel()
    return res


def test_the_actor_built_with_freeze_vision_does_not_train_the_vision_tower(vlms, tmp_path):
    """The actor's build with ``model.freeze_vision``: no gradient, no optimizer state and no update for the
    vision tower while the language model trains (one Megatron process, gloo); a text model is refused."""
    from pathlib import Path

    from relax_hpc.errors import PermanentError
    from relax_hpc.train.actor import MegatronActor
    from relax_hpc.train.config import TrainConfig

    from tests.train import launch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WORKER", Path(__file__).resolve())  # this file runs the rank (see __main__)
        r = launch.run_job("vlm_freeze", {"model": str(vlms[0])}, nproc=1, out_dir=tmp_path / "run", timeout=240)
    assert "error" not in r, r.get("error")
    print(f"[vlm freeze] {r}")
    assert r["tower"] > 0 and r["tower_trainable"] == 0 and r["tower_in_optimizer"] == 0, r
    assert r["stepped"] and r["grad_norm"] > 0 and r["vision_changed"] == [], r
    assert r["text_changed"] == r["text"] > 0, r  # every language-model parameter moved
    text = make_tiny_model(tmp_path / "text", arch="qwen3", layers=1)
    with pytest.raises(PermanentError, match=r"model.freeze_vision = true .* is a text model.*Fix: "
                                             r"model.freeze_vision: false"):
        MegatronActor.from_hf(text, TrainConfig(tp=1, pp=1), freeze_vision=True)


if __name__ == "__main__":  # the rank of the run above
    import os
    import sys

    from tests.train import worker

    worker.JOBS["vlm_freeze"] = job_vlm_freeze
    code = worker.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as worker.py: skip the slow interpreter teardown
