"""The role side: identity from the environment, the file rendezvous, and a role never outliving its controller."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import relax_hpc

from relax_hpc.controller.channel import Channel
from relax_hpc.recipe import dump_recipe, load_recipe
from relax_hpc.roles.runtime import CONTROLLER_LOST_EXIT, Identity, cross_members, reachable_host
from relax_hpc.rundir import create_run_dir, write_json


def test_identity_prefers_the_local_launcher_over_slurm():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURMD_NODENAME": "node2"}
    assert Identity.from_env("actor", env) == Identity("actor", 3, 4, 1, "node2")
    env.update(RELAX_RANK="0", RELAX_WORLD_SIZE="2", RELAX_LOCAL_RANK="0", RELAX_NODE="localhost")
    assert Identity.from_env("actor", env) == Identity("actor", 0, 2, 0, "localhost")
    assert reachable_host(Identity.from_env("actor", env)) == "127.0.0.1"


def test_cross_group_members_are_the_actor_then_the_other_roles(tmp_path):
    both = {"roles": {"reference": {"enabled": True}, "actor_fwd": {"enabled": True, "share_with": "reference"}}}
    assert cross_members(recipe_from(tmp_path, both)) == ["actor", "rollout", "reference", "actor_fwd"]
    assert cross_members(recipe_from(tmp_path, {})) == ["actor", "rollout"]


def recipe_from(tmp_path, data):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_recipe(path)


@pytest.fixture
def run(tmp_path):
    rd = create_run_dir(tmp_path / "runs", "r")
    fast = {"logging": {"heartbeat_s": 0.2, "heartbeat_timeout_s": 1.5}}
    rd.recipe.write_text(dump_recipe(recipe_from(tmp_path, fast)))
    return rd


def test_file_rendezvous_ignores_a_file_from_an_earlier_attempt(run, monkeypatch):
    from relax_hpc.roles import comm
    from relax_hpc.roles.runtime import RoleContext

    ch = Channel(run.token(), "127.0.0.1")
    write_json(run.controller_addr, {"host": "127.0.0.1", "port": ch.port})
    monkeypatch.setenv("RELAX_LAUNCH_ID", "new")
    monkeypatch.setenv("RELAX_RANK", "1")
    monkeypatch.setenv("RELAX_WORLD_SIZE", "2")
    ctx = RoleContext("actor", run.path)
    path = run.rendezvous / "actor.json"
    write_json(path, {"host": "127.0.0.1", "port": 1, "launch_id": "old"})
    with pytest.raises(TimeoutError):
        comm._wait_for_file(ctx, path, 0.3)
    write_json(path, {"host": "127.0.0.1", "port": 2, "launch_id": "new"})
    assert comm._wait_for_file(ctx, path, 0.3) == ("127.0.0.1", 2)
    ctx.close()
    ch.close()


def test_a_rank_exits_when_the_controller_is_gone(run):
    ch = Channel(run.token(), "127.0.0.1")
    write_json(run.controller_addr, {"host": "127.0.0.1", "port": ch.port})
    code = (f"from relax_hpc.roles.runtime import RoleContext\nimport time\n"
            f"ctx = RoleContext('rollout', {str(run.path)!r})\nctx.hello()\nctx.start_heartbeat()\n"
            f"print('up', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": _package_root()})
    try:
        assert p.stdout.readline().strip() == "up"
        ch.close()  # the controller dies
        t0 = time.monotonic()
        assert p.wait(timeout=20) == CONTROLLER_LOST_EXIT
        assert time.monotonic() - t0 < 10
        assert "no answer from the controller" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _package_root():
    return str(Path(relax_hpc.__file__).resolve().parents[1])


def test_heartbeats_show_the_task_in_hand_and_its_progress(run, monkeypatch):
    """serve() shows each task in ctx.info while it runs (the controller's hung-task check reads it), the
    controller accepts what it shows, and "no task" afterwards is an explicit None (info is merged)."""
    from relax_hpc.roles.runtime import RoleContext
    from relax_hpc.roles.tasks import serve

    ch = Channel(run.token(), "127.0.0.1")
    write_json(run.controller_addr, {"host": "127.0.0.1", "port": ch.port})
    monkeypatch.setenv("RELAX_RANK", "0")
    monkeypatch.setenv("RELAX_WORLD_SIZE", "1")
    ctx = RoleContext("rollout", run.path)
    shown = []

    def generate(task):
        shown.append(ctx.info["task"])
        ctx.progress()
        ctx.progress(2)
        shown.append(ctx.info["task"])
        ctx.report("ready")  # a heartbeat now, with what the task shows
        return {}

    ch.assign("rollout", {"id": 1, "kind": "generate", "step": 7, "engines": {}})
    ch.assign("rollout", {"id": 2, "kind": "stop"})
    try:
        serve(ctx, None, {"generate": generate, "stop": lambda task: None})
        p = shown[0]["progress"]
        assert shown == [{"id": 1, "kind": "generate", "step": 7, "progress": p},
                         {"id": 1, "kind": "generate", "step": 7, "progress": p + 3}]
        assert ctx.info["task"] is None
        beats = [m for _, m in ch.drain(1.0) if m["type"] == "heartbeat"]
        assert [m["info"]["task"] for m in beats] == [shown[1]]  # validated and queued for the loop
        ctx.report("ready")
        assert [m["info"]["task"] for _, m in ch.drain(1.0) if m["type"] == "heartbeat"] == [None]
    finally:
        ctx.close()
        ch.close()
