"""The sbatch script: one block per het component, job-wide options once, every recipe value quoted and inert."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc.launch.render import RenderError, render_script, shquote
from relax_hpc.recipe import RecipeError, load_recipe, recipe_from_dict
from relax_hpc.recipe.layout import het_groups

from .conftest import SMOKE

RUNNER = [sys.executable, "-u", "-m", "submitit.core._submit", "/runs/x/submitit"]


def four_groups(**slurm) -> dict:
    return {"run": {"name": "t"}, "slurm": {"partition": "debug", "time": "00:10:00", **slurm},
            "roles": {"actor": {"nodes": 2}, "rollout": {"nodes": 1},
                      "reference": {"enabled": True, "nodes": 1}, "actor_fwd": {"enabled": True, "nodes": 1}}}


def render(data: dict, run_dir: str = "/runs/x", command=RUNNER, search=()) -> str:
    return render_script(recipe_from_dict(data), Path(run_dir), list(command), "/repo", search)


def blocks(script: str) -> list[list[str]]:
    """The #SBATCH lines of each het component (split at '#SBATCH hetjob')."""
    out, cur = [], []
    for line in script.splitlines():
        if line.strip() == "#SBATCH hetjob":
            out.append(cur)
            cur = []
        elif line.startswith("#SBATCH"):
            cur.append(line)
    return out + [cur]


def test_one_block_per_role_group_in_het_order():
    script = render(four_groups())
    assert script.startswith("#!/bin/bash\n")
    assert script.count("#SBATCH hetjob") == 3
    b = blocks(script)
    assert len(b) == 4
    assert [next(l for l in blk if l.startswith("#SBATCH --nodes=")) for blk in b] == \
        ["#SBATCH --nodes=2", "#SBATCH --nodes=1", "#SBATCH --nodes=1", "#SBATCH --nodes=1"]
    for blk in b:
        assert "#SBATCH --partition=debug" in blk and "#SBATCH --time=00:10:00" in blk
        assert "#SBATCH --ntasks-per-node=1" in blk and "#SBATCH --cpus-per-task=1" in blk
    assert re.findall(r"# het group (\d+): (\S+)", script) == \
        [("0", "actor"), ("1", "rollout"), ("2", "reference"), ("3", "actor_fwd")]


def test_shared_role_has_no_block_of_its_own():
    data = four_groups()
    data["roles"]["actor_fwd"] = {"enabled": True, "share_with": "actor", "nodes": 1}
    script = render(data)
    assert script.count("#SBATCH hetjob") == 2
    assert "# het group 0: actor+actor_fwd" in script


def test_job_wide_options_once_in_first_block():
    script = render(four_groups(signal_lead_s=45))
    first = blocks(script)[0]
    for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=B:USR2@45",
                 "#SBATCH --job-name=relax-t", "#SBATCH --output=/runs/x/logs/batch-%j.out",
                 "#SBATCH --error=/runs/x/logs/batch-%j.err"):
        assert line in first, line
        assert script.count(line) == 1
    assert script.count("%j") == 2  # only the batch output paths use the leader id
    assert "#SBATCH --no-requeue" in render(four_groups(requeue=False))


def test_optional_values_only_when_set():
    plain = render(four_groups())
    for opt in ("--account", "--qos", "--constraint", "--gpus-per-node", "--mem"):
        assert opt not in plain
    data = four_groups(account="proj1", qos="high", constraint="a100", sbatch_extra=["--exclusive"])
    data["roles"]["actor"].update(gpus_per_node=4, tasks_per_node=4, mem="16G")
    b = blocks(render(data))
    assert "#SBATCH --gpus-per-node=4" in b[0] and "#SBATCH --mem=16G" in b[0]
    assert not any("--gpus-per-node" in l for l in b[1])
    for blk in b:
        assert {"#SBATCH --account=proj1", "#SBATCH --qos=high", "#SBATCH --constraint=a100",
                "#SBATCH --exclusive"} <= set(blk)


