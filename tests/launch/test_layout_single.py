"""``slurm.layout``: the dry run of either layout (its script and its steps), the single layout's engine placement,
and ``auto`` against a site that refuses heterogeneous jobs (relax-submit's choice and why, the preflight's refusal
of ``hetjob`` naming the key, relax-doctor's line).

The site that refuses het jobs: the dev cluster takes them, and it is shared (its configuration cannot change under
the other tests), so the refusal comes from a ``sbatch`` first on PATH that answers a het submission as a site's
job_submit plugin does and hands every other call to the real sbatch of the dev cluster."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from relax_hpc.backends.slurm import GROUP_NODES_ENV, SlurmBackend, slurm_layout
from relax_hpc.controller.steps import describe_steps
from relax_hpc.launch import doctor, layouts
from relax_hpc.launch.preflight import preflight_problems
from relax_hpc.launch.submit import dry_run, plan
from relax_hpc.recipe import load_recipe, recipe_from_dict, role_steps
from relax_hpc.recipe.layout import total_nodes

from .conftest import SMOKE

REFUSAL = "Heterogeneous jobs are not allowed on this cluster"


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def steps_of(lines: list[str]) -> dict[str, str]:
    """The dry run's step lines by role (the module they run) or engine (--job-name)."""
    out = {}
    for line in lines:
        for word in line.split():
            if word.startswith("relax_hpc.roles.") and word != "relax_hpc.roles.engine":
                out[word.rsplit(".", 1)[1]] = line
            elif word.startswith("--job-name=engine-"):
                out[word.removeprefix("--job-name=engine-")] = line
    return out


@pytest.mark.parametrize("mpi", ["none", "pmix"])
def test_dry_run_prints_the_single_layouts_one_allocation_and_its_placed_steps(tmp_path, monkeypatch, mpi):
    """smoke.yaml: actor on 2 nodes, rollout on 1, reference on 1 with actor_fwd sharing it. single: one block of
    4 nodes, no het separator, the groups' node lists exported; each role's step at its group's first node
    (--relative 0, 2, 3, 3), --overlap where it shares; the engine on rollout's node; --mpi only for pmix."""
    monkeypatch.chdir(tmp_path)
    p = plan(SMOKE, ["slurm.layout=single", f"slurm.mpi={mpi}", "model.path=/models/m"], check_place=False)
    out = dry_run(p)
    lines = sbatch_lines(out["script"])
    assert "#SBATCH hetjob" not in lines and lines.count("#SBATCH --nodes=4") == 1
    assert sum(1 for x in lines if x.startswith("#SBATCH --nodes=")) == 1
    assert "# 'slurm.layout: single (set in the recipe)'" in out["script"]
    assert "export RELAX_SLURM_LAYOUT=single" in out["script"]
    for k, (first, n) in enumerate([(0, 2), (2, 1), (3, 1)]):
        assert f'export {GROUP_NODES_ENV}{k}="$(IFS=,; echo "${{_nodes[*]:{first}:{n}}}")"' in out["script"]
    steps = steps_of(out["steps"])
    assert set(steps) == {"actor", "rollout", "reference", "actor_fwd", "engine0"}
    assert not any("--het-group" in s for s in steps.values())
    want = {"actor": "--relative=0 --nodes=2", "rollout": "--relative=2 --overlap --nodes=1",
            "reference": "--relative=3 --nodes=1", "actor_fwd": "--relative=3 --overlap --nodes=1",
            "engine0": "--relative=2 --nodes=1"}
    for name, where in want.items():
        assert f"srun {where} " in steps[name], steps[name]
    for role in ("actor", "rollout", "reference", "actor_fwd"):
        assert ("--mpi=pmix" in steps[role]) == (mpi == "pmix") and "--mpi=none" not in steps[role]


def test_dry_run_prints_the_het_layouts_components():
    p = plan(SMOKE, ["slurm.layout=hetjob", "model.path=/models/m"], check_place=False)
    out = dry_run(p)
    lines = sbatch_lines(out["script"])
    assert lines.count("#SBATCH hetjob") == 2 and [x for x in lines if x.startswith("#SBATCH --nodes=")] == \
        ["#SBATCH --nodes=2", "#SBATCH --nodes=1", "#SBATCH --nodes=1"]
    assert "export RELAX_SLURM_LAYOUT=hetjob" in out["script"] and GROUP_NODES_ENV not in out["script"]
    steps = steps_of(out["steps"])
    assert "srun --het-group=0 --nodes=2 " in steps["actor"] and "srun --het-group=2 --overlap " in steps["actor_fwd"]
    assert "srun --het-group=1 --nodes=1 " in steps["engine0"] and not any("--relative" in s for s in steps.values())


