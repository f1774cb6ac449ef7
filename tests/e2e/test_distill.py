"""On-policy distillation learns with no reward (``recipes/quickstart-distill.yaml``): a random student, a teacher
that knows one-digit addition on an engine of its own (``roles.teacher``), advantages −(log π_student − log
π_teacher) per token and nothing else (``opd.only_reward``). The task's reward is computed in shadow: it trains
nothing, and it rises.

The teacher here is the same tiny model taught the task by plain supervised steps in this process (seconds), not the
quickstart's RL run the recipe's header uses (minutes): what is under test is that the student learns from it.
Also checked on the way: the teacher engine in its own het group and in state.json, rollout's ``opd/*`` metrics
every step, and ``teacher_log_probs`` in every chunk the actor trained on.
"""

from __future__ import annotations

import json

import pytest

from relax_hpc.controller import run_controller
from relax_hpc.exchange.journal import iter_ops, replay

from .conftest import ARITH, REPO, make_run, metrics, state

STEPS = 30
RISE = 0.15

pytestmark = pytest.mark.slow


def sft_teacher(student, out, steps: int = 40):
    """``student``'s model, taught "a+b=" → the digit by cross-entropy on the answer token (Adam, full batch)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(student)
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    rows = [json.loads(line) for line in ARITH.read_text().splitlines() if line.strip()]
    ids = torch.tensor([tok(r["prompt"] + r["label"]).input_ids for r in rows])  # every prompt is 4 characters
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = model(ids[:, :-1]).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, ids[:, -1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    acc = (model(ids[:, :-1]).logits[:, -1].argmax(-1) == ids[:, -1]).float().mean().item()
    assert acc > 0.9, f"the teacher did not learn the task: {acc:.2f}"
    return out


def test_a_student_with_no_reward_learns_the_task_from_its_teacher(tmp_path, tiny_model, local_executor):
    teacher = sft_teacher(tiny_model, tmp_path / "teacher")
    run = make_run(tmp_path, tiny_model, f"run.steps={STEPS}", f"opd.teacher_model_path={teacher}",
                   recipe=REPO / "recipes" / "quickstart-distill.yaml", name="distill")
    assert run_controller(run.path)["state"] == "COMPLETED"

    summary = json.loads((run.path / "summary.json").read_text())
    first, last = summary["reward_first10"], summary["reward_last10"]
    assert last > first + RISE, f"the student did not learn: raw reward first 10 steps {first:.3f}, last 10 {last:.3f}"
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # the teacher asked every step, no sample without its numbers, the divergence measured
        assert r["opd/teacher_calls"] >= 1 and r["opd/teacher_bad_samples"] == 0 and r["opd/teacher_latency_mean"] > 0
        assert r["opd/reverse_kl"] == pytest.approx(r["opd/student_log_prob"] - r["opd/teacher_log_prob"], abs=1e-4)
    kl = [r["opd/reverse_kl"] for r in rows]
    assert sum(kl[-10:]) < sum(kl[:10]), kl  # the student moves toward the teacher

    ctl = state(run)
    assert list(ctl["teachers"]) == ["teacher0"] and ctl["teachers"]["teacher0"]["url"].startswith("http://127.0.0.1:")
    assert ctl["roles"]["teacher"]["het_group"] not in {ctl["roles"][r]["het_group"] for r in ("actor", "rollout")}
    produced = list(iter_ops(replay(run.path / "exchange" / "journal.jsonl"), "produced"))
    assert sorted({op["step"] for op in produced}) == list(range(1, STEPS + 1))
    assert all("teacher_log_probs" in op["fields"] for op in produced), produced
    print(f"distillation {STEPS} steps, no reward: raw reward {first:.3f} -> {last:.3f}, reverse KL "
          f"{sum(kl[:10]) / 10:.2f} -> {sum(kl[-10:]) / 10:.2f}")
