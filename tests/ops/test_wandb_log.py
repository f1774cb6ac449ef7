"""Weights & Biases beside TensorBoard, for real in offline mode: the files W&B writes are read back."""

import math

import pytest
import wandb_files

from relax_hpc.ops.metrics import RunMetrics
from relax_hpc.ops.wandb_log import STEP, check, credential_problems, public_config, run_id
from relax_hpc.recipe.schema import WandbConfig

pytest.importorskip("wandb")


def tb_scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wb_scalars(run_file):
    """tag -> [(rollout/step, value)], as a W&B chart plots them."""
    out: dict = {}
    for row in wandb_files.history(run_file):
        for k, v in row.items():
            if not k.startswith("_") and k != STEP:
                out.setdefault(k, []).append((row[STEP], v))
    return out


def same(a, b):
    return all(x[0] == y[0] and (x[1] == y[1] or (math.isnan(x[1]) and math.isnan(y[1])))
               for x, y in zip(a, b)) and len(a) == len(b)


def test_the_same_names_and_values_as_tensorboard_against_rollout_step(tmp_path):
    cfg = WandbConfig(project="relax-test", name="toy", tags=["t"], mode="offline")
    m = RunMetrics(tmp_path, wandb=cfg, run_name="toy", config={"algorithm": {"advantage_estimator": "grpo"}})
    for step in range(1, 4):
        m.log(step, {"rollout/raw_reward": step / 10, "train/loss": float("nan") if step == 2 else 0.5,
                     "perf/step_time": 1.0, "note": "x"})
    m.amend(2, {"eval/arith": 0.75})
    summary = m.finish({"run": "toy", "state": "COMPLETED", "reason": None, "total_steps": 3})

    [run_file] = wandb_files.run_files(tmp_path)
    assert summary["wandb"] == str(run_file.parent)
    tb, wb = tb_scalars(tmp_path / "tensorboard"), wb_scalars(run_file)
    assert set(wb) == set(tb) == {"rollout/raw_reward", "train/loss", "perf/step_time", "eval/arith"}
    for tag in tb:  # each W&B point is TensorBoard's (step, value), NaN included: a bad step shows in both
        assert same(sorted(wb[tag]), [(s, pytest.approx(v, rel=1e-6)) if not math.isnan(v) else (s, v)
                                      for s, v in sorted(tb[tag])]), tag
    assert math.isnan(dict(wb["train/loss"])[2])
    got = wandb_files.summary(run_file)
    assert got["reward_first10"] == pytest.approx(0.2) and got["steps"] == 3 and got["state"] == "COMPLETED"
    assert wandb_files.exit_code(run_file) == 0
    run = next(r.run for r in wandb_files.records(run_file) if r.WhichOneof("record_type") == "run")
    assert run.project == "relax-test" and run.display_name == "toy" and run.run_id == run_id(tmp_path)
    assert list(run.tags) == ["t"] and "algorithm" in run.config.SerializeToString().decode("utf-8", "replace")


def test_a_resumed_run_is_the_same_wandb_run_and_a_failed_one_says_so(tmp_path):
    cfg = WandbConfig(project="relax-test", mode="offline")
    first = RunMetrics(tmp_path, wandb=cfg)
    for step in (1, 2, 3):
        first.log(step, {"rollout/raw_reward": 0.1 * step})
    first.finish({"run": "r", "state": "REQUEUED", "reason": "time limit", "total_steps": 4})
    again = RunMetrics(tmp_path, start_step=2, wandb=cfg)  # step 3 is done again
    again.log(3, {"rollout/raw_reward": 0.9})
    again.finish({"run": "r", "state": "FAILED", "reason": "x", "total_steps": 4})

    files = wandb_files.run_files(tmp_path)
    assert len(files) == 2
    ids = {next(r.run.run_id for r in wandb_files.records(f) if r.WhichOneof("record_type") == "run") for f in files}
    assert ids == {run_id(tmp_path)}  # one W&B run: `wandb sync` puts both attempts in it
    assert [wandb_files.exit_code(f) for f in files] == [0, 1]
    assert wb_scalars(files[1])["rollout/raw_reward"] == [(3, 0.9)]  # the redone step, under its own rollout/step


def test_wandb_that_cannot_start_leaves_the_run_going_and_says_why(tmp_path, monkeypatch):
    """Online to a server that is not there (a compute node with no network): a warning, the reason in the
    summary, and TensorBoard and metrics.jsonl unchanged."""
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    m = RunMetrics(tmp_path, wandb=WandbConfig(project="p", mode="online", host="http://127.0.0.1:9",
                                               init_timeout_s=3))
    assert m.wandb_error and "127.0.0.1:9" in m.wandb_error
    m.log(1, {"rollout/raw_reward": 0.5})
    summary = m.finish({"run": "r", "state": "COMPLETED", "reason": None, "total_steps": 1})
    assert summary["wandb"] is None and "127.0.0.1:9" in summary["wandb_error"]
    assert tb_scalars(tmp_path / "tensorboard")["rollout/raw_reward"] == [(1, 0.5)]


