"""The long-tail workload of ``tools/bench/streaming.py``: a Relax-form generate function (``rollout.
custom_generate_function_path: longtail.generate``, with tools/bench on the roles' PYTHONPATH) that tells the CPU
reference engine each response's length: most prompts' responses are ``SHORT`` tokens, one prompt group in ten
(``LONG_EVERY``, chosen by a hash of the prompt, so about 10 % of the responses) ``LONG`` tokens, EOS ignored. The
lengths come from the environment (``RELAX_BENCH_SHORT``, ``RELAX_BENCH_LONG``) so the bench sets them."""

from __future__ import annotations

import os

LONG_EVERY = 10


def is_long(group_index: int | None) -> bool:
    """One prompt group in ten, spread over the step (a multiplicative hash of the group's index)."""
    return group_index is not None and (group_index * 2654435761 >> 7) % LONG_EVERY == 0


async def generate(args, sample, sampling_params, evaluation=False):
    from relax_hpc.engines.router import post  # sends the router's key

    n = int(os.environ.get("RELAX_BENCH_LONG" if is_long(sample.group_index) else "RELAX_BENCH_SHORT", "4"))
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    ids = list(sample.tokens)
    sp = {**sampling_params, "max_new_tokens": n, "ignore_eos": True}
    out = await post(url, {"input_ids": ids, "sampling_params": sp, "return_logprob": True})
    pairs = out["meta_info"]["output_token_logprobs"]
    new = [int(p[1]) for p in pairs]
    sample.tokens, sample.response, sample.response_length = ids + new, out["text"], len(new)
    sample.rollout_log_probs, sample.loss_mask = [float(p[0]) for p in pairs], [1] * len(new)
    sample.weight_versions.append(out["meta_info"]["weight_version"])
    sample.status = sample.Status.COMPLETED
    return sample
