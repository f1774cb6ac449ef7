"""One-digit addition: ``"a+b="`` → the digit ``a + b`` (a, b digits, a + b ≤ 9). The quickstart's task.

Why this task: a tiny model made by ``tools/make-tiny-model`` (character-level tokenizer: every digit
and ``+``/``=`` is one token) starts at chance and can learn it from scratch with GRPO in a couple of
hundred steps on a CPU, and a partial-credit reward gives a signal from the first step: random digits
near the answer score something, so group-normalized advantages are rarely all zero.

The reward is Relax's custom form (``rollout.custom_rm_path: relax_hpc.tasks.arith.reward_func``):

- 1.0 if the response's first character is the right digit;
- 0.5 · (1 − |d − answer| / 9) if it is another digit d;
- 0.0 otherwise (no response, a letter, a symbol).

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
    d = int(first)
    return 1.0 if d == answer else 0.5 * (1.0 - abs(d - answer) / 9.0)


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> float:
    """Relax's custom reward signature: ``args`` (unused here) and the ``Sample`` (``response``, ``label``)."""
    return score(sample.response, sample.label)


async def multiturn_reward(args: Any, sample: Any, **kwargs: Any) -> float:
    """The multi-turn variant (``recipes/quickstart-multiturn.yaml``, env ``recipes/examples/env_arith.py``): the
    last turn's answer scored as above, halved if it took a second turn (right at once 1.0, right after " no=" 0.5)."""
    traces = sample.metadata.get("rollout_traces") or [{"response": sample.response}]
    value = score(traces[-1]["response"], sample.label)
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
