"""The memory plan (relax_hpc/recipe/memory_plan.py): the numbers from config.json alone, the phases of a colocated
card, the verdict against slurm.gpu_memory_gb, and the refusal at validation (check_files) with the phase, the
biggest term and the keys that shrink it. The model is Qwen3-4B's config.json (tests/recipe/data/qwen3-4b)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_hpc.launch.files import check_files
from relax_hpc.recipe import RecipeError, load_recipe, recipe_from_dict
from relax_hpc.recipe.memory_plan import GiB, ModelShape, for_recipe, plan

REPO = Path(__file__).resolve().parents[2]
EIGHT_GPU = REPO / "recipes" / "qwen3-4b-dapo-8gpu.yaml"
QWEN3_4B = REPO / "tests" / "recipe" / "data" / "qwen3-4b"
CONFIG = json.loads((QWEN3_4B / "config.json").read_text())


def eight_gpu(*overrides: str):
    return load_recipe(str(EIGHT_GPU), [f"model.path={QWEN3_4B}", *overrides])


def terms(phase) -> dict[str, float]:
    return {f"{t.role} {t.what}": t.gib for t in phase.terms}


def test_qwen3_4b_parameters_from_config_json():
    """Qwen3-4B has 4.02B parameters (36 layers of 100.9M, a tied 389M embedding): the count from the shape alone."""
    shape = ModelShape.from_config(CONFIG)
    assert shape.tied and shape.kv_heads == 8 and shape.head_dim == 128
    assert shape.dense_layer_params == 2560 * (4096 + 2 * 1024) + 4096 * 2560 + 2 * 128 + 3 * 2560 * 9728 + 2 * 2560
    assert 4.00e9 < shape.total_params < 4.05e9
    untied = ModelShape.from_config({**CONFIG, "tie_word_embeddings": False})
    assert untied.total_params - shape.total_params == 151936 * 2560


def test_a_config_without_the_shape_names_the_field():
    mp, problems, why = for_recipe(eight_gpu(), REPO)
    assert mp is not None and why is None
    broken = {k: v for k, v in CONFIG.items() if k != "num_hidden_layers"}
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_config(broken)


def test_the_actor_terms_are_the_issue_arithmetic():
    """TP 2 x DP 4, bf16, distributed Adam: per GPU N/2 parameters in bf16 (2 bytes), fp32 grads (4), and the
    fp32 master weights and two Adam moments (12 bytes) over DP 4."""
    mp, _ = plan(eight_gpu("slurm.gpu_memory_gb=80", "train.offload=false"), CONFIG)
    train = terms(next(p for p in mp.cards[0].phases if p.name == "train"))
    n = ModelShape.from_config(CONFIG).total_params / 2
    assert train["actor params"] == pytest.approx(n * 2 / GiB, rel=1e-3)
    assert train["actor grads"] == pytest.approx(n * 4 / GiB, rel=1e-3)
    assert train["actor optimizer"] == pytest.approx(n * 12 / 4 / GiB, rel=1e-3)
    assert train["rollout context"] < 1 and "rollout static" not in train  # the engine has released its memory


def test_the_8gpu_recipe_fits_80gb_cards_with_trainer_offload():
    mp, problems = plan(eight_gpu("slurm.gpu_memory_gb=80", "train.offload=true"), CONFIG)
    assert not problems and not mp.problems() and mp.over() == []
    card = mp.cards[0]
    assert card.roles == ["actor", "rollout"]
    assert [p.name for p in card.phases] == ["generate", "train", "sync", "checkpoint"]
    gen, _, sync, save = card.phases
    assert terms(gen)["rollout static"] == pytest.approx(0.8 * 80)
    assert not {"actor params", "actor grads", "actor optimizer"} & set(terms(gen))  # on the host while it generates
    assert "actor params" in terms(sync) and "actor optimizer" not in terms(sync)  # the sync needs the weights only
    assert "verdict: fits" in mp.table() and "generate" in mp.table()
    # a save brings the optimizer state back beside the engines (they resumed at the sync): planned too
    assert {"rollout static", "actor params", "actor optimizer"} <= set(terms(save)) and "actor grads" not in terms(save)
    assert save.total > sync.total - terms(sync)["actor buckets"]


def test_without_trainer_offload_the_generate_phase_is_refused_naming_it_and_the_fix(tmp_path):
    r = eight_gpu("slurm.gpu_memory_gb=80", "train.offload=false")
    mine = [p for p in check_files(r, cwd=tmp_path) if p[0] == "slurm.gpu_memory_gb"]
    assert mine, "an 82 GiB generate phase on an 80 GiB card must be refused"
    msg = next(m for _, _, m in mine if "'generate'" in m)
    assert "over the card's 80 GiB" in msg and "Biggest term: rollout static 64.0 GiB" in msg
    for key in ("train.offload: true", "--mem-fraction-static in rollout.engine.args", "train.tp"):
        assert key in msg
    assert not [p for p in check_files(eight_gpu("slurm.gpu_memory_gb=80", "train.offload=true"), cwd=tmp_path)
                if p[0] == "slurm.gpu_memory_gb"]


def test_24gb_cards_are_refused_in_the_train_phase_naming_the_training_keys(tmp_path):
    problems = [p for p in check_files(eight_gpu("slurm.gpu_memory_gb=24"), cwd=tmp_path)
                if p[0] == "slurm.gpu_memory_gb"]
    msg = next(m for _, _, m in problems if "'train'" in m)
    for key in ("train.max_tokens_per_micro_batch", "train.optimizer_cpu_offload", "train.tp"):
        assert key in msg
    assert "train.recompute" not in msg  # the recipe recomputes fully already: not a fix


def test_without_the_card_memory_there_is_a_plan_and_no_verdict(tmp_path):
    r = eight_gpu("slurm.gpu_memory_gb=null", "train.offload=false")
    mp, problems, _ = for_recipe(r, tmp_path)
    assert problems == [] and mp.card_gib is None
    assert "verdict: none: the card's memory is unknown" in mp.table() and "slurm.gpu_memory_gb" in mp.table()
    assert "?" in mp.table()  # SGLang's static memory is a fraction of an unknown card
    assert not [p for p in check_files(r, cwd=tmp_path) if p[0] == "slurm.gpu_memory_gb"]


def test_unreadable_config_gives_no_plan_and_says_why(tmp_path):
    mp, problems, why = for_recipe(load_recipe(str(EIGHT_GPU), [f"model.path={tmp_path}"]), tmp_path)
    assert mp is None and problems == [] and "config.json" in why


def test_each_knob_shrinks_its_term():
    """The keys the refusal names do shrink what it says: offloaded optimizer, fewer tokens, full recompute, TP."""
    def train_terms(*ov):
        mp, _ = plan(eight_gpu("slurm.gpu_memory_gb=80", *ov), CONFIG)
        return terms(next(p for p in mp.cards[0].phases if p.name == "train"))

    base = train_terms()
    off = train_terms("train.use_precision_aware_optimizer=true", "train.optimizer_cpu_offload=true")
    assert base["actor optimizer"] > 5 and off["actor optimizer"] == 0
    aware = train_terms("train.use_precision_aware_optimizer=true")
    assert aware["actor optimizer"] == pytest.approx(base["actor optimizer"] * 10 / 12)  # 2-byte master remainders
    half = train_terms("train.max_tokens_per_micro_batch=5120", "train.max_seq_len=5120", "rollout.max_response_len=4096")
    assert half["actor activations"] == pytest.approx(base["actor activations"] / 2, rel=1e-6)
    none = train_terms("train.recompute=none", "train.recompute_method=uniform", "train.recompute_num_layers=1")
    assert none["actor activations"] > 2 * base["actor activations"]
    tp4 = train_terms("train.tp=4")
    assert tp4["actor params"] == pytest.approx(base["actor params"] / 2)


def test_an_engine_whose_static_memory_cannot_hold_its_weights_is_refused(tmp_path):
    r = eight_gpu("slurm.gpu_memory_gb=80", "rollout.engine.args=['--mem-fraction-static', '0.005']")
    problems = [p for p in check_files(r, cwd=tmp_path) if p[0] == "rollout.engine.args"]
    assert problems and "cannot hold the engine's bf16 weights" in problems[0][2]


def test_engines_on_their_own_gpus_are_planned_apart():
    """fully_async: the actor's cards train, the engines' cards generate; neither phase holds the other's terms."""
    data = {"mode": "fully_async", "model": {"path": str(QWEN3_4B)}, "slurm": {"gpu_memory_gb": 80},
            "train": {"tp": 2, "bf16": True, "max_tokens_per_micro_batch": 8192, "max_seq_len": 8192,
                      "recompute": "full"},
            "rollout": {"engine": {"kind": "sglang", "args": ["--mem-fraction-static", "0.85"]}},
            "roles": {"actor": {"nodes": 1, "gpus_per_node": 4, "tasks_per_node": 4},
                      "rollout": {"nodes": 1, "gpus_per_node": 4, "tasks_per_node": 1}}}
    mp, _ = plan(recipe_from_dict(data), CONFIG)
    by_role = {c.roles[0]: c for c in mp.cards}
    assert [p.name for p in by_role["actor"].phases] == ["train"]
    assert [p.name for p in by_role["rollout"].phases] == ["generate"]
    assert terms(by_role["rollout"].phases[0])["rollout static"] == pytest.approx(0.85 * 80)


