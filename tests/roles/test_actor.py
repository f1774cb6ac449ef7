"""The actor role's pieces that run without Megatron: the step's metrics over its k optimizer steps, and the role's
task handlers (one method per task kind)."""

import inspect

from relax_hpc.roles import actor as A


def test_a_skipped_optimizer_step_shows_in_the_steps_metrics():
    """The actor role's train/* over k updates: a skipped update's NaN stays visible in the means, and the skips
    are counted, not averaged."""
    import math

    ok = {"loss": 0.5, "grad_norm": 1.0, "nonfinite_skipped": 0.0, "num_samples": 4.0, "step": 1.0}
    bad = {"loss": math.nan, "grad_norm": math.inf, "nonfinite_skipped": 1.0, "num_samples": 4.0, "step": 2.0}
    out = A._over_steps([ok, bad, dict(ok, step=3.0)])
    assert math.isnan(out["loss"]) and out["grad_norm"] == math.inf
    assert out["nonfinite_skipped"] == 1.0 and out["num_samples"] == 12.0 and out["step"] == 3.0
    assert out["num_steps"] == 3.0


def test_the_actor_serves_every_task_kind_with_a_short_method():
    """roles/ holds entry points: the actor's work is a class with one handler per task kind, none of them long."""
    kinds = {"connect", "train", "stage", "sync", "checkpoint", "stop"}
    handlers = A.Actor.handlers(object.__new__(A.Actor))
    assert set(handlers) == kinds
    longest = max((len(inspect.getsource(f).splitlines()), name) for name, f in vars(A).items()
                  if inspect.isfunction(f))
    methods = max((len(inspect.getsource(f).splitlines()), name) for name, f in vars(A.Actor).items()
                  if inspect.isfunction(f))
    assert longest[0] <= 60 and methods[0] <= 60, (longest, methods)
