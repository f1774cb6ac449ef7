"""tools/gpu-check and tools/bench/actor_gpu.py on a machine without a GPU (CI): what can be checked without one.

The GPU itself is checked where one is lent (docs/gpu.md). Here: the no-CUDA paths say so and write nothing; the
plan lists the gpu tests and decides each wheel right; ``--cpu-dry-run`` runs every stage of gpu-check, the
benchmark at its ``--cpu-smoke`` shape (the same code path as on a card: actor against transformers, fp32, gloo),
whose numbers must agree where they must; the docs section is rewritten in place; the pins are the project's.
CUDA is hidden from every child (``CUDA_VISIBLE_DEVICES=""``), so on a GPU machine these test the same paths.
"""

from __future__ import annotations

import configparser
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_CHECK = REPO / "tools" / "gpu-check"
BENCH = REPO / "tools" / "bench" / "actor_gpu.py"
NEW_GPU_TESTS = ["test_sdpa_attention_matches_unfused_on_cuda", "test_packed_logprobs_match_padded_on_cuda_bf16",
                 "test_real_shape_trains_bf16_packed", "test_gpu_parity_train_resume"]


def load(path: Path, name: str):
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gc():
    return load(GPU_CHECK, "gpu_check")


def run(*args, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_actor_gpu_without_cuda_says_so_and_writes_nothing():
    docs, result = REPO / "docs" / "benchmarks.md", REPO / "tools" / "bench" / "results" / "actor_gpu.json"
    before = digest(docs), digest(result)
    p = run(REPO / "tools" / "bench" / "run", "--only", "actor-gpu")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "actor-gpu needs a CUDA GPU" in p.stdout and "nothing written" in p.stdout, p.stdout
    assert (digest(docs), digest(result)) == before  # neither the docs nor a result touched


def test_gpu_check_plan_and_no_cuda(gc, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    from transformers import __version__ as have_tf

    for name in (f"transformers-{have_tf}-py3-none-any.whl",  # the version installed here: skipped
                 "tokenizers-0.99.0-cp39-abi3-manylinux_2_17_x86_64.whl",  # another version: installed
                 "relax_nosuch_pkg-1.0-py3-none-any.whl",  # absent here: installed
                 "antlr4-python3-runtime-4.9.3.tar.gz"):  # an sdist cannot go in
        (wheels / name).write_bytes(b"")
    p = run(GPU_CHECK, "--plan", "--json", "--wheels", wheels)
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    w = plan["wheels"]
    assert [e["name"] for e in w["skip"]] == ["transformers"]
    assert sorted(e["name"] for e in w["install"]) == ["relax-nosuch-pkg", "tokenizers"]
    assert w["missing"] == []  # every pin is installed here at its version (the CI venv is the reference)
    assert len(w["errors"]) == 1 and "sdist" in w["errors"][0]
    assert plan["cuda"] is False
    assert plan["torch"]["ok"] and plan["torch"]["pinned"] == gc.torch_pin()  # this venv's torch is the pinned one
    assert plan["memory"]["test"] == "tests/recipe/test_memory_plan_gpu.py" in plan["test_files"]
    assert "tests/train/test_gpu.py" in plan["test_files"]
    ids = [t.split("::")[-1] for t in plan["tests"]]
    assert all(t in ids for t in NEW_GPU_TESTS), plan["tests"]
    assert "test_real_sglang_engine" in ids and not any("test_train_step" in t for t in plan["tests"])

    # the run itself stops at its first stage, says why, installs nothing and still leaves its result
    out, site = tmp_path / "out", tmp_path / "site"
    p = run(GPU_CHECK, "--wheels", wheels, "--site", site, "--out", out)
    assert p.returncode == 1
    assert "no CUDA device" in p.stdout and "torch.cuda.is_available() is False" in p.stdout, p.stdout
    res = json.loads((out / "gpu-check.json").read_text())
    assert res["ok"] is False and [s["name"] for s in res["stages"]] == ["cuda"]
    assert not site.exists()


def stand_in_sglang(root: Path, version: str) -> Path:
    """An interpreter that has SGLang ``version`` installed (its metadata only) and sets its own PYTHONPATH, as an
    SGLang venv's python: what the sglang stage finds, wraps and hands the SGLang tests (which skip without CUDA)."""
    info = root / "site" / f"sglang-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    py = root / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH={root / "site"} exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return py


def test_gpu_check_cpu_dry_run_every_stage_and_the_bench(gc, tmp_path):
    """Every stage of gpu-check on this CPU (the bench at its smoke shape), then the docs table from its result."""
    empty, out = tmp_path / "wheels", tmp_path / "out"
    empty.mkdir()
    sgl = stand_in_sglang(tmp_path / "sgl", gc.sglang_pin())
    p = run(GPU_CHECK, "--cpu-dry-run", "--wheels", empty, "--site", tmp_path / "site", "--out", out,
            "--sglang-python", sgl, "--sglang-site", tmp_path / "sglang-site", timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.loads((out / "gpu-check.json").read_text())
    assert res["ok"] and res["dry_run"]
    assert [s["name"] for s in res["stages"]] == ["cuda", "wheels", "imports", "tests", "sglang", "memory", "bench",
                                                  "handover"]
    stages = {s["name"]: s for s in res["stages"]}
    # the pinned torch ran (this venv's), and the memory test ran in the tests stage and skipped (no CUDA)
    assert stages["cuda"]["detail"]["torch_pinned"] is True and res["torch"]["torch_pin"] == gc.torch_pin()
    assert stages["memory"]["detail"]["measured"] is False and "CPU dry run" in stages["memory"]["detail"]["why"]
    pins = {n: v for n, v, _, _ in gc.PINS}
    assert {n: stages["imports"]["detail"]["versions"][n] for n in pins} == pins
    cases = {c["id"].split("::")[-1]: c for c in stages["tests"]["detail"]["cases"]}
    assert all(cases[t]["status"] == "skipped" for t in NEW_GPU_TESTS)  # no CUDA here
    # the sglang stage: the stand-in found, wrapped (no PYTHONPATH of ours), the SGLang tests run (skipped: no CUDA)
    g = stages["sglang"]["detail"]
    assert g["available"] and g["version"] == gc.sglang_pin() and g["python"] == str(sgl)
    assert "unset PYTHONPATH" in Path(g["wrapper"]).read_text()
    assert {c["id"].split("::")[-1] for c in g["cases"]} == {
        "test_generate_with_routed_experts", "test_release_and_resume_memory", "test_colocate_handover_by_cuda_ipc",
        "test_weight_sync_over_nccl", "test_real_sglang_engine"}, g["cases"]
    assert g["tests"] == g["skipped"] == 5
    assert {f.name for f in out.iterdir()} == {"gpu-check.json", "gpu-check.log", "actor_gpu.json", "handover_gpu.json",
                                               "pytest-gpu.xml", "pytest-sglang.xml"}
    # the colocate step (tools/bench/handover_gpu.py): its parts within the step, the pushes' figures on one basis
    h = json.loads((out / "handover_gpu.json").read_text())
    st, push = h["step"], h["push"]
    assert st["generate_s"] + st["release_s"] + st["train_s"] + st["resume_s"] + st["push_s"] <= st["step_s"] * 1.001
    assert st["idle_share"] == pytest.approx(1 - (st["generate_s"] + st["train_s"] + st["push_s"]) / st["step_s"])
    assert push["transfer_gbps"] == pytest.approx(push["bytes"] / push["transfer_s"] / 1e9)
    assert push["transfer_over_copy"] == pytest.approx(push["transfer_s"] / push["device_copy_s"])
    assert push["tensors"] > 0 and push["transfer_s"] <= push["sync_s"] and h["targets"]["transfer <= 10 ms"] is None

    r = json.loads((out / "actor_gpu.json").read_text())
    bench = load(BENCH, "actor_gpu")
    b = bench.SHAPES["cpu-smoke"]["batch"]
    batch = bench.make_batch(b["n"], b["group"], b["prompt"], tuple(b["response"]), vocab=128, seed=0)
    assert r["batch"]["lengths"] == [s.tokens.numel() for s in batch]
    assert r["batch"]["real_tokens"] == sum(r["batch"]["lengths"])
    for k in ("relax_train", "hf_train", "relax_logprobs", "hf_logprobs"):
        assert r[k]["tokens_per_s"] == pytest.approx(r["batch"]["real_tokens"] / r[k]["time_s"])
    assert r["ratio_train"] == pytest.approx(r["hf_train"]["time_s"] / r["relax_train"]["time_s"])
    # fp32, the same weights: the actor's first pass and transformers' agree token for token, and the first step's
    # gradient (same loss, same weights per micro-batch, same data) has the same norm
    d = r["logprob_diff"]
    assert d["tokens"] == sum(n - b["prompt"] for n in r["batch"]["lengths"])
    assert d["max"] <= 1e-4 and d["within"], d
    fs = r["first_step"]
    assert fs["relax"]["grad_norm"] == pytest.approx(fs["hf"]["grad_norm"], rel=1e-4), fs
    assert r["nonfinite_steps"] == 0 and 0 < r["hf_padding_share"] < 1

    # the docs: the GPU section replaced, in place, everything else as it was
    docs = tmp_path / "benchmarks.md"
    docs.write_text((REPO / "docs" / "benchmarks.md").read_text())
    for _ in range(2):  # twice: a rewrite finds its own section
        p = run(BENCH, "--from-json", out / "actor_gpu.json", "--docs", docs)
        assert p.returncode == 0, p.stderr
    text = docs.read_text()
    assert text.count("\n## GPU\n") == 1
    gpu = re.search(r"^## GPU\n.*?(?=^##+ )", text, re.S | re.M).group(0)
    assert r["card"] in gpu and "| relax_hpc `MegatronActor.train_step`" in gpu and r["date"] in gpu
    assert f"**{r['ratio_train']:.2f}×**" in gpu
    orig = (REPO / "docs" / "benchmarks.md").read_text()
    strip = re.compile(r"^## GPU\n.*?(?=^##+ )", re.S | re.M)
    assert strip.sub("", text) == strip.sub("", orig)


def test_wheel_names_and_tags(gc):
    assert gc.wheel_name(Path("megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl")) \
        == ("megatron-core", "0.16.1")
    assert gc.wheel_name(Path("foo-1.0-1-py3-none-any.whl")) == ("foo", "1.0")  # a build tag
    with pytest.raises(ValueError):
        gc.wheel_name(Path("foo-1.0.tar.gz"))
    ok = ["transformers-4.57.6-py3-none-any.whl", "tokenizers-0.22.2-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
          "crc32c-2.9.post0-cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64.whl",
          "requests_oauthlib-2.0.0-py2.py3-none-any.whl"]
    bad = ["crc32c-2.9.post0-cp311-cp311-manylinux_2_28_x86_64.whl", "x-1-cp312-cp312-macosx_11_0_arm64.whl",
           "x-1-cp312-cp312-manylinux_2_28_aarch64.whl", "x-1-cp313-abi3-manylinux_2_28_x86_64.whl"]
    assert [gc.compatible(f) for f in ok] == [True] * 4
    assert [gc.compatible(f) for f in bad] == [False] * 4


def test_only_sglang_tests_may_skip_on_a_gpu(gc):
    cases = [{"id": "a::test_x", "status": "passed", "why": None},
             {"id": "b::test_real_sglang_engine", "status": "skipped", "why": "needs RELAX_SGLANG_PYTHON: an "
                                                                                "interpreter that can `import sglang`"},
             {"id": "c::test_real_shape", "status": "skipped", "why": "needs a CUDA GPU"}]
    assert gc.judge_skips(cases, dry=False) == (["b::test_real_sglang_engine"], ["c::test_real_shape (needs a CUDA GPU)"])
    assert gc.judge_skips(cases, dry=True) == (["b::test_real_sglang_engine"], [])


def test_pins_are_the_projects(gc):
    """Every wheel gpu-check brings satisfies the project's own requirement for it (requirements-cpu.txt,
    setup.cfg, requirements-pins.txt: tools/install's); transformers stays < 5 and huggingface-hub < 1 (the image's are newer)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    reqs = {}
    lines = (REPO / "requirements-cpu.txt").read_text().splitlines()
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines += cfg["options"]["install_requires"].splitlines()
    lines += (REPO / "requirements-pins.txt").read_text().splitlines()  # tools/install's pins (megatron-bridge, ...)
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            r = Requirement(line)
            reqs.setdefault(gc.norm(r.name), []).append(r.specifier)
    pins = {gc.norm(n): Version(v) for n, v, _, _ in gc.PINS}
    for name, v in pins.items():
        for spec in reqs.get(name, []):
            assert spec.contains(v), f"{name}=={v} is not {spec} ({name} in the project's requirements)"
    # the GPU path's packages that such an image lacks or holds at another version are all brought
    assert {"megatron-core", "megatron-bridge", "transformers", "huggingface-hub", "tokenizers", "omegaconf",
            "antlr4-python3-runtime"} <= set(pins)
    assert pins["transformers"] < Version("5") and pins["huggingface-hub"] < Version("1")
    assert [n for n, _, kind, _ in gc.PINS if kind == "sdist"] == ["antlr4-python3-runtime"]


def test_gpu_check_plan_lists_the_sglang_stage_and_its_budget(tmp_path):
    sgl = stand_in_sglang(tmp_path / "sgl", "0.5.23")
    p = run(GPU_CHECK, "--plan", "--sglang-python", sgl, "--sglang-reserve", "180")
    assert p.returncode == 0, p.stderr
    assert f"sglang: stage budget 180 s; SGLang 0.5.23 pinned; --sglang-python / RELAX_SGLANG_PYTHON: {sgl}, " \
           "sglang 0.5.23" in p.stdout, p.stdout
    assert "pytest -m gpu tests/engines/test_sglang_gpu.py tests/engines/test_launcher.py::test_real_sglang_engine" \
        in p.stdout and "budget: 550 s (260 s kept for the bench, 180 s for the sglang stage)" in p.stdout


def test_sglang_stage_without_sglang_says_so_or_fails_when_required(gc, tmp_path):
    """No SGLang anywhere (no interpreter given, none in this python, no wheels): the stage passes saying why, runs
    nothing; with --require-sglang it fails naming the fix."""
    import argparse

    a = argparse.Namespace(sglang_python=None, sglang_wheels=str(tmp_path / "none"), sglang_site=str(tmp_path / "s"),
                           require_sglang=False)
    log = gc.Log(tmp_path / "log")
    got = gc.stage_sglang(a, {}, tmp_path, log, 60, dry=True)
    assert got["available"] is False and "has no sglang" in got["why"] and "no sglang wheel in" in got["why"]
    assert not (tmp_path / "s").exists() and not (tmp_path / "pytest-sglang.xml").exists()
    a.require_sglang = True
    with pytest.raises(gc.Failed, match="no SGLang here .*Fix: RELAX_SGLANG_PYTHON="):
        gc.stage_sglang(a, {}, tmp_path, log, 60, dry=True)


def test_only_the_nccl_skip_on_one_gpu_passes_the_sglang_stage(gc):
    cases = [{"id": "e::test_generate_with_routed_experts", "status": "passed", "why": None},
             {"id": "e::test_weight_sync_over_nccl", "status": "skipped", "why": "needs 2 GPUs: NCCL refuses two ranks"},
             {"id": "l::test_real_sglang_engine", "status": "skipped", "why": "needs RELAX_SGLANG_PYTHON"}]
    assert gc.judge_sglang_skips(cases, dry=False, gpus=1) == ["l::test_real_sglang_engine (needs RELAX_SGLANG_PYTHON)"]
    assert len(gc.judge_sglang_skips(cases, dry=False, gpus=2)) == 2  # with two GPUs the NCCL test must run
    assert gc.judge_sglang_skips(cases, dry=True, gpus=0) == []


def test_another_torch_than_the_pinned_one_is_refused_unless_asked_for(gc, tmp_path, monkeypatch):
    """Stage cuda checks torch against requirements-pins.txt (the GPU lock's torch): the image's 2.11 is refused,
    naming what was found, the pin and the fix; --image-torch runs with it and the result says so."""
    import torch

    pin = gc.torch_pin()
    assert pin == next(ln.split("==")[1].strip(" \\") for ln in (REPO / "requirements-lock-gpu.txt").read_text().splitlines()
                       if ln.startswith("torch=="))
    with pytest.raises(gc.Failed, match=r"torch here is 2\.11\.0\+cu130 \(at /img/torch\), not the pinned "
                                        rf"{re.escape(pin)} .*--image-torch"):
        gc.torch_check("2.11.0+cu130", "/img/torch", pin, image_torch=False)
    assert gc.torch_check("2.11.0+cu130", "/img/torch", pin, image_torch=True)["torch_pinned"] is False
    assert gc.torch_check(f"{pin}+cu130", "/img/torch", pin, image_torch=False)["torch_pinned"] is True
    # the stage itself, on this python's torch, with the pin moved away from it
    log = gc.Log(tmp_path / "log")
    monkeypatch.setattr(gc, "torch_pin", lambda: "2.11.0")
    with pytest.raises(gc.Failed, match=f"torch here is {re.escape(torch.__version__)} .*not the pinned 2.11.0"):
        gc.stage_cuda(log, dry=True)
    got = gc.stage_cuda(log, dry=True, image_torch=True)
    assert got["torch_pinned"] is False and got["torch"] == torch.__version__
    assert "--image-torch: checking with torch" in (tmp_path / "log").read_text()


def junit(path: Path, status: str, why: str = "") -> None:
    """A pytest junit report of the memory test alone, with ``status`` (what the tests stage leaves)."""
    mark = "" if status == "passed" else f'<{status} message="{why}"/>'
    path.write_text('<testsuites><testsuite tests="1" failures="%d" errors="0" skipped="%d">'
                    '<testcase classname="tests.recipe.test_memory_plan_gpu" name="test_the_memory_plan_against_'
                    'measured_peaks" time="1">%s</testcase></testsuite></testsuites>'
                    % (status == "failure", status == "skipped", mark))


def test_the_memory_stage_reports_the_comparison_and_fails_with_its_test(gc, tmp_path):
    log = gc.Log(tmp_path / "log")
    row = {"measured_mib": 1800.0, "planned_mib": 1730.0, "ratio": 1.04}
    (tmp_path / gc.MEMORY_RESULT).write_text(json.dumps({
        "card": "NVIDIA H100", "torch": "2.13.0+cu130", "params": 1.0e8, "activations": row,
        "phases": {"generate": row, "train": row, "sync (export, no buckets)": row,
                   "generate (train.offload)": {"measured_mib": 3.0, "planned_mib": 0.0, "ratio": None}}}))
    junit(tmp_path / "pytest-gpu.xml", "passed")
    got = gc.stage_memory({}, tmp_path, log, 60)
    assert got["measured"] and got["card"] == "NVIDIA H100"
    text = (tmp_path / "log").read_text()
    assert "memory plan vs measured on NVIDIA H100" in text and "1800.0" in text and "1.04" in text
    junit(tmp_path / "pytest-gpu.xml", "failure", "the state terms are off")
    with pytest.raises(gc.Failed, match="test_the_memory_plan_against_measured_peaks: failure .the state terms"):
        gc.stage_memory({}, tmp_path, log, 60)
    junit(tmp_path / "pytest-gpu.xml", "skipped", "needs a CUDA GPU")
    assert gc.stage_memory({}, tmp_path, log, 60, dry=True)["measured"] is False
    with pytest.raises(gc.Failed, match="skipped"):  # on a card the test must run
        gc.stage_memory({}, tmp_path, log, 60)
