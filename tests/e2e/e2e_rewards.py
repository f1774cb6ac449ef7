"""Reward functions for the end-to-end tests, in Relax's custom form (imported by the rollout role from PYTHONPATH)."""

from relax_hpc.tasks.arith import score


async def raise_on_ones(args, sample, **kwargs):
    """The arithmetic reward, except that it raises for every prompt that starts with "1+"."""
    if str(sample.prompt).startswith("1+"):
        raise ValueError(f"test reward refuses {sample.prompt!r}")
    return score(sample.response, sample.label)


_killed: set[str] = set()


def _kill_engine(name: str) -> None:
    """SIGKILL a rollout engine by the PID the controller recorded (this runs inside the rollout role, whose
    argv[1] is the run directory)."""
    import json
    import os
    import signal
    import sys
    from pathlib import Path

    st = json.loads((Path(sys.argv[1]) / "state.json").read_text())
    os.kill(int(st["engines"][name]["pid"]), signal.SIGKILL)
    _killed.add(name)


async def raise_on_ones_killing_engines(args, sample, **kwargs):
    """``raise_on_ones``, and the first reward of step 2 kills engine1, the first of step 4 engine0. The kills
    come from inside the step's rollout (colocate: step N is generated with weights N-1), so they always land
    during that step, whatever the machine's speed."""
    version = sample.weight_versions[-1] if sample.weight_versions else "0"
    step = int(version) + 1 if str(version).isdigit() else 1
    for name, at in (("engine1", 2), ("engine0", 4)):
        if step >= at and name not in _killed:
            _kill_engine(name)
    return await raise_on_ones(args, sample, **kwargs)


async def generate_in_segments(args, sample, sampling_params, evaluation=False):
    """A Relax-form generate function (relax_hpc's post in place of Relax's) that returns every odd-indexed rollout as
    two segments: the response as sampled, then the same tokens again with loss mask 0 (so nothing trains twice)."""
    import copy

    from relax_hpc.rollout.router import post  # sends the router's key

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    ids = list(sample.tokens)
    out = await post(url, {"input_ids": ids, "sampling_params": sampling_params, "return_logprob": True})
    pairs = out["meta_info"]["output_token_logprobs"]
    new = [int(p[1]) for p in pairs]
    sample.tokens, sample.response, sample.response_length = ids + new, out["text"], len(new)
    sample.rollout_log_probs, sample.loss_mask = [float(p[0]) for p in pairs], [1] * len(new)
    sample.weight_versions.append(out["meta_info"]["weight_version"])
    sample.status = sample.Status.COMPLETED
    if sample.index % 2 == 0:
        return sample
    again = copy.deepcopy(sample)
    again.loss_mask = [0] * len(new)
    return [sample, again]


async def kill_engine1_in_step_2(args, sample, **kwargs):
    """The arithmetic reward; the first reward of step 2 kills engine1 (once: not the one started again)."""
    version = sample.weight_versions[-1] if sample.weight_versions else "0"
    if str(version).isdigit() and int(version) + 1 >= 2 and "engine1" not in _killed:
        _kill_engine("engine1")
    return score(sample.response, sample.label)


_huge_given: set[int] = set()


async def huge_reward_in_step_2(args, sample, **kwargs):
    """The arithmetic reward, except that the first sample scored in step 2 gets 1e39: finite as a Python float,
    inf in the exchange's float32 raw_reward column (tests/e2e/test_nonfinite.py)."""
    version = sample.weight_versions[-1] if sample.weight_versions else "0"
    if str(version).isdigit() and int(version) + 1 == 2 and not _huge_given:
        _huge_given.add(sample.index)
        return 1e39
    return score(sample.response, sample.label)
