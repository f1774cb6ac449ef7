"""The recipe's ``train:`` section: how the actor's Megatron model is split, batched and optimized.

Pure Python on purpose: the recipe validator imports this on the login node, where megatron-core may
not even be installed. Field types stay within what :mod:`relax_hpc.recipe.validate` understands.
Data parallelism is not a field: it is whatever is left, world / (tp × pp); expert parallelism (``ep``) splits a
mixture-of-experts model's experts over ``ep`` of those data-parallel ranks (Megatron's layout), so it divides
the data-parallel size and the model's experts (checked at build, where both are known).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from relax_hpc.seed import DEFAULT_SEED

# LoRA targets: Megatron's linear layers (the fused ones take one adapter for all their parts), and HF's names for them
MEGATRON_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
HF_LORA_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                   "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
                   "lm_head": "output_layer"}
DEFAULT_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def megatron_targets(names: list[str]) -> list[str]:
    """``train.lora.target_modules`` as Megatron's linear names, in Megatron's order; ValueError naming the
    problem for an unknown name or part of a fused linear (q_proj without k_proj and v_proj)."""
    out = set()
    for n in names:
        if n in MEGATRON_LORA_TARGETS:
            out.add(n)
        elif n in HF_LORA_TARGETS:
            meg = HF_LORA_TARGETS[n]
            parts = sorted(h for h, m in HF_LORA_TARGETS.items() if m == meg)
            if not set(parts) <= set(names) and meg not in names:
                raise ValueError(f"{n} is one part of Megatron's fused {meg} ({', '.join(parts)}), which takes one "
                                 f"adapter for all of them. Fix: name all of {', '.join(parts)}, or {meg}")
            out.add(meg)
        else:
            raise ValueError(f"{n!r} is not a LoRA target. Fix: any of {', '.join(MEGATRON_LORA_TARGETS)} "
                             f"(Megatron's names) or {', '.join(HF_LORA_TARGETS)} (HF's)")
    return [m for m in MEGATRON_LORA_TARGETS if m in out]


@dataclass
class LoraConfig:
    """``train.lora``: low-rank adapters trained on the frozen base model (docs/lora.md; Relax's --lora-* flags)."""

    rank: int = 16  # Relax --lora-rank
    alpha: float = 32.0  # Relax --lora-alpha: the update is scaled by alpha / rank
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))  # Megatron's or HF's names
    dropout: float = 0.0  # Relax --lora-dropout
    mode: Literal["merge", "adapter"] = "merge"  # what the weight sync sends: merged weights, or the adapters alone

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainConfig:
    tp: int = 1  # tensor-parallel size (Megatron tensor_model_parallel_size)
    pp: int = 1  # pipeline-parallel size; data parallel = world / (tp × pp)
    ep: int = 1  # expert-parallel size (Megatron expert_model_parallel_size): MoE experts split over ep DP ranks
    routing_replay: bool = False  # MoE: route each token to the experts the engine chose (its routed_experts; Relax's --use-rollout-routing-replay)
    micro_batch_size: int = 1  # samples per forward/backward pass on one data-parallel rank (padded micro-batches)
    global_batch_size: int | None = None  # samples per optimizer step across all DP ranks; None: the rollout step / num_steps_per_rollout
    num_steps_per_rollout: int | None = None  # optimizer steps (mini-batches) per rollout step; None: from global_batch_size, else 1
    lr: float = 1e-6  # peak learning rate (Relax default 1e-6)
    min_lr: float = 0.0  # floor of the cosine decay; unused with lr_decay: constant
    lr_warmup_steps: int = 0  # linear warmup from 0 to lr over this many optimizer steps
    lr_decay: Literal["constant", "cosine"] = "constant"  # schedule after warmup
    lr_decay_steps: int = 0  # cosine: optimizer steps from the end of warmup down to min_lr (0: no decay)
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    adam_beta1: float = 0.9  # Adam first-moment decay
    adam_beta2: float = 0.98  # Adam second-moment decay
    adam_eps: float = 1e-8  # Adam denominator epsilon
    clip_grad: float = 1.0  # global gradient-norm clip (0: off)
    use_distributed_optimizer: bool = True  # shard optimizer state over data-parallel ranks (ZeRO-1)
    # megatron-core's OptimizerConfig options of the same names (Relax's --optimizer-cpu-offload, ...; GPU only):
    optimizer_cpu_offload: bool = False  # Adam's state and step on the host (HybridDeviceOptimizer, all of it); needs the next
    use_precision_aware_optimizer: bool = False  # master weights as bf16 + 16-bit remainders; needs Transformer Engine and the distributed optimizer
    overlap_cpu_optimizer_d2h_h2d: bool = False  # with optimizer_cpu_offload: copy grads/params to and from the host on side streams
    bf16: bool = False  # bf16 weights/activations with fp32 master weights (GPU); False: fp32 everywhere
    seed: int = DEFAULT_SEED  # seeds torch/numpy/python and Megatron's model-parallel RNG on every rank
    max_seq_len: int = 4096  # longest prompt+response accepted; longer samples are an error, not truncated
    logprob_micro_batch_size: int | None = None  # samples per forward-only pass (log-probs); None: micro_batch_size
    max_tokens_per_micro_batch: int | None = None  # pack samples into micro-batches of at most this many tokens (no padding); None: micro_batch_size samples, padded
    logprob_max_tokens_per_micro_batch: int | None = None  # the same for forward-only passes; None: max_tokens_per_micro_batch
    recompute: Literal["none", "selective", "full"] = "none"  # activation recompute (Megatron recompute_granularity)
    recompute_method: Literal["uniform", "block"] = "uniform"  # full recompute: layers in chunks (uniform) or the first N (block)
    recompute_num_layers: int = 1  # full recompute: layers per chunk (uniform) or recomputed layers per stage (block)
    sequence_parallel: bool = False  # split the sequence over TP ranks outside attention/MLP (needs tp > 1)
    nonfinite: Literal["skip", "fail"] = "skip"  # NaN/inf loss, grad norm or training value: skip the update, or fail
    max_nonfinite_skips: int = 3  # consecutive optimizer steps skipped before the run fails; 0: fail at the first
    balance_data: bool = False  # deal each mini-batch's samples to the DP ranks by token count, evenly (Relax's --balance-data); False: contiguous shares
    offload: bool = False  # colocate: params, grads and optimizer state leave the device while engines generate (Relax's --offload-train)
    overlap_sync: Literal["auto", True, False] = "auto"  # step N's weight push runs behind step N+1's train (fully_async, bounded max_staleness >= 1; auto: there)
    lora: LoraConfig | None = None  # low-rank adapters on the frozen base model (docs/lora.md); None: full fine-tuning


