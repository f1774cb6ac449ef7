"""``train.lora.mode: adapter`` with SGLang, judged by SGLang's own code (its interpreter, ``RELAX_SGLANG_PYTHON``):

* the launch flags the engine role adds (``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``) through
  the launcher's real process start, parsed and checked by SGLang (``prepare_server_args``, its
  ``check_lora_server_args``); negative controls: Megatron's module names and a missing rank are refused by it;
* the adapter directory the actor writes (:func:`relax_hpc.weights.lora.write_peft_dir`) read by SGLang's own
  ``LoRAConfig`` and ``LoRAAdapter.initialize_weights`` (its PEFT loader and its q/k/v, gate/up stacking); negative
  control: the same tensors under Megatron's names give SGLang nothing to stack;
* the sync's requests (:class:`relax_hpc.weights.lora.AdapterDirSync`: unload, load, weight version) and a generate
  naming the adapter, parsed by SGLang's HTTP application into its ``io_struct`` classes with no key dropped;
  negative control: a misspelled key is refused by SGLang's route.
"""

from __future__ import annotations

import json

import pytest
import torch

from contract_support import run_sglang, served_recorder

RANK, ALPHA = 4, 8.0
KEY = "relax-lora-contract-key"


def _launch_lora(sglang_python, tmp_path, monkeypatch, overrides=()):
    from test_launch import launch, sglang_recipes

    return launch(sglang_python, tmp_path, monkeypatch, sglang_recipes()[0],
                  ["train.lora.mode=adapter", f"train.lora.rank={RANK * 2}", *overrides])


