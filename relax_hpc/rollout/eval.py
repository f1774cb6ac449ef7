"""The periodic eval: when it runs (:func:`should_eval`), its groups, and :func:`run_eval` on the driver's engines.
Its metrics, with Relax's names, are :mod:`relax_hpc.rollout.metrics`."""

from __future__ import annotations

import time
from typing import Any, Iterable

from relax_hpc.rollout.metrics import eval_metrics
from relax_hpc.rollout.sample import Sample


# --------------------------------------------------------------------------------------------------
# Periodic eval
# --------------------------------------------------------------------------------------------------


def should_eval(step: int, eval_interval: int | None, *, num_steps: int | None = None) -> bool:
    """Whether to eval after rollout step ``step`` (0-based), Relax's rule: every ``eval_interval`` steps
    ((step + 1) % interval == 0) and after the last step. :func:`should_eval_before_train` is the step-0 check."""
    if eval_interval is None:
        return False
    if num_steps is not None and step == num_steps - 1:
        return True
    return (step + 1) % eval_interval == 0


def should_eval_before_train(eval_interval: int | None, skip_eval_before_train: bool = False) -> bool:
    return eval_interval is not None and not skip_eval_before_train


def eval_groups(dataset: Iterable[Sample], n_samples_per_eval_prompt: int) -> list[list[Sample]]:
    """Every prompt of an eval set as a group of ``n_samples_per_eval_prompt`` copies (ids in order)."""
    groups, idx = [], 0
    for gi, template in enumerate(dataset):
        group = []
        for _ in range(n_samples_per_eval_prompt):
            group.append(template.copy(group_index=gi, index=idx))
            idx += 1
        groups.append(group)
    return groups


async def run_eval(driver: Any, datasets: dict[str, Iterable[Sample]], *, n_samples_per_eval_prompt: int | None = None,
                   step: int | None = None, seed: int | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """Generate and score every eval set with the driver's eval settings; returns (metrics, results by name).

    ``driver`` is a :class:`relax_hpc.rollout.driver.RolloutDriver`: eval uses its eval sampling
    parameters (``eval_temperature`` etc., falling back to the rollout ones), ``eval_reward_key``, no
    log-probs and no reward normalization; ``n_samples_per_eval_prompt`` defaults to the recipe's
    (``driver.cfg``). ``seed`` seeds each set's requests as ``generate_rollout(seed=)`` does (None: unseeded).
    """
    n = n_samples_per_eval_prompt or driver.cfg.n_samples_per_eval_prompt
    metrics: dict[str, float] = {}
    results: dict[str, Any] = {}
    t0 = time.monotonic()
    for name, ds in datasets.items():
        result = await driver.generate_rollout(eval_groups(ds, n), evaluation=True, seed=seed)
        results[name] = result
        from relax_hpc.rollout.driver import rollout_view  # here: the controller imports this module, light

        metrics |= eval_metrics(name, *rollout_view(result.samples, result.raw_rewards), n)  # a rollout counts once
    metrics["perf/eval_time"] = time.monotonic() - t0
    if step is not None:
        metrics["eval/step"] = float(step)
    return metrics, results
