"""The commands as a user types them: dry runs, refusals (exit 2, key named, nothing left behind, nothing
submitted), and local runs without Slurm on PATH."""

from __future__ import annotations

import glob
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_hpc.launch import localproc

from .conftest import SMOKE, cli, jobs_named, unique_job_name


def no_run_dirs(cwd) -> bool:
    runs = cwd / "runs"
    return not runs.exists() or not any(runs.iterdir())


# ------------------------------------------------------------------------------------------ dry runs ---

@pytest.mark.slurm
def test_dry_run_prints_script_and_steps_and_submits_nothing(slurm_cluster, tmp_path):
    name = unique_job_name()
    p = cli("relax-submit", "--dry-run", str(SMOKE), f"slurm.job_name={name}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("#SBATCH hetjob") == 2 and "#!/bin/bash" in p.stdout
    assert "srun --het-group=0" in p.stdout and "srun --het-group=2 --overlap" in p.stdout
    assert "relax_hpc.roles.actor_fwd" in p.stdout
    assert no_run_dirs(tmp_path)
    assert f"#SBATCH --job-name={name}" in p.stdout
    assert jobs_named(name) == set()  # squeue lists a job from the moment sbatch returns: no wait needed


@pytest.mark.slurm
def test_dry_run_json(slurm_cluster, tmp_path):
    p = cli("relax-submit", "--dry-run", "--json", str(SMOKE), cwd=tmp_path)
    d = json.loads(p.stdout)
    assert d["dry_run"] is True and d["job_id"] is None and d["executor"] == "slurm"
    assert d["script"].startswith("#!/bin/bash") and len(d["steps"]) == 4
    assert no_run_dirs(tmp_path)


def test_dry_run_local_without_slurm(no_slurm_env, tmp_path):
    p = cli("relax-submit", "--dry-run", str(SMOKE), cwd=tmp_path, env=no_slurm_env)
    assert p.returncode == 0, p.stderr
    assert "no sbatch on PATH" in p.stderr and "Executor: local" in p.stdout
    assert "RELAX_RANK=1" in p.stdout and "relax_hpc.roles.actor" in p.stdout  # the actor's 2 local ranks
    assert no_run_dirs(tmp_path)


EIGHT_GPU = SMOKE.parent / "qwen3-4b-dapo-8gpu.yaml"
ELSEWHERE = ["model.path=/cluster/models/Qwen3-4B", "data.path=/cluster/data/dapo.jsonl", "slurm.partition=gpu"]


def test_render_only_shows_the_batch_script_of_a_recipe_for_a_cluster_not_reachable_from_here(no_slurm_env,
                                                                                              tmp_path):
    """The 8-GPU recipe on a machine with no Slurm and no GPU: a plain dry run falls back to a local run and refuses
    the GPUs and the cluster's paths, and says how to see the script anyway; --render-only prints the batch script
    and the srun lines, labelled as not checked, and submits and creates nothing."""
    p = cli("relax-submit", "--dry-run", str(EIGHT_GPU), *ELSEWHERE, cwd=tmp_path, env=no_slurm_env)
    assert p.returncode == 2 and "roles.actor.gpus_per_node = 8" in p.stderr and "--render-only" in p.stderr
    p = cli("relax-submit", "--dry-run", "--render-only", str(EIGHT_GPU), *ELSEWHERE, cwd=tmp_path,
            env=no_slurm_env)
    assert p.returncode == 0, p.stderr
    assert "no sbatch on PATH" not in p.stderr and "Executor: slurm" in p.stdout
    assert "# NOT CHECKED (--render-only)" in p.stdout and "partition, node and GPU counts" in p.stdout
    assert "#SBATCH --gpus-per-node=8" in p.stdout and "#SBATCH --partition=gpu" in p.stdout
    # colocate on one node: the job's one component is a plain job (no --het-group)
    assert "srun --relative=0 --nodes=1 --ntasks=8" in p.stdout and "--het-group" not in p.stdout, p.stdout
    assert "/cluster/models" not in p.stderr
    assert no_run_dirs(tmp_path)
    d = json.loads(cli("relax-submit", "--dry-run", "--render-only", "--json", str(EIGHT_GPU), *ELSEWHERE,
                       cwd=tmp_path, env=no_slurm_env).stdout)
    assert d["render_only"] is True and d["script"].startswith("#!/bin/bash") and "skipped_checks" in d


def test_render_only_still_validates_the_recipe_and_needs_dry_run(no_slurm_env, tmp_path):
    p = cli("relax-submit", "--dry-run", "--render-only", str(EIGHT_GPU), *ELSEWHERE, "roles.actor.nodes=two",
            cwd=tmp_path, env=no_slurm_env)
    assert_refused(p, "roles.actor.nodes", "integer", tmp_path)
    for args in (["--render-only"], ["--render-only", "--dry-run", "--local"]):
        p = cli("relax-submit", *args, str(SMOKE), cwd=tmp_path, env=no_slurm_env)
        assert p.returncode == 2 and "--render-only goes with --dry-run" in p.stderr


# ------------------------------------------------------------------------------------------ refusals ---

VALIDATOR_CASES = [
    (["roles.actor.nodes=two"], "roles.actor.nodes", "integer"),
    (["roles.actor.nodse=2"], "roles.actor.nodse", "did you mean"),
    (["slurm.partition=debug;touch /tmp/relax-pwned"], "slurm.partition", "shell metacharacters"),
    (["slurm.sbatch_extra=['--comment=$(touch x)']"], "slurm.sbatch_extra[0]", "shell metacharacters"),
    (["slurm.template=no-such-template.j2"], "slurm.template", "no such template"),
]
CLUSTER_CASES = [
    (["roles.actor.nodes=5"], "roles.actor.nodes", "has only 4 node(s)"),
    (["roles.rollout.gpus_per_node=5"], "roles.rollout.gpus_per_node", "at most 4 GPUs"),
    (["slurm.partition=nosuch"], "slurm.partition", "no such partition"),
    (["roles.actor_fwd.share_with=null"], "roles.actor_fwd.nodes", "never puts two components"),
]


def assert_refused(p, key, text, cwd):
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert f"  - {key}" in p.stderr and text in p.stderr, p.stderr
    assert "nothing was submitted" in p.stderr
    assert no_run_dirs(cwd)


@pytest.mark.parametrize("overrides,key,text", VALIDATOR_CASES)
def test_bad_recipe_refused_locally(no_slurm_env, tmp_path, overrides, key, text):
    p = cli("relax-submit", "--local", str(SMOKE), *overrides, cwd=tmp_path, env=no_slurm_env)
    assert_refused(p, key, text, tmp_path)


@pytest.mark.slurm
@pytest.mark.parametrize("overrides,key,text", VALIDATOR_CASES + CLUSTER_CASES)
def test_bad_recipe_refused_before_sbatch(slurm_cluster, tmp_path, overrides, key, text):
    name = unique_job_name()
    p = cli("relax-submit", str(SMOKE), *overrides, f"slurm.job_name={name}", cwd=tmp_path)
    assert_refused(p, key, text, tmp_path)
    assert jobs_named(name) == set()


@pytest.mark.slurm
def test_the_key_the_user_set_is_named_first_with_the_cluster_check(slurm_cluster, tmp_path):
    """On the 4-node cluster, 999 actor nodes were refused as "train.global_batch_size = None: leaves 64 samples
    per optimizer step for 999 data-parallel actor ranks", and the cluster check never ran (issue 28)."""
    name = unique_job_name()
    p = cli("relax-submit", "--dry-run", str(SMOKE), "roles.actor.nodes=999", f"slurm.job_name={name}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    listed = [ln for ln in p.stderr.splitlines() if ln.startswith("  - ")]
    assert listed and all(ln.startswith("  - roles.actor.nodes = 999: ") for ln in listed), p.stderr
    assert "has only 4 node(s)" in p.stderr and "train.global_batch_size" not in p.stderr
    assert no_run_dirs(tmp_path)
    assert jobs_named(name) == set()


def test_a_byte_of_the_command_line_that_is_not_utf8_is_refused_by_key(no_slurm_env, tmp_path):
    """argv reaches Python as text with a lone surrogate for the byte: refused naming the key, no traceback."""
    import os

    p = cli("relax-submit", "--local", "--dry-run", str(SMOKE), os.fsdecode(b"model.path=/m/\xff"), cwd=tmp_path,
            env=no_slurm_env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "  - model.path = '/m/\\udcff': contains a character that cannot be encoded as UTF-8" in p.stderr


def test_refusal_as_json(no_slurm_env, tmp_path):
    p = cli("relax-submit", "--local", "--json", str(SMOKE), "roles.actor.nodes=two", cwd=tmp_path,
            env=no_slurm_env)
    assert p.returncode == 2
    d = json.loads(p.stdout)
    assert d["error"] == "recipe refused" and d["problems"][0]["key"] == "roles.actor.nodes"


def test_local_gpus_without_cuda_refused(no_slurm_env, tmp_path):
    if glob.glob("/dev/nvidia[0-9]*") or shutil.which("nvidia-smi"):
        pytest.skip("this machine may have CUDA")
    p = cli("relax-submit", "--local", str(SMOKE), "roles.rollout.gpus_per_node=1", cwd=tmp_path, env=no_slurm_env)
    assert_refused(p, "roles.rollout.gpus_per_node", "no CUDA GPU", tmp_path)


def test_missing_recipe_file(no_slurm_env, tmp_path):
    p = cli("relax-submit", "--local", str(tmp_path / "nope.yaml"), cwd=tmp_path, env=no_slurm_env)
    assert p.returncode == 2 and "no such file" in p.stderr


def test_status_and_cancel_without_runs(tmp_path):
    p = cli("relax-status", cwd=tmp_path)
    assert p.returncode == 2 and "no runs under" in p.stderr
    p = cli("relax-cancel", "nope", cwd=tmp_path)
    assert p.returncode == 2 and "no run or job id" in p.stderr


# ---------------------------------------------------------------------------------------- local runs ---

def going(cwd: Path) -> bool:
    """The run under ``cwd/runs`` reports itself running: its controller's state.json, every role started."""
    for path in (cwd / "runs").glob("*/state.json"):
        try:
            st = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        roles = (st.get("roles") or {}).values()
        return st.get("state") == "RUNNING" and bool(roles) and all(None not in r["pids"] for r in roles)
    return False


@pytest.mark.slow
def test_local_smoke_run_without_slurm(no_slurm_env, tmp_path):
    """No sbatch on PATH: relax-submit runs the smoke recipe here, in the foreground, to COMPLETED."""
    p = cli("relax-submit", str(SMOKE), cwd=tmp_path, env=no_slurm_env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no sbatch on PATH" in p.stderr and "COMPLETED" in p.stdout
    s = cli("relax-status", "--json", cwd=tmp_path, env=no_slurm_env)
    d = json.loads(s.stdout)
    assert d["state"] == "COMPLETED" and d["executor"] == "local" and d["reason"] is None
    assert [c["het_group"] for c in d["components"]] == [0, 1, 2]
    assert set(d["roles"]) == {"actor", "rollout", "reference", "actor_fwd"}
    assert all(r["phase"] == "done" for r in d["roles"].values())
    run_dir = tmp_path / "runs" / d["run"]
    assert (run_dir.stat().st_mode & 0o777) == 0o700
    job = json.loads((run_dir / "job.json").read_text())
    assert job["executor"] == "local" and job["pid"] == int(job["job_id"])
    import relax_hpc  # the code that ran, recorded by relax-submit and shown by relax-status

    assert d["provenance"]["relax_hpc"] == relax_hpc.__version__
    assert d["provenance"] == json.loads((run_dir / "provenance.json").read_text())
    assert d["progress"]["reward_last"] is None and d["progress"]["eta_s"] is None  # the smoke run trains nothing


@pytest.mark.slow
def test_local_detach_then_cancel(no_slurm_env, tmp_path):
    """--detach, relax-cancel, then ``relax-submit --resume --json`` in the foreground: it follows the run to its end
    and reports the final state as JSON (the same foreground report as ``relax-submit --local --json``)."""
    # the rollout role is held ready in the first attempt: the cancel always finds the run going
    env = dict(no_slurm_env, RELAX_TEST_HOLD_ROLE="rollout")
    p = cli("relax-submit", "--local", "--detach", "--json", str(SMOKE), cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert {"run", "run_dir", "job_id", "pid"} <= set(d)
    # cancel once the run is going: a SIGTERM before the controller handles it is swallowed by submitit's runner
    # (which bypasses SIGTERM), and relax-cancel waits out its grace, then kills
    deadline = time.monotonic() + 120
    while not going(tmp_path):
        assert time.monotonic() < deadline, "the detached run never reported itself running"
        time.sleep(0.05)
    c = cli("relax-cancel", d["run"], "--json", cwd=tmp_path, env=no_slurm_env)
    assert c.returncode == 0, c.stderr
    assert json.loads(c.stdout)["action"] in ("terminated", "killed")
    s = json.loads(cli("relax-status", d["run"], "--json", cwd=tmp_path, env=no_slurm_env).stdout)
    assert s["state"] == "CANCELLED", s
    # the cancelled run goes on in its own directory: a new process, the old id kept, the next attempt
    assert cli("relax-submit", "--resume", d["run"], "x=1", cwd=tmp_path, env=no_slurm_env).returncode != 0
    r = cli("relax-submit", "--resume", d["run"], "--json", cwd=tmp_path, env=no_slurm_env, timeout=300)
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)  # --json in the foreground: the final state, reported once the run has ended
    assert again["state"] == "COMPLETED" and again["executor"] == "local" and again["reason"] is None
    assert again["run_dir"] == d["run_dir"] and again["job_id"] != d["job_id"]
    assert again["previous_job_ids"] == [d["job_id"]]
    assert len(json.loads((Path(d["run_dir"]) / "provenance.json").read_text())["resumes"]) == 1
    state = json.loads((Path(d["run_dir"]) / "state.json").read_text())
    assert state["attempt"] == len(state["history"]) == 1  # the first, cancelled while going, in the history
    assert state["history"][0]["state"] == "CANCELLED", state["history"]
    done = cli("relax-submit", "--resume", d["run"], cwd=tmp_path, env=no_slurm_env)
    assert done.returncode != 0 and "COMPLETED" in done.stderr  # a finished run is not started again


def _hang_report(p: subprocess.Popen, out_file: Path, err_file: Path, cwd: Path) -> str:
    """Where a relax-submit that did not end after Ctrl-C is: its signal masks, its threads' stacks (SIGUSR1, see
    faulthandler above), the run's processes."""
    status = Path(f"/proc/{p.pid}/status").read_text() if Path(f"/proc/{p.pid}/status").exists() else ""
    sig = "\n".join(line for line in status.splitlines() if line.startswith(("Sig", "State", "Threads")))
    n = len(err_file.read_text())
    p.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while len(err_file.read_text()) == n and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the rest of the dump
    procs = []
    for job in (cwd / "runs").glob("*/job.json"):
        pgid = json.loads(job.read_text()).get("pid")
        for pid in localproc.run_processes(pgid) if isinstance(pgid, int) else ():
            try:
                procs.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
    state = [f.read_text() for f in (cwd / "runs").glob("*/state.json")]
    return (f"relax-submit did not end 90 s after Ctrl-C\n{sig}\n--- run processes:\n" + "\n".join(procs) +
            f"\n--- state.json: {state}\n--- stdout:\n{out_file.read_text()[-3000:]}\n"
            f"--- stderr:\n{err_file.read_text()[-12000:]}")


def _submit_held(no_slurm_env, tmp_path: Path, sigint) -> tuple[subprocess.Popen, Path, Path]:
    """relax-submit --local of the smoke recipe, the rollout role held ready (the run is going until it is
    stopped), started with SIGINT set to ``sigint``. Unbuffered, unwrapped output: its lines are in the files the
    moment it prints them. SIGUSR1 dumps its threads: if it ever hangs, the failure says where."""
    code = ("import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
            "from relax_hpc.launch.cli import submit_main; sys.exit(submit_main(sys.argv[1:]))")
    env = dict(no_slurm_env, RELAX_TEST_HOLD_ROLE="rollout", PYTHONUNBUFFERED="1", COLUMNS="1000")
    out_file, err_file = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_file, "w") as out, open(err_file, "w") as err:
        p = subprocess.Popen([sys.executable, "-c", code, "--local", str(SMOKE)], cwd=tmp_path, env=env,
                             stdout=out, stderr=err, preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    return p, out_file, err_file


def _wait_following(p: subprocess.Popen, out_file: Path, err_file: Path, cwd: Path, line: str) -> None:
    """Until relax-submit printed ``line`` (it follows the run: its Ctrl-C handler is in place) and the run is going."""
    deadline = time.monotonic() + 120
    while not (line in out_file.read_text() and going(cwd)):
        assert time.monotonic() < deadline and p.poll() is None, (out_file.read_text(), err_file.read_text())
        time.sleep(0.05)


def _ended_cancelled(p: subprocess.Popen, out_file: Path, err_file: Path, cwd: Path, env: dict) -> dict:
    try:
        p.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(_hang_report(p, out_file, err_file, cwd))
    finally:
        if p.poll() is None:
            p.kill()
    d = json.loads(cli("relax-status", "--json", cwd=cwd, env=env).stdout)
    assert d["state"] == "CANCELLED", d
    job = json.loads((cwd / "runs" / d["run"] / "job.json").read_text())
    assert not localproc.run_processes(job["pid"])  # nothing of the run is left
    return d


@pytest.mark.slow
def test_ctrl_c_in_foreground_cancels_the_run(no_slurm_env, tmp_path):
    # a terminal's foreground job gets SIGINT as Python's default handles it (the suite itself may run in the
    # background of a script, where SIGINT is ignored and every child inherits that)
    p, out_file, err_file = _submit_held(no_slurm_env, tmp_path, signal.SIG_DFL)
    try:
        _wait_following(p, out_file, err_file, tmp_path, "Ctrl-C cancels")
        p.send_signal(signal.SIGINT)
    finally:
        _ended_cancelled(p, out_file, err_file, tmp_path, no_slurm_env)
    assert p.returncode == 130, (out_file.read_text(), err_file.read_text())
    assert "cancelling" in err_file.read_text()


@pytest.mark.slow
def test_in_the_background_relax_submit_names_relax_cancel_not_ctrl_c(no_slurm_env, tmp_path):
    """Started with SIGINT ignored (``relax-submit ... &`` in a script): no Ctrl-C reaches it, and it does not
    promise one; relax-cancel, which it names, stops the run and relax-submit reports it."""
    p, out_file, err_file = _submit_held(no_slurm_env, tmp_path, signal.SIG_IGN)
    try:
        _wait_following(p, out_file, err_file, tmp_path, "SIGINT is ignored here")
        out = out_file.read_text()
        [run] = [d.name for d in (tmp_path / "runs").iterdir()]
        assert "Ctrl-C cancels" not in out and f"relax-cancel {run} cancels" in out, out
        c = cli("relax-cancel", run, cwd=tmp_path, env=no_slurm_env)
        assert c.returncode == 0, (c.stdout, c.stderr)
    finally:
        _ended_cancelled(p, out_file, err_file, tmp_path, no_slurm_env)
    assert p.returncode == 1 and "CANCELLED" in err_file.read_text(), (out_file.read_text(), err_file.read_text())


@pytest.mark.slurm
def test_sbatch_refusal_leaves_nothing_behind(slurm_cluster, tmp_path):
    """A request only sbatch can judge (an unknown node): exit 1, sbatch's words, the run directory removed."""
    p = cli("relax-submit", "--json", str(SMOKE), "slurm.sbatch_extra=[--nodelist=nosuchnode]", cwd=tmp_path)
    assert p.returncode == 1
    assert "Invalid node name" in p.stderr and json.loads(p.stdout)["error"] == "submission failed"
    assert no_run_dirs(tmp_path)


def test_resume_refuses_a_latest_naming_no_complete_checkpoint(no_slurm_env, tmp_path, capsys):
    """``latest`` names a checkpoint that is gone: relax-submit --resume refuses (exit 1, the file and the fix
    named) before anything is submitted or changed; metrics.jsonl keeps its 100 rows."""
    from relax_hpc.launch.cli import submit_main
    from relax_hpc.launch.submit import resume
    from relax_hpc.recipe import dump_recipe, recipe_from_dict
    from relax_hpc.rundir import create_run_dir, write_json, write_private
    from relax_hpc.train.latest import BrokenLatest

    rd = create_run_dir(tmp_path / "runs", "broken")
    write_private(rd.recipe, dump_recipe(recipe_from_dict({"run": {"name": "broken"}})))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_json(rd.job, {"run": rd.name, "run_dir": str(rd.path), "executor": "local", "job_id": str(dead.pid),
                        "pid": dead.pid, "pgid": dead.pid, "pid_start": 1, "submitted_at": time.time()})
    write_json(rd.state, {"run": rd.name, "state": "CANCELLED", "reason": "relax-cancel", "roles": {}})
    rows = "".join(json.dumps({"step": s, "rollout/raw_reward": 0.5}) + "\n" for s in range(1, 101))
    (rd.path / "metrics.jsonl").write_text(rows)
    ck = rd.path / "checkpoints"
    (ck / "step_00000090").mkdir(parents=True)
    (ck / "step_00000090" / "meta.json").write_text('{"step": 90}')
    (ck / "latest").write_text("step_00000100\n")  # pruned away, or never completed
    before = {p: p.read_bytes() for p in (rd.job, rd.state, ck / "latest")}

    with pytest.raises(BrokenLatest, match=r"checkpoints/latest names 'step_00000100', which does not exist"):
        resume(rd.path, "local")
    assert submit_main(["--resume", str(rd.path), "--local"]) == 1
    err = capsys.readouterr().err
    assert "latest names 'step_00000100'" in err and "echo step_00000090 >" in err, err
    assert (rd.path / "metrics.jsonl").read_text() == rows
    assert {p: p.read_bytes() for p in before} == before and not (rd.path / "submitit").exists()
