#!/usr/bin/env python3
"""The quickstart's task as a bare GRPO loop, to choose the recipe by the task's own measure (run by hand).

    .venv/bin/python tools/bench/arith_sweep.py [--prompts 55] [--n 32] [--lr 1e-3] [--steps 100]
        [--reward exact|partial] [--seed 1] [--model runs/models/tiny-llama]

The same tiny Llama, the 55 sums and the quickstart's objective in about 60 lines of plain torch (no Megatron, no
engine, no exchange): each step samples ``n`` answers of one token at temperature 1 for ``prompts`` sums, scores
them (``exact``: 1 for the right digit; ``partial``: the earlier reward, 0.5 · (1 − |d − answer| / 9) for another
digit), normalizes per group (GRPO), and takes one AdamW step (betas 0.9/0.98, grad clip 1.0) on
−mean(advantage · log π). Every 20 steps it prints greedy accuracy over all 55 sums. A step takes milliseconds, so a
grid of settings runs in minutes; docs/quickstart.md has the grid that chose recipes/quickstart.yaml, which the
real run then confirmed (tests/e2e/test_quickstart_solves.py).
"""

import argparse
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from relax_hpc.tasks.arith import prompts as sums  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=55, help="sums per step (a GRPO group each)")
    p.add_argument("--n", type=int, default=32, help="samples per sum")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--reward", choices=("exact", "partial"), default="exact")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default=str(REPO / "runs" / "models" / "tiny-llama"))
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    rows = sums()
    ids = torch.tensor([tok(r["prompt"])["input_ids"] for r in rows])
    labels = torch.tensor([int(r["label"]) for r in rows])
    digit = {tok(str(d))["input_ids"][0]: d for d in range(10)}
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)

    def reward(token: int, label: int) -> float:
        d = digit.get(token)
        if d is None:
            return 0.0
        if d == label:
            return 1.0
        return 0.5 * (1 - abs(d - label) / 9) if a.reward == "partial" else 0.0

    def greedy() -> int:
        with torch.no_grad():
            pred = model(ids).logits[:, -1].argmax(-1)
        return sum(digit.get(int(t), -1) == int(y) for t, y in zip(pred, labels))

    line = [f"step 0: {greedy()}/55"]
    order: list[int] = []
    for step in range(1, a.steps + 1):
        if len(order) < a.prompts:
            perm = list(range(len(rows)))
            random.shuffle(perm)
            order += perm
        pick, order = torch.tensor(order[:a.prompts]), order[a.prompts:]
        x, y = ids[pick].repeat_interleave(a.n, 0), labels[pick].repeat_interleave(a.n, 0)
        with torch.no_grad():
            sampled = torch.multinomial(F.softmax(model(x).logits[:, -1], -1), 1).squeeze(1)
        r = torch.tensor([reward(int(t), int(l)) for t, l in zip(sampled, y)]).view(a.prompts, a.n)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
        logp = F.log_softmax(model(x).logits[:, -1], -1).gather(1, sampled[:, None]).squeeze(1)
        loss = -(adv * logp).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            line.append(f"{step}: {greedy()}/55")
    print(f"prompts={a.prompts} n={a.n} lr={a.lr:g} reward={a.reward} seed={a.seed}  greedy " + ", ".join(line))


if __name__ == "__main__":
    main()
