"""``relax-submit --dry-run`` prints the memory plan (issue 40, "Must show"): the 8-GPU Qwen3-4B recipe with Qwen3-4B's
config.json fits 80 GB cards with trainer offload, is refused without it and on 24 GB cards, naming memory; exit 2
and nothing created. ``--render-only`` (no Slurm here) is the dry run that can reach exit 0 for an 8-GPU recipe on
this machine; the plain dry run refuses the memory plan through the file checks, with the place's own problems."""

from __future__ import annotations

import json

from .conftest import REPO, cli

EIGHT_GPU = REPO / "recipes" / "qwen3-4b-dapo-8gpu.yaml"
QWEN3_4B = REPO / "tests" / "recipe" / "data" / "qwen3-4b"
ARGS = [f"model.path={QWEN3_4B}", "data.path=/cluster/data/dapo.jsonl", "slurm.partition=gpu"]


def dry(tmp_path, env, *overrides, render_only=True, json_out=False):
    flags = ["--dry-run"] + (["--render-only"] if render_only else []) + (["--json"] if json_out else [])
    return cli("relax-submit", *flags, str(EIGHT_GPU), *ARGS, *overrides, cwd=tmp_path, env=env)


def test_the_8gpu_recipe_fits_80gb_cards_with_trainer_offload(no_slurm_env, tmp_path):
    p = dry(tmp_path, no_slurm_env)  # the recipe says train.offload: true, slurm.gpu_memory_gb: 80
    assert p.returncode == 0, p.stderr
    assert "# ---------------- memory plan: one GPU, GiB" in p.stdout
    table = p.stdout.split("memory plan")[1]
    assert "generate" in table and "train" in table and "sync" in table and "rollout static" in table
    assert "# verdict: fits: peak" in p.stdout and "of 80 GiB" in p.stdout
    assert not (tmp_path / "runs").exists()
    d = json.loads(dry(tmp_path, no_slurm_env, json_out=True).stdout)
    assert d["memory_plan"]["fits"] is True and d["memory_plan"]["card_gib"] == 80


def test_without_trainer_offload_80gb_cards_are_refused_naming_memory(no_slurm_env, tmp_path):
    p = dry(tmp_path, no_slurm_env, "train.offload=false")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "  - slurm.gpu_memory_gb = 80.0: the memory plan does not fit: in phase 'generate'" in p.stderr
    assert "train.offload: true" in p.stderr and "nothing was submitted" in p.stderr
    assert not (tmp_path / "runs").exists()
    # the plain dry run (a local run here: no Slurm) refuses it through the file checks, beside the GPU count
    p = dry(tmp_path, no_slurm_env, "train.offload=false", render_only=False)
    assert p.returncode == 2 and "the memory plan does not fit" in p.stderr, p.stderr


def test_24gb_cards_are_refused(no_slurm_env, tmp_path):
    p = dry(tmp_path, no_slurm_env, "slurm.gpu_memory_gb=24")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "the memory plan does not fit: in phase 'train'" in p.stderr and "over the card's 24 GiB" in p.stderr
    assert not (tmp_path / "runs").exists()


def test_without_the_card_memory_the_plan_is_printed_without_a_verdict(no_slurm_env, tmp_path):
    p = dry(tmp_path, no_slurm_env, "slurm.gpu_memory_gb=null", "train.offload=false")
    assert p.returncode == 0, p.stderr
    assert "# verdict: none: the card's memory is unknown. Set slurm.gpu_memory_gb" in p.stdout
