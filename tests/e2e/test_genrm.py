"""recipes/genrm-slurm.yaml on the dev cluster: the judge runs in its own het component, rollout's reward asks it
about every answer, and the calls are counted per step (genrm/requests, genrm/errors, genrm/latency_p50)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_hpc.rundir import RunDir

from .conftest import REPO, follow_slurm, make_tiny_model, metrics, quickstart_overrides, submit_slurm

STEPS = 3
PROMPTS = 4  # rollout_batch_size: each step judges at most 4 × 8 answers


@pytest.mark.slurm
@pytest.mark.slow
def test_genrm_recipe_on_slurm_counts_the_judge_calls(slurm_cluster, tmp_path, tiny_model):
    judge = make_tiny_model(tmp_path / "tiny-judge", arch="llama", hidden=64, layers=2, heads=4, kv_heads=2, seed=1,
                            max_pos=2048)
    sub = submit_slurm(REPO / "recipes" / "genrm-slurm.yaml", tmp_path, slurm_cluster.env,
                       quickstart_overrides(tiny_model, tmp_path / "runs", f"run.steps={STEPS}",
                                            f"rollout.rollout_batch_size={PROMPTS}", f"genrm.model_path={judge}",
                                            "rollout.custom_rm_path=relax_hpc.tasks.arith.judged_reward"))
    job, run_dir = sub["job_id"], Path(sub["run_dir"])
    st, seen = follow_slurm(sub, tmp_path, slurm_cluster.env, 3, 600)
    assert st.get("state") == "COMPLETED", st
    assert seen == {f"{job}+{k}" for k in range(3)}, "actor, rollout and genrm never ran at once"
    ctl = json.loads((run_dir / "state.json").read_text())
    assert len({ctl["roles"][r]["het_group"] for r in ("actor", "rollout", "genrm")}) == 3
    assert list(ctl["judges"]) == ["judge0"] and ctl["judges"]["judge0"]["url"].startswith("http://")
    assert ctl["judges"]["judge0"]["node"] not in {ctl["roles"]["rollout"]["nodes"][0], ctl["roles"]["actor"]["nodes"][0]}
    rows = metrics(RunDir(run_dir))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        # one call per answer the rule can read (an empty response has none, and costs no call)
        assert 0 < r["genrm/requests"] <= PROMPTS * 8, r
        assert r["genrm/errors"] == 0 and r["genrm/latency_p50"] > 0, r
        assert 0.0 <= r["rollout/judge/mean"] <= 1.0 and 0.0 <= r["rollout/judge_agrees/mean"] <= 1.0
