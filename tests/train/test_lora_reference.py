"""The reference's log-probs from the LoRA actor's own model, adapters off (``MegatronActor.compute_ref_log_probs``,
the actor role's ``_ref_log_probs``; :func:`relax_hpc.train.config.reference_from_actor` decides when): equal in
fp32, bit for bit, to what a reference role on the base weights computes for the same batch, and the very field the
loss reads. Then the recipe side: when it is the run's way, what is refused with it, and that the controller then
has no reference role to wait for.

One process (this file is the rank's worker, see ``__main__``): a tiny Qwen3 LoRA actor trains 2 steps (so its
adapters are not zero), then a forward-only model built as the reference role builds its own
(:func:`relax_hpc.train.forward_config.forward_train` of the same train config) and a plain base model compute the
same batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                                    "output_layer"]}


def job_lora_ref(args: dict, out: Path) -> dict:
    import dataclasses
    from types import SimpleNamespace

    import torch

    import worker
    from relax_hpc.roles.actor import Actor
    from relax_hpc.train import MegatronActor, init_parallel
    from relax_hpc.train.batch import TrainingSample
    from relax_hpc.train.config import LoraConfig
    from relax_hpc.train.forward_config import forward_train

    init_parallel(1, 1, seed=1)
    cfg = worker._train_cfg({"tp": 1}, micro_batch_size=2, lr=1e-2, clip_grad=1.0, lora=LoraConfig(**LORA))
    algo = worker._algo(eps_clip=0.2, use_kl_loss=True, kl_loss_coef=0.1)
    actor = MegatronActor.from_hf(args["hf"], cfg, algo)
    batch = worker.make_batch(8, seed=11)
    for s, o in zip(batch, actor.compute_log_probs(batch)):
        s.old_log_probs = o
    ref0 = actor.compute_ref_log_probs(batch)
    for s, r in zip(batch, ref0):
        s.ref_log_probs = r
    kl = [actor.train_step(batch)["kl_loss"] for _ in range(2)]  # the adapters move away from the base
    lp_on = actor.compute_log_probs(batch)
    from_actor = actor.compute_ref_log_probs(batch)
    after = actor.compute_log_probs(batch)  # the adapters are back on after

    # the actor role's path: this rank's samples get ref_log_probs, the field the reference role writes
    samples = [TrainingSample(tokens=s.tokens, response_start=s.response_start) for s in batch]
    role = SimpleNamespace(model=actor, recipe=SimpleNamespace(train=cfg, algorithm=algo, roles=SimpleNamespace(
        reference=SimpleNamespace(enabled=False))))
    took = Actor._ref_log_probs(role, samples)
    role_field = [s.ref_log_probs for s in samples]
    role.recipe.roles.reference.enabled = True  # a reference role writes the field instead: the actor leaves it
    untouched = [TrainingSample(tokens=s.tokens, response_start=s.response_start) for s in batch]
    left = Actor._ref_log_probs(role, untouched)
    no_lora = MegatronActor.from_hf(args["hf"], dataclasses.replace(cfg, lora=None), algo, forward_only=True)
    try:
        no_lora.compute_ref_log_probs(batch)
        refused = ""
    except RuntimeError as e:
        refused = str(e)

    # the reference role's model: forward only, built from model.path with its train config (forward_train)
    ref_role = MegatronActor.from_hf(args["hf"], forward_train(cfg, None), algo, forward_only=True)
    by_role = ref_role.compute_log_probs(batch)

    # train.lora.mode adapter with SGLang: the adapters as a PEFT directory (weights/lora.py), here loaded by the
    # reference engine's same call; the engine's merge must be megatron-bridge's merged export
    from relax_hpc.engines.model_runner import CPUEngine
    from relax_hpc.weights.lora import adapter_tensors, lora_record, write_peft_dir

    named = list(adapter_tensors(actor))
    write_peft_dir(named, lora_record(actor), args["hf"], out / "peft")
    merged = dict(actor.named_hf_weights())
    eng = CPUEngine(args["hf"], max_batch=2, batch_wait_ms=1.0, seed=0)
    keys = [k for k in merged if k in eng.params]

    def engine_diff() -> float:
        return max(float((eng.params[k].float() - merged[k].float()).abs().max()) for k in keys)

    before = engine_diff()
    loaded = eng.load_lora_adapter({"lora_name": "relax-lora", "lora_path": str(out / "peft")})
    peft = {"before": before, "after": engine_diff(), "loaded": list(loaded), "keys": len(keys),
            "names": sorted(n for n, _ in named)[:2]}
    peft["role"] = _actor_role_adapter_sync(actor, eng, args["hf"], out, engine_diff)

    def equal(a, b) -> bool:
        return len(a) == len(b) and all(x.dtype == y.dtype == torch.float32 and torch.equal(x, y) for x, y in zip(a, b))

    def maxdiff(a, b) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    return {"equal_role": equal(from_actor, by_role),
            "equal_plain_base": equal(from_actor, no_lora.compute_log_probs(batch)),
            "equal_before_training": equal(from_actor, ref0), "on_vs_ref": maxdiff(lp_on, by_role),
            "back_on": equal(after, lp_on), "role_field_equal": equal(role_field, by_role),
            "took": took, "left": left, "left_field": [s.ref_log_probs for s in untouched] == [None] * len(untouched),
            "kl": kl, "refused": refused, "peft": peft}


def _actor_role_adapter_sync(actor, eng, hf: str, out: Path, engine_diff) -> dict:
    """The actor role's connect and sync in adapter mode, against the engine served over HTTP. The one stand-in:
    the engine's /server_info as the actor saw it at connect says SGLang (SGLang needs a GPU), which picks the
    PEFT-directory route; the same engine said to be relax_hpc's keeps the weight-sync group's route."""
    import threading
    from types import SimpleNamespace

    from relax_hpc.engines.cpu_engine import serve
    from relax_hpc.engines.lora import LORA_NAME
    from relax_hpc.roles.actor import Actor
    from relax_hpc.train import lora as L
    from relax_hpc.weights.push import BackgroundPush

    for c in L._chunks(actor.model):
        c._relax_lora["mode"] = "adapter"
    server = serve(eng)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    eng.unload_lora_adapter({"lora_name": "relax-lora"})
    res: dict = {"base_before": engine_diff(), "version_before": eng.model_info().get("weight_version")}
    role = Actor.__new__(Actor)  # the role's own methods, on the state they read
    role.model, role.rank, role.offload = actor, 0, None
    role._adapter_sync, role.behind = None, BackgroundPush()  # declared in Actor.__init__
    role.recipe = SimpleNamespace(model=SimpleNamespace(path=hf))
    role.ctx = SimpleNamespace(run=SimpleNamespace(path=out / "run", api_key=lambda: None))
    role.weights = SimpleNamespace(sender=SimpleNamespace(infos={eng.url: {"engine": "relax_hpc-cpu"}}),
                                   engines={"e0": eng.url}, released={})
    role._adapter_dir_connect({"e0": eng.url})
    res["cpu_route"] = role.adapter_dir
    role.weights.sender.infos = {eng.url: {"engine": "sglang"}}  # the stand-in (docstring)
    role._adapter_dir_connect({"e0": eng.url})
    res["sglang_route"] = role.adapter_dir
    res["after_connect"] = engine_diff()
    res["version_after_connect"] = eng.model_info().get("weight_version")
    done = role.sync(SimpleNamespace(version=5, engines={"e0": eng.url}, nodes=None, snapshot=None))
    res.update(versions=done.engine_versions, dead=done.dead_engines, bytes=done.metrics["perf/weight_sync_bytes"],
               after_sync=engine_diff(), version=eng.model_info().get("weight_version"), name=LORA_NAME,
               link=str((out / "run" / "lora" / "adapter").resolve().name))
    role.close = lambda: None
    role._adapter_sync.close()
    server.shutdown()
    return res


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory) -> dict:
    from train import launch
    from train.conftest import load_tiny_model_tool
    from train.conftest import part

    root = tmp_path_factory.mktemp("lora_ref")
    hf = str(load_tiny_model_tool().make_tiny_model(root / "qwen3", arch="qwen3", seed=0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WORKER", Path(__file__).resolve())  # this file runs the rank (see __main__)
        res = launch.run_job("suite", {"ref": ["lora_ref", {"hf": hf}]}, nproc=1, out_dir=root, timeout=300)
    return part(res, "ref")


def test_reference_from_the_actor_equals_the_reference_role(ref_run):
    """fp32 bit-equality with the reference role's model (and a plain base model) on the same batch; the adapters
    really moved (their log-probs differ from it: the negative control), and are back on after."""
    r = ref_run
    print(f"LoRA actor's log-probs vs the reference: max |diff| = {r['on_vs_ref']:.3e} (adapters on)")
    assert r["on_vs_ref"] > 1e-3  # a trained adapter: equality below is not the trivial one
    assert r["equal_role"] and r["equal_plain_base"] and r["equal_before_training"]
    assert r["back_on"]


def test_actor_role_sets_the_field_the_loss_reads(ref_run):
    """The actor role puts π_ref in each sample's ``ref_log_probs`` (exchange/fields.py's name, the reference
    role's) only when it is the run's way, and the KL loss trains on it (non-zero once the adapters moved)."""
    r = ref_run
    assert r["role_field_equal"] and r["took"] is not None and r["took"] >= 0
    assert r["left"] is None and r["left_field"]
    assert abs(r["kl"][0]) < 1e-6 and abs(r["kl"][1]) > 1e-6  # first step: adapters at B = 0 are the base
    assert "train.lora" in r["refused"] and "roles.reference" in r["refused"]


def test_adapter_directory_gives_the_engine_the_bridges_merge(ref_run):
    """The trained adapters written as the SGLang adapter sync writes them (megatron-bridge's export, B unscaled,
    PEFT's config with alpha and r), loaded by an engine: its weights are megatron-bridge's merged ones (the merge
    mode's sync), which the untouched engine's are not."""
    p = ref_run["peft"]
    assert p["loaded"][0] is True, p["loaded"]
    print(f"engine vs merged export: max |diff| {p['before']:.3e} before the adapter, {p['after']:.3e} after")
    assert p["before"] > 1e-3 and p["after"] < 1e-5 and p["keys"] > 0
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in p["names"])


def test_actor_role_syncs_adapters_by_directory_to_sglang(ref_run):
    """The actor role in adapter mode with SGLang engines: at connect the engine gets the actor's adapters (its
    version left as it is), at each sync version v's PEFT directory, swapped in; the engine then serves the merged
    weights exactly and reports v. With relax_hpc's engines the weight-sync group stays the route."""
    r = ref_run["peft"]["role"]
    assert r["cpu_route"] is False and r["sglang_route"] is True
    assert r["base_before"] > 1e-3 and r["after_connect"] < 1e-5 and r["version_after_connect"] == r["version_before"]
    assert r["versions"] == {"e0": "5"} and r["dead"] == {} and r["version"] == "5" and r["link"] == "v5"
    assert r["after_sync"] < 1e-5 and r["bytes"] > 0


def _recipe(tmp_path, *overrides: str):
    from relax_hpc.recipe.load import load_recipe

    from train.conftest import REPO

    return load_recipe(REPO / "recipes" / "quickstart-lora.yaml",
                       [f"run.runs_root={tmp_path}", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01",
                        *overrides])


def test_recipe_lora_kl_without_a_reference_role(tmp_path):
    """train.lora + use_kl_loss + no reference role validates (the actor is the reference) and the controller's
    forward roles have no reference to wait for; with a reference role enabled, it does that work as before."""
    from relax_hpc.controller.training import _forward_roles
    from relax_hpc.train.config import reference_from_actor

    r = _recipe(tmp_path)
    assert not r.roles.reference.enabled and reference_from_actor(r)
    assert "reference" not in _forward_roles(r)
    r2 = _recipe(tmp_path, "roles.reference.enabled=true")
    assert not reference_from_actor(r2) and "reference" in _forward_roles(r2)


def test_recipe_refuses_what_contradicts_it(tmp_path):
    """algorithm.ref_update_interval would refresh a reference that is the fixed base here: refused naming the key;
    without train.lora, use_kl_loss still needs the reference role."""
    from relax_hpc.recipe.load import load_recipe

    from train.conftest import REPO

    with pytest.raises(Exception, match="algorithm.ref_update_interval") as e:
        _recipe(tmp_path, "algorithm.ref_update_interval=2")
    assert "Fix" in str(e.value)
    _recipe(tmp_path, "algorithm.ref_update_interval=2", "roles.reference.enabled=true")  # a reference role: fine
    with pytest.raises(Exception, match="algorithm.use_kl_loss"):
        load_recipe(REPO / "recipes" / "quickstart.yaml", [f"run.runs_root={tmp_path}", "algorithm.use_kl_loss=true",
                                                           "algorithm.kl_loss_coef=0.01"])


if __name__ == "__main__":  # the rank of the run above
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import worker

    worker.run(lora_ref=job_lora_ref)
