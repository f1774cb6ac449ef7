"""One rank of a relax_hpc.train test job, run as its own process (see ``launch.py``).

Why processes and not in-pytest: megatron's parallel state, the CPU layer's process-wide torch
function mode and dist_checkpointing's helper processes are global to a process; keeping them out
of the pytest process keeps other packages' tests unaffected, and a hang is killed by a timeout.

    python tests/train/worker.py JOB OUT_DIR ARGS_JSON     (env: RANK, WORLD_SIZE, RELAX_TEST_STORE)

Rank 0 writes ``OUT_DIR/result.json``. The ``if __name__ == "__main__"`` guard is required:
dist_checkpointing's writer uses the spawn start method and re-imports ``__main__``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path


def init_dist():
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from relax_hpc.train import cpu_compat

    cpu_compat.compile_eagerly()  # as relax_hpc.train.build does, before any job imports megatron
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["RELAX_TEST_STORE"].rsplit(":", 1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    store = dist.TCPStore(host, int(port), world_size=None, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group(cpu_compat.backend(), store=store, rank=rank, world_size=world)
    return rank, world


def make_batch(n: int, seed: int = 0, vocab: int = 128, fixed_old: bool = False):
    """n samples of 8–14 tokens with a 2–5 token prompt, advantages +1/−1/+0.5/−0.5 repeating."""
    import torch

    from relax_hpc.train.batch import TrainingSample

    g = torch.Generator().manual_seed(seed)
    out = []
    advs = [1.0, -1.0, 0.5, -0.5]
    for i in range(n):
        L = int(torch.randint(8, 15, (1,), generator=g))
        start = int(torch.randint(2, 6, (1,), generator=g))
        s = TrainingSample.of(torch.randint(6, vocab, (L,), generator=g), start, advantage=advs[i % 4])
        if fixed_old:  # data that does not depend on the model, so a resumed run sees the same batch
            s.old_log_probs = torch.full((L - start,), -4.85) + 0.01 * torch.randn(L - start, generator=g)
        out.append(s)
    return out


def _algo(**kw):
    from relax_hpc.algo import AlgorithmConfig

    return AlgorithmConfig(**kw)


def _train_cfg(layout: dict, **kw):
    from relax_hpc.train import TrainConfig

    return TrainConfig(tp=layout.get("tp", 1), pp=layout.get("pp", 1),
                       use_distributed_optimizer=layout.get("distopt", True), seed=1, **kw)


def _full_logits(actor, tokens):
    """Logits gathered over TP ([B, S, V]) from the actor's first chunk."""
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from relax_hpc.train import cpu_compat

    dev = cpu_compat.device()
    with torch.no_grad():
        out = actor.model[0](tokens.to(dev), torch.arange(tokens.shape[1], device=dev)[None].expand_as(tokens.to(dev)), None)
        return gather_from_tensor_model_parallel_region(out).float().cpu()


