"""The real recipes (Qwen3-4B on dapo-math-17k) and the data tool they start from.

- ``tools/prepare-data dapo-math`` on small files of the hub's two layouts (BytedTsinghua's parquet, with its
  repeated rows; zhuzilin's JSONL), and a bad row refused by number with nothing written.
- Both recipes pass ``relax-submit --dry-run`` against a GPU cluster: the suite's second dev cluster, of nodes
  with 64 CPUs and 8 fake GPUs each (``gpu_slurm_cluster``, tests/conftest.py), and print srun lines that say
  where each role runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "prepare-data"
PROMPT = "Solve the following math problem step by step. The last line of your response should be of the form " \
         "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\nRemember to put " \
         "your answer on its own line after \"Answer:\"."


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)


def hub_parquet(path: Path, questions: list[tuple[str, str]], repeat: int = 3) -> Path:
    """BytedTsinghua-SIA/DAPO-Math-17k's layout: data/dapo-math-17k.parquet, every problem repeated."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "math_dapo", "prompt": [{"content": PROMPT.format(q=q), "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"idx-{i}"}} for _ in range(repeat) for i, (q, a) in enumerate(questions)]
    (path / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), path / "data" / "dapo-math-17k.parquet")
    return path


QUESTIONS = [("What is $2+3$?", "5"), ("Find $x$ if $2x=14$.", "7"), ("What is $10-4$?", "6")]


def test_prepare_data_reads_both_hub_layouts(tmp_path):
    src = hub_parquet(tmp_path / "DAPO-Math-17k", QUESTIONS)
    out = tmp_path / "dapo.jsonl"
    p = prepare("dapo-math", str(src), str(out))
    assert p.returncode == 0, p.stderr
    assert "3 records (9 rows read, 6 repeated prompts left out)" in p.stdout, p.stdout
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["label"] for r in recs] == ["5", "7", "6"]
    assert recs[0]["prompt"] == [{"role": "user", "content": PROMPT.format(q="What is $2+3$?")}]
    assert recs[1]["metadata"] == {"data_source": "math_dapo", "index": "idx-1"}
    # zhuzilin/dapo-math-17k (Relax's copy) is already prompt + label: it passes through
    z = tmp_path / "dapo-math-17k.jsonl"
    z.write_text("".join(json.dumps({"prompt": r["prompt"], "label": r["label"]}) + "\n" for r in recs))
    p = prepare("dapo-math", str(z), str(tmp_path / "z.jsonl"), "--limit", "2")
    assert p.returncode == 0, p.stderr
    assert [json.loads(x)["label"] for x in (tmp_path / "z.jsonl").read_text().splitlines()] == ["5", "7"]
    # a row without an answer: refused by file and row, nothing written
    z.write_text(z.read_text() + json.dumps({"prompt": "What is 1+1?", "label": ""}) + "\n")
    p = prepare("dapo-math", str(z), str(tmp_path / "bad.jsonl"))
    assert p.returncode == 1 and f"{z}: row 4: no answer" in p.stderr, p.stderr
    assert not (tmp_path / "bad.jsonl").exists() and not list(tmp_path.glob("bad.jsonl*"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The recipes' inputs, small: a prepared data file and a Qwen3-shaped model with the context they ask."""
    d = tmp_path_factory.mktemp("real-recipes")
    assert prepare("dapo-math", str(hub_parquet(d / "hub", QUESTIONS)), str(d / "dapo.jsonl")).returncode == 0
    from tests.weights.conftest import make_tiny_model

    model = make_tiny_model(d / "qwen3", arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, seed=0,
                            max_pos=20480)
    return model, d / "dapo.jsonl"


@pytest.mark.slurm
@pytest.mark.parametrize("recipe,steps", [
    ("qwen3-4b-dapo-8gpu.yaml", ["relax_hpc.roles.actor", "relax_hpc.roles.rollout", "relax_hpc.roles.engine"]),
    ("qwen3-4b-dapo-async-2node.yaml", ["relax_hpc.roles.actor", "relax_hpc.roles.rollout", "relax_hpc.roles.engine",
                                        "relax_hpc.roles.engine"]),
])
def test_the_real_recipes_pass_a_dry_run_on_a_gpu_cluster(gpu_slurm_cluster, prepared, recipe, steps, tmp_path):
    model, data = prepared
    p = subprocess.run([str(REPO / ".venv" / "bin" / "relax-submit"), "--dry-run", str(REPO / "recipes" / recipe),
                        f"model.path={model}", f"data.path={data}", "slurm.partition=debug",
                        f"run.runs_root={tmp_path / 'runs'}"],
                       capture_output=True, text=True, env=gpu_slurm_cluster, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert "#SBATCH --gpus-per-node=8" in out and "nothing submitted" in out, out
    sruns = [x for x in out.splitlines() if x.startswith("srun ")]
    assert [next(s for s in steps if s in x) for x in sruns] == steps, sruns
    if recipe.startswith("qwen3-4b-dapo-8gpu"):  # colocate: one node, the engine's step overlaps the actor's
        assert out.count("#SBATCH --nodes=1") == 1 and "--overlap" in sruns[2] and "--gres=gpu:8" in sruns[2]
    else:  # fully async: two components, 2 engines of TP 4 on the rollout node
        assert out.count("#SBATCH --nodes=1") == 2
        assert all("--het-group=1" in x and "--gres=gpu:4" in x for x in sruns[2:]) and "engine1" in sruns[3], sruns
    assert not list((tmp_path / "runs").glob("*")), "a dry run creates nothing"