@pytest.mark.parametrize("layout", ["hetjob", "auto"])
def test_one_component_is_a_plain_job_whatever_the_layout_says(layout):
    """Colocate with no other role: one component. Rendered as a het job, its steps' --het-group=0 finds no het
    component (Slurm: "No directives to start application on any available hetjob components")."""
    over = [f"slurm.layout={layout}", "model.path=/models/m", "roles.rollout.share_with=actor",
            "roles.rollout.nodes=2", "roles.reference.enabled=false", "roles.actor_fwd.enabled=false",
            "roles.actor_fwd.share_with=null"]
    p = plan(SMOKE, over, check_place=False)
    out = dry_run(p)
    assert "#SBATCH hetjob" not in out["script"] and "export RELAX_SLURM_LAYOUT=single" in out["script"]
    assert all("--het-group" not in s for s in out["steps"]), out["steps"]
    assert "one component" in out["script"]
    r = load_recipe(SMOKE, over[1:] + [f"slurm.layout={layout}"])
    assert not [x for x in preflight_problems(r, "slurm") if x[0] == "slurm.layout"]
    assert r.slurm.layout == "single"  # settled by the preflight: the run's recipe copy says so


def test_the_single_allocation_is_as_big_as_the_biggest_groups_node():
    """Every node can hold any group's tasks: the most CPUs (tasks × CPUs), GPUs and memory a group asks per node."""
    p = plan(SMOKE, ["slurm.layout=single", "roles.actor.gpus_per_node=2", "roles.actor.tasks_per_node=2",
                     "roles.actor.mem=2G",
                     "roles.rollout.tasks_per_node=2", "roles.rollout.cpus_per_task=3", "roles.rollout.mem=3000"],
             check_place=False)
    lines = sbatch_lines(dry_run(p)["script"])
    for want in ("--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=6", "--gpus-per-node=2", "--mem=3000"):
        assert f"#SBATCH {want}" in lines, lines
    assert total_nodes(p.recipe) == 4


def test_single_layout_engines_go_on_rollouts_nodes_named_by_the_batch_script():
    """A run's own engine K: the node of its task slot (--relative); a scale-out's engine: off the other groups'
    nodes and off the nodes ``exclude`` names (the run's own engines), on whichever rollout node has room."""
    r = load_recipe(SMOKE, ["slurm.layout=single", "roles.rollout.nodes=3", "roles.rollout.tasks_per_node=2"])
    rollout = next(s for s in role_steps(r) if s.role == "rollout")
    env = {f"{GROUP_NODES_ENV}0": "n1,n2", f"{GROUP_NODES_ENV}1": "n3,n4,n5", f"{GROUP_NODES_ENV}2": "n6"}
    b = SlurmBackend()
    assert b._single_engine_place(rollout, 2, "engine0", [], env) == ["--relative=2"]
    assert b._single_engine_place(rollout, 2, "engine3", [], env) == ["--relative=3"]
    assert b._single_engine_place(rollout, 2, "step0", ["n3"], env) == ["--exclude=n1,n2,n3,n6"]
    assert b._single_engine_place(rollout, 2, "step0", [], {}) == ["--relative=2"]  # no names: a dry run
    assert b.nodelist(1, {**env, "SLURM_JOB_NODELIST": "n[1-6]"}) == "n3,n4,n5"
    assert b.nodelist(1, {"SLURM_HET_SIZE": "3", "SLURM_JOB_NODELIST_HET_GROUP_1": "n3"}) == "n3"
    assert b.nodelist(3, env) == "localhost"  # no such group


def test_an_auto_recipe_takes_the_layout_the_batch_script_says():
    r = load_recipe(SMOKE)
    assert r.slurm.layout == "auto"
    assert recipe_from_dict({}).slurm.mpi == "none"  # the default rendezvous needs no MPI (the file one)
    assert slurm_layout(r, {"RELAX_SLURM_LAYOUT": "single"}) == "single"
    assert slurm_layout(r, {"SLURM_JOB_ID": "5", "SLURM_HET_SIZE": "3"}) == "hetjob"
    assert slurm_layout(r, {"SLURM_JOB_ID": "5"}) == "single"  # a plain job: no het component to name
    assert slurm_layout(r, {}) == "hetjob"
    assert slurm_layout(load_recipe(SMOKE, ["slurm.layout=single"]), {"SLURM_HET_SIZE": "3"}) == "single"


# ---- a site that refuses het jobs ----

