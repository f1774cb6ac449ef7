"""The LoRA quickstart as a user runs it (``relax-submit --local recipes/quickstart-lora.yaml``): ONE whole run,
module-scoped, that every check here reads. It learns the quickstart's sums with adapters on the frozen tiny model,
syncs only the adapters to the CPU engine (``train.lora.mode: adapter``), and its checkpoint exports as a merged HF
model (the default) and as PEFT adapters (``--adapter``), both answering the sums as the engine did."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from relax_hpc.rundir import RunDir

from .conftest import REPO, metrics, quickstart_overrides

RECIPE = REPO / "recipes" / "quickstart-lora.yaml"
BIN = REPO / ".venv" / "bin"
# The suite's one LoRA run: the recipe as a user runs it, cut to 60 steps (the recipe's 100 steps answer 47 of the
# 55 sums, measured; 60 already clear every check here) to keep the suite's time down
STEPS = 60
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a loaded 2-core machine: 11 min measured for 100 steps


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model) -> dict:
    tmp = tmp_path_factory.mktemp("lora")
    t0 = time.time()
    p = subprocess.run([str(BIN / "relax-submit"), "--local", str(RECIPE),
                        *quickstart_overrides(tiny_model, tmp / "runs", f"run.steps={STEPS}",
                                              f"rollout.eval_interval={STEPS}", machinery=False, recipe=RECIPE)],
                       cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    [run] = (tmp / "runs").glob("quickstart-lora-*")
    print(f"LoRA quickstart run: {time.time() - t0:.0f} s")
    return {"run": run, "tmp": tmp, "out": p.stdout + p.stderr,
            "summary": json.loads((run / "summary.json").read_text())}


def _greedy(model, tok) -> list[str]:
    import torch

    from relax_hpc.tasks import arith

    out = []
    with torch.no_grad():
        for row in arith.prompts():
            enc = tok(row["prompt"], return_tensors="pt")
            ids = model.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)
            out.append(tok.decode(ids[0, enc["input_ids"].shape[1]:]).strip())
    return out


def _right(answers: list[str]) -> int:
    from relax_hpc.tasks import arith

    return sum(a == row["label"] for a, row in zip(answers, arith.prompts()))


def _export(lora_run, name: str, *flags: str) -> Path:
    out = lora_run["tmp"] / name
    e = subprocess.run([str(BIN / "relax-export"), str(lora_run["run"]), str(out), *flags],
                       capture_output=True, text=True, timeout=600)
    assert e.returncode == 0, e.stderr
    return out


def test_the_lora_quickstart_learns(lora_run):
    """Last 10 steps' mean reward at least 0.2 above the first 10's; greedy eval from ~1/55 to most sums."""
    rewards = [r["rollout/raw_reward"] for r in metrics(RunDir(lora_run["run"]))
               if "rollout/raw_reward" in r]
    s = lora_run["summary"]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"LoRA quickstart: reward first 10 {first:.3f} -> last 10 {last:.3f}; greedy eval "
          f"{s['eval_first']['arith'] * 55:.0f}/55 -> {s['eval_last']['arith'] * 55:.0f}/55, {s['wall_time_s']:.0f} s")
    assert s["state"] == "COMPLETED" and len(rewards) == s["steps"]
    assert last - first >= 0.2
    assert s["eval_first"]["arith"] < 0.2 and s["eval_last"]["arith"] >= 0.5


def test_adapter_sync_sends_a_fraction_of_the_model(lora_run):
    """Every sync logged perf/weight_sync_bytes: the adapters only, under a quarter of the model's bytes (what a merged
    or full fine-tuning sync sends); and the engines' weights passed the actor's fingerprint check each time."""
    from safetensors.torch import load_file

    rows = [r for r in metrics(RunDir(lora_run["run"])) if "step" in r]
    synced = [r["perf/weight_sync_bytes"] for r in rows if "perf/weight_sync_bytes" in r]
    full = sum(t.numel() * t.element_size() for t in load_file(str(_model_dir(lora_run) / "model.safetensors")).values())
    print(f"weight sync bytes: adapter mode {synced[-1]:.0f}, the full model {full}")
    assert len(synced) == lora_run["summary"]["steps"]
    assert max(synced) * 4 < full
    assert all(r.get("weights/fingerprint_match", 1.0) == 1.0 for r in rows)


def _model_dir(lora_run) -> Path:
    import yaml

    return Path(yaml.safe_load((lora_run["run"] / "recipe.yaml").read_text())["model"]["path"])


def test_merged_export_answers_as_the_engine(lora_run):
    """relax-export (merged, the default) loads in transformers, and its greedy answers count what the engine's
    last greedy eval counted (one near-tie may break either way between two float paths, as in the quickstart)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _export(lora_run, "merged")
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    right = _right(_greedy(model, tok))
    print(f"merged export answers {right}/55")
    assert abs(right - round(lora_run["summary"]["eval_last"]["arith"] * 55)) <= 1
    assert right >= 0.5 * 55


def test_adapter_export_is_peft_and_equals_the_merged(lora_run):
    """relax-export --adapter writes PEFT's adapter_config.json and adapter_model.safetensors; applied to the base
    model (by peft where installed, else by their definition W + lora_alpha / r · B A) they give the merged export's
    logits."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _export(lora_run, "adapters", "--adapter")
    merged_dir = lora_run["tmp"] / "merged"
    if not merged_dir.exists():
        merged_dir = _export(lora_run, "merged")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and "lm_head" in cfg["target_modules"]
    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert tensors and all(k.startswith("base_model.model.") and ".lora_" in k for k in tensors)
    base_dir = _model_dir(lora_run)
    tok = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    try:
        from peft import PeftModel

        adapted = PeftModel.from_pretrained(base, str(out)).eval()
    except ImportError:  # peft is not installed here: apply the adapters by their definition
        sd = base.state_dict()
        scale = cfg["lora_alpha"] / cfg["r"]
        with torch.no_grad():
            for k in [k for k in tensors if k.endswith(".lora_A.weight")]:
                mod = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                sd[mod + ".weight"] += scale * tensors[k.replace("lora_A", "lora_B")] @ tensors[k]
        base.load_state_dict(sd)
        adapted = base
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    ids = tok("3+4=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = (adapted(ids).logits - merged(ids).logits).abs().max().item()
    assert diff < 1e-4, diff