# ----------------------------------------------------------------------------- the optimizer offload keys ---

@pytest.mark.parametrize("train,key,text", [
    ({"use_precision_aware_optimizer": True, "use_distributed_optimizer": False}, "train.use_precision_aware_optimizer",
     "needs the distributed optimizer"),
    ({"optimizer_cpu_offload": True}, "train.optimizer_cpu_offload", "use_precision_aware_optimizer: true"),
    ({"overlap_cpu_optimizer_d2h_h2d": True}, "train.overlap_cpu_optimizer_d2h_h2d", "optimizer_cpu_offload"),
])
def test_optimizer_offload_keys_need_what_megatron_needs(train, key, text):
    data = {"train": train, "roles": {"actor": {"gpus_per_node": 2, "tasks_per_node": 2}}}
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(data)
    found = {k: m for k, _, m in e.value.problems}
    assert key in found and text in found[key], found


def test_optimizer_offload_is_refused_on_a_cpu_only_actor():
    """megatron-core's HybridDeviceOptimizer makes CUDA streams and moves CUDA tensors only; the precision-aware
    optimizer needs Transformer Engine: refused at validation on a CPU-only run, naming why."""
    both = {"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True}
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"train": both})  # the default actor has no GPUs
    found = {k: m for k, _, m in e.value.problems}
    assert set(found) == {"train.optimizer_cpu_offload", "train.use_precision_aware_optimizer"}
    assert "CPU-only run" in found["train.optimizer_cpu_offload"]
    gpu = recipe_from_dict({"train": both, "roles": {"actor": {"gpus_per_node": 2, "tasks_per_node": 2}}})
    assert gpu.train.optimizer_cpu_offload and gpu.train.use_precision_aware_optimizer


