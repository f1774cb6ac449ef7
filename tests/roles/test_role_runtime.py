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
from relax_hpc.identity import Identity, cross_members, reachable_host
from relax_hpc.roles.runtime import CONTROLLER_LOST_EXIT
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
    from relax_hpc.controller.messages import GenerateResult, GenerateTask, StopTask
    from relax_hpc.roles.runtime import RoleContext
    from relax_hpc.roles.tasks import serve

    ch = Channel(run.token(), "127.0.0.1")
    write_json(run.controller_addr, {"host": "127.0.0.1", "port": ch.port})
    monkeypatch.setenv("RELAX_RANK", "0")
    monkeypatch.setenv("RELAX_WORLD_SIZE", "1")
    ctx = RoleContext("rollout", run.path)
    shown = []

    def generate(task):
        assert isinstance(task, GenerateTask) and task.step == 7  # the handler gets the typed task
        shown.append(ctx.info["task"])
        ctx.progress()
        ctx.progress(2)
        shown.append(ctx.info["task"])
        ctx.report("ready")  # a heartbeat now, with what the task shows
        return GenerateResult(chunks=[])

    ch.assign("rollout", GenerateTask(id=1, step=7, engines={}, seq=0, data_state=None).to_dict())
    ch.assign("rollout", StopTask(id=2).to_dict())
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


def _serve_once(run, monkeypatch, task: dict, handler):
    """serve() one ``task`` (then stop) with ``handler`` for its kind; the task_done results the controller got and
    what serve raised."""
    from relax_hpc.controller.messages import StopTask
    from relax_hpc.roles.runtime import RoleContext
    from relax_hpc.roles.tasks import serve

    ch = Channel(run.token(), "127.0.0.1")
    write_json(run.controller_addr, {"host": "127.0.0.1", "port": ch.port})
    monkeypatch.setenv("RELAX_RANK", "0")
    monkeypatch.setenv("RELAX_WORLD_SIZE", "1")
    ctx = RoleContext("actor", run.path)
    ch.assign("actor", task)
    ch.assign("actor", StopTask(id=99).to_dict())
    raised = None
    try:
        serve(ctx, None, {task["kind"]: handler, "stop": lambda t: None})
    except Exception as e:
        raised = e
    finally:
        ctx.close()
        done = [m for _, m in ch.drain(1.0) if m["type"] == "task_done"]
        ch.close()
    return {m["task_id"]: m["result"] for m in done}, raised


def test_serve_sends_the_typed_result_as_its_dict(run, monkeypatch):
    from relax_hpc.controller.messages import TrainResult, TrainTask

    got = []
    chunk = {"path": "/x/step_3/chunk_rollout_0.h5", "step": 3, "n": 1, "fields": ["tokens"], "checksum": "c",
             "size": 1, "attrs": {}, "sides": []}
    task = TrainTask(id=1, step=3, chunks=[chunk])
    done, raised = _serve_once(run, monkeypatch, task.to_dict(),
                               lambda t: got.append(t) or TrainResult(metrics={"train/loss": 0.5}))
    assert raised is None and got == [task]
    assert done == {1: {"metrics": {"train/loss": 0.5}}, 99: {}}


def test_a_malformed_task_fails_with_the_message_error(run, monkeypatch):
    from relax_hpc.controller.messages import MessageError

    called = []
    done, raised = _serve_once(run, monkeypatch, {"id": 1, "kind": "train", "step": "3", "chunks": []}, called.append)
    assert isinstance(raised, MessageError) and not called  # the handler never sees it; the role fails
    assert done[1]["error"].startswith("MessageError: malformed train task: field 'step': expected int, got str '3'")
    assert done[1]["restartable"] is False


def test_a_result_of_the_wrong_type_fails_the_task(run, monkeypatch):
    from relax_hpc.controller.messages import TrainTask

    done, raised = _serve_once(run, monkeypatch, TrainTask(id=1, step=3, chunks=[]).to_dict(),
                               lambda t: {"metrics": {}})  # a plain dict: not the train result
    assert raised is not None
    assert "malformed train result" in done[1]["error"] and "expected TrainResult, got dict" in done[1]["error"]
