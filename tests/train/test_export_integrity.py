"""Checkpoints carry a sha256 manifest, checked on resume and on export; the export refuses non-finite weights, a
truncated checkpoint is named, OUT_DIR never holds a mix of two exports, and --force never takes an input with it.

Real checkpoints of the tiny Qwen3 (``tools/make-tiny-model``), saved by :func:`relax_hpc.train.checkpoint.save`
in one worker process (gloo, world 1; no training run): step 2 and step 4 of a run, their final norm filled with
2.0 and 4.0 so an export shows which step's weights it holds. That process also loads damaged copies the way a
resume does (``checkpoint.load``) and exports an older-style checkpoint with NaN bytes through ``relax-export``'s
``main``. The refusals before megatron run in this process; the two concurrent exports are two real CLI processes.
This file is also the worker (``python tests/train/test_export_integrity.py JOB OUT ARGS``, see ``launch.py``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = (2, 4)  # the run's two checkpoints; final_layernorm.weight is filled with the step
NAN_AT = (("decoder.layers.mlp.linear_fc2.weight", 1), ("output_layer.weight", 0))  # (stored key, first offset)
NAN_COUNT = 3072  # NaNs written into each: 6,144 in all, the probe


# ------------------------------------------------------------------ damaging a checkpoint as a probe would ---

def tensor_bytes(step_dir: Path, fqn: str, first: int) -> tuple[Path, int, int]:
    """(file, offset, length) of the raw values of one stored tensor of a torch_dist checkpoint (the key as stored,
    and the first index of its global offset: ``decoder.layers.…`` stacks the layers)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(step_dir)).read_metadata().storage_data
    [info] = [v for k, v in storage.items() if k.fqn == fqn and k.offset[0] == first]
    path = step_dir / info.relative_path
    with open(path, "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    values = torch.load(io.BytesIO(blob), weights_only=True).numpy().tobytes()
    at = blob.find(values)
    assert at > 0, f"the values of {fqn} not found in {path}"
    return path, info.offset + at, len(values)


def write_nan(step_dir: Path, fqn: str, first: int, n: int = NAN_COUNT) -> Path:
    import numpy as np

    path, at, _ = tensor_bytes(step_dir, fqn, first)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(np.full(n, np.nan, dtype=np.float32).tobytes())
    return path


def flip_byte(step_dir: Path, fqn: str = "decoder.layers.mlp.linear_fc2.weight", first: int = 0) -> Path:
    """One bit of one weight (the middle of its values) flipped: the file keeps its size and still loads."""
    path, at, length = tensor_bytes(step_dir, fqn, first)
    with open(path, "r+b") as f:
        f.seek(at + length // 2 + 1)
        b = f.read(1)
        f.seek(at + length // 2 + 1)
        f.write(bytes([b[0] ^ 0x10]))
    return path


def as_older(step_dir: Path) -> Path:
    """The checkpoint as a save before manifests left it: no manifest.sha256, meta.json without "manifest"."""
    (step_dir / "manifest.sha256").unlink(missing_ok=True)
    meta = json.loads((step_dir / "meta.json").read_text())
    meta.pop("manifest", None)
    (step_dir / "meta.json").write_text(json.dumps(meta))
    return step_dir


def truncate(path: Path, keep: int = 100_000) -> Path:
    os.truncate(path, keep)
    return path


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


def make_run(root: Path, model_path: str) -> Path:
    run = root / "runs" / "demo-20260101-000000"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text(f"run:\n  name: demo\nmodel:\n  path: {model_path}\ntrain:\n  bf16: false\n")
    return run


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ the worker: save, resume-load, NaN export ---

def job_integrity(args: dict, out: Path) -> dict:
    import contextlib
    import logging

    import torch

    from relax_hpc.errors import is_permanent
    from relax_hpc.train import checkpoint as ckpt, cpu_compat
    from relax_hpc.train.config import TrainConfig
    from relax_hpc.train.export_cli import main as export_main
    from relax_hpc.train.model import build_model
    from relax_hpc.train.parallel import init_parallel

    cpu_compat.compile_eagerly()  # as relax_hpc.train.build does
    run, cases = Path(args["run"]), Path(args["cases"])
    init_parallel(1, 1, seed=0)
    chunks = build_model(args["hf"], TrainConfig(tp=1, pp=1)).chunks
    norm = chunks[0].decoder.final_layernorm.weight
    for s in STEPS:
        with torch.no_grad():
            norm.fill_(float(s))
        ckpt.save(run / "checkpoints", chunks, None, step=s, extra_state={"step": s})
    saved = run / "checkpoints" / "step_00000004"

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: warned.append(rec.getMessage())
    logging.getLogger("relax_hpc.checkpoint").addHandler(handler)

    def resume(step_dir: Path) -> dict:
        """checkpoint.load as a resume calls it; what it raised (any BaseException: torch's CheckpointException
        is one), or the final norm it loaded and the warnings it logged."""
        warned.clear()
        with torch.no_grad():
            norm.fill_(-1.0)
        try:
            step, _ = ckpt.load(step_dir, chunks, None, load_optimizer=False)
        except BaseException as e:  # noqa: BLE001 - recorded for the test to judge
            return {"raised": type(e).__name__, "error": str(e), "permanent": is_permanent(e),
                    "lines": len(str(e).splitlines())}
        return {"step": step, "norm": norm.unique().tolist(), "warnings": list(warned)}

    def case(name: str) -> Path:
        return Path(shutil.copytree(saved, cases / name / saved.name))

    res = {"manifest": (saved / "manifest.sha256").read_text() if (saved / "manifest.sha256").exists() else None,
           "files": [str(p.relative_to(saved)) for p in sorted(saved.rglob("*")) if p.is_file()]}
    res["intact"] = resume(saved)
    flipped = case("flipped")
    res["flipped_file"] = str(flip_byte(flipped))
    res["flipped"] = resume(flipped)
    res["older"] = resume(as_older(case("older")))
    older_short = as_older(case("older_truncated"))
    res["older_truncated_file"] = str(truncate(older_short / "__0_1.distcp"))
    res["older_truncated"] = resume(older_short)
    # an older checkpoint whose bytes keep their sizes but do not load: a stored tensor's zip header overwritten
    older_bad = as_older(case("older_unloadable"))
    path, at, _ = tensor_bytes(older_bad, "output_layer.weight", 0)
    with open(path, "r+b") as f:
        f.seek(at - 200)
        f.write(b"\0" * 200)
    res["older_unloadable"] = resume(older_bad)
    gone = case("manifest_deleted")
    (gone / "manifest.sha256").unlink(missing_ok=True)  # (the code before manifests wrote none)
    res["manifest_deleted"] = resume(gone)

    # relax-export of an older-style checkpoint (no manifest to catch them) with NaN bytes in two tensors
    nan_run = copy_run(run, cases / "nan_run")
    nan_step = as_older(nan_run / "checkpoints" / "step_00000004")
    for fqn, first in NAN_AT:
        write_nan(nan_step, fqn, first)
    nan_out = cases / "nan_out"  # an earlier export there, which --force would replace: a failure must keep it
    nan_out.mkdir()
    (nan_out / "model.safetensors").write_bytes(b"an earlier export")
    (nan_out / "notes.txt").write_text("mine")
    before = snapshot(nan_out)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = export_main([str(nan_run), str(nan_out), "--force"])
    res["nan_export"] = {"rc": rc, "stderr": err.getvalue(), "out_kept": snapshot(nan_out) == before,
                         "left": sorted(p.name for p in cases.iterdir() if p.name.startswith(".nan_out"))}
    return res


def job_integrity_tp2(args: dict, out: Path) -> dict:
    """Two ranks, TP=2: each hashes its own shards at the save; at a load each checks half the files, and damage
    only one rank can see fails both, with the same message (no rank left waiting in a collective)."""
    import torch.distributed as dist

    from relax_hpc.train import checkpoint as ckpt
    from relax_hpc.train import cpu_compat, manifest
    from relax_hpc.train.config import TrainConfig
    from relax_hpc.train.model import build_model
    from relax_hpc.train.parallel import init_parallel

    cpu_compat.compile_eagerly()  # as relax_hpc.train.build does
    root = Path(args["root"])
    init_parallel(2, 1, seed=0)
    chunks = build_model(args["hf"], TrainConfig(tp=2, pp=1)).chunks
    step_dir = ckpt.save(root, chunks, None, step=1)
    res = {"files": manifest.listing(step_dir), "listed": sorted(manifest.read(step_dir) or {})}
    names = sorted(manifest.read(step_dir) or {})
    res["damaged"] = manifest.share(names, 1, 2)[0]  # a file only rank 1 checks
    dist.barrier()
    if dist.get_rank() == 0:
        with open(step_dir / res["damaged"], "r+b") as f:
            f.seek(10)
            b = f.read(1)
            f.seek(10)
            f.write(bytes([b[0] ^ 1]))
    dist.barrier()
    try:
        ckpt.load(step_dir, chunks, None, load_optimizer=False)
        mine = None
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        mine = f"{type(e).__name__}: {e}"
    everyone: list = [None, None]
    dist.all_gather_object(everyone, mine)
    res["raised"] = everyone
    return res


@pytest.fixture(scope="module")
def saved(tiny_models, tmp_path_factory) -> dict:
    from train import launch

    base = tmp_path_factory.mktemp("integrity")
    run = make_run(base, tiny_models["qwen3"])
    args = {"hf": tiny_models["qwen3"], "run": str(run), "cases": str(base / "cases")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WORKER", Path(__file__).resolve())  # this file runs the rank (see __main__)
        res = launch.run_job("integrity", args, nproc=1, out_dir=base / "job", timeout=300)
    return dict(res, run=run, base=base, model=Path(tiny_models["qwen3"]))


@pytest.fixture(scope="module")
def saved_tp2(tiny_models, tmp_path_factory) -> dict:
    from train import launch

    base = tmp_path_factory.mktemp("integrity_tp2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WORKER", Path(__file__).resolve())
        return launch.run_job("integrity_tp2", {"hf": tiny_models["qwen3"], "root": str(base / "ck")}, nproc=2,
                              out_dir=base / "job", timeout=300)


def _failed(res: dict, key: str) -> dict:
    r = res[key]
    assert "raised" in r, f"{key}: loaded without complaint: {r}"
    return r


# ------------------------------------------------------------------ save writes it, resume checks it ---

@pytest.mark.timeout(400)
def test_save_writes_a_manifest_of_every_file_that_an_intact_load_passes(saved):
    from relax_hpc.train import manifest

    step_dir = saved["run"] / "checkpoints" / "step_00000004"
    assert saved["manifest"] is not None, "the save wrote no manifest.sha256"
    listed = manifest.read(step_dir)
    assert sorted(listed) == manifest.listing(step_dir)  # every file but meta.json and the manifest itself
    assert {".metadata", "common.pt", "rng/rank_00000.pt"} <= set(listed) and any(n.endswith(".distcp") for n in listed)
    assert manifest.verify(step_dir, listed) == []
    assert json.loads((step_dir / "meta.json").read_text())["manifest"] == "manifest.sha256"
    # `sha256sum -c` checks it by hand
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", "--quiet", "-c", "manifest.sha256"], cwd=step_dir, check=True)
    assert saved["intact"] == {"step": 4, "norm": [4.0], "warnings": []}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_share_the_hashing_and_damage_one_rank_finds_fails_both(saved_tp2):
    r = saved_tp2
    assert r["listed"] == r["files"]
    assert {"rng/rank_00000.pt", "rng/rank_00001.pt"} <= set(r["listed"])
    assert any(n.startswith("__0_") for n in r["listed"]) and any(n.startswith("__1_") for n in r["listed"])
    first, second = r["raised"]
    assert first is not None and first == second, r["raised"]  # the same refusal on both ranks
    assert first.startswith("CheckpointDamaged: ") and f"{r['damaged']} (" in first


@pytest.mark.timeout(400)
def test_resume_load_refuses_a_checksum_mismatch_naming_the_file(saved):
    r = _failed(saved, "flipped")
    print(f"[resume, one bit flipped] {r['raised']}: {r['error']}")
    assert r["raised"] == "CheckpointDamaged" and r["permanent"] and r["lines"] == 1
    assert saved["flipped_file"] in r["error"] and "sha256" in r["error"]
    assert "latest" in r["error"] and "Fix:" in r["error"]
    r = _failed(saved, "manifest_deleted")  # deleting the manifest does not switch the check off
    assert r["raised"] == "CheckpointDamaged" and "manifest.sha256 is missing" in r["error"]


@pytest.mark.timeout(400)
def test_an_older_checkpoint_without_manifest_loads_with_a_warning(saved):
    r = saved["older"]
    assert r.get("norm") == [4.0] and r.get("step") == 4, r
    assert len(r["warnings"]) == 1 and "has no manifest.sha256" in r["warnings"][0]


@pytest.mark.timeout(400)
def test_a_truncated_or_unloadable_checkpoint_is_named_in_one_line(saved):
    """No manifest to compare with: the shards' sizes against .metadata name the truncated file; bytes that do not
    load raise one line naming the checkpoint, not torch's CheckpointException (a BaseException) and its traceback."""
    r = _failed(saved, "older_truncated")
    print(f"[resume, truncated] {r['raised']}: {r['error']}")
    assert r["raised"] == "CheckpointDamaged" and r["permanent"] and r["lines"] == 1
    assert f"{saved['older_truncated_file']} is truncated (100000 bytes" in r["error"]
    r = _failed(saved, "older_unloadable")
    print(f"[resume, unloadable] {r['raised']}: {r['error']}")
    assert r["raised"] == "CheckpointDamaged" and r["permanent"] and r["lines"] == 1
    assert "older_unloadable/step_00000004 cannot be loaded" in r["error"] and "Fix:" in r["error"]


# ------------------------------------------------------------------ relax-export ---

@pytest.mark.timeout(400)
def test_export_of_nan_weights_is_refused_naming_the_tensors(saved):
    r = saved["nan_export"]
    print(r["stderr"].strip())
    assert r["rc"] == 2, r["stderr"][-3000:]
    line = [x for x in r["stderr"].splitlines() if "non-finite weights" in x]
    assert len(line) == 1 and line[0].startswith("relax-export: checkpoint ")
    for name in ("decoder.layers.1.mlp.linear_fc2.weight (3072 of 16384", "output_layer.weight (3072 of 8192"):
        assert name in line[0]
    assert "has no manifest.sha256" in r["stderr"]  # an older checkpoint: exported only after a warning
    assert r["out_kept"] and r["left"] == []  # --force replaced nothing, no staging directory is left


def _export(argv, monkeypatch, capsys) -> tuple[int, str]:
    from relax_hpc.train.export_cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # export() sets it in this process
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


@pytest.mark.timeout(400)
def test_export_refuses_a_damaged_checkpoint_naming_the_file_before_building(saved, tmp_path, monkeypatch, capsys):
    """Checked against the manifest before megatron is imported: a flipped bit, a truncated file (with a manifest,
    and without one: an older checkpoint's sizes), a deleted manifest."""
    megatron_before = "megatron.core" in sys.modules
    runs = {}
    for name in ("flipped", "truncated", "older_truncated", "no_manifest"):
        runs[name] = copy_run(saved["run"], tmp_path / name)
    s4 = "checkpoints/step_00000004"
    flipped = flip_byte(runs["flipped"] / s4)
    truncated = truncate(runs["truncated"] / s4 / "__0_0.distcp")
    older_truncated = truncate(as_older(runs["older_truncated"] / s4) / "__0_0.distcp")
    (runs["no_manifest"] / s4 / "manifest.sha256").unlink(missing_ok=True)
    for name, named in (("flipped", f"{flipped} ("), ("truncated", f"{truncated} (100000 bytes) has sha256"),
                        ("older_truncated", f"{older_truncated} is truncated (100000 bytes"),
                        ("no_manifest", f"{runs['no_manifest'] / s4 / 'manifest.sha256'} is missing")):
        out = tmp_path / f"out_{name}"
        rc, err = _export([runs[name], out], monkeypatch, capsys)
        print(f"[export {name}] {err.strip()}")
        assert rc == 2 and named in err, err
        assert "is damaged" in err and "--step one of 2" in err  # the other complete checkpoint
        assert not out.exists()
    assert megatron_before or "megatron.core" not in sys.modules  # refused before the model's build


@pytest.mark.timeout(400)
def test_force_onto_the_model_or_an_input_is_refused_and_nothing_deleted(saved, tmp_path, monkeypatch, capsys):
    model = Path(shutil.copytree(saved["model"], tmp_path / "models" / "base"))  # a copy: the fixture's is shared
    run = make_run(tmp_path, str(model))
    shutil.copytree(saved["run"] / "checkpoints", run / "checkpoints")
    before_model, before_run = snapshot(model), snapshot(run)
    for out, says in ((model, f"OUT_DIR {model} is the run's model directory"),
                      (model.parent, f"OUT_DIR {model.parent} holds {model}"),
                      (run, f"OUT_DIR {run} is the run directory"),
                      (run.parent, f"OUT_DIR {run.parent} holds {run}"),
                      (run / "checkpoints", f"OUT_DIR {run / 'checkpoints'} holds"),
                      (run / "checkpoints" / "step_00000002", "is inside the run's checkpoints")):
        rc, err = _export([run, out, "--force"], monkeypatch, capsys)
        assert rc == 2 and says in err and "Fix:" in err, err
    assert snapshot(model) == before_model and snapshot(run) == before_run


def _start(run: Path, step: int, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "relax_hpc.train.export_cli", str(run), str(out), "--step",
                             str(step)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=out.parent, start_new_session=True)


def _past_plan(p: subprocess.Popen) -> str:
    """Block until the export printed its plan line (it found OUT_DIR empty and goes on to export)."""
    line = p.stdout.readline()
    assert line.startswith("relax-export: run "), f"no plan line (rc {p.wait()}): {line!r}"
    return line


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_concurrent_exports_into_one_directory_never_mix(saved, tmp_path):
    """Two real relax-export processes, step 2 and step 4, into one empty OUT_DIR, both past their checks before
    either writes (the first is stopped until the second has checked). One is there whole, its weights those of
    the step its relax_export.json names; the other is refused, naming OUT_DIR; no staging directory is left."""
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    out.mkdir()
    a = _start(saved["run"], 2, out)
    procs, errors, rcs = {2: a}, {}, {}
    try:
        _past_plan(a)
        os.kill(a.pid, signal.SIGSTOP)
        procs[4] = b = _start(saved["run"], 4, out)
        _past_plan(b)
        os.kill(a.pid, signal.SIGCONT)
        for s, p in procs.items():
            errors[s] = p.communicate(timeout=500)[1]
            rcs[s] = p.returncode
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    print(f"[concurrent exports] exit codes {rcs}\n" + "\n".join(
        x for e in errors.values() for x in e.splitlines() if x.startswith("relax-export")))
    assert sorted(rcs.values()) == [0, 2], (rcs, errors)
    won = next(s for s, rc in rcs.items() if rc == 0)
    lost = next(s for s, rc in rcs.items() if rc == 2)
    assert f"OUT_DIR {out} was filled by another export" in errors[lost]
    assert f"step {won}" in errors[lost]  # names what OUT_DIR holds now
    prov = json.loads((out / "relax_export.json").read_text())
    assert prov["step"] == won
    weights = load_file(out / "model.safetensors")
    assert weights["model.norm.weight"].unique().tolist() == [float(won)]  # the weights are that step's
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf.")] == []


if __name__ == "__main__":  # the worker of the fixture above
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import worker

    worker.run(integrity=job_integrity, integrity_tp2=job_integrity_tp2)