def check(cfg: TrainConfig) -> list[tuple[str, object, str]]:
    """Meaning checks the type pass cannot do: (key, value, "problem. fix") for every bad value."""
    out: list[tuple[str, object, str]] = []

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            out.append((key, getattr(cfg, key), msg))

    need(cfg.tp >= 1, "tp", "must be at least 1. Fix: use 1 for no tensor parallelism")
    need(cfg.pp >= 1, "pp", "must be at least 1. Fix: use 1 for no pipeline parallelism")
    need(cfg.ep >= 1, "ep", "must be at least 1. Fix: use 1 for no expert parallelism (a dense model needs 1)")
    need(cfg.micro_batch_size >= 1, "micro_batch_size", "must be at least 1 sample. Fix: use 1")
    if cfg.global_batch_size is not None:
        need(cfg.global_batch_size >= 1, "global_batch_size", "must be at least 1 or null. Fix: use null")
        if cfg.global_batch_size >= 1 and cfg.micro_batch_size >= 1 and cfg.max_tokens_per_micro_batch is None:
            need(cfg.global_batch_size % cfg.micro_batch_size == 0, "global_batch_size",
                 f"is not a multiple of train.micro_batch_size = {cfg.micro_batch_size}. "
                 "Fix: make it micro_batch_size × data-parallel size × a whole number of micro-batches")
    if cfg.num_steps_per_rollout is not None:
        need(cfg.num_steps_per_rollout >= 1, "num_steps_per_rollout", "must be at least 1 or null. Fix: use null")
    if cfg.logprob_micro_batch_size is not None:
        need(cfg.logprob_micro_batch_size >= 1, "logprob_micro_batch_size", "must be at least 1 or null. Fix: use null")
    if cfg.max_tokens_per_micro_batch is not None:  # packing decides the micro-batches: a sample count would do nothing
        need(cfg.micro_batch_size == 1, "micro_batch_size",
             f"is not used when train.max_tokens_per_micro_batch = {cfg.max_tokens_per_micro_batch} packs the "
             "micro-batches by tokens. Fix: remove micro_batch_size, or max_tokens_per_micro_batch for padded ones")
    if cfg.logprob_micro_batch_size is not None:
        packed = cfg.logprob_max_tokens_per_micro_batch or cfg.max_tokens_per_micro_batch
        need(packed is None, "logprob_micro_batch_size",
             f"is not used when the log-prob passes are packed by tokens ({packed} a micro-batch). "
             "Fix: remove logprob_micro_batch_size")
    for key in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch"):
        v = getattr(cfg, key)
        if v is not None:
            need(v >= cfg.max_seq_len, key,
                 f"is below train.max_seq_len = {cfg.max_seq_len}: the longest sample accepted must fit in one "
                 "micro-batch. Fix: at least max_seq_len tokens (e.g. 2-4 x max_seq_len), or null for padded micro-batches")
    need(cfg.recompute_num_layers >= 1, "recompute_num_layers", "must be at least 1. Fix: e.g. 1")
    if cfg.recompute != "full":  # the two shape full recompute only
        need(cfg.recompute_method == "uniform", "recompute_method",
             f"applies to train.recompute: full only, and train.recompute = {cfg.recompute}. "
             "Fix: set train.recompute: full, or remove recompute_method")
        need(cfg.recompute_num_layers == 1, "recompute_num_layers",
             f"applies to train.recompute: full only, and train.recompute = {cfg.recompute}. "
             "Fix: set train.recompute: full, or remove recompute_num_layers")
    need(not cfg.sequence_parallel or cfg.tp > 1, "sequence_parallel",
         f"needs tensor parallelism, and train.tp = {cfg.tp}. Fix: set train.tp >= 2, or sequence_parallel: false")
    need(cfg.sequence_parallel or cfg.tp == 1 or cfg.ep == 1, "sequence_parallel",
         f"must be on with both tensor and expert parallelism (train.tp = {cfg.tp}, train.ep = {cfg.ep}): Megatron's "
         "MoE training requires it. Fix: sequence_parallel: true, or train.ep: 1")
    need(cfg.lr > 0, "lr", "must be positive. Fix: e.g. 1e-6")
    need(0 <= cfg.min_lr <= cfg.lr, "min_lr", f"must be between 0 and train.lr = {cfg.lr}. Fix: e.g. 0")
    need(cfg.lr_warmup_steps >= 0, "lr_warmup_steps", "must be 0 or more. Fix: use 0 for no warmup")
    need(cfg.lr_decay_steps >= 0, "lr_decay_steps", "must be 0 or more. Fix: use 0 for no decay")
    need(cfg.weight_decay >= 0, "weight_decay", "must be 0 or more. Fix: e.g. 0.0 or 0.01")
    need(0 <= cfg.adam_beta1 < 1, "adam_beta1", "must be in [0, 1). Fix: e.g. 0.9")
    need(0 <= cfg.adam_beta2 < 1, "adam_beta2", "must be in [0, 1). Fix: e.g. 0.98")
    need(cfg.adam_eps > 0, "adam_eps", "must be positive. Fix: e.g. 1e-8")
    need(cfg.clip_grad >= 0, "clip_grad", "must be 0 (off) or positive. Fix: e.g. 1.0")
    # what megatron-core (OptimizerConfig, get_megatron_optimizer) and Megatron-LM's arguments require of them
    need(not cfg.use_precision_aware_optimizer or cfg.use_distributed_optimizer, "use_precision_aware_optimizer",
         "needs the distributed optimizer (megatron-core asserts it), and train.use_distributed_optimizer = False. "
         "Fix: use_distributed_optimizer: true, or use_precision_aware_optimizer: false")
    need(not cfg.optimizer_cpu_offload or cfg.use_precision_aware_optimizer, "optimizer_cpu_offload",
         "needs train.use_precision_aware_optimizer: true (megatron's hybrid CPU optimizer runs on its code path; "
         "Relax passes both). Fix: use_precision_aware_optimizer: true, or optimizer_cpu_offload: false")
    need(not cfg.overlap_cpu_optimizer_d2h_h2d or cfg.optimizer_cpu_offload, "overlap_cpu_optimizer_d2h_h2d",
         "overlaps the copies of the CPU optimizer, and train.optimizer_cpu_offload = False: it would do nothing. "
         "Fix: optimizer_cpu_offload: true, or overlap_cpu_optimizer_d2h_h2d: false")
    need(cfg.nonfinite in ("skip", "fail"), "nonfinite",
         "must be skip or fail. Fix: skip (a non-finite step is not applied) or fail (it ends the run)")
    need(cfg.max_nonfinite_skips >= 0, "max_nonfinite_skips",
         "must be 0 (fail at the first non-finite step) or more. Fix: e.g. 3")
    if cfg.lora is not None:
        out.extend(check_lora(cfg.lora))
    need(cfg.max_seq_len >= 2, "max_seq_len", "must be at least 2 tokens (one prompt, one response). Fix: e.g. 4096")
    return out


