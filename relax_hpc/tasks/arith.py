"""One-digit addition: ``"a+b="`` → the digit ``a + b`` (a, b digits, a + b ≤ 9). The quickstart's task.

Why this task: a tiny model made by ``tools/make-tiny-model`` (character-level tokenizer: every digit
and ``+``/``=`` is one token) starts at chance and learns all 55 sums from scratch with GRPO in a few minutes on
a CPU; the task's own measure is greedy accuracy over the 55 sums (the quickstart evaluates it before and after).

The reward is Relax's custom form (``rollout.custom_rm_path: relax_hpc.tasks.arith.reward_func``): 1.0 if the
response's first character is the right digit, else 0.0. An earlier partial credit for near digits
(0.5 · (1 − |d − answer| / 9)) taught the wrong thing: a digit near the middle earns it on every prompt without
reading the prompt, so the policy collapsed to answering 4, 6 or 7 everywhere (15 of 55 right) while its reward
rose (docs/quickstart.md, "Why the quickstart learns the sums").

``python -m relax_hpc.tasks.arith OUT.jsonl`` writes the 55 prompts (``recipes/data/arith.jsonl``), one
JSON object per line with ``prompt`` and ``label``.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def prompts() -> list[dict[str, str]]:
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10) if a + b <= 9]


def score(response: str, label: Any) -> float:
    answer = int(str(label).strip())
    first = (response or "")[:1]
    if not first.isdigit() or not first.isascii():
        return 0.0
    return 1.0 if int(first) == answer else 0.0


def shaped_score(response: str, label: Any) -> float:
    """:func:`score` with partial credit for a near digit: 0.5 · (1 − |d − answer| / 9). The reward rises within a
    few steps of a random model, which is what the end-to-end tests of the machinery need (resume, faults, modes:
    tests/e2e/conftest.py's overrides); it does not teach the sums (its best prompt-blind answer is a middle digit)."""
    full = score(response, label)
    first = (response or "")[:1]
    if full or not first.isdigit() or not first.isascii():
        return full
    return 0.5 * (1.0 - abs(int(first) - int(str(label).strip())) / 9.0)


async def shaped_reward(args: Any, sample: Any, **kwargs: Any) -> float:
    return shaped_score(sample.response, sample.label)


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> float:
    """Relax's custom reward signature: ``args`` (unused here) and the ``Sample`` (``response``, ``label``)."""
    return score(sample.response, sample.label)


async def multiturn_reward(args: Any, sample: Any, **kwargs: Any) -> float:
    """The multi-turn variant (``recipes/quickstart-multiturn.yaml``, env ``recipes/examples/env_arith.py``): the
    last turn's answer scored with partial credit (:func:`shaped_score`: the multi-turn recipe runs the cheap batch,
    where the exact reward gives too little signal), halved if it took a second turn (right at once 1.0, right
    after " no=" 0.5)."""
    traces = sample.metadata.get("rollout_traces") or [{"response": sample.response}]
    value = shaped_score(traces[-1]["response"], sample.label)
    return value if len(traces) <= 1 else 0.5 * value


async def judged_reward(args: Any, sample: Any, **kwargs: Any) -> dict[str, float]:
    """The arithmetic reward with the run's GenRM judge beside it (``recipes/genrm-slurm.yaml``): ``score`` is the
    rule's (what trains), ``judge`` the judge's verdict on ``Answer: <the response>`` by the ``dapo-genrm`` rule, and
    ``judge_agrees`` whether the judge called it right exactly when the rule did. The judge runs in shadow: its
    verdicts are logged (``rollout/judge/mean``, ``rollout/judge_agrees/mean``) before a recipe trusts it."""
    from relax_hpc.rollout import genrm
    from relax_hpc.rollout.rewards.builtin import dapo_genrm_reward

    rule = score(sample.response, sample.label)
    judged = await dapo_genrm_reward(sample.prompt, f"Answer: {sample.response}", sample.label, {}, genrm.generate)
    return {"score": rule, "judge": judged["score"], "judge_agrees": float((judged["score"] == 1.0) == (rule == 1.0))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m relax_hpc.tasks.arith OUT.jsonl", file=sys.stderr)
        return 2
    with open(argv[0], "w", encoding="utf-8") as f:
        for rec in prompts():
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
