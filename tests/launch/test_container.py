"""slurm.container: the steps' srun options (pyxis) and command prefix (Apptainer), their checks, the dry run's
lines, and one local run whose every step goes through an Apptainer-style prefix (a stand-in ``apptainer`` that
applies --env and --pwd, records its arguments and runs the command after the image)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from relax_hpc.backends import container
from relax_hpc.backends import LocalBackend, SlurmBackend
from relax_hpc.controller.steps import describe_steps, engine_step_argv, step_commands
from relax_hpc.errors import PermanentError
from relax_hpc.launch.submit import plan
from relax_hpc.recipe import RecipeError, recipe_from_dict

from .conftest import SMOKE, cli

PY = "/host/venv/bin/python"  # the host's interpreter: a container step must not run it


def recipe(**c):
    roles = {"actor": {"nodes": 2}, "rollout": {"gpus_per_node": 4, "tasks_per_node": 2}}
    return recipe_from_dict({"roles": roles, "model": {"path": "/m"},
                             "slurm": {"container": c, "srun_args": ["--exclusive"]}})


def problems(**c) -> dict[str, tuple[object, str]]:
    with pytest.raises(RecipeError) as e:
        recipe(**c)
    return {k: (v, m) for k, v, m in e.value.problems}


def test_pyxis_role_and_engine_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = recipe(runtime="pyxis", image="nvcr.io#nvidia/pytorch:25.09-py3", mounts=["/lustre/models:/lustre/models:ro"],
               env={"NCCL_DEBUG": "INFO"})
    run_dir = tmp_path / "runs" / "r1"
    actor = step_commands(r, run_dir, SlurmBackend(), PY)[0].procs[0]
    argv = actor.argv
    own = f"{run_dir}:{run_dir}"  # the run dir lies under the working directory: that mount brings it
    mounts = next(a for a in argv if a.startswith("--container-mounts=")).split("=", 1)[1].split(",")
    assert mounts[0] == "/lustre/models:/lustre/models:ro" and own not in mounts
    assert set(mounts[1:]) == {f"{tmp_path}:{tmp_path}", f"{container.PACKAGE_ROOT}:{container.PACKAGE_ROOT}"}
    pyxis = ["--container-image=nvcr.io#nvidia/pytorch:25.09-py3", f"--container-workdir={tmp_path}",
             "--container-env=PYTHONPATH,NCCL_DEBUG"]
    assert all(o in argv for o in pyxis)
    # the container's values travel in srun's environment (--container-env names them), never on its command line
    assert actor.env["NCCL_DEBUG"] == "INFO" and not any("INFO" in a or a.startswith("--export") for a in argv)
    # srun's options, the container's, the recipe's srun_args, then the image's python (not the host's)
    assert argv[-5:] == ["--exclusive", "python3", "-m", "relax_hpc.roles.actor", str(run_dir.resolve())]
    assert argv.index("--kill-on-bad-exit=1") < argv.index(pyxis[0]) < argv.index("--exclusive")
    assert PY not in argv and actor.env["PYTHONPATH"].startswith(container.PACKAGE_ROOT)
    engine = engine_step_argv(r, run_dir, SlurmBackend(), "e0", "initial", "initial", python=PY)
    assert engine[0] == "srun" and "--gres=gpu:2" in engine and all(o in engine for o in pyxis)
    assert engine[engine.index("--exclusive") + 1:][:3] == ["python3", "-m", "relax_hpc.roles.engine"]


def test_apptainer_prefix_under_slurm_and_locally(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = recipe(runtime="apptainer", image="/img/relax.sif", mounts=["/data:/data"], env={"HF_HOME": "/data/hf"},
               workdir="/data/work", python="/opt/py/bin/python")
    run_dir = tmp_path / "r1"
    argv = SlurmBackend().engine_step_argv(r, run_dir, "e0", [PY, "-m", "relax_hpc.roles.engine", str(run_dir)])
    i = argv.index("apptainer")
    assert not any(a.startswith("--container") for a in argv)
    assert argv[i:] == ["apptainer", "exec", "--nv",
                        "--bind", ",".join(["/data:/data", *(f"{p}:{p}" for p in sorted(
                            [container.PACKAGE_ROOT, str(run_dir)], key=len))]),
                        "--env", f"PYTHONPATH={container.step_pythonpath()}",
                        "--pwd", "/data/work", "/img/relax.sif",
                        "/opt/py/bin/python", "-m", "relax_hpc.roles.engine", str(run_dir)]
    assert argv[i - 1] == "--exclusive"  # srun's options first
    # locally the same prefix, behind the rank's CPU binding (an apptainer on PATH: it is never run here)
    (tmp_path / "apptainer").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "apptainer").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RELAX_LOCAL_CPUS", "actor=0")
    proc = step_commands(r, run_dir, LocalBackend(), PY)[0].procs[1]
    assert proc.argv[:4] == ["taskset", "-c", "0", "apptainer"] and proc.argv[-3:-1] == ["-m", "relax_hpc.roles.actor"]
    assert f"PYTHONPATH={proc.env['PYTHONPATH']}" in proc.argv and proc.env["RELAX_RANK"] == "1"
    # the container's variables: Apptainer's APPTAINERENV_<NAME> in the step's environment, off its command line
    assert proc.env["APPTAINERENV_HF_HOME"] == "/data/hf" and not any("/data/hf" in a for a in proc.argv)
    slurm_step = step_commands(r, run_dir, SlurmBackend(), PY)[0].procs[0]
    assert slurm_step.env["APPTAINERENV_HF_HOME"] == "/data/hf" and not any("/data/hf" in a for a in slurm_step.argv)


def test_no_container_leaves_the_steps_as_they_were(tmp_path):
    r = recipe_from_dict({"model": {"path": "/m"}})
    lines = describe_steps(r, tmp_path, PY, SlurmBackend())
    assert all(PY in line and "--container-" not in line and "apptainer exec" not in line for line in lines)
    assert [container.readable(line) for line in lines] == lines


def test_a_writable_mount_above_a_path_brings_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "r1"
    c = recipe(runtime="pyxis", image="i.sqsh", mounts=[f"{tmp_path}:{tmp_path}"]).slurm.container
    assert container.mounts(c, run_dir)[:1] == [f"{tmp_path}:{tmp_path}"]
    assert not any(m.startswith(f"{run_dir}:") for m in container.mounts(c, run_dir))
    c = recipe(runtime="pyxis", image="i.sqsh", mounts=[f"{tmp_path}:{tmp_path}:ro"]).slurm.container
    assert f"{tmp_path}:{tmp_path}" in container.mounts(c, run_dir)  # read-only: the run dir must be writable


def test_pyxis_cannot_run_locally(tmp_path):
    r = recipe(runtime="pyxis", image="i.sqsh")
    with pytest.raises(PermanentError, match="pyxis runs a container only through srun"):
        LocalBackend().engine_step_argv(r, tmp_path, "e0", [PY, "-m", "m"])
    with pytest.raises(RecipeError) as e:  # relax-submit --local refuses it before anything is made
        plan(SMOKE, ["slurm.container.runtime=pyxis", "slurm.container.image=i.sqsh"], "local")
    assert [(k, v) for k, v, _ in e.value.problems] == [("slurm.container.runtime", "pyxis")]
    assert "runtime: apptainer" in e.value.problems[0][2]


def test_apptainer_must_be_on_path_for_local_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no apptainer here
    over = ["slurm.container.runtime=apptainer", "slurm.container.image=/i.sif"]
    with pytest.raises(RecipeError) as e:
        plan(SMOKE, over, "local")
    assert [(k, v) for k, v, _ in e.value.problems] == [("slurm.container.runtime", "apptainer")]
    assert "no apptainer on PATH" in e.value.problems[0][2]
    with pytest.raises(PermanentError, match="no apptainer on PATH"):
        LocalBackend().engine_step_argv(recipe(runtime="apptainer", image="/i.sif"), tmp_path, "e0", [PY, "-m", "m"])
    assert "apptainer" in SlurmBackend().engine_step_argv(recipe(runtime="apptainer", image="/i.sif"), tmp_path,
                                                          "e0", [PY, "-m", "m"])  # on the nodes, not here


@pytest.mark.parametrize("c,key,value,text", [
    ({"image": "i.sif"}, "slurm.container.runtime", None, "Fix: runtime: pyxis"),
    ({"runtime": "docker", "image": "i.sif"}, "slurm.container.runtime", "docker",
     "must be one of 'pyxis', 'apptainer'"),
    ({"runtime": "apptainer"}, "slurm.container.image", "", "is empty"),
    ({"runtime": "pyxis", "image": "img;rm -rf /"}, "slurm.container.image", "img;rm -rf /", "' ' ';'"),
    ({"runtime": "pyxis", "image": "i", "mounts": ["/data"]}, "slurm.container.mounts[0]", "/data", "is not SRC:DST"),
    ({"runtime": "pyxis", "image": "i", "mounts": ["data:/data"]}, "slurm.container.mounts[0]", "data:/data",
     "absolute"),
    ({"runtime": "pyxis", "image": "i", "mounts": ["/a:/b:rx"]}, "slurm.container.mounts[0]", "/a:/b:rx", "':ro'"),
    ({"runtime": "pyxis", "image": "i", "mounts": ["/a b:/b"]}, "slurm.container.mounts[0]", "/a b:/b", "spaces"),
    ({"runtime": "pyxis", "image": "i", "env": {"PYTHONPATH": "/x"}}, "slurm.container.env.PYTHONPATH", "/x",
     "Fix: remove it"),
    ({"runtime": "pyxis", "image": "i", "env": {"RELAX_RANK": "0"}}, "slurm.container.env.RELAX_RANK", "0",
     "Fix: remove it"),
    ({"runtime": "pyxis", "image": "i", "env": {"LD_LIBRARY_PATH": "/opt/lib"}},
     "slurm.container.env.LD_LIBRARY_PATH", "/opt/lib", "host's srun"),
    ({"runtime": "apptainer", "image": "i", "env": {"X": "a\0b"}}, "slurm.container.env.X", "a\0b", "NUL"),
    ({"runtime": "pyxis", "image": "i", "env": {"A-B": "1"}}, "slurm.container.env.A-B", "1", "rename it"),
    ({"runtime": "apptainer", "image": "i", "workdir": "work"}, "slurm.container.workdir", "work", "absolute path"),
    ({"runtime": "apptainer", "image": "i", "workdir": "/w/$HOME"}, "slurm.container.workdir", "/w/$HOME", "'$'"),
    ({"runtime": "apptainer", "image": "i", "python": "python3 -u"}, "slurm.container.python", "python3 -u",
     "Fix: e.g. 'python3'"),
])
def test_bad_values_are_refused_by_key_value_and_fix(c, key, value, text):
    got = problems(**c)
    assert key in got, got
    assert got[key][0] == value and text in got[key][1], got[key]


def test_values_with_commas_are_fine_now_that_they_travel_in_the_environment():
    """A value like NCCL_SOCKET_IFNAME=ib0,ib1 was refused while values went on srun --export / apptainer --env lines."""
    for runtime in ("pyxis", "apptainer"):
        c = recipe_from_dict({"slurm": {"container": {"runtime": runtime, "image": "i",
                                                       "env": {"NCCL_SOCKET_IFNAME": "ib0,ib1"}}}}).slurm.container
        assert c.env == {"NCCL_SOCKET_IFNAME": "ib0,ib1"}


def test_container_options_in_srun_args_are_refused():
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"slurm": {"srun_args": ["--container-image=x"], "container": {"runtime": "pyxis",
                                                                                         "image": "i"}}})
    assert [(k, v) for k, v, _ in e.value.problems] == [("slurm.srun_args[0]", "--container-image=x")]
    assert recipe_from_dict({"slurm": {"srun_args": ["--container-image=x"]}}).slurm.container is None  # the raw hook


def test_readable_puts_each_container_part_on_a_line_and_means_the_same(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for c in ({"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:25.09-py3", "env": {"A": "x y"}},
              {"runtime": "apptainer", "image": "/i.sif", "env": {"A": "1", "B": "2"}}):
        for line in describe_steps(recipe(**c), tmp_path / "r", PY, SlurmBackend()):
            out = container.readable(line)
            rows = out.split(" \\\n    ")
            assert shlex.split(out.replace("\\\n", "")) == shlex.split(line)  # a shell reads the same words
            assert rows[0].startswith("srun ") and rows[-1].startswith("python3 -m relax_hpc.roles.")
            assert all(r.lstrip("'").startswith(("--container-", "--export=", "--exclusive", "apptainer exec",
                                                 "--bind", "--env", "--pwd")) for r in rows[1:-1]), rows


FAKE_APPTAINER = """#!/bin/bash
# An Apptainer-style runner: applies APPTAINERENV_<NAME> (as NAME), records its arguments and what the command will
# see of the variables the test names (one JSON line), applies --env and --pwd, runs the command after the image.
# Like apptainer, it refuses anything but `exec` and options it does not know.
for v in $(compgen -e | grep '^APPTAINERENV_'); do export "${{v#APPTAINERENV_}}=${{!v}}"; done
printf '%s\\n' "$(python3 -c 'import json,os,sys; print(json.dumps({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in ("CONTAINER_TEST", "SECRET_TOKEN", "HF_TOKEN")}}}}))' "$@")" >> "{log}"
[ "$1" = exec ] || {{ echo "fake apptainer: only exec" >&2; exit 2; }}
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --nv) shift ;;
    --bind) shift 2 ;;
    --env) export "$2"; shift 2 ;;
    --pwd) cd "$2" || exit 3; shift 2 ;;
    -*) echo "fake apptainer: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ -n "$1" ] || {{ echo "fake apptainer: no image" >&2; exit 2; }}