def check_lora(lcfg: LoraConfig) -> list[tuple[str, object, str]]:
    out: list[tuple[str, object, str]] = []
    if lcfg.rank < 1:
        out.append(("lora.rank", lcfg.rank, "must be at least 1. Fix: e.g. 16 (8-64 is usual)"))
    if lcfg.alpha <= 0:
        out.append(("lora.alpha", lcfg.alpha, "must be positive (the update is scaled by alpha / rank). Fix: e.g. 2 x rank"))
    if not 0 <= lcfg.dropout < 1:
        out.append(("lora.dropout", lcfg.dropout, "must be in [0, 1). Fix: 0.0"))
    if not lcfg.target_modules:
        out.append(("lora.target_modules", lcfg.target_modules,
                    f"names no module. Fix: e.g. [{', '.join(DEFAULT_LORA_TARGETS)}]"))
    else:
        try:
            megatron_targets(lcfg.target_modules)
        except ValueError as e:
            out.append(("lora.target_modules", lcfg.target_modules, str(e)))
    return out


def hf_lora_targets(names: list[str]) -> list[str]:
    """``train.lora.target_modules`` as HF module names (PEFT's ``target_modules``, SGLang's
    ``--lora-target-modules``): each Megatron linear stands for every HF module it fuses."""
    megs = megatron_targets(names)
    return [hf for hf, meg in HF_LORA_TARGETS.items() if meg in megs]


