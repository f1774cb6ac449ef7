"""Relax's own Qwen3-4B text scripts, converted: the 8-GPU colocate one (run-qwen3-4B-8xgpu.sh) and the 4-GPU fully
async one with reference and actor_fwd (run-qwen3-4B-4xgpu-async.sh), each with the model's MODEL_ARGS
(scripts/models/qwen3-4B.sh). Our copies of their flags are in relax_scripts/, their shell variables unexpanded.

- ``relax-submit --from-relax-args`` prints a recipe for each that validates, with each role sized from
  ``--resource`` and every flag either on its key or named in the header with the reason.
- Both printed recipes pass ``relax-submit --dry-run`` against a cluster of 8-GPU nodes: the suite's
  (``gpu_slurm_cluster``, tests/conftest.py: four nodes of 8 fake GPUs and 64 CPUs), with a
  tiny Qwen3-shaped model and a prepared data file where the scripts' $MODEL_DIR and $DATA_DIR point.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relax_hpc.recipe import recipe_from_dict
from relax_hpc.recipe.from_relax import convert

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "relax_scripts"
COLOCATE, ASYNC = "run-qwen3-4B-8xgpu.args", "run-qwen3-4B-4xgpu-async.args"


def script_flags(name: str, model_dir: str = "/models", data_dir: str = "/data") -> list[str]:
    """MODEL_ARGS then the script's own flags, as the script passes them (its variables set as a user would)."""
    env = {"MODEL_DIR": model_dir, "DATA_DIR": data_dir, "EXP_DIR": "/exps", "PROJECT_NAME": "Relax/dev/dapo-math",
           "now": "2026-12-07-06:00:00"}
    words = []
    for f in ("qwen3-4B.args", name):
        text = (SCRIPTS / f).read_text()
        for k, v in env.items():
            text = text.replace("${%s}" % k, v)
        words += shlex.split(text, comments=True)
    assert not [w for w in words if "$" in w], "a variable left unexpanded"
    return words


def said(notes: list[str], flag: str) -> str:
    hits = [n for n in notes if n.startswith(flag)]
    assert hits, f"{flag} is neither carried over nor named in the header"
    return hits[0]


def test_the_colocate_script_becomes_an_8_gpu_recipe():
    """--resource actor/rollout [1, 8] with --colocate and --rollout-num-gpus-per-engine 8: the actor's 8 ranks
    (TP 2 × DP 4, which the validator refused when the actor got one rank) and one engine of TP 8 on the same
    GPUs; bf16; every other flag on its key or in the header."""
    data, notes = convert(script_flags(COLOCATE))
    r = recipe_from_dict(data)  # validates
    assert (r.roles.actor.nodes, r.roles.actor.gpus_per_node, r.roles.actor.tasks_per_node) == (1, 8, 8)
    ro = r.roles.rollout
    assert (ro.share_with, ro.gpus_per_node, ro.tasks_per_node) == ("actor", 8, 1)  # one engine, TP 8 / 1
    assert (r.mode, r.train.tp, r.train.sequence_parallel, r.train.bf16) == ("colocate", 2, True, True)
    assert (r.train.max_tokens_per_micro_batch, r.train.logprob_max_tokens_per_micro_batch) == (10240, 30720)
    assert r.algorithm.calculate_per_token_loss and r.rollout.engine.args == ["--mem-fraction-static", "0.8"]
    assert r.rollout.engine.offload and r.forward is None and not r.roles.reference.enabled
    assert r.train.balance_data  # Relax's --balance-data
    assert "--resource" not in " ".join(n for n in notes if "not in relax_hpc's table" in n)
    assert "not in relax_hpc's table" not in "\n".join(notes), [n for n in notes if "table" in n]
    assert "the model's architecture" in said(notes, "--swiglu --num-layers 36")


def test_the_async_script_becomes_a_recipe_with_forward_roles_of_their_own_layout():
    """--resource with reference and actor_fwd of one GPU each, and --ref-actor-config's TP 1 without sequence
    parallelism: forward.*; advantages [1, 0] and --num-iters-per-train-update named with the reason."""
    data, notes = convert(script_flags(ASYNC))
    r = recipe_from_dict(data)
    assert r.mode == "fully_async" and r.max_staleness == 1
    for role in ("actor", "rollout", "reference", "actor_fwd"):
        g = r.role(role)
        assert (g.enabled, g.nodes, g.gpus_per_node, g.tasks_per_node, g.share_with) == (True, 1, 1, 1, None), role
    assert (r.forward.tp, r.forward.sequence_parallel, r.forward.max_tokens_per_micro_batch) == (1, False, None)
    assert "Relax reads it only with --use-dynamic-batch-size" in said(notes, "--ref-actor-config max_tokens_per_gpu")
    assert "always so" in said(notes, "--ref-actor-config only_load_weight")
    assert "not supported" in said(notes, "--num-iters-per-train-update 2")
    assert "beside the controller" in said(notes, "--resource advantages")
    assert "4 nodes in all" in said(notes, "roles actor, reference, actor_fwd, rollout")
    assert r.algorithm.use_kl_loss  # a reference is there: Relax computes (and logs) the KL term of weight 0
    for flag in ("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"):
        key = flag.removeprefix("--").replace("-", "_")
        assert getattr(r.train, key, None) is True or "left out" in said(notes, flag), flag
    assert "not in relax_hpc's table" not in "\n".join(notes)