def test_smoke_recipe_renders():
    recipe = load_recipe(SMOKE)
    script = render_script(recipe, Path("/runs/smoke-1"), RUNNER, "/repo")
    assert script.count("#SBATCH hetjob") == len(het_groups(recipe)) - 1
    # slurm.env's values are secrets: the controller sets them (from RUN/secrets.json); the script names them only
    assert "# slurm.env: OMPI_MCA_btl (set by" in script and "self,tcp" not in script


def test_values_are_quoted_and_inert(tmp_path):
    """A command argument with spaces and shell syntax, a run dir with a space and a quote: the script parses, and
    running it passes the exact value and executes none of it. An env value is not in the script at all (a secret:
    the controller sets it)."""
    pwned = tmp_path / "PWNED"
    nasty = f"a b; touch {pwned}; $(touch {pwned}) `touch {pwned}` 'q' \"dq\" * ~ $HOME"
    run_dir = tmp_path / "run dir 'x'"
    out = tmp_path / "seen.txt"
    probe = [sys.executable, "-c",
             "import os, sys; open(sys.argv[1], 'w').write(sys.argv[2] + '|' + os.environ['RELAX_RUN_DIR'])",
             str(out), nasty]
    data = four_groups(env={"NASTY": nasty})
    script = render(data, run_dir=str(run_dir), command=probe)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    assert "touch" in script and "export NASTY" not in script and "'a b; touch" not in script.split("exec ")[0]
    p = subprocess.run(["bash", str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert out.read_text() == f"{nasty}|{run_dir}"
    assert not pwned.exists()
    assert "RELAX_EXECUTOR=slurm" in script and script.rstrip().splitlines()[-1].startswith("exec ")


def test_refuses_values_that_would_break_a_line():
    with pytest.raises(RenderError):
        shquote("a\n#SBATCH --x")
    with pytest.raises(RenderError):
        shquote(None)
    assert shquote(shquote("a b")) == "'a b'"  # idempotent


def test_custom_template(tmp_path):
    tpl = tmp_path / "mine.j2"
    tpl.write_text("#!/bin/bash\n#SBATCH --job-name={{ job_name }}\n"
                   "{% for g in groups %}# group {{ g.het_group }} {{ g.role }} nodes={{ g.nodes }}\n{% endfor %}"
                   "echo {{ env.X }}\nexec {{ command | shjoin }}\n")
    script = render(four_groups(template=str(tpl), env={"X": "a b; c"}))
    assert "# group 1 rollout nodes=1" in script
    assert "echo '***'" in script and "a b; c" not in script  # masked (a secret), quoted though the template forgot
    # relative names: looked up in the given directories (working dir, recipe dir), then relax_hpc/sbatch/
    assert "group 0 actor" in render(four_groups(template="mine.j2", env={"X": "1"}), search=[tmp_path])
    assert "#SBATCH hetjob" in render(four_groups(template="hetjob.sbatch.j2"))


@pytest.mark.parametrize("text,msg", [
    ("#!/bin/bash\necho {{ no_such_thing }}\n", "unknown variable"),
    ("#!/bin/bash\n{% for %}\n", "syntax error"),
    ("echo no shebang\n", "#!"),
])
def test_broken_custom_template_is_a_recipe_error(tmp_path, text, msg):
    tpl = tmp_path / "bad.j2"
    tpl.write_text(text)
    with pytest.raises(RecipeError) as e:
        render(four_groups(template=str(tpl)))
    (key, value, message), = e.value.problems
    assert key == "slurm.template" and msg in message


def test_missing_template_names_the_key(tmp_path):
    with pytest.raises(RecipeError) as e:
        render(four_groups(template=str(tmp_path / "nope.j2")))
    assert e.value.problems[0][0] == "slurm.template"


@pytest.mark.slurm
def test_sbatch_accepts_the_script(slurm_cluster, tmp_path):
    """sbatch --test-only parses every directive (het blocks included) and schedules nothing."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    script = render_script(load_recipe(SMOKE, ["slurm.env.X=a b; c", "slurm.job_name=relax-render-test"]),
                           run_dir, ["/bin/true"], "/repo")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    p = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "to start at" in p.stderr