def test_a_mixture_of_experts_counts_its_experts_and_splits_them_over_ep():
    """Qwen3-30B-A3B's shape (128 experts of 768, 8 a token): 30.5B parameters; ep 8 holds 1/8 of the experts."""
    moe = {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
           "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
           "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}
    shape = ModelShape.from_config(moe)
    assert 30.4e9 < shape.total_params < 30.6e9 and shape.experts_per_token == 8

    def params(ep):
        data = {"model": {"path": str(QWEN3_4B)}, "train": {"ep": ep, "bf16": True},
                "roles": {"actor": {"gpus_per_node": 8, "tasks_per_node": 8}, "rollout": {"gpus_per_node": 8}}}
        mp, _ = plan(recipe_from_dict(data), moe)
        return terms(next(c for c in mp.cards if "actor" in c.roles).phases[0])["actor params"]

    experts = 48 * shape.expert_layer_params * 2 / GiB
    assert params(1) - params(8) == pytest.approx(experts * 7 / 8, rel=1e-6)


@pytest.mark.parametrize("value", [0, -80])
def test_the_card_memory_must_be_a_size(value):
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"slurm": {"gpu_memory_gb": value}})
    assert [k for k, _, _ in e.value.problems] == ["slurm.gpu_memory_gb"] and "more than 0" in str(e.value)


def test_the_reference_engine_holds_its_bf16_weights_and_a_full_batchs_kv_cache():
    """relax_hpc's own engine on the actor's one GPU (the one-GPU box): no fraction, its weights (not split) and
    the KV cache of 64 sequences of train.max_seq_len tokens."""
    data = {"model": {"path": str(QWEN3_4B)}, "slurm": {"gpu_memory_gb": 80},
            "train": {"bf16": True, "max_seq_len": 4096}, "rollout": {"engine": {"kind": "reference"}},
            "roles": {"actor": {"gpus_per_node": 1, "tasks_per_node": 1},
                      "rollout": {"share_with": "actor", "gpus_per_node": 1}}}
    mp, _ = plan(recipe_from_dict(data), CONFIG)
    gen = terms(mp.cards[0].phases[0])
    kv = 64 * 4096 * 36 * 2 * 8 * 128 * 2
    assert gen["rollout static"] == pytest.approx((ModelShape.from_config(CONFIG).total_params * 2 + kv) / GiB)
    assert "--mem-fraction-static" not in " ".join(mp.hints[(mp.cards[0].label, "generate")])
