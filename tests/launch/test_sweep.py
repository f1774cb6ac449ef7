"""relax-submit --sweep (relax_hpc.launch.sweep): the grid, the names, every point checked before anything is
submitted, the throttle as a Slurm dependency in the first #SBATCH block; on the dev cluster a 2-point sweep
shown by relax-status --sweep, and relax-cancel --sweep."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from relax_hpc.launch import sweep
from relax_hpc.launch.sweep import SweepError

from .conftest import SMOKE, cli


def test_values_split_on_top_level_commas_only():
    assert sweep.split_values("1e-6,3e-6") == ["1e-6", "3e-6"]
    assert sweep.split_values("[a,b],[c]") == ["[a,b]", "[c]"]
    assert sweep.split_values("'x,y',z") == ["'x,y'", "z"]


def test_the_grid_and_its_names():
    axes = sweep.parse_axes(["train.lr=1e-6,3e-6", "rollout.temperature=0.8,1.0"], ["run.steps=2"])
    pts = sweep.points(axes)
    assert [sweep.label(p) for p in pts] == [
        "train.lr=1e-6 rollout.temperature=0.8", "train.lr=1e-6 rollout.temperature=1.0",
        "train.lr=3e-6 rollout.temperature=0.8", "train.lr=3e-6 rollout.temperature=1.0"]
    assert sweep.slug(pts[0]) == "lr1e-6-temperature0.8"
    assert sweep.slug((("a.lr", "1"), ("b.lr", "2"))) == "a.lr1-b.lr2"  # a shared last part: the full keys
    assert sweep.slug((("data.path", "/x y/z"),)) == "path_x_y_z"  # only what a run name may hold


@pytest.mark.parametrize("specs, overrides, words", [
    (["train.lr"], [], "expected KEY=V1,V2"),
    (["train.lr=1e-6,"], [], "an empty value"),
    (["train.lr=1", "train.lr=2"], [], "given twice"),
    (["train.lr=1,2"], ["train.lr=3"], "also a plain override"),
    (["run.name=a,b"], [], "run.name cannot be swept"),
])
def test_bad_sweep_options_are_refused(specs, overrides, words):
    with pytest.raises(SweepError, match=words):
        sweep.parse_axes(specs, overrides)


def test_the_throttle_goes_in_the_first_sbatch_block_of_that_submission_only():
    sw = sweep.plan_sweep(SMOKE, [], ["train.lr=1e-6,3e-6,5e-6"], "slurm", name="t", max_running=2,
                          check_place=False)
    assert [sw.after(i) for i in range(3)] == [None, None, 0]
    after = sweep.AfterPlan(**{f: getattr(sw.plans[2], f) for f in ("recipe", "source", "overrides", "executor",
                                                                       "python", "search")}, after="41")
    script = after.script(sw.runs_root / "x")
    lines = script.splitlines()
    dep = lines.index("#SBATCH --dependency=afterany:41")
    assert dep < lines.index("#SBATCH hetjob") and script.count("--dependency") == 1
    assert "--dependency" not in sw.plans[2].script(sw.runs_root / "x")  # the recipe itself has none
    assert "dependency" not in " ".join(sw.plans[2].recipe.slurm.sbatch_extra)  # a continuation job waits for none


def test_a_bad_value_at_any_point_submits_nothing_and_names_the_point(tmp_path):
    p = cli("relax-submit", str(SMOKE), "--dry-run", "--render-only", "--sweep", "train.lr=1e-6,-3",
            "rollout.temperature=0.8", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "point 2 of 2 (train.lr=-3 rollout.temperature=0.8)" in p.stderr and "train.lr" in p.stderr
    assert "point 1 of 2" not in p.stderr and "nothing was submitted" in p.stderr
    assert not (tmp_path / "runs").exists()
    p = cli("relax-submit", str(SMOKE), "--local", "--sweep", "train.lr=1e-6,3e-6", "--sweep-max-running", "1",
            cwd=tmp_path)
    assert p.returncode == 2 and "needs Slurm" in p.stderr and not (tmp_path / "runs").exists()


def test_dry_run_lists_each_point_and_what_it_waits_for(tmp_path):
    p = cli("relax-submit", str(SMOKE), "--dry-run", "--render-only", "--json", "--sweep", "train.lr=1e-6,3e-6",
            "rollout.temperature=0.8,1.0", "--sweep-max-running", "3", "--sweep-name", "grid", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["sweep"] == "grid" and [x["after_point"] for x in d["points"]] == [None, None, None, 1]
    assert [x["run_name"] for x in d["points"]][-1] == "smoke-lr3e-6-temperature1.0"
    assert not (tmp_path / "runs").exists()


def test_status_of_an_unknown_sweep_says_what_exists(tmp_path):
    (tmp_path / "runs" / "sweeps").mkdir(parents=True)
    (tmp_path / "runs" / "sweeps" / "old.json").write_text(json.dumps({"sweep": "old", "points": []}))
    p = cli("relax-status", "--sweep", "nope", cwd=tmp_path)
    assert p.returncode == 2 and "no sweep 'nope'" in p.stderr and "old" in p.stderr


# ------------------------------------------------------------------------------------- dev cluster ---

def sweep_status(cwd, name) -> dict:
    p = cli("relax-status", "--sweep", name, "--json", cwd=cwd)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def wait_final(cwd, name, timeout=400.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        d = sweep_status(cwd, name)
        if d["final"]:
            return d
        if time.monotonic() > deadline:
            raise TimeoutError(f"sweep {name} not over after {timeout:.0f} s: {d}")
        time.sleep(2)


def sacct_times(job_id: str) -> tuple[str, str]:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,Start,End"], capture_output=True,
                         text=True, check=True).stdout
    row = next(line.split("|") for line in out.splitlines() if line.startswith(f"{job_id}+0|"))
    return row[1], row[2]


@pytest.mark.slurm
def test_a_two_point_sweep_on_the_dev_cluster(slurm_cluster, tmp_path):
    """Two smoke runs (1 step), one at a time: relax-status --sweep shows a row per point with its state, the
    second waits on the first (Slurm's Dependency), both complete."""
    p = cli("relax-submit", "--json", str(SMOKE), "--sweep", "train.lr=1e-6,3e-6", "--sweep-max-running", "1",
            "--sweep-name", "two", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    first, second = rec["points"]
    assert second["after"] == first["job_id"] and first["after"] is None
    assert "afterany:" + first["job_id"] in (tmp_path / "runs" / second["run"] / "job.sbatch").read_text()
    d = sweep_status(tmp_path, "two")
    assert [r["label"] for r in d["points"]] == ["train.lr=1e-6", "train.lr=3e-6"]
    assert d["points"][1]["state"] in ("PENDING", "RUNNING", "COMPLETED")
    d = wait_final(tmp_path, "two")
    assert [r["state"] for r in d["points"]] == ["COMPLETED", "COMPLETED"], d
    assert all(r["step"] is not None and r["total_steps"] == 1 for r in d["points"]), d
    assert sacct_times(second["job_id"])[0] >= sacct_times(first["job_id"])[1]  # it waited for the first
    table = cli("relax-status", "--sweep", "two", cwd=tmp_path)
    assert table.returncode == 0 and "train.lr=3e-6" in table.stdout and "COMPLETED" in table.stdout


@pytest.mark.slurm
def test_cancel_a_sweep_cancels_every_point(slurm_cluster, tmp_path):
    p = cli("relax-submit", "--json", str(SMOKE), "--sweep", "train.lr=1e-6,3e-6", "--sweep-max-running", "1",
            "--sweep-name", "gone", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    c = cli("relax-cancel", "--sweep", "gone", "--json", cwd=tmp_path)
    assert c.returncode == 0, c.stderr
    submitted = [x["job_id"] for x in json.loads(p.stdout)["points"]]
    assert [r["job_id"] for r in json.loads(c.stdout)["points"]] == submitted
    d = wait_final(tmp_path, "gone", timeout=120)
    assert [r["state"] for r in d["points"]] == ["CANCELLED", "CANCELLED"], d  # the waiting one never ran
