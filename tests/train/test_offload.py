"""Trainer offload (``train.offload``, :mod:`relax_hpc.train.offload`): off the device while the engines generate,
and exactly the same training.

Two processes (gloo, CPU; DP=2) run the tiny Qwen3 through Megatron DDP and the distributed optimizer (its state
sharded over the two ranks) twice from the same weights and batch, 3 steps each, the way the actor role does a
colocate step: a train task (reload, π_old forward, ``train_step``, then the gradients and optimizer state off), a
sync (the HF weights read, then the parameters off) and the engines' turn (everything off). With offload every
storage behind the parameters, DDP's param and grad buffers, ``main_grad`` and the Adam state is looked at (by the
test, not by the module under test) at each point.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

STEPS = 3


def part(res: dict, name: str) -> dict:
    from train.conftest import part as conftest_part  # not at the top: this file is also the rank's __main__

    return conftest_part(res, name)


def _held(actor) -> dict[str, list[int]]:
    """Bytes of the storage under every tensor of each kind, looked up independently of TrainOffload."""
    import torch

    out: dict[str, list[int]] = {"params": [], "grads": [], "optimizer": []}
    for m in actor.model:
        for buf in m.buffers + m.expert_parallel_buffers:  # megatron DDP's contiguous buffers
            out["params"].append(buf.param_data.untyped_storage().nbytes())
            out["grads"].append(buf.grad_data.untyped_storage().nbytes())
        for p in m.parameters():
            out["params"].append(p.untyped_storage().nbytes())
            out["grads"].append(p.main_grad.untyped_storage().nbytes())
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:  # fp32 main params: views of DDP's param buffer (fp32 training), sent with it
                out["params"].append(p.untyped_storage().nbytes())
                out["optimizer"] += [v.untyped_storage().nbytes() for v in opt.optimizer.state[p].values()
                                     if torch.is_tensor(v)]
    return out


def _expected_bytes(actor) -> dict[str, int]:
    """What a whole cycle frees: the param and grad buffers and every Adam state tensor (fp32 training: the
    optimizer's main params are views of the param buffer, not memory of their own)."""
    import torch

    buffers = sum(b.param_data.nbytes + b.grad_data.nbytes for m in actor.model
                  for b in m.buffers + m.expert_parallel_buffers)
    adam = sum(v.nbytes for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
               for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    return {"buffers": buffers, "adam": adam}


def job_offload(args: dict, out: Path) -> dict:
    import torch

    import worker
    from relax_hpc.train import MegatronActor, init_parallel
    from relax_hpc.train.offload import TrainOffload
    from relax_hpc.train.parallel import destroy_parallel

    batch = worker.make_batch(8, seed=11)

    def run(offload: bool) -> dict:
        init_parallel(1, 1, seed=1)
        cfg = worker._train_cfg({"tp": 1, "distopt": True}, micro_batch_size=2, lr=1e-3, clip_grad=1.0)
        actor = MegatronActor.from_hf(args["hf"], cfg, worker._algo(eps_clip=0.2))
        off = TrainOffload(actor.model, actor.optimizer) if offload else None
        r: dict = {"metrics": [], "weights": [], "held": [], "cycle": [], "expected": [], "reload_s": [],
                   "optimizers": [type(o).__name__ for o in getattr(actor.optimizer, "chained_optimizers",
                                                                     [actor.optimizer])]}
        if off:
            off.offload()  # the connect: the engines generate step 1 next
            r["held"].append(("connect", _held(actor)))
        for _ in range(STEPS):
            if off:
                r["reload_s"].append(off.reload())  # the train task
            old = actor.compute_log_probs(batch)
            data = [dataclasses.replace(s, old_log_probs=o) for s, o in zip(batch, old)]
            r["metrics"].append(actor.train_step(data))
            if off:
                off.offload(("grads", "optimizer"))
                r["held"].append(("after train", _held(actor)))
            r["weights"].append([t.clone() for _, t in actor.named_hf_weights()])  # the sync
            if off:
                r["expected"].append(_expected_bytes(actor))
                off.offload(("params",))
                r["cycle"].append(off.cycle_metrics())
                r["held"].append(("engines generate", _held(actor)))
        if off:
            off.reload()
        r["opt_state"] = worker._opt_state(actor)
        r["after"] = actor.compute_log_probs(batch)
        del actor
        destroy_parallel()
        return r

    plain, offl = run(False), run(True)
    same_w = [all(torch.equal(a, b) for a, b in zip(x, y)) and len(x) == len(y)
              for x, y in zip(plain["weights"], offl["weights"])]
    return {"plain_metrics": plain["metrics"], "offload_metrics": offl["metrics"], "synced_weights_equal": same_w,
            "opt_state_equal": worker._same(plain["opt_state"], offl["opt_state"]),
            "after_equal": all(torch.equal(a, b) for a, b in zip(plain["after"], offl["after"])),
            "held": offl["held"], "cycle": offl["cycle"], "expected": offl["expected"],
            "reload_s": offl["reload_s"], "optimizers": offl["optimizers"],
            "n_opt_state": len(offl["opt_state"]), "world": int(os.environ["WORLD_SIZE"])}


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory) -> dict:
    from train import launch
    from train.conftest import load_tiny_model_tool

    root = tmp_path_factory.mktemp("offload")
    hf = str(load_tiny_model_tool().make_tiny_model(root / "qwen3", arch="qwen3", seed=0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "WORKER", Path(__file__).resolve())  # this file runs the rank (see __main__)
        # two ranks, DP=2: the distributed optimizer shards its state (each rank's Adam state is half the model's)
        return launch.run_job("suite", {"offload": ["offload", {"hf": hf}]}, nproc=2, out_dir=root, timeout=300)


def test_offloaded_storages_are_empty_while_the_engines_generate(offload_run):
    """After the connect and after every sync (the engines' turn) every parameter, DDP buffer, main_grad and Adam
    state tensor has a storage of 0 bytes; after a train step the gradients and optimizer state are already off
    and the parameters (the sync reads them) are not."""
    r = part(offload_run, "offload")
    assert set(r["optimizers"]) == {"DistributedOptimizer"}, r["optimizers"]
    held = r["held"]
    assert [w for w, _ in held] == ["connect"] + ["after train", "engines generate"] * STEPS
    for where, kinds in held:
        if where == "after train":
            assert all(n > 0 for n in kinds["params"]) and kinds["params"], kinds
            assert kinds["optimizer"] and all(n == 0 for n in kinds["grads"] + kinds["optimizer"]), (where, kinds)
        else:  # at the connect Adam has no state yet: its main params are views of the (freed) param buffer
            assert kinds["params"] and kinds["grads"], kinds
            assert all(n == 0 for ns in kinds.values() for n in ns), (where, kinds)


def test_offload_bytes_are_the_params_grads_and_adam_state(offload_run):
    """``perf/train_offload_bytes`` of each step's cycle is every byte of the param and grad buffers and the Adam
    state (> 0), and the times are reported."""
    r = part(offload_run, "offload")
    assert len(r["cycle"]) == STEPS
    for cyc, want in zip(r["cycle"], r["expected"]):
        print(f"[offload] freed {cyc['perf/train_offload_bytes']:.0f} B in {cyc['perf/train_offload_time']:.4f} s")
        assert cyc["perf/train_offload_bytes"] == want["buffers"] + want["adam"] > 0
        # DP=2: each rank's Adam state is its shard, two fp32 moments of half the parameters (+ step counters): about
        # the param buffer's size, which is half the two buffers
        assert r["world"] == 2 and 0.45 * want["buffers"] < want["adam"] < 0.55 * want["buffers"], want
        assert cyc["perf/train_offload_time"] >= 0
    assert len(r["reload_s"]) == STEPS and all(s >= 0 for s in r["reload_s"])


def test_training_with_offload_is_bit_identical(offload_run):
    """Every step's metrics (loss, grad norm, ...), the weights each sync reads, the weights and Adam state at the
    end and the log-probs after: equal, not close."""
    r = part(offload_run, "offload")
    assert len(r["plain_metrics"]) == STEPS and r["plain_metrics"][0]["grad_norm"] > 0
    assert r["offload_metrics"] == r["plain_metrics"]
    assert r["synced_weights_equal"] == [True] * STEPS
    assert r["opt_state_equal"] and r["n_opt_state"] > 0 and r["after_equal"]


def test_a_storage_that_cannot_be_freed_is_refused_before_any_is():
    """Memory torch does not own (here a numpy array's) cannot be resized in place: the offload says so, naming the
    key, and frees nothing (a half-offloaded model would be worse than none)."""
    import numpy as np
    import torch

    from relax_hpc.train.offload import TrainOffload

    lin = torch.nn.Linear(4, 4)
    lin.weight.data = torch.from_numpy(np.zeros((4, 4), dtype=np.float32))
    off = TrainOffload([lin], None, device="cpu")
    with pytest.raises(RuntimeError, match="train.offload.*Fix: train.offload: false"):
        off.offload()
    assert lin.bias.untyped_storage().nbytes() == 16 and not off.offloaded


def test_train_offload_only_in_colocate():
    from relax_hpc.recipe import RecipeError, recipe_from_dict

    assert recipe_from_dict({"mode": "colocate", "train": {"offload": True}}).train.offload is True
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({"mode": "fully_async", "train": {"offload": True}})
    (key, value, msg), = [p for p in e.value.problems if p[0] == "train.offload"]
    assert value is True and "fully_async" in msg and "Fix: offload: false, or mode: colocate" in msg


if __name__ == "__main__":  # the rank of the run above
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import worker

    worker.run(offload=job_offload)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_bytes_wait_in_pinned_host_memory_and_the_device_memory_is_given_back():
    """The CUDA branch: host copies pinned, the copies finished before the storages are freed, the freed blocks
    returned to the driver (empty_cache: memory_reserved drops), and everything back byte for byte."""
    import torch

    from relax_hpc.train.offload import TrainOffload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).cuda()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
    adam.step()

    class Wrapped:  # Megatron's optimizer wrapper: the torch optimizer is its .optimizer
        optimizer = adam

    params = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for st in adam.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.is_cuda]
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    off = TrainOffload([model], Wrapped())
    freed, _ = off.offload()
    assert freed >= 2 * sum(p.numel() * 4 for p in model.parameters())  # params + Adam's two moments at least
    assert all(o.host is None or o.host.is_pinned() for o in off.out.values())
    assert torch.cuda.memory_reserved() < reserved and sum(off.device_bytes().values()) == 0
    off.reload()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    now = [v for st in adam.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.is_cuda]
    assert all(torch.equal(a, b) for a, b in zip(state, now))