def job_parity(args: dict, out: Path) -> dict:
    """Bridge-built logits and log-probs vs transformers at args['tp']; HF export; named weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from relax_hpc.train import MegatronActor, init_parallel
    from relax_hpc.train.parallel import destroy_parallel

    tp = args["tp"]
    res = {}
    for arch, hf_dir in args["models"].items():
        init_parallel(tp, 1, seed=1)
        actor = MegatronActor.from_hf(hf_dir, _train_cfg({"tp": tp}), forward_only=True)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 128, (3, 20), generator=g)
        meg = _full_logits(actor, tokens)
        with torch.no_grad():
            ref = hf(tokens).logits.float()
        batch = make_batch(5, seed=7)
        lps = actor.compute_log_probs(batch)
        lp_diff = 0.0
        for s, lp in zip(batch, lps):
            t = s.tokens
            with torch.no_grad():
                full = torch.log_softmax(hf(t[None]).logits[0].float(), -1)
            want = full[s.response_start - 1: -1].gather(-1, t[s.response_start:, None])[:, 0]
            lp_diff = max(lp_diff, (lp - want).abs().max().item())
        exp_dir = out / f"export_{arch}_tp{tp}"
        actor.export_hf(exp_dir)
        names = {}
        orig = load_file(str(Path(hf_dir) / "model.safetensors"))
        w_diff = 0.0
        for name, t in actor.named_hf_weights():
            names[name] = list(t.shape)
            w_diff = max(w_diff, (t.float().cpu() - orig[name].float()).abs().max().item())
        # HF-named tensors loaded back (what a forward role following the actor through weight sync does)
        moved = {n: t.float().cpu() + 0.01 * (i + 1) for i, (n, t) in enumerate(actor.named_hf_weights())}
        actor.load_hf_weights(moved)
        load_diff = max((t.float().cpu() - moved[n]).abs().max().item() for n, t in actor.named_hf_weights())
        r = {"logits_max_diff": (meg - ref).abs().max().item(), "logprob_max_diff": lp_diff,
             "weights_max_diff": w_diff, "n_weights": len(names), "missing": sorted(set(orig) - set(names)),
             "load_max_diff": load_diff}
        if int(os.environ["RANK"]) == 0:
            back = AutoModelForCausalLM.from_pretrained(exp_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                r["export_logits_max_diff"] = (back(tokens).logits.float() - ref).abs().max().item()
        res[arch] = r
        del actor
        destroy_parallel()
    return res


def _share_checks(actor, batch: list, old: list) -> dict:
    """What the actor role does with its DP share: π_old of its own samples only (``share=True``: no gather), and
    the largest |π_old − engine| gap all-reduced over DP. Engine log-probs here are π_old + 0.001·(i+1) for sample i,
    so every layout must find the same gap as one process over the whole batch."""
    from relax_hpc.train.batch import dp_shard
    from relax_hpc.train.logprobs import rollout_logprob_gap, sample_means

    p = actor.parallel
    with_engine = [dataclasses.replace(s, rollout_log_probs=o + 0.001 * (i + 1))
                   for i, (s, o) in enumerate(zip(batch, old))]
    pairs = dp_shard(list(zip(with_engine, old)), p.dp, p.dp_rank)
    mine = [s for s, _ in pairs]
    own = actor.compute_log_probs(mine, share=True)
    gap = rollout_logprob_gap(mine, own)
    means = sample_means([dataclasses.replace(s, old_log_probs=o) for s, o in zip(mine, own)],
                         ["old_log_probs", "ref_log_probs"])  # no sample has ref_log_probs: left out
    return {"share_max_diff": max((a - o).abs().max().item() for a, (_, o) in zip(own, pairs)),
            "mean_lp": means["old_log_probs"], "mean_keys": sorted(means),
            "mean_lp_want": sum(float(o.mean()) for o in old) / len(old),
            "share_n": len(mine), "gap_max": gap["train/train_rollout_logprob_abs_diff_max"]}


def _fused_old(actor, batch: list, old: list) -> dict:
    """One update of ``batch`` without π_old, as the actor role trains a one-update step: the log-probs its forward
    hands back (``old_out``) against π_old of a pass of its own (``old``, the same weights)."""
    from relax_hpc.train.batch import share_of

    p = actor.parallel
    share = share_of([dataclasses.replace(s, old_log_probs=None) for s in batch], p.dp, p.dp_rank)
    got = [None] * len(share.samples)
    m = actor.train_step(share, old_out=got)
    pos = [next(j for j, b in enumerate(batch) if b.tokens is s.tokens) for s in share.samples]  # its batch index
    return {"metrics": m, "fused_n": sum(g is not None for g in got),
            "fused_max_diff": max((g - old[j]).abs().max().item() for g, j in zip(got, pos) if g is not None)}


def job_train(args: dict, out: Path) -> dict:
    """For each layout: fixed batch, old log-probs from the initial model, GRPO steps; losses and log-prob moves."""
    import torch

    from relax_hpc.train import MegatronActor, init_parallel
    from relax_hpc.train.logprobs import set_progress_hook
    from relax_hpc.train.parallel import destroy_parallel

    res = {}
    for layout in args["layouts"]:
        key = "tp{tp}_pp{pp}_dp{dp}".format(dp=int(os.environ["WORLD_SIZE"]) // (layout.get("tp", 1) * layout.get("pp", 1)),
                                            tp=layout.get("tp", 1), pp=layout.get("pp", 1))
        init_parallel(layout.get("tp", 1), layout.get("pp", 1), seed=1)
        actor = MegatronActor.from_hf(args["hf"], _train_cfg(layout, micro_batch_size=2, lr=args["lr"], clip_grad=1.0),
                                      _algo(**args.get("algo", {})))
        batch = make_batch(args["n"], seed=11)
        old = actor.compute_log_probs(batch)
        share = _share_checks(actor, batch, old)
        for s, o in zip(batch, old):
            s.old_log_probs = o
        steps, t0, calls = [], time.time(), []
        set_progress_hook(lambda: calls.append(1))  # a role's ctx.progress: once per micro-batch
        fused = {}
        for i in range(args["steps"]):
            if i == 0 and layout.get("pp", 1) == 1:  # a one-update step: π_old is the update's own forward
                fused = _fused_old(actor, batch, old)  # (relax_hpc.train.config.old_from_train_forward)
                m = fused.pop("metrics")
            else:
                m = actor.train_step(batch)
            steps.append({k: m[k] for k in ("loss", "pg_loss", "grad_norm", "pg_clipfrac", "ppo_kl", "entropy_loss")})
        step_s = (time.time() - t0) / args["steps"]
        set_progress_hook(None)
        new = actor.compute_log_probs(batch)
        res[key] = {"steps": steps, "step_s": step_s, "progress_calls": len(calls),
                    "advantage": [float(s.advantages[0]) for s in batch], **share, **fused,
                    "logprob_change": [(n - o).mean().item() for n, o in zip(new, old)]}
        del actor
        destroy_parallel()
    return res


def job_resume(args: dict, out: Path) -> dict:
    """mode=save: k steps, save, n more (reference). mode=load: load, n steps. Per layout, fixed data."""
    import torch

    from relax_hpc.train import MegatronActor, init_parallel
    from relax_hpc.train.logprobs import set_progress_hook
    from relax_hpc.train.parallel import destroy_parallel

    res = {}
    for layout in args["layouts"]:
        init_parallel(layout.get("tp", 1), layout.get("pp", 1), seed=1)
        actor = MegatronActor.from_hf(args["hf"], _train_cfg(layout, micro_batch_size=1, lr=args["lr"], clip_grad=1.0),
                                      _algo(**args.get("algo", {})))
        batch = make_batch(args["n_samples"], seed=5, fixed_old=True)
        r: dict = {}
        if args["mode"] == "save":
            for _ in range(args["k"]):
                actor.train_step(batch)
            t0 = time.time()
            actor.save_checkpoint(layout["ckpt"], {"data_pos": args["k"], "note": "hello"})
            r["save_s"] = time.time() - t0
            if layout.get("pp", 1) == 1:  # test_export_cli's: the saved model's logits
                tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
                r["tokens"], r["logits"] = tokens.tolist(), _full_logits(actor, tokens).tolist()
        else:
            t0 = time.time()
            r["extra"] = actor.load_checkpoint(layout["ckpt"])
            r["load_s"] = time.time() - t0
            r["step_after_load"] = actor.step
        r["steps"] = []
        for _ in range(args["n"]):
            m = actor.train_step(batch)
            r["steps"].append([m["loss"], m["grad_norm"]])
        res[layout["name"]] = r
        del actor
        destroy_parallel()
    return res


def _opt_state(actor) -> list:
    """Copies of every weight, every optimizer main param and every Adam state tensor (step included)."""
    import torch

    out = [p.detach().clone() for m in actor.model for p in m.parameters()]
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                out += [v.detach().clone() for _, v in sorted(opt.optimizer.state[p].items()) if torch.is_tensor(v)]
    return out


def _same(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def job_nonfinite(args: dict, out: Path) -> dict:
    """train.nonfinite per layout: a step with a NaN advantage under skip changes no weight and no optimizer state
    and says so in its metrics; the next good step trains; train.max_nonfinite_skips consecutive skips are allowed
    and one more fails; under fail the first fails. Same decision on every rank (else a collective would hang)."""
    import math

    import torch

    from relax_hpc.errors import is_permanent
    from relax_hpc.train import MegatronActor, init_parallel
    from relax_hpc.train.parallel import destroy_parallel

    res = {}
    for layout in args["layouts"]:
        tp, pp = layout.get("tp", 1), layout.get("pp", 1)
        key = f"tp{tp}_pp{pp}_dp{int(os.environ['WORLD_SIZE']) // (tp * pp)}"
        init_parallel(tp, pp, seed=1)
        cfg = _train_cfg(layout, micro_batch_size=2, lr=1e-3, clip_grad=1.0, max_nonfinite_skips=2)
        actor = MegatronActor.from_hf(args["hf"], cfg, _algo(eps_clip=0.2))
        batch = make_batch(4, seed=11, fixed_old=True)
        poisoned = [dataclasses.replace(s, advantages=torch.full_like(s.advantages, float("nan"))) if i == 1 else s
                    for i, s in enumerate(batch)]
        r: dict = {"first": actor.train_step(batch)}  # Adam state exists from here on
        before = _opt_state(actor)
        m = actor.train_step(poisoned, rollout_step=7)
        r["skip"] = {k: m[k] for k in ("loss", "pg_loss", "grad_norm", "nonfinite_skipped", "update_successful",
                                       "step")}
        r["skip"]["why"], r["skip"]["unchanged"] = actor.last_skip, _same(before, _opt_state(actor))
        m = actor.train_step(batch)
        after = _opt_state(actor)
        r["next"] = {"loss": m["loss"], "nonfinite_skipped": m["nonfinite_skipped"], "why": actor.last_skip,
                     "changed": not _same(before, after), "finite": all(bool(torch.isfinite(t).all()) for t in after)}
        r["streak"] = []
        for _ in range(3):  # two skips pass (max_nonfinite_skips = 2), the third ends the run
            try:
                r["streak"].append(actor.train_step(poisoned, rollout_step=9)["nonfinite_skipped"])
            except Exception as e:
                r["streak_error"], r["streak_permanent"] = str(e), is_permanent(e)
        r["streak_unchanged"] = _same(after, _opt_state(actor))
        actor.train_step(batch)  # an applied step ends the streak
        cfg.nonfinite = "fail"
        held = _opt_state(actor)
        try:
            actor.train_step(poisoned, rollout_step=12)
        except Exception as e:
            r["fail_error"], r["fail_permanent"], r["fail_type"] = str(e), is_permanent(e), type(e).__name__
        r["fail_unchanged"] = _same(held, _opt_state(actor))
        r["loss_is_nan"] = math.isnan(r["skip"]["loss"])
        res[key] = r
        del actor
        destroy_parallel()
    return res


def spread_batch(n: int, seed: int, lengths: tuple[int, int], vocab: int = 128) -> list:
    """n samples with a 3–6 token prompt and a response length drawn in ``lengths``: a spread like an RL step's."""
    import torch

    from relax_hpc.train.batch import TrainingSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        start = int(torch.randint(3, 7, (1,), generator=g))
        r = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        out.append(TrainingSample.of(torch.randint(6, vocab, (start + r,), generator=g), start,
                                     advantage=[1.0, -1.0, 0.5, -0.25][i % 4]))
    return out