def test_disabled_writes_nothing(tmp_path):
    m = RunMetrics(tmp_path, wandb=WandbConfig(project="p", mode="disabled"))
    m.log(1, {"rollout/raw_reward": 0.5})
    m.finish({"run": "r", "state": "COMPLETED", "reason": None, "total_steps": 1})
    assert not (tmp_path / "wandb").exists()


def test_run_ids_are_stable_per_directory_and_w_and_b_shaped(tmp_path):
    a, b = tmp_path / "My Run.v2", tmp_path / "other" / "My Run.v2"
    assert run_id(a) == run_id(a) != run_id(b)
    assert run_id(a).startswith("my-run-v2-") and len(run_id("x" * 200)) <= 64


def test_the_section_is_checked_by_name():
    assert check(WandbConfig(project="p")) == []
    [(key, _, msg)] = check(WandbConfig(project=""))
    assert key == "logging.wandb.project" and "Fix" in msg
    [(key, val, msg)] = check(WandbConfig(project="p", host="wandb.example.org"))
    assert key == "logging.wandb.host" and val == "wandb.example.org" and "https://" in msg
    [(key, val, _)] = check(WandbConfig(project="p", init_timeout_s=0))
    assert (key, val) == ("logging.wandb.init_timeout_s", 0)


def test_an_online_run_needs_a_key_the_job_will_see(tmp_path):
    cfg = WandbConfig(project="p", mode="online")
    [(key, val, msg)] = credential_problems(cfg, env={}, home=str(tmp_path))
    assert (key, val) == ("logging.wandb.mode", "online") and "wandb login" in msg and "mode: offline" in msg
    assert credential_problems(cfg, env={"WANDB_API_KEY": "k"}, home=str(tmp_path)) == []
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert credential_problems(cfg, env={}, home=str(tmp_path)) == []
    host = WandbConfig(project="p", mode="online", host="https://wandb.example.org")
    assert credential_problems(host, env={}, home=str(tmp_path))  # the key is for another server
    assert credential_problems(WandbConfig(project="p", mode="offline"), env={}, home=str(tmp_path)) == []


def test_the_config_w_and_b_gets_has_no_secrets():
    """An online run uploads its config: Apprise URLs keep their scheme only, other URLs lose user:password."""
    got = public_config({"logging": {"notify_urls": ["slack://T000/B000/XXXX", "mailto://u:p@x.org"]},
                         "opd": {"teacher_url": "https://user:pw@teacher:30000/generate"},
                         "model": {"path": "/m"}, "n": 3})
    assert got["logging"]["notify_urls"] == ["slack://...", "mailto://..."]
    assert got["opd"]["teacher_url"] == "https://teacher:30000/generate"
    assert got["model"] == {"path": "/m"} and got["n"] == 3


def test_no_w_and_b_file_holds_a_recipe_secret(tmp_path, monkeypatch):
    """The config W&B writes to its files (and uploads, online or through wandb sync) is the controller's recipe with
    its secrets masked: a slurm.env token, a container variable named like a key, a notification URL's password.
    The token in the controller's environment (as the launcher sets slurm.env there) is not written either."""
    from relax_hpc.recipe import recipe_from_dict, recipe_to_dict

    canary = "canary-3a8f61d2"
    monkeypatch.setenv("HF_TOKEN", f"{canary}-env")
    recipe = recipe_from_dict({"slurm": {"env": {"HF_TOKEN": f"{canary}-env"},
                                         "container": {"runtime": "pyxis", "image": "i.sqsh",
                                                       "env": {"MY_API_KEY": f"{canary}-ct"}}},
                               "logging": {"notify_urls": [f"json://relax:{canary}-url@localhost/hook"]}})
    config = public_config(recipe_to_dict(recipe))
    assert config["slurm"]["env"] == {"HF_TOKEN": "***"} and config["logging"]["notify_urls"] == ["json://..."]
    m = RunMetrics(tmp_path, wandb=WandbConfig(project="relax-test", mode="offline"), run_name="s", config=config)
    m.log(1, {"rollout/raw_reward": 0.5})
    m.finish({"run": "s", "state": "COMPLETED", "reason": None, "total_steps": 1})
    [run_file] = wandb_files.run_files(tmp_path)
    files = [p for p in (tmp_path / "wandb").rglob("*") if p.is_file() and not p.is_symlink()]
    assert run_file in files and any(p.name.startswith("debug") for p in files)
    assert [p for p in files if canary.encode() in p.read_bytes()] == []
    assert "HF_TOKEN" in run_file.read_bytes().decode("utf-8", "replace")  # the config is there, masked