def test_the_printed_recipes_say_what_they_left_out_and_load(tmp_path):
    for name in (COLOCATE, ASYNC):
        p = subprocess.run([sys.executable, "-m", "relax_hpc.launch.cli", "--from-relax-args", *script_flags(name)],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        head = [x for x in p.stdout.splitlines() if x.startswith("#")]
        assert shlex.split(head[1].removeprefix("#   ")) == script_flags(name)  # the flags, quoted to paste back
        assert any("--use-health-check: always on in relax_hpc" in x for x in head)
        recipe_from_dict(yaml.safe_load(p.stdout))


@pytest.fixture(scope="module")
def script_dirs(tmp_path_factory):
    """$MODEL_DIR/Qwen3-4B: a tiny Qwen3-shaped model with the context the scripts ask; $DATA_DIR's dapo-math-17k and
    aime-2024 files in the layout the scripts name."""
    from tests.weights.conftest import make_tiny_model

    d = tmp_path_factory.mktemp("relax-scripts")
    make_tiny_model(d / "models" / "Qwen3-4B", arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, seed=0,
                    max_pos=32768)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "label": str(a + b)}
            for a, b in ((2, 3), (4, 1), (7, 2))]
    for rel in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl"):
        (d / "data" / rel).parent.mkdir(parents=True)
        (d / "data" / rel).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.mark.slurm
@pytest.mark.parametrize("name,steps", [
    (COLOCATE, ["relax_hpc.roles.actor", "relax_hpc.roles.rollout", "relax_hpc.roles.engine"]),
    (ASYNC, ["relax_hpc.roles.actor", "relax_hpc.roles.rollout", "relax_hpc.roles.reference",
             "relax_hpc.roles.actor_fwd", "relax_hpc.roles.engine"]),
])
def test_the_printed_recipes_pass_a_dry_run_on_8_gpu_nodes(gpu_slurm_cluster, script_dirs, name, steps, tmp_path):
    flags = script_flags(name, model_dir=str(script_dirs / "models"), data_dir=str(script_dirs / "data"))
    p = subprocess.run([sys.executable, "-m", "relax_hpc.launch.cli", "--from-relax-args", *flags], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    recipe = tmp_path / "from-relax.yaml"
    recipe.write_text(p.stdout)
    p = subprocess.run([str(REPO / ".venv" / "bin" / "relax-submit"), "--dry-run", str(recipe), "slurm.partition=debug",
                        f"run.runs_root={tmp_path / 'runs'}"],
                       capture_output=True, text=True, env=gpu_slurm_cluster, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert "nothing submitted" in out and "Executor: slurm" in out
    sruns = [x for x in out.splitlines() if x.startswith("srun ")]
    assert sorted(next(s for s in steps if s + " " in x + " " or s in x.split()) for x in sruns) == sorted(steps)
    if name == COLOCATE:  # one component, one node: the engine's step overlaps the actor's 8 ranks, on all 8 GPUs
        assert out.count("#SBATCH hetjob") == 0 and "#SBATCH --gpus-per-node=8" in out
        assert "--ntasks=8" in sruns[0] and "--overlap" in sruns[-1] and "--gres=gpu:8" in sruns[-1], sruns
    else:  # four components of one node and one GPU each
        assert out.count("#SBATCH hetjob") == 3 and out.count("#SBATCH --gpus-per-node=1") == 4, out
        megatron = [x for x in sruns if any(f"relax_hpc.roles.{r} " in x + " " for r in ("actor", "reference",
                                                                                       "actor_fwd"))]
        assert len(megatron) == 3 and not any("--overlap" in x for x in megatron), sruns  # GPUs of their own
        assert sorted(x.split()[1] for x in sruns[:-1]) == [f"--het-group={k}" for k in range(4)], sruns
        assert "--gres=gpu:1" in sruns[-1], sruns  # the engine: TP 1
    assert not list((tmp_path / "runs").glob("*")), "a dry run creates nothing"
