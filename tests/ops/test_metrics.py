"""Run metrics: TensorBoard scalars under the names they came with, metrics.jsonl, summary.json, reward.png."""

import json

from relax_hpc.ops.metrics import RunMetrics, numeric


def test_numeric_keeps_finite_numbers_only():
    assert numeric({"a": 1, "b": 2.5, "c": float("nan"), "d": "x", "e": True, "f": None}) == {"a": 1.0, "b": 2.5}


def test_steps_go_to_tensorboard_jsonl_and_the_summary(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = RunMetrics(tmp_path)
    for step in range(1, 26):
        m.log(step, {"rollout/raw_reward": step / 100, "train/grad_norm": 1.0, "perf/step_time": 2.0, "note": "x"})
    summary = m.finish({"run": "r", "state": "COMPLETED", "reason": None, "total_steps": 25})

    assert summary["steps"] == 25 and summary["reward_window"] == 10
    assert abs(summary["reward_first10"] - 0.055) < 1e-9 and abs(summary["reward_last10"] - 0.205) < 1e-9
    assert summary["reward_final"] == 0.25
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 26)) and "note" not in rows[0]

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"rollout/raw_reward", "train/grad_norm", "perf/step_time"} <= set(acc.Tags()["scalars"])
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("rollout/raw_reward")][:2] == [(1, 0.01), (2, 0.02)]


def test_a_run_without_steps_still_gets_a_summary(tmp_path):
    summary = RunMetrics(tmp_path, tensorboard=False).finish({"run": "r", "state": "FAILED", "reason": "boom"})
    assert summary["steps"] == 0 and summary["reward_first10"] is None and summary["reward_png"] is None
    assert summary["reason"] == "boom" and not (tmp_path / "reward.png").exists()
