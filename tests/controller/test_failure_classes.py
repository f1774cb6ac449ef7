"""Which failures a restart may fix (relax_hpc.errors.verdict), and how a role reports a full disk.

An error that will repeat (bad data, a user function that does not load, an input error while a role loads its
inputs) and a full disk fail the run at once; a crash, a broken collective, an engine that died are restarted.
Real errors throughout: a real bad dataset, a real missing plugin, a real full filesystem (tmpfs)."""

from __future__ import annotations

import pytest

from ctl_helpers import make_run
from relax_hpc.controller.channel import Channel
from relax_hpc.errors import NO_SPACE, PERMANENT, PermanentError, is_permanent, no_space, verdict
from relax_hpc.plugins import load_plugin
from relax_hpc.rollout.data import DataKeys, PromptDataset
from relax_hpc.rundir import write_json


def raised(fn, *args, **kw) -> BaseException:
    try:
        fn(*args, **kw)
    except BaseException as e:  # noqa: BLE001 (the error is what the test looks at)
        return e
    raise AssertionError(f"{fn} did not raise")


def full_disk_error(disk) -> OSError:
    disk.fill()
    return raised((disk.path / "chunk.h5").write_bytes, b"x" * 8192)


def test_bad_data_and_a_plugin_that_does_not_load_are_permanent(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"question": "1+1=", "label": "2"}\n')
    for e in (raised(PromptDataset, bad, keys=DataKeys(input_key="prompt")),
              raised(PromptDataset, tmp_path / "missing.jsonl"),
              raised(load_plugin, "no_such_module_here.reward", "rollout.custom_rm_path")):
        assert verdict(e) == PERMANENT and is_permanent(e), e
        assert isinstance(e, ValueError)  # still what callers of the old loaders catch


def test_input_errors_are_permanent_only_while_a_role_loads_its_inputs():
    for e in (ValueError("Unrecognized model in /models/x"), KeyError("vocab_size"), FileNotFoundError(2, "x"),
              ModuleNotFoundError("no module named 'vllm'"), AssertionError("heads % tp")):
        assert verdict(e, loading=True) == PERMANENT, e
        assert verdict(e) is None, e  # later a task's own verdict says it (roles/tasks.py), or a restart may help
    for e in (RuntimeError("NCCL error: unhandled system error"), ConnectionRefusedError(111, "refused"),
              TimeoutError("store"), MemoryError(), KeyboardInterrupt(), SystemExit(1)):
        assert verdict(e, loading=True) is None, e  # what a restart can fix, or the process told to go


def test_a_full_disk_is_its_own_class_whatever_carries_it(small_disk):
    e = full_disk_error(small_disk(1))
    assert verdict(e) == NO_SPACE and no_space(e) is e
    try:
        try:
            raise e
        except OSError as inner:
            raise PermanentError("checkpoint step 3 could not be saved") from inner
    except PermanentError as outer:
        assert verdict(outer) == NO_SPACE  # the disk, not the permanent wrapper: a resume works once space is freed
    text_only = RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos; No space left on device")
    assert verdict(text_only) == NO_SPACE  # errno lost on the way (torch, HDF5): the text still says it
    assert verdict(RuntimeError("Disk quota exceeded (os error 122)")) == NO_SPACE
    assert verdict(RuntimeError("file write failed")) is None


def _serve(run, monkeypatch, handler):
    """Serve one train task with ``handler`` over a real control socket; the task_done result the controller got."""
    from relax_hpc.controller.messages import StopTask, TrainTask
    from relax_hpc.roles.runtime import RoleContext
    from relax_hpc.roles.tasks import serve

    ch = Channel(run.token(), "127.0.0.1")
    write_json(run.controller_addr, {"host": "127.0.0.1", "port": ch.port})
    monkeypatch.setenv("RELAX_RANK", "0")
    monkeypatch.setenv("RELAX_WORLD_SIZE", "1")
    ctx = RoleContext("actor", run.path)
    ch.assign("actor", TrainTask(id=1, step=3, chunks=[]).to_dict())
    ch.assign("actor", StopTask(id=2).to_dict())
    try:
        with pytest.raises(Exception):
            serve(ctx, None, {"train": handler, "stop": lambda t: None})
    finally:
        ctx.close()
        done = [m for _, m in ch.drain(1.0) if m["type"] == "task_done"]
        ch.close()
    return done[0]["result"]


class EngineGone(RuntimeError):
    restartable = True  # like WeightSyncError: the machinery broke


def test_a_task_that_hits_a_full_disk_reports_the_mount_point_and_is_never_restarted(tmp_path, small_disk,
                                                                                      monkeypatch):
    disk = small_disk(8)
    run = make_run(disk.path)

    def train(task):
        try:
            raise full_disk_error(disk)  # a write of this task's, on the run's disk
        except OSError as inner:
            raise EngineGone("the sync's staging file could not be written") from inner

    res = _serve(run, monkeypatch, train)
    assert res["restartable"] is False  # restarting into the same full disk would fail the same way
    assert res["error"].startswith(f"no space left on {disk.path} (No space left on device). Fix: free space on "
                                   f"{disk.path} (or raise the quota), then relax-submit --resume {run.path}")


def test_a_task_with_bad_data_is_not_restartable(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    res = _serve(run, monkeypatch, lambda task: PromptDataset(tmp_path / "missing.jsonl"))
    assert res["restartable"] is False and res["error"].startswith("DataError: ")


def test_a_rank_dying_of_an_error_reports_its_verdict_and_reason(tmp_path, small_disk, monkeypatch):
    """What roles/runtime.main sends with the ``error`` it reports (the controller restarts only for None)."""
    from relax_hpc.roles.runtime import RoleContext, classify

    disk = small_disk(8)
    run = make_run(disk.path)
    ch = Channel(run.token(), "127.0.0.1")
    write_json(run.controller_addr, {"host": "127.0.0.1", "port": ch.port})
    monkeypatch.setenv("RELAX_RANK", "0")
    monkeypatch.setenv("RELAX_WORLD_SIZE", "1")
    ctx = RoleContext("rollout", run.path)
    try:
        bad = raised(PromptDataset, tmp_path / "missing.jsonl")
        assert classify(ctx, bad, loading=False) == (PERMANENT, f"DataError: {tmp_path / 'missing.jsonl'}: no such "
                                                                "file or directory")
        assert classify(ctx, ValueError("Unrecognized model"), loading=True) == (PERMANENT, "ValueError: "
                                                                                 "Unrecognized model")
        assert classify(ctx, ValueError("Unrecognized model"), loading=False) == (None, None)
        assert classify(ctx, RuntimeError("gloo: connection closed by peer"), loading=True) == (None, None)
        v, reason = classify(ctx, full_disk_error(disk), loading=False)
        assert v == NO_SPACE and reason.startswith(f"no space left on {disk.path} (No space left on device). Fix:")
    finally:
        ctx.close()
        ch.close()
