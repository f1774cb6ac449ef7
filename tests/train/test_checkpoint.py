"""Must-show 3: save at step k, resume in a fresh process, and the next steps' losses and grad norms are
bit-identical to the uninterrupted run (DistributedOptimizer sharded over DP=2 included); a TP=2
checkpoint resumes at TP=1 (and a DP=2 DistributedOptimizer checkpoint at TP=2, DP=1).

The rest, on plain directories (no Megatron): ``latest`` and pruning, and the fsync walk.

The uninterrupted runs (K steps, save, N more) are part of the ``multi_run`` launch (conftest); one
fresh two-process launch here resumes all four combinations.
Timeouts everywhere: a dist_checkpointing save that loses its writer process hangs instead of failing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train.conftest import RESUME_ARGS, part, resume_layouts
from train.launch import run_job

@pytest.fixture(scope="module")
def resumed(tiny_models, multi_run) -> tuple[dict, dict]:
    ref = part(multi_run, "resume_save")
    root = Path(multi_run["ckpt_root"])
    same = resume_layouts(root)
    by_name = {l["name"]: l for l in same}
    swapped = [dict(by_name["tp2"], name="tp2_at_tp1", tp=1),  # TP=2 checkpoint -> TP=1 (DP=2)
               dict(by_name["dp2"], name="dp2_at_tp2", tp=2)]  # DP=2-sharded optimizer -> TP=2, DP=1
    args = dict(RESUME_ARGS, mode="load", hf=tiny_models["qwen3"], layouts=same + swapped)
    got = run_job("resume", args, nproc=2, out_dir=root / "load", timeout=300)
    assert "error" not in got, got.get("error")
    return ref, got


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_same_layout_is_bit_exact(resumed):
    ref, got = resumed
    for name in ("dp2", "tp2"):
        print(f"[resume {name}] uninterrupted (loss, grad_norm) {ref[name]['steps']}\n"
              f"[resume {name}] resumed                       {got[name]['steps']}"
              f"  (save {ref[name]['save_s']:.1f} s, load {got[name]['load_s']:.1f} s)")
        assert got[name]["extra"] == {"data_pos": RESUME_ARGS["k"], "note": "hello"}
        assert got[name]["step_after_load"] == RESUME_ARGS["k"]
        assert all(g > 0 for _, g in ref[name]["steps"])  # real updates, not all-clipped
        assert got[name]["steps"] == ref[name]["steps"]  # float equality: bit-identical


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_at_other_layout(resumed):
    ref, got = resumed
    for name, src in (("tp2_at_tp1", "tp2"), ("dp2_at_tp2", "dp2")):
        worst = max(abs(a - b) for s, t in zip(ref[src]["steps"], got[name]["steps"]) for a, b in zip(s, t))
        print(f"[resume {name}] max |diff| of losses and grad norms vs uninterrupted {src}: {worst:.2e}")
        assert got[name]["step_after_load"] == RESUME_ARGS["k"]
        assert worst <= 1e-5, (ref[src]["steps"], got[name]["steps"])


# ------------------------------------------------------------------ latest, pruning, fsync (no Megatron) ---

def fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    from relax_hpc.train.latest import step_dir_name

    d = root / step_dir_name(step)
    (d / "rng").mkdir(parents=True)
    (d / "common.pt").write_bytes(b"x" * 10)
    (d / "rng" / "rank_00000.pt").write_bytes(b"r")
    if complete:
        (d / "meta.json").write_text(json.dumps({"step": step, "extra_state": {"step": step}}))
    return d


def point_latest(root: Path, step: int) -> None:
    from relax_hpc.train.latest import LATEST, step_dir_name

    (root / LATEST).write_text(step_dir_name(step) + "\n")


def test_prune_never_deletes_the_checkpoint_latest_names(tmp_path):
    """A run resumed from step 2 (keep 2) while steps 6 and 8 of its earlier life are still on disk: pruning
    after the save of step 4 keeps 4 (latest) and 2, leaves the later ones for the resumed run to overwrite."""
    from relax_hpc.train.checkpoint import _prune

    for s in (2, 6, 8):
        fake_checkpoint(tmp_path, s)
    fake_checkpoint(tmp_path, 1)
    fake_checkpoint(tmp_path, 3, complete=False)  # a save killed half way: not counted, not deleted
    fake_checkpoint(tmp_path, 4)
    point_latest(tmp_path, 4)
    _prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_00000002", "step_00000003", "step_00000004", "step_00000006", "step_00000008"]
    point_latest(tmp_path, 8)  # the usual case: latest is the newest
    _prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000008"]


def test_read_latest_refuses_a_latest_that_names_no_complete_checkpoint(tmp_path):
    from relax_hpc.train.latest import BrokenLatest, read_latest

    assert read_latest(tmp_path) is None  # no latest: a run that has not checkpointed yet
    fake_checkpoint(tmp_path, 2)
    point_latest(tmp_path, 2)
    step_dir, meta = read_latest(tmp_path)
    assert step_dir.name == "step_00000002" and meta["step"] == 2
    point_latest(tmp_path, 5)  # missing
    with pytest.raises(BrokenLatest, match=r"latest names 'step_00000005', which does not exist.*"
                                           r"echo step_00000002 > .*latest.*delete"):
        read_latest(tmp_path)
    fake_checkpoint(tmp_path, 5, complete=False)  # incomplete
    with pytest.raises(BrokenLatest, match=r"not a complete checkpoint \(no meta.json\)"):
        read_latest(tmp_path)
    (tmp_path / "latest").write_text("")
    with pytest.raises(BrokenLatest, match="is empty"):
        read_latest(tmp_path)


def test_fsync_tree_syncs_every_file_and_directory(tmp_path, monkeypatch):
    """dist_checkpointing writes without fsync: the walk fsyncs every file and directory before latest moves
    (observed through a pass-through spy on os.fsync: the real fsync still runs)."""
    import os

    from relax_hpc.train import checkpoint

    d = fake_checkpoint(tmp_path, 1)
    synced, real = [], os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    assert checkpoint.fsync_tree(d) == 3
    assert sorted(synced) == sorted(str(p) for p in (d, d / "common.pt", d / "meta.json", d / "rng",
                                                     d / "rng" / "rank_00000.pt"))