shift
exec "$@"
"""
CANARY = "canary-7f3e9a1c"  # a token's value: it must reach the steps, and no file of the run but its secrets file


def files_holding(root: Path, text: str) -> list[Path]:
    """Every file under ``root`` whose bytes hold ``text``."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and text.encode() in p.read_bytes())


def test_a_local_run_goes_through_the_apptainer_prefix(no_slurm_env, tmp_path):
    """The smoke recipe (bootstrap only) with every step in an Apptainer-style container: each rank went through
    the prefix with the run dir bound, the image's interpreter, --env and --pwd applied, and the run completed.
    The recipe's secrets (a container variable named like a token, a slurm.env token) reach every step's process,
    never its command line, and no file of the run directory but RUN/secrets.json (0600)."""
    bin_dir, log, work = tmp_path / "bin", tmp_path / "apptainer.jsonl", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    fake = bin_dir / "apptainer"
    fake.write_text(FAKE_APPTAINER.format(log=log))
    fake.chmod(0o755)
    env = {**no_slurm_env, "PATH": f"{bin_dir}{os.pathsep}{no_slurm_env['PATH']}"}
    recipe_file = tmp_path / "secret.yaml"  # the secrets in a file: relax-submit's own command line is the user's
    recipe_file.write_text(f"defaults: [{SMOKE}]\nslurm:\n  env: {{HF_TOKEN: {CANARY}-hf}}\n"
                           f"  container:\n    env: {{SECRET_TOKEN: {CANARY}-ct}}\n")
    over = ["roles.reference.enabled=false", "roles.actor_fwd.enabled=false", "roles.actor_fwd.share_with=null",
            "roles.actor.nodes=1",
            "slurm.container.runtime=apptainer", "slurm.container.image=/images/relax.sif",
            f"slurm.container.python={sys.executable}", f"slurm.container.workdir={work}",
            "slurm.container.env.CONTAINER_TEST=inside"]
    p = cli("relax-submit", "--local", "--json", str(recipe_file), *over, cwd=tmp_path, env=env, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(p.stdout)
    assert d["state"] == "COMPLETED", d
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    run_dir = Path(d["run_dir"]).resolve()
    roles = sorted(c["argv"][-2].rsplit(".", 1)[1] for c in calls)
    assert roles == ["actor", "rollout"], calls
    for call in calls:
        c = call["argv"]
        assert c[:3] == ["exec", "--nv", "--bind"] and f"{run_dir}:{run_dir}" in c[3].split(",")
        assert c[c.index("--pwd") + 1:][:3] == [str(work), "/images/relax.sif", sys.executable]
        assert c[-1] == str(run_dir)
        # inside: the container's variables (APPTAINERENV_), slurm.env's (the job's environment)
        assert call["env"] == {"CONTAINER_TEST": "inside", "SECRET_TOKEN": f"{CANARY}-ct", "HF_TOKEN": f"{CANARY}-hf"}
        assert not any(CANARY in a or "CONTAINER_TEST" in a for a in c)  # ... and nothing of them on its command line
    assert files_holding(run_dir, CANARY) == [run_dir / "secrets.json"]
    assert (run_dir / "secrets.json").stat().st_mode & 0o777 == 0o600
    assert CANARY not in p.stdout + p.stderr


def test_attached_engines_run_in_the_container_too(tmp_path, monkeypatch):
    from relax_hpc.launch.attach import AttachOptions, render_attach

    monkeypatch.chdir(tmp_path)
    r = recipe_from_dict({"run": {"name": "r"}, "model": {"path": "/m"},
                          "slurm": {"container": {"runtime": "pyxis", "image": "i.sqsh"}}})
    last = render_attach(r, tmp_path / "r1", "op1", "att-", 2, AttachOptions()).splitlines()[-1]
    words = shlex.split(last)
    assert words[:2] == ["exec", "srun"] and "--container-image=i.sqsh" in words
    assert words[words.index(f"--container-workdir={tmp_path}") + 2:][:3] == ["python3", "-m", "relax_hpc.roles.engine"]