def test_lora_launch_flags_parse_with_sglang(sglang_python, tmp_path, monkeypatch):
    """The recipe's engine command with train.lora.mode adapter: SGLang's parser takes it (the launcher's real start),
    and its resolution and launch checks take its LoRA flags, with LoRA on, the rank and the HF module names of
    train.lora.target_modules."""
    from relax_hpc.engines.launcher import sglang_lora_args
    from relax_hpc.train.config import DEFAULT_LORA_TARGETS, hf_lora_targets

    rc, a, h, _ = _launch_lora(sglang_python, tmp_path, monkeypatch)
    assert rc == 0, h.log_tail(15)
    flags = sglang_lora_args(RANK * 2, hf_lora_targets(list(DEFAULT_LORA_TARGETS)))
    argv = a["argv"]
    at = argv.index("--enable-lora")
    assert argv[at: at + len(flags)] == flags, argv
    out = tmp_path / "lora.json"
    r = run_sglang(sglang_python, "check_lora.py", "launch", str(out), "--model-path", str(_tiny_llama(tmp_path)),
                   "--device", "cpu", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    want = sorted(hf_lora_targets(list(DEFAULT_LORA_TARGETS)))
    assert got == {"enable_lora": True, "max_lora_rank": RANK * 2, "lora_target_modules": want, "lora_paths": []}


def test_negative_controls_megatron_names_and_no_rank_are_refused(sglang_python, tmp_path):
    """SGLang refuses Megatron's module names (its choices are HF's) and LoRA without a rank or adapters."""
    from relax_hpc.engines.launcher import sglang_lora_args

    base = ["--model-path", str(_tiny_llama(tmp_path)), "--device", "cpu"]
    r = run_sglang(sglang_python, "check_lora.py", "launch", str(tmp_path / "x.json"), *base,
                   *sglang_lora_args(RANK, ["linear_qkv"]))
    assert r.returncode == 2 and "invalid choice: 'linear_qkv'" in r.stderr
    r = run_sglang(sglang_python, "check_lora.py", "launch", str(tmp_path / "y.json"), *base, "--enable-lora",
                   "--lora-target-modules", "q_proj")
    assert r.returncode == 1 and "--max-lora-rank" in r.stderr


def _tiny_llama(tmp_path):
    from tests.rollout.conftest import _tiny_model_maker

    return _tiny_model_maker()(tmp_path / "tiny-llama", arch="llama", hidden=64, layers=2, heads=4, kv_heads=2, seed=0)


def _bridge_like(w0: dict, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Adapters as megatron-bridge exports them (HF module names), on every linear and the output layer."""
    g = torch.Generator().manual_seed(seed)
    mods = [f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]
    out = []
    for m in mods:
        o, i = w0[m + ".weight"].shape
        out += [(m + ".lora_A.weight", torch.randn(RANK, i, generator=g)),
                (m + ".lora_B.weight", torch.randn(o, RANK, generator=g))]
    return out


def _sglang_reads(sglang_python, tmp_path, peft_dir, base) -> dict:
    from relax_hpc.engines.launcher import sglang_lora_args
    from relax_hpc.train.config import hf_lora_targets

    out = tmp_path / f"{peft_dir.name}.json"
    targets = hf_lora_targets(["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer"])
    r = run_sglang(sglang_python, "check_lora.py", "peft", str(out), str(peft_dir), str(base),
                   *sglang_lora_args(RANK, targets))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_adapter_directory_is_loaded_by_sglangs_peft_loader(sglang_python, tmp_path):
    from safetensors.torch import load_file

    from relax_hpc.weights.lora import write_peft_dir

    base = _tiny_llama(tmp_path)
    named = _bridge_like(load_file(str(base / "model.safetensors")))
    write_peft_dir(named, {"config": {"rank": RANK, "alpha": ALPHA, "dropout": 0.0}}, str(base), tmp_path / "peft")
    got = _sglang_reads(sglang_python, tmp_path, tmp_path / "peft", base)
    assert got["r"] == RANK and got["lora_alpha"] == ALPHA and got["scaling"] == ALPHA / RANK
    assert got["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj", "lm_head"])
    p = "base_model.model.model.layers.1."
    layer = got["layers"][1]
    # q (64), k and v (32 each: 2 kv heads of 16) stacked by SGLang, each with its own rank-RANK slice of A
    assert layer[p + "self_attn.qkv_proj.lora_A.weight"] == [3 * RANK, 64]
    assert layer[p + "self_attn.qkv_proj.lora_B.weight"] == [128, RANK]
    assert layer[p + "mlp.gate_up_proj.lora_A.weight"] == [2 * RANK, 64]
    assert layer[p + "mlp.down_proj.lora_B.weight"] == [64, RANK]
    assert got["embedding"] == {"base_model.model.lm_head.lora_A.weight": [RANK, 64],
                                "base_model.model.lm_head.lora_B.weight": [128, RANK]}


def test_negative_control_megatron_names_give_sglang_nothing_to_stack(sglang_python, tmp_path):
    from safetensors.torch import load_file

    from relax_hpc.weights.lora import write_peft_dir

    base = _tiny_llama(tmp_path)
    named = [(n.replace("self_attn.q_proj", "self_attention.linear_qkv").replace("lm_head", "output_layer"), t)
             for n, t in _bridge_like(load_file(str(base / "model.safetensors")))
             if ".k_proj." not in n and ".v_proj." not in n]
    write_peft_dir(named, {"config": {"rank": RANK, "alpha": ALPHA, "dropout": 0.0}}, str(base), tmp_path / "meg")
    got = _sglang_reads(sglang_python, tmp_path, tmp_path / "meg", base)
    assert not any("qkv_proj" in k for k in got["layers"][1]) and got["embedding"] == {}


@pytest.fixture(scope="module")
def lora_recorder(sglang_python, tmp_path_factory):
    yield from served_recorder(sglang_python, "lora_recorder.py", tmp_path_factory.mktemp("sglang-lora-recorder"), KEY)


IO = "sglang.srt.managers.io_struct."


def test_adapter_sync_and_generate_requests_parsed_by_sglang(lora_recorder, tmp_path):
    """Two syncs, as the actor's rank 0 makes them, then a generate of the run: each request parsed by SGLang into
    its class with no key dropped; the adapter is loaded from the link to the newest version, under one name."""
    from relax_hpc.engines.client import EngineClient
    from relax_hpc.engines.lora import LORA_NAME, generate_fields
    from relax_hpc.weights.lora import AdapterDirSync

    named = [("model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(RANK, 8)),
             ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.ones(8, RANK))]
    lora_recorder.take()
    sync = AdapterDirSync(tmp_path / "lora", KEY, "/base")
    try:
        for v in ("1", "2"):
            _, versions, dead = sync.publish(v, named, {"config": {"rank": RANK, "alpha": ALPHA, "dropout": 0.0}},
                                             {"e0": lora_recorder.url})
            assert versions == {"e0": v} and dead == {}
    finally:
        sync.close()
    from types import SimpleNamespace

    fields = generate_fields(SimpleNamespace(train=SimpleNamespace(lora=SimpleNamespace(mode="adapter"))))
    c = EngineClient(lora_recorder.url, api_key=KEY, timeout=30)
    try:
        c.generate([1, 2, 3], {"max_new_tokens": 2}, extra=fields)
    finally:
        c.close()
    got = lora_recorder.take()
    link = str(tmp_path / "lora" / "adapter")
    want = [("/unload_lora_adapter", "UnloadLoRAAdapterReqInput", {"lora_name": LORA_NAME}),
            ("/load_lora_adapter", "LoadLoRAAdapterReqInput", {"lora_name": LORA_NAME, "lora_path": link}),
            ("/update_weight_version", "UpdateWeightVersionReqInput", {"new_version": "1"})] * 2
    want[5] = ("/update_weight_version", "UpdateWeightVersionReqInput", {"new_version": "2"})
    seen = [(g["route"], g["cls"].removeprefix(IO), {k: g["body"][k] for k in w[2]}) for g, w in zip(got, want)]
    assert seen == want, got
    assert all(g["unknown"] == [] and g["auth"] == f"Bearer {KEY}" for g in got), got
    gen = got[-1]
    assert gen["route"] == "/generate" and gen["body"]["lora_path"] == LORA_NAME and gen["unknown"] == []


def test_negative_control_a_misspelled_lora_key_is_refused_by_sglang(lora_recorder):
    from relax_hpc.engines.client import EngineClient

    lora_recorder.take()
    c = EngineClient(lora_recorder.url, api_key=KEY, timeout=30, retries=0)
    try:
        r = c.request("POST", "/load_lora_adapter", {"lora_name": "x", "lora_dir": "/somewhere"},
                      ok_statuses=(200, 400, 422))
    finally:
        c.close()
    assert r.status_code in (400, 422) and lora_recorder.take() == []
