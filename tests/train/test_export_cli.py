"""relax-export: a checkpoint saved at TP=2 (the ``multi_run`` launch's, DistributedOptimizer included) written as an
HF directory by the CLI, in one process without GPUs, that transformers loads with the saved Megatron model's logits;
and the refusals (no run, no checkpoint, no such step, OUT_DIR not empty, no model), each naming the run, the step
and the fix, before megatron is imported.

One subprocess of the CLI (megatron's imports cost ~8 s); the refusals run in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.conftest import RESUME_ARGS, part

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5  # fp32, CPU: test_bridge_parity's bound for Megatron (TP=2) against transformers


def make_run(root: Path, model_path: str, *, runs_root: str = "./runs", name: str = "demo-20260101-000000") -> Path:
    """A run directory as relax-submit leaves it, as far as relax-export reads it: recipe.yaml and checkpoints/."""
    run = root / runs_root / name
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text(f"run:\n  name: demo\n  runs_root: {runs_root}\nmodel:\n  path: {model_path}\n"
                                     "train:\n  tp: 2\n  bf16: false\n")
    return run


def fake_checkpoint(root: Path, name_step: int, run_step: int) -> Path:
    """A complete step directory (meta.json) whose run step (extra_state.step) may differ from its name's."""
    d = root / f"step_{name_step:08d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": name_step, "extra_state": {"step": run_step}}))
    return d


@pytest.fixture(scope="module")
def exported(multi_run, tiny_models, tmp_path_factory) -> dict:
    """The TP=2 checkpoint of ``multi_run`` under a run directory, exported by ``relax-export`` run from elsewhere:
    the run's relative model.path is found through its runs_root, as its roles found it."""
    base = tmp_path_factory.mktemp("export")
    submit_dir = base / "submitted_here"
    (submit_dir / "models").mkdir(parents=True)
    (submit_dir / "models" / "qwen3").symlink_to(tiny_models["qwen3"])
    run = make_run(submit_dir, "models/qwen3")
    (run / "checkpoints").symlink_to(Path(multi_run["ckpt_root"]) / "ck_tp2")
    out = base / "hf"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "relax_hpc.train.export_cli", str(run), str(out)], cwd=base,
                          env=dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"run": run, "out": out, "stdout": proc.stdout, "cli_s": time.monotonic() - t0,
            "saved": part(multi_run, "resume_save")["tp2"]}


@pytest.mark.timeout(600)
def test_tp2_checkpoint_exports_to_what_transformers_loads_with_the_same_logits(exported, tiny_models):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, saved = exported["out"], exported["saved"]
    print(exported["stdout"].strip(), f"\n[export tp2 -> hf] the CLI took {exported['cli_s']:.1f} s")
    tokens = torch.tensor(saved["tokens"])
    want = torch.tensor(saved["logits"])  # the TP=2 Megatron model's, gathered, right after the save
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(tokens).logits.float()
        base = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32).eval()(tokens).logits
    diff, moved = (got - want).abs().max().item(), (base - want).abs().max().item()
    print(f"[export tp2 -> hf] max |logits - Megatron's| {diff:.2e} (the initial model's: {moved:.2e})")
    assert diff <= TOL
    assert moved > 1000 * TOL  # the checkpoint's trained weights were exported, not model.path's
    assert AutoTokenizer.from_pretrained(out)("1 + 2 =")["input_ids"]  # tokenizer files came along
    prov = json.loads((out / "relax_export.json").read_text())
    assert prov["step"] == RESUME_ARGS["k"] and prov["saved_layout"]["tp"] == 2
    assert prov["model_path"] == str(Path(tiny_models["qwen3"]).resolve())
    assert "saved at TP=2, PP=1" in exported["stdout"]


