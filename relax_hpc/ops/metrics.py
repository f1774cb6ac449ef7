"""Run metrics, written by the controller: TensorBoard scalars, ``metrics.jsonl``, ``summary.json``, ``reward.png``.

Every metric a role returns for a step goes to TensorBoard under the name it came with (Relax's names:
``rollout/raw_reward``, ``rollout/response_len/mean``, ``train/pg_loss``, ``train/grad_norm``,
``train/loss``, ``perf/rollout_time``, ``perf/train_time``, ``perf/weight_sync_time``, ``perf/step_time``,
``eval/...``), with the rollout step as TensorBoard's step, into ``RUN_DIR/tensorboard``; and as one JSON
line per step into ``RUN_DIR/metrics.jsonl`` (what tests and the summary read; no TensorBoard needed).

Eval results (``eval/...``) come after their step's row is written (the eval runs on the weights the step's sync
put on the engines): :meth:`RunMetrics.amend` adds them to that row, so a step keeps one row. The eval before
training is step 0's row (``eval/*`` only, no reward: the summary does not count it as a step).

At the end of a run :meth:`RunMetrics.finish` writes ``summary.json`` (mean reward of the first and of the
last 10 steps, steps done, wall time, final state) and ``reward.png`` (mean raw reward per step, matplotlib
with the Agg backend: no display needed). The writer is TensorBoard's own event-file writer (the package
``tensorboard``), so the controller never imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

from relax_hpc.rundir import write_json

log = logging.getLogger("relax_hpc.metrics")

REWARD = "rollout/raw_reward"
PASS1 = "-pass@1"  # eval/<set>-pass@1: the share of an eval set's prompts answered right (reward >= 1)
WINDOW = 10  # steps averaged at each end of the run for summary.json


class TensorBoardWriter:
    """Scalars into an event file under ``logdir`` (TensorBoard's EventFileWriter; no torch)."""

    def __init__(self, logdir: str | os.PathLike):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._Event, self._Summary = Event, Summary
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._w = EventFileWriter(str(logdir), flush_secs=5)
        self._w.add_event(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        vals = [self._Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
        if vals:
            self._w.add_event(self._Event(wall_time=wall_time or time.time(), step=int(step),
                                          summary=self._Summary(value=vals)))

    def purge_from(self, step: int) -> None:
        """Hide the events at ``step`` and later that earlier attempts wrote (steps a resumed run does again):
        TensorBoard drops them when it reads a START session log at that step, so a curve stays one curve."""
        from tensorboard.compat.proto.event_pb2 import SessionLog

        self._w.add_event(self._Event(wall_time=time.time(), step=int(step),
                                      session_log=SessionLog(status=SessionLog.START)))

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a dict as floats (what can be a TensorBoard scalar); NaN and ±inf kept: a step whose loss
    was NaN must say so (``metrics.jsonl`` writes them as JSON's ``NaN``/``Infinity``, which ``json.loads``
    reads). Strings, bools and the rest are left out."""
    return {str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class RunMetrics:
    """The controller's metrics sink for one run: ``log`` a step's metrics, ``finish`` once at the end.

    ``start_step``: the step the run resumes after (its checkpoint's; 0 for a fresh start). What an earlier
    attempt logged up to it is kept (``metrics.jsonl`` and the same TensorBoard directory, so the curves go
    on); what it logged after is dropped, because this attempt does those steps again."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, start_step: int = 0,
                 started: float | None = None, wandb: Any = None, run_name: str | None = None,
                 config: dict[str, Any] | None = None, plot_marks: dict[str, float] | None = None):
        self.dir = Path(run_dir)
        self.plot_marks = dict(plot_marks or {})  # logging.plot_marks: labelled levels drawn on reward.png
        self.rewards: dict[int, float] = {}
        self.evaluated: set[int] = set()  # steps whose row has eval/* metrics (kept from an earlier attempt too)
        self.pass1: dict[int, dict[str, float]] = {}  # step -> {eval set: eval/<set>-pass@1}, for the summary and plot
        self.started = started or time.time()
        earlier = self._keep_until(start_step)
        self._tb: TensorBoardWriter | None = None
        if tensorboard:
            try:
                self._tb = TensorBoardWriter(self.dir / "tensorboard")
            except ImportError as e:  # the package is in requirements; still, never fail a run over it
                log.warning("no TensorBoard events (cannot import tensorboard: %s); metrics.jsonl still has them", e)
        if self._tb is not None and earlier:
            self._tb.purge_from(start_step + 1)
        self._wb = None  # logging.wandb (ops/wandb_log.py): a view of the same scalars, never the record
        self.wandb_error: str | None = None  # why W&B is off in a run that asked for it
        if wandb is not None and wandb.mode != "disabled":
            try:
                from relax_hpc.ops.wandb_log import WandbWriter

                self._wb = WandbWriter(wandb, self.dir, run_name or self.dir.name, config)
            except Exception as e:  # no network, a bad key: the run goes on, and says so
                self.wandb_error = f"{type(e).__name__}: {e}"
                log.warning("no W&B logging (%s); TensorBoard and metrics.jsonl still have every metric",
                            self.wandb_error)
        self._jsonl = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")

    def _to_wandb(self, step: int, vals: dict[str, float]) -> None:
        if self._wb is None:
            return
        try:
            self._wb.scalars(step, vals)
        except Exception as e:  # W&B going away mid-run must not end it; it stops being fed, once, loudly
            self.wandb_error = f"{type(e).__name__}: {e}"
            log.warning("W&B logging stopped at step %d (%s); TensorBoard and metrics.jsonl go on", step,
                        self.wandb_error)
            self._close_wandb(1)

    def _close_wandb(self, exit_code: int, summary: dict[str, Any] | None = None) -> None:
        wb, self._wb = self._wb, None
        if wb is None:
            return
        try:
            if summary:
                wb.summary(summary)
            wb.close(exit_code)
        except Exception as e:
            log.warning("W&B did not close cleanly (%s: %s)", type(e).__name__, e)

    def _keep_until(self, step: int) -> bool:
        """Drop an earlier attempt's rows after ``step``, keep its rewards; True if there was an earlier attempt."""
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return False
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            if int(row.get("step", 0)) <= step:
                kept.append(line)
                if REWARD in row:
                    self.rewards[int(row["step"])] = float(row[REWARD])
                if any(k.startswith("eval/") for k in row):
                    self.evaluated.add(int(row["step"]))
                    self._note_evals(int(row["step"]), row)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        os.replace(tmp, path)
        return True

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """Record ``metrics`` for rollout step ``step``; returns the numeric ones that were written."""
        vals = numeric(metrics)
        now = time.time()
        if self._tb is not None:
            self._tb.scalars(step, vals, now)
        self._to_wandb(step, vals)
        self._jsonl.write(json.dumps({"step": int(step), "time": now, **vals}, sort_keys=True) + "\n")
        self._jsonl.flush()
        if REWARD in vals:
            self.rewards[int(step)] = vals[REWARD]
        if any(k.startswith("eval/") for k in vals):
            self.evaluated.add(int(step))
            self._note_evals(int(step), vals)
        return vals

    def _note_evals(self, step: int, vals: dict[str, Any]) -> None:
        for k, v in vals.items():
            if k.startswith("eval/") and k.endswith(PASS1):
                self.pass1.setdefault(step, {})[k[len("eval/"):-len(PASS1)]] = float(v)

    def eval_ends(self) -> dict[str, Any]:
        """Each eval set's pass@1 at the first and at the last step evaluated (``eval_first``/``eval_last``, by set
        name, with ``eval_first_step``/``eval_last_step``); empty when no eval ran."""
        if not self.pass1:
            return {}
        first, last = min(self.pass1), max(self.pass1)
        return {"eval_first": self.pass1[first], "eval_first_step": first,
                "eval_last": self.pass1[last], "eval_last_step": last}

    def amend(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """Add ``metrics`` to step ``step``'s row (eval results, which come after the row was written): TensorBoard
        gets them at ``step``; ``metrics.jsonl`` is rewritten (tmp + rename: a reader sees the old file or the new
        one) with them merged into the step's last row, or with a new row in step order when the step has none
        (step 0's eval). Returns the numeric ones."""
        vals = numeric(metrics)
        if self._tb is not None:
            self._tb.scalars(step, vals, time.time())
        self._to_wandb(step, vals)
        path = self.dir / "metrics.jsonl"
        self._jsonl.close()
        lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        rows: list[Any] = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line cut by a kill: dropped, as _keep_until does
                continue
        at = next((i for i in range(len(rows) - 1, -1, -1) if int(rows[i].get("step", -1)) == int(step)), None)
        if at is None:  # a row of its own, before any later step's
            where = next((i for i, r in enumerate(rows) if int(r.get("step", 0)) > int(step)), len(rows))
            rows.insert(where, {"step": int(step), "time": time.time(), **vals})
        else:
            rows[at] = {**rows[at], **vals}
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._jsonl = open(path, "a", encoding="utf-8")
        if REWARD in vals:
            self.rewards[int(step)] = vals[REWARD]
        if any(k.startswith("eval/") for k in vals):
            self.evaluated.add(int(step))
            self._note_evals(int(step), vals)
        return vals

    def reward_ends(self) -> tuple[float | None, float | None]:
        """Mean reward of the first and of the last ``WINDOW`` steps logged (None before any)."""
        r = [self.rewards[s] for s in sorted(self.rewards)]
        if not r:
            return None, None
        return statistics.fmean(r[:WINDOW]), statistics.fmean(r[-WINDOW:])

    def finish(self, state: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write ``summary.json`` and ``reward.png``; close the writers. Returns the summary."""
        first, last = self.reward_ends()
        steps = sorted(self.rewards)
        summary = {
            "run": state.get("run"), "state": state.get("state"), "reason": state.get("reason"),
            "steps": len(steps), "total_steps": state.get("total_steps"),
            "wall_time_s": round(time.time() - self.started, 1),
            "reward_first10": first, "reward_last10": last,
            "reward_window": min(WINDOW, len(steps)),
            "reward_final": self.rewards[steps[-1]] if steps else None,
            "tensorboard": str(self.dir / "tensorboard") if self._tb is not None else None,
            "wandb": self._wb.files if self._wb is not None else None,
            "reward_png": None, **self.eval_ends(), **(extra or {}),
        }
        if self.wandb_error:
            summary["wandb_error"] = self.wandb_error
        if steps:
            try:
                plot_rewards(self.dir / "reward.png", steps, [self.rewards[s] for s in steps], title=state.get("run"),
                             evals=self.pass1, marks=self.plot_marks)
                summary["reward_png"] = str(self.dir / "reward.png")
            except Exception as e:  # a plot must never turn a finished run into a failed one
                log.warning("could not draw reward.png: %s", e)
        write_json(self.dir / "summary.json", summary)
        self._close_wandb(0 if state.get("state") in ("COMPLETED", "REQUEUED") else 1,
                          {k: v for k, v in summary.items() if k.startswith("reward_") or k in ("steps", "state")})
        self.close()
        return summary

    def close(self) -> None:
        self._close_wandb(1)
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._jsonl.closed:
            self._jsonl.close()


def summary_line(s: dict[str, Any]) -> str:
    """``summary.json`` in one line, as a run's last lines say it: steps and time, the mean reward of the first and
    the last steps, and each eval set's pass@1 at the first and the last eval (the task's own measure)."""
    if s.get("reward_first10") is None:
        line = f"{s.get('steps', 0)} steps"
    else:
        line = (f"{s['steps']} steps in {s.get('wall_time_s')} s; mean reward first {s['reward_window']} steps "
                f"{s['reward_first10']:.3f}, last {s['reward_window']} steps {s['reward_last10']:.3f}")
    for name, v in (s.get("eval_last") or {}).items():
        line += (f"; eval {name} pass@1 {(s.get('eval_first') or {}).get(name, float('nan')):.3f} (step "
                 f"{s.get('eval_first_step')}) -> {v:.3f} (step {s.get('eval_last_step')})")
    return line


def plot_rewards(path: str | os.PathLike, steps: list[int], rewards: list[float], title: str | None = None,
                 evals: dict[int, dict[str, float]] | None = None, marks: dict[str, float] | None = None) -> None:
    """Mean raw reward per step (dots) and its running mean over ``WINDOW`` steps (line), as a PNG; with ``evals``
    (step -> {set: pass@1}) each eval set's pass@1 as a line of squares, with ``marks`` (label -> level) dashed
    horizontal lines (the task's chance level and ceiling: ``logging.plot_marks``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, rewards, ".", color="tab:blue", alpha=0.5, label="mean reward of the step")
    smooth = [statistics.fmean(rewards[max(0, i - WINDOW + 1): i + 1]) for i in range(len(rewards))]
    ax.plot(steps, smooth, "-", color="tab:orange", label=f"running mean ({WINDOW} steps)")
    for name in sorted({n for v in (evals or {}).values() for n in v}):
        at = sorted(s for s, v in (evals or {}).items() if name in v)
        ax.plot(at, [evals[s][name] for s in at], "s-", markersize=4, label=f"eval/{name}-pass@1")
    for i, (label, level) in enumerate(sorted((marks or {}).items(), key=lambda kv: kv[1])):
        ax.axhline(level, linestyle="--", linewidth=1, color=("tab:gray", "tab:green", "tab:red")[i % 3])
        ax.annotate(f"{label} {level:g}", (0.01, level), xycoords=("axes fraction", "data"), fontsize=8,
                    va="bottom", color="dimgray")
    ax.set_xlabel("rollout step")
    ax.set_ylabel(REWARD)
    ax.set_title(title or "reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    tmp = Path(str(path) + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