def reference_from_actor(recipe) -> bool:
    """Whether the actor itself computes π_ref (``ref_log_probs``) with its LoRA adapters switched off: the
    reference is then the base model the adapters sit on, with no second copy of the weights and no reference
    role. So when ``train.lora`` is set, the algorithm needs π_ref (``algorithm.use_kl_loss``) and
    ``roles.reference`` is not enabled (an enabled reference role keeps doing it, as without LoRA)."""
    return (recipe.train.lora is not None and recipe.algorithm.use_kl_loss
            and not recipe.roles.reference.enabled)


def old_from_train_forward(recipe) -> bool:
    """Whether π_old (``log_probs``) is the train forward's own, detached (ratio ≡ 1; Relax's true on-policy): the
    rollout step is one optimizer step (``train.num_steps_per_rollout`` 1, or ``train.global_batch_size`` the whole
    step, or neither set) on one pipeline stage, and π_old is the actor's (no ``actor_fwd`` role, not
    ``algorithm.use_rollout_logprobs``). A forward pass of its own before the update would compute the same numbers
    with the same weights, so it is not made, and nothing stages π_old early (``rollout.stream_groups``)."""
    t, ro = recipe.train, recipe.rollout
    whole = ro.rollout_batch_size * ro.n_samples_per_prompt
    one_step = t.num_steps_per_rollout in (None, 1) and t.global_batch_size in (None, whole)
    return (one_step and t.pp == 1 and not recipe.roles.actor_fwd.enabled
            and not recipe.algorithm.use_rollout_logprobs)