def job_equal(args: dict, out: Path) -> dict:
    """The same training under ``base`` and each of ``variants`` (TrainConfig overrides) at one layout, from the
    same weights: log-probs before, then per step loss, grad norm and the log-probs after, and the weights at the
    end, as max |variant − base|. ``padding``: pad tokens / all tokens the micro-batches of each config hold."""
    import torch

    from relax_hpc.train import MegatronActor, init_parallel
    from relax_hpc.train.logprobs import plan_micro_batches
    from relax_hpc.train.parallel import destroy_parallel

    layout = args.get("layout", {})
    batch = spread_batch(args["n"], args.get("seed", 3), tuple(args.get("lengths", (4, 40))))

    def run(over: dict) -> dict:
        init_parallel(layout.get("tp", 1), layout.get("pp", 1), seed=1)
        cfg = _train_cfg(layout, lr=args.get("lr", 1e-4), clip_grad=1.0, **{**args.get("base", {}), **over})
        actor = MegatronActor.from_hf(args["hf"], cfg, _algo(**args.get("algo", {})))
        from megatron.core.tensor_parallel.random import CheckpointFunction as CF
        from megatron.core.utils import get_model_config

        recomputed, fwd = [0], CF.forward  # chunks kept for recompute: a recompute variant must have some

        def counted(ctx, *a):
            recomputed[0] += 1
            return fwd(ctx, *a)

        CF.forward = staticmethod(counted)
        old = actor.compute_log_probs(batch)
        data = [dataclasses.replace(s, old_log_probs=o) for s, o in zip(batch, old)]
        steps = []
        for _ in range(args.get("steps", 2)):
            m = actor.train_step(data)
            steps.append([m["loss"], m["grad_norm"], m["pg_clipfrac"], m["entropy_loss"]])
        CF.forward = staticmethod(fwd)
        sp = get_model_config(actor.model[0]).sequence_parallel
        after = actor.compute_log_probs(batch)
        weights = [t.clone() for _, t in actor.named_hf_weights()]
        mbs = plan_micro_batches(batch, cfg.micro_batch_size, pad_id=actor.pad_id, train=True, pp=1,
                                 max_seq_len=cfg.max_seq_len, global_seq_len=0,
                                 max_tokens=cfg.max_tokens_per_micro_batch)
        real = sum(s.tokens.numel() for s in batch)
        held = sum(mb.tokens.numel() for mb in mbs)
        del actor
        destroy_parallel()
        return {"old": old, "steps": steps, "after": after, "weights": weights, "padding": 1 - real / held,
                "micro_batches": len(mbs), "recomputed": recomputed[0], "sequence_parallel": sp}

    def gap(a, b) -> float:
        return max(((x - y).abs().max().item() for x, y in zip(a, b)), default=0.0)

    base = run({})
    res = {"base": {"steps": base["steps"], "padding": base["padding"], "micro_batches": base["micro_batches"],
                    "recomputed": base["recomputed"], "sequence_parallel": base["sequence_parallel"]}}
    for name, over in args["variants"].items():
        v = run(over)
        res[name] = {"old": gap(v["old"], base["old"]), "after": gap(v["after"], base["after"]),
                     "weights": gap(v["weights"], base["weights"]), "steps": v["steps"],
                     "step_diff": max(abs(x - y) for a, b in zip(v["steps"], base["steps"]) for x, y in zip(a, b)),
                     "padding": v["padding"], "micro_batches": v["micro_batches"], "recomputed": v["recomputed"],
                     "sequence_parallel": v["sequence_parallel"]}
    return res


