"""Trainer offload (``train.offload``) on the seeded colocate quickstart: the same run with the actor's parameters,
gradients and optimizer state off the device while the engines generate gives the same numbers at every step.

The run without offload is the session's uninterrupted run of :data:`interrupt.SHORT` (the resume and mini-batch
tests' reference: no run of its own): 4 steps of 4 mini-batch updates each (so the loss and clip fraction move off
0) and a checkpoint every 2 steps (saved from the offloaded actor: it reloads, saves and goes off again, and the next
generate waits for it).
"""

from __future__ import annotations

from . import interrupt
from .conftest import metrics, reference_run

OFFLOAD_METRICS = ("perf/train_offload_bytes", "perf/train_offload_time", "perf/train_reload_time")


def test_offload_gives_the_same_run_step_for_step(tmp_path, tiny_model, uninterrupted_run):
    plain = uninterrupted_run(*interrupt.SHORT, steps=interrupt.STEPS)
    without = {r["step"]: r for r in metrics(plain)}
    run = reference_run(tmp_path, tiny_model, *interrupt.SHORT, "train.offload=true", name="offload",
                        steps=interrupt.STEPS)
    rows = {r["step"]: r for r in metrics(run)}
    for n, r in rows.items():
        want = without[n]
        # every number the run computed: rewards, losses, grad norms, log-probs, weight checks; not the clocks
        keys = sorted(k for k in want if not k.startswith("perf/") and k != "time")
        assert sorted(k for k in r if not k.startswith("perf/") and k != "time") == keys, n
        assert {k: r[k] for k in keys} == {k: want[k] for k in keys}, n
        assert r["train/loss"] != 0 and r["train/grad_norm"] > 0  # the updates did something to compare
        # what the cycle freed (the tiny model's params, grads and Adam state) and what it took, each step
        assert r["perf/train_offload_bytes"] > 0 and r["perf/train_offload_time"] >= 0, n
        assert r["perf/train_reload_time"] >= 0, n
        assert not any(k in want for k in OFFLOAD_METRICS)  # off: nothing offloaded, nothing said
    one = rows[1]
    print(f"[train offload] {interrupt.STEPS} steps equal; freed {one['perf/train_offload_bytes']:.0f} B a step, "
          f"offload {one['perf/train_offload_time'] * 1e3:.1f} ms, reload {one['perf/train_reload_time'] * 1e3:.1f} ms")

    def saved(r) -> list[str]:  # checkpoint.interval 2: saved from the offloaded actor at the same steps
        return sorted(p.name for p in (r.path / "checkpoints").iterdir())

    assert saved(run) == saved(plain) and len(saved(run)) >= 2
