"""The quickstart learns: a shortened run on the local executor (and, marked slurm, as a Slurm het job).

The local test runs the quickstart recipe for 25 steps (the full quickstart runs 200; docs/quickstart.md
has its numbers), with the engine handing its memory over to the actor as on a one-GPU box
(``rollout.engine.offload``: release before training, resume and ``/update_weights_from_tensor`` at the sync; on
CPU the release is a no-op and the tensors go through shared memory, so the whole sequence runs), and checks what a user is told to look at: summary.json's rewards (the last 10 steps'
mean well above the first 10's), TensorBoard events with Relax's metric names, state.json's progress,
reward.png; and what the run checks on the way: every step's samples carry the weights of the step
before, every sync lands (fingerprint), engine and actor log-probs agree. Both runs read their TensorBoard tags
against docs/metrics.md (:func:`check_tags_against_doc`): every tag is documented, and every documented name the
run should write is there.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import wandb_files

from relax_hpc.controller import run_controller
from relax_hpc.exchange.audit import exactly_once
from relax_hpc.exchange.journal import iter_ops, replay
from relax_hpc.rundir import RunDir

from .conftest import (REPO, follow_slurm, metrics, quickstart_overrides, state, submit_slurm, tensorboard_tags,
                       wait_until)

STEPS = 25
RISE = 0.15
METRICS_DOC = REPO / "docs" / "metrics.md"
_NAME = re.compile(r"`((?:rollout|train|perf|eval|weights|exchange|genrm|health)/[^`\s]*)`")
# documented names the quickstart does not write, and why: what it leaves off. Everything else documented, it must
NOT_IN_THE_QUICKSTART = {
    r"eval/.*|perf/eval_time": "no eval sets (rollout.eval_interval)",
    r"genrm/.*": "no judge (roles.genrm)",
    r"perf/(ref_)?log_probs_time|rollout/ref_log_probs|train/kl_loss": "no forward roles (use_kl_loss, actor_fwd)",
    r"train/(tis|tis_clipfrac|tis_abs|ois)": "no TIS (use_tis, get_mismatch_metrics)",
    r"train/opsm_clipfrac": "no OPSM (use_opsm)",
    r"rollout/dynamic_sampling_.*": "no dynamic sampling",
    r"rollout/partial_.*": "no partial rollout",
    r"rollout/removed_samples_ratio": "no sample filter",
    r"rollout/passrate/.*": "no rollout.log_passrate",
    r"rollout/segments_per_rollout": "no custom generate function",
    r"perf/train_(offload_bytes|offload_time|reload_time)": "no trainer offload (train.offload)",
    r"perf/weight_snapshot_time": "no external engines (rollout.external_engines, relax-scale --attach-url)",
    r"perf/weight_(pack_ahead_(time|bytes)|sync_behind_time|sync_overlapped)": "colocate: no sync behind the next "
                                                                               "train (train.overlap_sync)",
    r"health/recovery_time": "nothing failed, so nothing recovered (docs/reliability.md)",
    r"rollout/(turns|env_tokens_ratio|env_failures|truncated_turns|truncated_by/.*|truncated_observations)":
        "no multi-turn environment",
}
FORWARD_ROLES = r"perf/(ref_)?log_probs_time|rollout/ref_log_probs|train/kl_loss"
OFFLOAD = {r"perf/engine_(release|resume)_time": "the engines keep their memory (rollout.engine.offload)"}


def metrics_doc() -> tuple[dict[str, re.Pattern], set[str]]:
    """docs/metrics.md's names: {name as written: the tags it stands for}, and the names it says are not logged.
    A table row's name is its first cell (the second is Relax's name); ``{a,b}`` is either (``...``: any),
    ``<x>`` any part; ``train/*`` names a whole section (a heading), not a metric."""
    names: set[str] = set()
    not_logged: set[str] = set()
    skip = False
    for line in METRICS_DOC.read_text().splitlines():
        skip = line.startswith("Not logged") or (skip and bool(line.strip()))
        text = line.split("|")[1] if line.startswith("|") else line
        (not_logged if skip else names).update(n for n in _NAME.findall(text) if not n.endswith("/*"))

    def part(p: str) -> str:
        if p.startswith("{"):
            return "(?:" + "|".join(".+" if a == "..." else re.escape(a) for a in p[1:-1].split(",")) + ")"
        return ".+" if p.startswith("<") else re.escape(p)

    def pattern(name: str) -> re.Pattern:
        return re.compile("".join(part(p) for p in re.split(r"(\{[^}]*\}|<[^>]*>)", name)))

    return {n: pattern(n) for n in names}, not_logged


def literal_names(documented: dict[str, re.Pattern]) -> set[str]:
    """The documented names with no varying part, braces expanded: the names a run can be asked for."""
    out: set[str] = set()
    for n in documented:
        if not re.search(r"<|\.\.\.", n):
            parts = [p[1:-1].split(",") if p.startswith("{") else [p] for p in re.split(r"(\{[^}]*\})", n)]
            out |= {"".join(c) for c in itertools.product(*parts)}
    return out


def check_tags_against_doc(tags: set[str], absent: dict[str, str]) -> None:
    """Every tag the run wrote is documented in docs/metrics.md, none of those it says are not logged; and every
    documented name is among the tags, except those ``absent`` (regex -> why this run does not write it)."""
    documented, not_logged = metrics_doc()
    undocumented = sorted(t for t in tags if not any(p.fullmatch(t) for p in documented.values()))
    assert not undocumented, f"tags docs/metrics.md does not name: {undocumented}"
    assert not tags & not_logged, tags & not_logged
    missing = sorted(n for n in literal_names(documented) - tags if not any(re.fullmatch(a, n) for a in absent))
    assert not missing, f"documented in docs/metrics.md, not written by this run: {missing}"


def test_the_metrics_doc_reads_as_the_tag_check_reads_it():
    documented, not_logged = metrics_doc()
    assert not_logged == {"rollout/entropy"}
    assert documented["perf/task_<kind>_time"].fullmatch("perf/task_generate_time")
    assert documented["rollout/response_len/{mean,median,max,min}"].fullmatch("rollout/response_len/max")
    assert not any(p.fullmatch("perf/reference_time") or p.fullmatch("perf/exchange_read_time")
                   for p in documented.values())  # the Relax column is not ours: the old names are gone
    names = literal_names(documented)
    assert {"perf/ref_log_probs_time", "perf/log_probs_time", "perf/train_get_data_time", "perf/save_model_time",
            "weights/versions_ok"} <= names and not any("<" in n or "{" in n for n in names)


@pytest.mark.slow
def test_quickstart_learns_locally(tmp_path, tiny_model, local_executor):
    from .conftest import make_run

    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", "rollout.engine.offload=true",
                   "logging.wandb.project=quickstart", "logging.wandb.mode=offline", name="quickstart")
    t0 = time.monotonic()
    final = run_controller(run.path)
    wall = time.monotonic() - t0
    assert final["state"] == "COMPLETED"

    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["state"] == "COMPLETED"
    first, last = summary["reward_first10"], summary["reward_last10"]
    assert last > first + RISE, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    assert (run.path / "reward.png").stat().st_size > 1000

    st = state(run)
    assert st["step"] == STEPS and st["total_steps"] == STEPS and st["phase"] == "finished"
    assert st["reward"] is not None and st["reward_first10"] == first and st["reward_last10"] == last
    assert st["last_checkpoint"]["step"] == STEPS and Path(st["last_checkpoint"]["path"]).is_dir()
    # the engine registry: the run's one engine, started with it, ready, serving the last step's weights
    [(name, engine)] = st["engines"].items()
    assert name == "engine0" and engine["origin"] == "initial" and engine["state"] == "ready"
    assert engine["weight_version"] == str(STEPS) and engine["job_id"] == "local" and engine["url"].startswith("http")

    tags = tensorboard_tags(run.path / "tensorboard")
    for tag in ("rollout/raw_reward", "rollout/response_len/mean", "train/pg_loss", "train/grad_norm", "train/loss",
                "perf/rollout_time", "perf/train_time", "perf/weight_sync_time", "perf/step_time",
                "perf/train_get_data_time", "perf/engine_release_time", "perf/engine_resume_time"):
        assert [s for s, _ in tags.get(tag, [])] == list(range(1, STEPS + 1)), tag
    check_tags_against_doc(set(tags), NOT_IN_THE_QUICKSTART)
    assert tags["rollout/raw_reward"][-1][1] == pytest.approx(summary["reward_final"], abs=1e-6)
    # W&B (offline): the same names as TensorBoard's, each against rollout/step, the same reward curve
    [wb_file] = wandb_files.run_files(run.path)
    wb: dict = {}
    for row in wandb_files.history(wb_file):
        for k, v in row.items():
            if not k.startswith("_") and k != "rollout/step":
                wb.setdefault(k, []).append((row["rollout/step"], v))
    assert set(wb) == set(tags)
    assert [(s, pytest.approx(v, abs=1e-6)) for s, v in tags["rollout/raw_reward"]] == wb["rollout/raw_reward"]
    assert summary["wandb"] == str(wb_file.parent) and wandb_files.exit_code(wb_file) == 0

    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["rollout/weight_version"] == r["step"] - 1  # generated with the weights synced after step N-1
        assert r["weights/fingerprint_match"] == 1.0 and r["weights/versions_ok"] == 1.0
        assert r["train/train_rollout_logprob_abs_diff_max"] <= 1e-4
    # colocate is max_staleness 0: from the journal, every partition started with none uncleared (rollout
    # never ran ahead), and every sample was trained on exactly once
    journal = run.path / "exchange" / "journal.jsonl"
    starts = list(iter_ops(replay(journal), "start"))
    assert [s["step"] for s in starts] == list(range(1, STEPS + 1))
    assert all(s["min_uncleared"] is None for s in starts)
    assert exactly_once(journal, ["train"]) == []
    # the hand-over, from the engine's own log of calls: each step generates, gives its memory up while the actor
    # trains, takes it back, and only then gets the new weights (by tensor: no weight-sync group) and generates
    calls = re.findall(r"INFO call (/\w+)", (run.path / "logs" / "engine0.log").read_text())
    steps = "".join({"/generate": "g", "/release_memory_occupation": "r", "/resume_memory_occupation": "m",
                     "/update_weights_from_tensor": "t", "/update_weight_version": "v"}.get(c, "") for c in calls)
    assert re.fullmatch(r"(t+v)?(g+rmt+v){%d}" % STEPS, steps), steps
    assert "/update_weights_from_distributed" not in calls
    print(f"quickstart {STEPS} steps: reward {first:.3f} -> {last:.3f}, {wall:.0f} s")


@pytest.mark.slurm
@pytest.mark.slow
def test_quickstart_learns_on_slurm_with_four_groups_at_once(slurm_cluster, tmp_path, tiny_model):
    """relax-submit recipes/quickstart-slurm.yaml on the dev cluster: actor, rollout, reference and actor_fwd each
    in their own het component (one node each), fully async; the reward rises, and the journal shows every
    produced sample consumed exactly once by each task (train, reference, actor_fwd)."""
    recipe = REPO / "recipes" / "quickstart-slurm.yaml"
    sub = submit_slurm(recipe, tmp_path, slurm_cluster.env,
                       quickstart_overrides(tiny_model, tmp_path / "runs", f"run.steps={STEPS}"))
    job, run_dir = sub["job_id"], Path(sub["run_dir"])
    st, seen = follow_slurm(sub, tmp_path, slurm_cluster.env, 4, 1200)
    assert st.get("state") == "COMPLETED", st
    assert seen == {f"{job}+{k}" for k in range(4)}, "the four components never ran at once"
    # relax-status --json shows the engine registry: where the engine ran (the rollout component's job and step);
    # the run has ended, so the engine is stopped, last seen ready
    [engine] = st["engines"]
    assert (engine["name"], engine["origin"], engine["state"], engine["last_state"]) == \
        ("engine0", "initial", "stopped", "ready")
    assert engine["weight_version"] == str(STEPS) and engine["job_id"].isdigit() and engine["step_id"].isdigit()
    ctl = json.loads((run_dir / "state.json").read_text())
    het = ctl["roles"]["rollout"]["het_group"]

    def own_step() -> str | None:  # the engine is a job step of its own, not the rollout driver's (accounting lags)
        out = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,JobName"], capture_output=True, text=True,
                             env=slurm_cluster.env).stdout
        names = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
        return names.get(f"{job}+{het}.{engine['step_id']}")

    wait_until(own_step, 60, every=1, what=f"engine0's step {job}+{het}.{engine['step_id']} in sacct")
    assert own_step() == "engine-engine0"
    assert ctl["executor"] == "slurm" and ctl["step"] == STEPS and ctl["mode"] == "fully_async"
    assert len({ctl["roles"][r]["het_group"] for r in ("actor", "rollout", "reference", "actor_fwd")}) == 4
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_last10"] > summary["reward_first10"] + RISE, summary
    assert exactly_once(run_dir / "exchange" / "journal.jsonl", ["train", "reference", "actor_fwd"]) == []
    rows = metrics(RunDir(run_dir))
    assert all("train/kl_loss" in r and "perf/ref_log_probs_time" in r and "perf/log_probs_time" in r for r in rows)
    # the forward roles' names too, as Relax names them: read from the run's TensorBoard against docs/metrics.md
    check_tags_against_doc(set(tensorboard_tags(run_dir / "tensorboard")),
                           {**{k: v for k, v in NOT_IN_THE_QUICKSTART.items() if k != FORWARD_ROLES}, **OFFLOAD})
    # actor_fwd follows the actor through the weight syncs (its weights checked like an engine's), so checkpoints
    # stay at checkpoint.interval (0: one, after the last step), not one per step
    assert all(r["weights/fingerprint_match"] == 1.0 for r in rows)
    saved = [e["detail"] for e in ctl["events"] if e["event"] == "checkpoint"]
    assert len(saved) == 1 and saved[0].startswith(f"step {STEPS}:"), saved
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [f"step_{STEPS:08d}"]