def job_attention(args: dict, out: Path) -> dict:
    """SDPAttention against megatron-core's unfused DotProductAttention (fp32, GQA 4 heads / 2 groups, causal):
    outputs and input grads; then packed (thd, three samples, two of one length, and a pad tail) against each sample
    alone."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from relax_hpc.train import init_parallel
    from relax_hpc.train.attention import SDPAttention
    from relax_hpc.train.parallel import destroy_parallel

    init_parallel(1, 1, seed=1)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False)
    ref = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    sdpa = SDPAttention(cfg, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(0)

    def qkv(s, b):
        return [torch.randn(s, b, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2)]

    q, k, v = qkv(13, 3)
    a, b = ref(q, k, v, None), sdpa(q, k, v, None)
    ga = torch.autograd.grad(a.square().sum(), (q, k, v))
    gb = torch.autograd.grad(b.square().sum(), (q, k, v))
    res = {"shape": list(b.shape), "out": (a - b).abs().max().item(),
           "grad": max((x - y).abs().max().item() for x, y in zip(ga, gb))}
    lens, tail = [5, 9, 5], 4  # two of one length: one batched call
    parts = [qkv(n, 1) for n in lens + [tail]]
    cat = [torch.cat([p[i].detach() for p in parts]).squeeze(1) for i in range(3)]  # [t, heads, 16]
    cu = torch.tensor([0, 5, 14, 19, 23], dtype=torch.int32)
    packed = sdpa(*cat, None, packed_seq_params=PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9))
    alone = torch.cat([ref(*[t.detach() for t in p], None).reshape(-1, 4, 16) for p in parts])
    res["packed_shape"] = list(packed.shape)
    res["packed"] = (packed - alone).abs().max().item()
    # packed RoPE on a CPU: one gather of the frequencies (cpu_compat) where megatron slices them per sequence
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings import rope_utils

    thd, cp = rope_utils._apply_rotary_pos_emb_thd, ps.get_context_parallel_group()
    freqs, t = torch.randn(11, 1, 1, 16, generator=g), torch.randn(23, 4, 16, generator=g)
    res["rope_thd"] = {"gathered": getattr(thd, "_relax", False),
                       "as_megatron": torch.equal(thd(t, cu, freqs, cp_group=cp),
                                                  thd.__wrapped__(t, cu, freqs, cp_group=cp))}
    # query-key layer scaling (an fp16 guard megatron undoes in its softmax) leaves the attention as it is
    scaled = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
                               apply_query_key_layer_scaling=True)
    q, k, v = (t.detach() for t in qkv(7, 2))
    res["layer_scaling"] = (DotProductAttention(scaled, 3, AttnMaskType.causal, "self")(q, k, v, None)
                            - SDPAttention(scaled, 3, AttnMaskType.causal, "self")(q, k, v, None)).abs().max().item()
    destroy_parallel()
    return res


def job_kernels(args: dict, out: Path) -> dict:
    """What the real provider of ``args['hf']`` is given by ``choose_kernels`` on CUDA with nothing extra installed,
    with a Transformer Engine stand-in, and with TE and apex: its spec and its fusion flags."""
    from relax_hpc.train.model import FUSIONS, choose_kernels, import_bridge

    bridge = import_bridge().from_hf_pretrained(args["hf"])
    stand_ins = {"none": lambda name: False, "te": lambda name: name == "transformer_engine",
                 "te_apex": lambda name: True}
    res = {}
    for name, importable in stand_ins.items():
        provider = bridge.to_megatron_provider(load_weights=False)
        asked = {k: bool(getattr(provider, k, False)) for k in FUSIONS}  # the bridge's defaults here
        for k in FUSIONS:  # a provider that asks for every fusion (as on a GPU box with TE)
            setattr(provider, k, True)
        default_spec = provider.transformer_layer_spec
        choose_kernels(provider, cuda=True, importable=importable)
        res[name] = {"asked": asked, "flags": {k: bool(getattr(provider, k)) for k in FUSIONS},
                     "spec": getattr(provider.transformer_layer_spec, "__name__", "?"),
                     "default_spec_kept": provider.transformer_layer_spec is default_spec}
    provider = bridge.to_megatron_provider(load_weights=False)
    choose_kernels(provider, cuda=False, importable=stand_ins["te_apex"])
    res["cpu"] = {"flags": {k: bool(getattr(provider, k)) for k in FUSIONS}}
    return res


def job_suite(args: dict, out: Path) -> dict:
    """Several jobs in one launch (imports cost ~8 s per process): {"name": [job, args], ...}.

    A failing job is recorded as {"error": traceback} and the rest are not run (the parallel state
    may be half torn down); each test checks only its own job's entry.
    """
    res, failed = {}, None
    for name, (job, sub) in args.items():
        if failed:
            res[name] = {"error": f"not run: job {failed!r} failed before it"}
            continue
        t0 = time.time()
        try:
            res[name] = JOBS[job](sub, out)
        except Exception:
            traceback.print_exc()
            res[name], failed = {"error": traceback.format_exc()}, name
        res[name + "_s"] = time.time() - t0
    return res


def job_lora(args: dict, out: Path) -> dict:
    from lora_jobs import job_lora as lora  # tests/train/lora_jobs.py (test_lora.py reads it)

    return lora(args, out)


JOBS = {"parity": job_parity, "train": job_train, "resume": job_resume, "nonfinite": job_nonfinite,
        "equal": job_equal, "attention": job_attention, "kernels": job_kernels, "suite": job_suite,
        "lora": job_lora}


def main() -> int:
    job, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    rank, _ = init_dist()
    try:
        result = JOBS[job](args, out)
        status = 0
    except Exception:
        traceback.print_exc()
        result, status = {"error": traceback.format_exc()}, 1
    if rank == 0:
        tmp = out / "result.json.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out / "result.json")
    import torch.distributed as dist

    if status == 0:
        dist.barrier()
        dist.destroy_process_group()
    return status


def run(**jobs) -> None:
    """Be one rank of a run: :func:`main` with ``jobs`` added to :data:`JOBS` (a test file that is its own worker
    passes its jobs), then exit."""
    JOBS.update(jobs)
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with torch, megatron, the bridge and transformers loaded it takes
    # seconds (measured 17-28 s on a busy 2-core box) and there is nothing left to flush.
    os._exit(code)


if __name__ == "__main__":
    run()
