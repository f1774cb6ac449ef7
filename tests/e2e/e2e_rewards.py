"""Reward functions for the end-to-end tests, in Relax's custom form (imported by the rollout role from PYTHONPATH)."""

from relax_hpc.tasks.arith import score


async def raise_on_ones(args, sample, **kwargs):
    """The arithmetic reward, except that it raises for every prompt that starts with "1+"."""
    if str(sample.prompt).startswith("1+"):
        raise ValueError(f"test reward refuses {sample.prompt!r}")
    return score(sample.response, sample.label)