def steps_per_rollout(cfg: TrainConfig, samples: int) -> int:
    """k, the optimizer steps per rollout step of ``samples`` samples (Relax's ``--num-steps-per-rollout``, verl's
    ``ppo_mini_batch_size``): ``num_steps_per_rollout``, else samples / ``global_batch_size``, else 1. The
    recipe validator checks that the two agree and divide ``samples``."""
    if cfg.num_steps_per_rollout is not None:
        return cfg.num_steps_per_rollout
    if cfg.global_batch_size:
        return max(1, samples // cfg.global_batch_size)
    return 1


# Checks of train keys against other sections; relax_hpc.recipe.validate.check calls them (the recipe typed Any:
# train/ does not import the recipe, which imports this module).


def check_batch(r: Any) -> list[tuple[str, object, str]]:
    """Mini-batch updates split a rollout step's samples into k equal global batches
    (``train.num_steps_per_rollout`` = k, or ``train.global_batch_size`` = samples / k): a size that does not
    divide the samples, or two keys that disagree, would fail at step 1, after the queue."""
    gbs, k, ro = r.train.global_batch_size, r.train.num_steps_per_rollout, r.rollout
    samples = ro.rollout_batch_size * ro.n_samples_per_prompt
    what = (f"the samples of one rollout step, rollout.rollout_batch_size × rollout.n_samples_per_prompt = "
            f"{ro.rollout_batch_size} × {ro.n_samples_per_prompt} = {samples}")
    if gbs is not None and gbs >= 1 and samples % gbs:
        return [("train.global_batch_size", gbs, f"must divide {what}: each optimizer step trains one equal "
                 f"share of them. Fix: set it to {samples} (one step) or a divisor of {samples}, or null and "
                 "set train.num_steps_per_rollout")]
    if k is not None and k >= 1 and samples % k:
        return [("train.num_steps_per_rollout", k, f"must divide {what}: the step's samples are split into "
                 f"that many equal global batches. Fix: use a divisor of {samples}, e.g. 1, 2 or 4")]
    if k is not None and k >= 1 and gbs is not None and gbs >= 1 and gbs * k != samples:
        return [("train.num_steps_per_rollout", k, f"disagrees with train.global_batch_size = {gbs}: "
                 f"{k} steps of {gbs} samples is not {what}. Fix: set one of them (the other to null), or "
                 f"make global_batch_size = {samples} / num_steps_per_rollout")]
    a, mp = r.roles.actor, r.train.tp * r.train.pp
    world = a.nodes * a.tasks_per_node
    k = steps_per_rollout(r.train, samples)
    if mp >= 1 and world % mp == 0 and k >= 1 and samples // k < world // mp and gbs is None \
            and r.train.num_steps_per_rollout is None:
        # neither batch key is set: the actor's size is what asks too much (roles.actor.nodes=999)
        return [("roles.actor.nodes", a.nodes, f"gives {world // mp} data-parallel actor ranks (roles.actor.nodes × "
                 f"tasks_per_node ÷ (train.tp × train.pp)), more than the {samples} samples of one rollout step "
                 f"({ro.rollout_batch_size} × {ro.n_samples_per_prompt}): every rank needs at least one. Fix: at "
                 f"most {samples * mp // a.tasks_per_node or 1} nodes, or more samples per rollout step")]
    if mp >= 1 and world % mp == 0 and k >= 1 and samples // k < world // mp:
        return [("train.num_steps_per_rollout" if r.train.num_steps_per_rollout else "train.global_batch_size",
                 r.train.num_steps_per_rollout or gbs, f"leaves {samples // k} samples per optimizer step for "
                 f"{world // mp} data-parallel actor ranks: every rank needs at least one. Fix: fewer steps "
                 "per rollout, or more samples per rollout step")]
    return []


def check_train_offload(r: Any) -> list[tuple[str, object, str]]:
    """train.offload frees the actor's device memory for engines on the same device while they generate: only
    colocate has them take turns (in fully_async the actor's GPUs are its own, and it trains while they generate)."""
    if r.train.offload and r.mode != "colocate":
        return [("train.offload", True, f"moves the actor's parameters, gradients and optimizer state off the GPU "
                 f"while the engines on it generate, which only mode: colocate has them do (this recipe: {r.mode}, "
                 "where the actor's GPUs are its own). Fix: offload: false, or mode: colocate")]
    return []


def overlap_allowed(r: Any) -> str | None:
    """Why this recipe's mode cannot push step N's weights while step N+1 trains (None: it can). Step N+1's samples
    must be allowed to be made without step N's weights: fully_async with a bounded staleness of at least 1."""
    if r.mode != "fully_async":
        return f"mode is {r.mode}, where rollout waits for every sync (the roles take turns)"
    if r.staleness_mode != "bounded":
        return f"staleness_mode is {r.staleness_mode}, where each sync is held for the generate it is due after"
    if r.max_staleness < 1:
        return f"max_staleness is {r.max_staleness}, so step N+1 may not be generated before step N's sync lands"
    return None


def overlap_sync(r: Any) -> bool:
    """Whether the actor pushes step N's weights behind step N+1's train (train.overlap_sync; auto: where allowed)."""
    return r.train.overlap_sync is not False and overlap_allowed(r) is None


def check_overlap_sync(r: Any) -> list[tuple[str, object, str]]:
    """train.overlap_sync: true where the mode cannot overlap the sync is refused (auto turns it off there)."""
    why = overlap_allowed(r) if r.train.overlap_sync is True else None
    if why is None:
        return []
    return [("train.overlap_sync", True, f"pushes step N's weights while step N+1 trains, but {why}. Fix: "
             "overlap_sync: auto (or false), or mode: fully_async with staleness_mode: bounded and max_staleness >= 1")]


def check_lora_adapter_mode(r: Any) -> list[tuple[str, object, str]]:
    """train.lora.mode: adapter sends the adapters alone: relax_hpc's reference engine merges them into its weights,
    SGLang loads them as a LoRA adapter (/load_lora_adapter, from a PEFT directory under the run's directory) and
    serves it to the requests naming it (every request of the run does: docs/lora.md). What cannot take them is
    refused: actor_fwd's copy of the actor takes full weights only, and SGLang loads adapters at run time only
    without data-parallel replicas in one server."""
    lora = r.train.lora
    if lora is None or lora.mode != "adapter":
        return []
    out: list[tuple[str, object, str]] = []
    kind = r.rollout.engine.kind  # auto: SGLang on GPU engine nodes that have it (roles.engine_host.engine_kind)
    args = list(r.rollout.engine.args)
    dp = next((args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--dp-size", "--dp", "--data-parallel-size")),
              None)
    if kind != "reference" and dp is not None and dp != "1":
        out.append(("rollout.engine.args", args, f"starts SGLang with {dp} data-parallel replicas, and SGLang loads "
                    "LoRA adapters at run time (/load_lora_adapter) only with one: train.lora.mode adapter needs "
                    "that. Fix: drop --dp-size (run more engines instead), or train.lora.mode: merge"))
    if r.roles.actor_fwd.enabled:
        out.append(("train.lora.mode", "adapter", "roles.actor_fwd follows the actor's full weights and cannot take "
                    "the adapters alone. Fix: mode: merge, or roles.actor_fwd.enabled: false"))
    return out


def check_lora_reference(r: Any) -> list[tuple[str, object, str]]:
    """With train.lora, use_kl_loss and no reference role the actor computes π_ref itself, adapters off: the base
    model, always (relax_hpc.train.config.reference_from_actor). A key that would make π_ref anything else is
    refused."""
    if not reference_from_actor(r) or r.algorithm.ref_update_interval is None:
        return []
    return [("algorithm.ref_update_interval", r.algorithm.ref_update_interval,
             "would refresh the reference from the actor's checkpoints, but with train.lora and no reference role "
             "π_ref is the actor's own base model (its adapters switched off), which never changes. Fix: remove "
             "algorithm.ref_update_interval, or roles.reference.enabled: true (a reference role that loads the "
             "actor's checkpoints)")]