def test_refusals_name_the_run_the_step_and_the_fix(tmp_path, capsys, tiny_models):
    from relax_hpc.train.export_cli import EXIT_REFUSED, main

    def refused(*argv) -> str:
        assert main([str(a) for a in argv]) == EXIT_REFUSED
        return capsys.readouterr().err

    run = make_run(tmp_path, tiny_models["qwen3"])
    out = tmp_path / "out"
    assert "not a run directory" in refused(tmp_path / "nope", out)
    err = refused(run, out)
    assert f"run {run} has no checkpoint" in err and "relax-cancel --checkpoint" in err
    ck = run / "checkpoints"
    fake_checkpoint(ck, 3, 3)
    fake_checkpoint(ck, 8, 6)  # 2 optimizer steps a rollout step: named step_00000008, run step 6
    fake_checkpoint(ck, 9, 9).joinpath("meta.json").unlink()  # a save killed half way: not offered
    err = refused(run, out)  # complete ones but no latest
    assert "has no checkpoint" in err and "complete ones: 3, 6" in err and "--step" in err
    (ck / "latest").write_text("step_00000009\n")
    err = refused(run, out)
    assert "names no complete checkpoint" in err and "--step with one of 3, 6" in err
    err = refused(run, out, "--step", 5)
    assert f"run {run} has no complete checkpoint of step 5" in err and "--step one of 3, 6" in err
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = refused(run, out, "--step", 6)
    assert f"OUT_DIR {out} is not empty" in err and "step 6" in err and "--force" in err
    err = refused(run, tmp_path / "new", "--step", 6, "--model", tmp_path / "nomodel")
    assert "is not an HF model directory" in err and "--model DIR" in err
    assert (out / "keep.txt").read_text() == "mine" and not (tmp_path / "new").exists()  # nothing written


def test_which_checkpoint_and_which_model(tmp_path, monkeypatch, tiny_models):
    """--step is the run's step (what relax-status counts), the directory's name only as a fallback; a relative
    model.path is the submit directory's (found from runs_root), whatever directory relax-export runs in."""
    from relax_hpc.train.export_cli import find_checkpoint, parser, plan

    submit_dir = tmp_path / "proj"
    submit_dir.mkdir()
    (submit_dir / "m").symlink_to(tiny_models["qwen3"])
    run = make_run(submit_dir, "m", runs_root="out/runs")
    ck = run / "checkpoints"
    for name_step, run_step in ((4, 2), (8, 4), (12, 6)):
        fake_checkpoint(ck, name_step, run_step)
    (ck / "latest").write_text("step_00000012\n")
    assert find_checkpoint(run, None)[:2] == (ck / "step_00000012", 6)
    assert find_checkpoint(run, 4)[:2] == (ck / "step_00000008", 4)  # run step 4, not step_00000004
    assert find_checkpoint(run, 12)[:2] == (ck / "step_00000012", 12)  # a directory name, when no run step matches
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = elsewhere / "full"
    out.mkdir()
    (out / "x").write_text("")
    p = plan(parser().parse_args([str(run), str(out), "--step", "2", "--force"]))  # --force: a non-empty OUT_DIR
    assert (p.step, p.step_dir, p.bf16) == (2, ck / "step_00000004", False)
    assert p.model_path == Path(tiny_models["qwen3"]).resolve()


def test_a_run_is_found_by_its_directory_or_its_recipe_name(tmp_path, monkeypatch):
    """`relax-export quickstart OUT` (run.name, as relax-status takes it): the latest run of that name under ./runs."""
    from relax_hpc.train.export_cli import ExportError, find_run

    monkeypatch.chdir(tmp_path)
    for name in ("walk-20260101-000000", "walk-20260102-000000", "walk-long-20260103-000000"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "recipe.yaml").write_text("{}\n")
    assert find_run("walk") == tmp_path / "runs" / "walk-20260102-000000"
    assert find_run("walk-20260101-000000") == tmp_path / "runs" / "walk-20260101-000000"
    assert find_run(str(tmp_path / "runs" / "walk-long-20260103-000000")).name == "walk-long-20260103-000000"
    with pytest.raises(ExportError, match="not a run directory"):
        find_run("wal")


def test_the_export_answers_the_standard_transformers_call(exported):
    """``model.generate(**tok(text, return_tensors="pt"))`` on the export, as a user tries it: no token_type_ids
    (tools/make-tiny-model's tokenizer declares the inputs a causal LM takes), one greedy token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported["out"])
    enc = tok("3+4=", return_tensors="pt")
    out = AutoModelForCausalLM.from_pretrained(exported["out"]).generate(**enc, max_new_tokens=1, do_sample=False,
                                                                         pad_token_id=tok.pad_token_id)
    assert set(enc) == {"input_ids", "attention_mask"} and out.shape[1] == enc["input_ids"].shape[1] + 1