@pytest.fixture
def het_refusing_site(slurm_cluster, tmp_path, monkeypatch):
    """``sbatch`` that refuses a het submission (a ':' separator) as a job_submit plugin does; the rest goes to the
    dev cluster's own sbatch. The layout answers are cached per process: cleared before and after."""
    real = shutil.which("sbatch")
    assert real
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text(f"""#!/bin/bash
for a in "$@"; do
  if [ "$a" = ":" ]; then
    echo "sbatch: error: {REFUSAL}" >&2
    echo "sbatch: error: Batch job submission failed: Unspecified error" >&2
    exit 1
  fi
done
exec {real} "$@"
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    layouts.het_jobs_allowed.cache_clear()
    yield fake
    layouts.het_jobs_allowed.cache_clear()


@pytest.mark.slurm
def test_auto_picks_single_where_het_jobs_are_refused_and_says_why(het_refusing_site, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = plan(SMOKE, [], check_place=True)  # the preflight asks (sinfo, sbatch --test-only)
    assert p.recipe.slurm.layout == "single"  # settled in the recipe the run's copy is made from
    out = dry_run(p)
    assert "export RELAX_SLURM_LAYOUT=single" in out["script"] and "#SBATCH hetjob" not in out["script"]
    why = next(line for line in out["script"].splitlines() if "slurm.layout: auto -> single" in line)
    assert "refuses heterogeneous jobs" in why and REFUSAL in why, why
    assert all("--het-group" not in s for s in out["steps"])


@pytest.mark.slurm
def test_the_preflight_refuses_a_het_layout_the_site_rejects_naming_the_key(het_refusing_site):
    problems = preflight_problems(load_recipe(SMOKE, ["slurm.layout=hetjob"]), "slurm")
    [(key, value, msg)] = [x for x in problems if x[0] == "slurm.layout"]
    assert value == "hetjob" and REFUSAL in msg and "Fix: slurm.layout: single" in msg
    assert not [x for x in preflight_problems(load_recipe(SMOKE, ["slurm.layout=single"]), "slurm")
                if x[0] == "slurm.layout"]


@pytest.mark.slurm
def test_relax_doctor_says_whether_the_partition_takes_het_jobs(het_refusing_site, slurm_cluster):
    refused = doctor.check_hetjobs("debug")
    assert refused.status == doctor.WARN and REFUSAL in refused.detail and "slurm.layout: single" in refused.fix
    layouts.het_jobs_allowed.cache_clear()
    os.environ["PATH"] = os.environ["PATH"].split(os.pathsep, 1)[1]  # the real sbatch (monkeypatch restores PATH)
    taken = doctor.check_hetjobs("debug")
    assert taken.status == doctor.OK and "takes heterogeneous jobs" in taken.detail, taken
    layouts.het_jobs_allowed.cache_clear()
    unknown = doctor.check_hetjobs("no-such-partition")
    assert unknown.status == doctor.WARN and "even a plain job" in unknown.detail


def test_describe_steps_follows_the_settled_layout():
    r = load_recipe(SMOKE, ["slurm.layout=single", "model.path=/m"])
    assert all("--het-group" not in s for s in describe_steps(r, Path("/runs/x")))


@pytest.mark.parametrize("opt", ["--relative=1", "--het-group=0", "-w", "--nodelist=n1", "--exclude=n2"])
def test_srun_args_that_would_place_the_steps_are_refused(opt):
    from relax_hpc.recipe import RecipeError

    with pytest.raises(RecipeError) as e:
        load_recipe(SMOKE, [f"slurm.srun_args=[{opt}]"])
    assert [k for k, _, _ in e.value.problems] == ["slurm.srun_args[0]"] and "places the steps" in str(e.value)


def test_a_local_run_never_asks_slurm_for_its_layout(tmp_path, monkeypatch):
    """relax-submit --local renders the script only to check its template: it must not ask Slurm which layout the
    site takes (``sbatch --test-only`` waited its 30 s where Slurm's clients are installed and no slurmctld answers:
    a local quickstart took 42 s instead of 12). An ``sbatch`` first on PATH records each call; the recipe keeps its
    ``auto``. Negative control: a Slurm run's plan asks it."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text(f'#!/bin/bash\necho "$@" >> {calls}\necho "sbatch: error: no controller" >&2\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    layouts.het_jobs_allowed.cache_clear()
    try:
        p = plan(SMOKE, ["model.path=/m"], "local", check_place=False)
        assert not calls.exists(), calls.read_text()
        assert p.recipe.slurm.layout == "auto"
        plan(SMOKE, ["model.path=/m"], "slurm", check_place=False)
        assert "--test-only" in calls.read_text()
    finally:
        layouts.het_jobs_allowed.cache_clear()
