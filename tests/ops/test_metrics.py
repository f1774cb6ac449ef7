"""Run metrics: TensorBoard scalars under the names they came with, metrics.jsonl, summary.json, reward.png."""

import json
import math

from relax_hpc.ops.metrics import RunMetrics, numeric


def test_numeric_keeps_numbers_nan_and_inf_included_and_drops_the_rest():
    got = numeric({"a": 1, "b": 2.5, "c": float("nan"), "g": float("-inf"), "d": "x", "e": True, "f": None})
    assert set(got) == {"a", "b", "c", "g"} and got["a"] == 1.0 and got["b"] == 2.5
    assert math.isnan(got["c"]) and got["g"] == float("-inf")


def test_nan_and_inf_reach_metrics_jsonl_tensorboard_and_the_readers(tmp_path):
    """A step that trained on NaN says so everywhere a person or a tool looks (a dropped value would hide it)."""
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = RunMetrics(tmp_path)
    m.log(1, {"rollout/raw_reward": 0.5, "train/loss": 0.25, "train/grad_norm": 1.0})
    m.log(2, {"rollout/raw_reward": float("inf"), "train/loss": float("nan"), "train/grad_norm": float("inf"),
              "train/nonfinite_skipped": 1.0})
    m.amend(2, {"eval/arith": float("nan")})  # the rewrite path keeps them too
    summary = m.finish({"run": "r", "state": "COMPLETED", "reason": None, "total_steps": 2})

    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" in text and "Infinity" in text
    rows = [json.loads(line) for line in text.splitlines()]
    assert math.isnan(rows[1]["train/loss"]) and rows[1]["train/grad_norm"] == math.inf
    assert math.isnan(rows[1]["eval/arith"]) and rows[1]["train/nonfinite_skipped"] == 1.0
    assert summary["reward_final"] == math.inf and json.loads((tmp_path / "summary.json").read_text())["steps"] == 2

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss[0] == (1, 0.25) and loss[1][0] == 2 and math.isnan(loss[1][1])
    assert [e.value for e in acc.Scalars("train/grad_norm")] == [1.0, math.inf]
    assert math.isnan(acc.Scalars("eval/arith")[0].value)

    # tools/compare-runs reads the rows and counts equal non-finite values as equal, one-sided ones as different
    path = Path(__file__).resolve().parents[2] / "tools" / "compare-runs"
    loader = importlib.machinery.SourceFileLoader("compare_runs", str(path))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("compare_runs", loader))
    loader.exec_module(mod)
    assert math.isnan(mod.steps(tmp_path)[2]["train/loss"])
    assert mod.diff(math.nan, math.nan) == 0.0 and mod.diff(math.inf, math.inf) == 0.0
    assert mod.diff(math.nan, 1.0) == math.inf and mod.diff(math.inf, -math.inf) == math.inf
    assert mod.diff(1.0, 1.5) == 0.5


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


def test_the_summary_carries_each_eval_sets_first_and_last_pass1_and_survives_a_resume(tmp_path):
    """eval_first/eval_last: eval/<set>-pass@1 at the first and the last step evaluated (step 0's row is the eval
    before training); a resumed attempt reads them back from metrics.jsonl; summary_line says them."""
    from relax_hpc.ops.metrics import summary_line

    m = RunMetrics(tmp_path, tensorboard=False)
    m.amend(0, {"eval/arith": 0.02, "eval/arith-pass@1": 1 / 55})
    for step in (1, 2):
        m.log(step, {"rollout/raw_reward": 0.1 * step})
    m.amend(2, {"eval/arith-pass@1": 54 / 55, "eval/other-pass@1": 0.5})
    m.close()
    again = RunMetrics(tmp_path, tensorboard=False, start_step=2)  # a resume after step 2
    s = again.finish({"run": "r", "state": "COMPLETED"})
    assert s["eval_first"] == {"arith": 1 / 55} and s["eval_first_step"] == 0
    assert s["eval_last"] == {"arith": 54 / 55, "other": 0.5} and s["eval_last_step"] == 2
    assert "eval arith pass@1 0.018 (step 0) -> 0.982 (step 2)" in summary_line(s)
    (tmp_path / "none").mkdir()
    assert RunMetrics(tmp_path / "none", tensorboard=False).eval_ends() == {}  # no eval: no eval_* keys


def test_plot_marks_are_drawn_on_reward_png(tmp_path):
    """logging.plot_marks: labelled levels on reward.png (the same curve with and without them differs only there)."""
    from relax_hpc.ops.metrics import plot_rewards

    steps, rewards = list(range(1, 21)), [0.05 * s for s in range(1, 21)]
    plot_rewards(tmp_path / "plain.png", steps, rewards, title="t")
    plot_rewards(tmp_path / "marks.png", steps, rewards, title="t", marks={"chance": 0.1, "ceiling": 1.0})
    plot_rewards(tmp_path / "evals.png", steps, rewards, title="t", evals={0: {"arith": 0.02}, 20: {"arith": 0.98}})
    plain = (tmp_path / "plain.png").read_bytes()
    assert (tmp_path / "marks.png").read_bytes() != plain and (tmp_path / "evals.png").read_bytes() != plain
