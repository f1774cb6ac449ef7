"""The memory plan: what each GPU holds, phase by phase, from the recipe and the model's ``config.json`` alone.

No weights are read and nothing is allocated: the numbers are arithmetic on the model's shape (hidden size,
layers, heads, vocabulary, ...), the parallel layout, the dtypes and the optimizer, so ``relax-submit`` can tell
before the queue that a colocate recipe cannot fit (docs/gpu.md, "Memory plan", has the formulas and how close
they are). Per GPU, in GiB (2^30 bytes):

* a Megatron role (the actor; reference and actor_fwd forward only) holds its parameter shard ``N_gpu`` =
  (layer parameters / (tp·pp), experts / (ep·tp·pp)) + the embedding (and an untied output head) / tp;
  parameters ``N_gpu × (2 bf16 | 4 fp32)``, gradients ``N_gpu × 4`` (Megatron's grad buffer reduces in fp32; with
  ``train.lora`` the gradients and the optimizer state below count the adapters' parameters only: the base is frozen),
  optimizer state ``N_gpu × (8 Adam moments + 4 fp32 master weights with bf16, 2 with the precision-aware
  optimizer's remainders) / DP`` with the distributed optimizer (DP = ranks / (tp·pp·cp)), on the host with
  ``train.optimizer_cpu_offload``;
* activations of one micro-batch of ``T`` tokens (``train.max_tokens_per_micro_batch``, else micro_batch_size ×
  max_seq_len), bf16: per token and layer ``8h/s + (2(a·d + 2·kv·d) + 2·a·d + 6·f)/tp`` bytes (the two norms'
  inputs and outputs, q/k/v, the attention output, the MLP's gate, up and product; ``s`` = tp with sequence
  parallel, else 1; flash attention keeps no a·s² scores), over the layers kept (all; with full recompute the
  layers' inputs ``2h/s`` plus one recomputed chunk), × pp micro-batches in flight on the first stage, / cp, plus
  the fp32 logits and their gradient ``2 × 4 × T·V/tp``;
* an engine holds its static memory: SGLang's ``--mem-fraction-static`` × the card (weights and KV cache), relax_hpc's
  reference engine its bf16 weights and the KV cache of a full batch (64 × max_seq_len tokens);
* every process on a card holds its CUDA context (:data:`CONTEXT_GIB`).

Where the engines share the actor's GPUs (colocate) the card goes through three phases: ``generate`` (the engines'
static memory; the actor keeps its parameters, gradients and optimizer state unless ``train.offload`` moves them to
the host), ``train`` (the engines have released their memory, ``rollout.engine.offload``; the actor adds its
activations) and ``sync`` (the engines have taken their memory back; the actor holds its parameters, and its
gradients and optimizer state unless offloaded, plus the weight buckets in flight).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.recipe.reader import TextError, read_text
from relax_hpc.recipe.schema import Recipe, RoleGroup
from relax_hpc.train.config import megatron_targets
from relax_hpc.train.forward_config import role_train

Problem = tuple[str, object, str]

GiB = float(1 << 30)
CONTEXT_GIB = 0.75  # a process's CUDA context, cuBLAS workspace and NCCL buffers on one card (measured 0.5-1 GiB)
SGLANG_DEFAULT_FRACTION = 0.88  # assumed when rollout.engine.args has no --mem-fraction-static (SGLang's ~0.88 on 80 GB cards)
REFERENCE_MAX_BATCH = 64  # relax_hpc's reference engine's --max-batch-size default: its KV cache's batch
BUCKET_BYTES = 512 << 20  # the weight sync's bucket (weights/buckets.py DEFAULT_BUCKET_BYTES); two in flight
CONFIG_BYTES = 16 << 20  # as the validator reads config.json
FORWARD_ROLES = ("reference", "actor_fwd")  # Megatron forward only: parameters and one layer's activations
ROWS = ("static", "params", "grads", "optimizer", "activations", "buckets", "context")  # the table's order
UNPLANNED_ROLES = ("genrm", "teacher")  # judge and teacher engines: their own models, not in this plan


class PlanError(ValueError):
    """The model's config.json lacks what the plan needs (the message names the field)."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only transformer's config.json (a VLM's ``text_config``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # the dense MLP's intermediate size (SwiGLU: gate, up, down)
    vocab: int
    tied: bool  # the output head is the embedding
    experts: int = 0  # MoE: routed experts per layer (0: dense)
    moe_ffn: int = 0  # each expert's intermediate size
    shared_ffn: int = 0  # MoE: the shared expert's intermediate size (0: none)
    experts_per_token: int = 0  # MoE: the experts each token is routed to
    frozen_params: int = 0  # an omni thinker's audio tower: on every Megatron rank beside the model, no grads

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

        def num(*names: str, default: int | None = None) -> int:
            for n in names:
                v = text.get(n)
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    return v
            if default is None:
                raise PlanError(f"config.json has no {names[0]} (a positive integer)")
            return default

        hidden, heads = num("hidden_size"), num("num_attention_heads")
        if not hidden or not heads:
            raise PlanError("config.json's hidden_size and num_attention_heads must be positive")
        experts = num("num_experts", "num_local_experts", "n_routed_experts", default=0)
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))  # transformers' default
        return cls(hidden=hidden, layers=num("num_hidden_layers"), heads=heads,
                   kv_heads=num("num_key_value_heads", default=heads),
                   head_dim=num("head_dim", default=hidden // heads), ffn=num("intermediate_size"),
                   vocab=num("vocab_size"), tied=bool(tied), experts=experts,
                   moe_ffn=num("moe_intermediate_size", default=0) if experts else 0,
                   shared_ffn=num("shared_expert_intermediate_size", default=0) if experts else 0,
                   experts_per_token=num("num_experts_per_tok", default=1) if experts else 0,
                   frozen_params=audio_tower_params(config))

    @property
    def attention_params(self) -> int:  # q, k, v, o projections, q/k norms
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 2 * self.head_dim

    @property
    def dense_layer_params(self) -> int:
        """One layer's parameters outside the routed experts: attention, the dense or shared MLP, router, norms."""
        mlp = 3 * self.hidden * (self.shared_ffn if self.experts else self.ffn)
        router = self.hidden * self.experts
        return self.attention_params + mlp + router + 2 * self.hidden

    @property
    def expert_layer_params(self) -> int:
        return 3 * self.hidden * self.moe_ffn * self.experts

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        heads = 1 if self.tied else 2
        return self.layers * (self.dense_layer_params + self.expert_layer_params) + heads * self.embedding_params \
            + self.hidden

    def activation_bytes_per_token_layer(self, tp: int, sp: bool) -> float:
        """bf16 activations one layer keeps for its backward, per token (the module docstring's formula)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        ffn = self.ffn if not self.experts else self.experts_per_token * self.moe_ffn + self.shared_ffn  # its experts'
        inside = 2 * (q + 2 * kv) + 2 * q + 6 * ffn
        return 8 * self.hidden / (tp if sp else 1) + inside / tp


@dataclass
class Term:
    role: str  # actor, rollout, reference, actor_fwd
    what: str  # params, grads, optimizer, activations, static, context, buckets
    gib: float | None  # None: not known without the card's memory
    note: str = ""


@dataclass
class Phase:
    name: str  # generate, train, sync (colocate), or the one phase of a card that is not shared
    terms: list[Term] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(t.gib or 0.0 for t in self.terms)

    @property
    def known(self) -> bool:
        return all(t.gib is not None for t in self.terms)

    def biggest(self) -> Term:
        return max(self.terms, key=lambda t: t.gib or 0.0)


@dataclass
class CardPlan:
    """The GPUs of one het component: the roles on them and what one GPU holds in each phase."""

    label: str  # e.g. "actor's GPUs (1 node(s) x 8)"
    roles: list[str]
    phases: list[Phase]


@dataclass
class MemoryPlan:
    card_gib: float | None  # slurm.gpu_memory_gb; None: unknown, no verdict
    cards: list[CardPlan]
    notes: list[str] = field(default_factory=list)
    hints: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (card label, phase) -> keys that shrink it

    def peak(self) -> tuple[CardPlan, Phase] | None:
        best = None
        for c in self.cards:
            for p in c.phases:
                if best is None or p.total > best[1].total:
                    best = (c, p)
        return best

    def over(self) -> list[tuple[CardPlan, Phase]]:
        if self.card_gib is None:
            return []
        return [(c, p) for c in self.cards for p in c.phases if p.total > self.card_gib]

    def problems(self) -> list[Problem]:
        """One problem per card and phase over the card: the phase, its total, its biggest term, the fix."""
        out: list[Problem] = []
        for c, p in self.over():
            big = p.biggest()
            terms = ", ".join(f"{t.role} {t.what} {_gib(t.gib)}" for t in p.terms if (t.gib or 0) >= 0.05)
            fix = "; ".join(self.hints.get((c.label, p.name), [])) or "more or larger GPUs"
            out.append(("slurm.gpu_memory_gb", self.card_gib,
                        f"the memory plan does not fit: in phase {p.name!r} one GPU of {c.label} needs "
                        f"{p.total:.1f} GiB, over the card's {self.card_gib:g} GiB. Biggest term: {big.role} "
                        f"{big.what} {_gib(big.gib)}{f' ({big.note})' if big.note else ''}. All: {terms}. "
                        f"Fix: {fix} (relax-submit --dry-run prints the plan; docs/gpu.md, Memory plan)"))
        return out

    def table(self) -> str:
        """The plan as a small text table, one block per group of GPUs, and the verdict (or why there is none)."""
        if not self.cards:
            return "no role runs on a GPU: nothing to plan"
        lines = []
        for c in self.cards:
            lines.append(f"{c.label}  [{', '.join(c.roles)}]")
            whats = sorted(dict.fromkeys((t.role, t.what) for p in c.phases for t in p.terms),
                           key=lambda rw: (ROWS.index(rw[1]) if rw[1] in ROWS else len(ROWS), rw[0]))
            width = max([len(f"{r} {w}") for r, w in whats] + [len("total")])
            lines.append("  " + " " * width + "".join(f"{p.name:>10}" for p in c.phases))
            for r, w in whats:
                cells = []
                for p in c.phases:
                    hit = [t for t in p.terms if (t.role, t.what) == (r, w)]
                    cells.append(f"{_cell(hit[0].gib) if hit else '-':>10}")
                lines.append(f"  {f'{r} {w}':<{width}}" + "".join(cells))
            lines.append(f"  {'total':<{width}}" + "".join(
                f"{(f'{p.total:.1f}' if p.known else f'>={p.total:.1f}'):>10}" for p in c.phases))
        lines += [f"note: {n}" for n in self.notes]
        if self.card_gib is None:
            lines.append("verdict: none: the card's memory is unknown. Set slurm.gpu_memory_gb (relax-doctor prints "
                         "it on a GPU node) to have the plan checked")
        elif self.over():
            lines.append("verdict: DOES NOT FIT: " + "; ".join(
                f"{c.label} phase {p.name} {p.total:.1f} > {self.card_gib:g} GiB" for c, p in self.over()))
        else:
            pk = self.peak()
            lines.append(f"verdict: fits: peak {pk[1].total:.1f} of {self.card_gib:g} GiB ({pk[0].label}, phase "
                         f"{pk[1].name})" if pk else "verdict: fits: no GPU role")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"card_gib": self.card_gib, "notes": self.notes, "fits": None if self.card_gib is None else not self.over(),
                "cards": [{"label": c.label, "roles": c.roles, "phases": {
                    p.name: {"total_gib": round(p.total, 2), "terms": [
                        {"role": t.role, "what": t.what, "gib": None if t.gib is None else round(t.gib, 2)}
                        for t in p.terms]} for p in c.phases}} for c in self.cards]}


def _gib(v: float | None) -> str:
    return "? GiB" if v is None else f"{v:.1f} GiB"


def _cell(v: float | None) -> str:
    return "?" if v is None else f"{v:.1f}"


# ---------------------------------------------------------------------------------------------- the terms ---

def lora_params(shape: ModelShape, lora, layers: int, tp: int) -> float:
    """A pipeline stage's LoRA adapter parameters per TP rank: rank × (in + out) per targeted linear of its
    ``layers`` layers (the output layer's on the stage that holds it, counted here: the heaviest case)."""
    q, kv, h = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden
    ffn = shape.shared_ffn if shape.experts else shape.ffn
    sizes = {"linear_qkv": h + q + 2 * kv, "linear_proj": q + h, "linear_fc1": h + 2 * ffn, "linear_fc2": ffn + h}
    targets = megatron_targets(lora.target_modules)
    per_layer = sum(sizes[m] for m in targets if m in sizes)
    head = h + shape.vocab if "output_layer" in targets else 0
    return lora.rank * (layers * per_layer + head) / tp


def audio_tower_params(config: dict) -> int:
    """Parameters of an omni thinker's audio tower (Whisper's encoder and its projection: relax_hpc.train.omni holds
    it whole and frozen on every Megatron rank) from ``audio_config``; 0 for a model without one."""
    a = config.get("audio_config") if config.get("model_type") == "qwen2_5_omni_thinker" else None
    if not isinstance(a, dict):
        return 0
    try:
        d, layers, ffn = int(a["d_model"]), int(a["encoder_layers"]), int(a["encoder_ffn_dim"])
        mel, out = int(a.get("num_mel_bins", 128)), int(a.get("output_dim", d))
    except (KeyError, TypeError, ValueError):
        return 0
    layer = 4 * d * d + 3 * d + 2 * d * ffn + ffn + d + 4 * d  # q k v o (k without bias), fc1 fc2, two norms
    return layers * layer + 3 * mel * d + 3 * d * d + 2 * d + d * out + out + 2 * d + 2 * out  # convs, proj,
    # ln_post, the audio_bos_eos_token embedding


def _megatron_terms(recipe: Recipe, shape: ModelShape, role: str, ranks: int, notes: list[str]) -> dict[str, Term]:
    """Per GPU of a Megatron role: params, grads, optimizer (actor only), activations, context."""
    t = role_train(recipe, role)  # the forward roles' own layout (forward:), else train's
    tp, pp, ep, cp = t.tp, t.pp, t.ep, getattr(t, "cp", 1)  # cp: context parallelism, when train has it
    dp = max(1, ranks // max(1, tp * pp * cp))
    edp = max(1, ranks // max(1, tp * pp * ep))  # experts' data-parallel group (expert TP = tp)
    layers = -(-shape.layers // pp)  # the heaviest stage's
    # one stage holds the embedding and an untied head; at pp > 1 the first holds it, the last the head (a copy if tied)
    emb = shape.embedding_params * ((1 if shape.tied else 2) if pp == 1 else 1) / tp
    dense = layers * shape.dense_layer_params / tp + emb
    experts = layers * shape.expert_layer_params / (tp * ep)
    n = dense + experts
    pbytes = 2 if t.bf16 else 4
    tower = shape.frozen_params  # replicated, frozen: parameters only
    why = f"{n / 1e9:.2f}B parameters x {pbytes} bytes" + (f" (+ the audio tower's {tower / 1e9:.2f}B)" if tower else "")
    out = {"params": Term(role, "params", (n + tower) * pbytes / GiB, why)}
    train = role == "actor"
    if train and t.lora is not None:  # LoRA: grads and Adam state for the adapters only (the base is frozen)
        dense, experts = lora_params(shape, t.lora, layers, tp), 0.0
        n = dense
    if train:
        out["grads"] = Term(role, "grads", n * 4 / GiB, "fp32 grad buffer" + (" (LoRA adapters)" if t.lora else ""))
        master = (2 if t.use_precision_aware_optimizer else 4) if t.bf16 else 0
        per = 8 + master
        shard_d, shard_e = (dp, edp) if t.use_distributed_optimizer else (1, 1)
        opt = (dense * per / shard_d + experts * per / shard_e) / GiB
        if t.optimizer_cpu_offload:
            notes.append(f"{role}: optimizer state {opt:.1f} GiB per rank in host memory (train.optimizer_cpu_offload)")
            opt = 0.0
        out["optimizer"] = Term(role, "optimizer", opt, f"Adam {per} bytes/param" + (f" / DP {dp}" if shard_d > 1 else ""))
    # activations: one micro-batch of T tokens
    tokens = t.max_tokens_per_micro_batch if train else (t.logprob_max_tokens_per_micro_batch or t.max_tokens_per_micro_batch)
    if tokens is None:
        mbs = t.micro_batch_size if train else (t.logprob_micro_batch_size or t.micro_batch_size)
        tokens = mbs * t.max_seq_len
    tokens = tokens / cp
    per_layer = shape.activation_bytes_per_token_layer(tp, t.sequence_parallel)
    if not train:  # forward only: nothing is kept for a backward, one layer's at a time
        layer_acts = tokens * per_layer
    elif t.recompute == "full":
        n_rec = t.recompute_num_layers
        inputs = tokens * 2 * shape.hidden / (tp if t.sequence_parallel else 1)
        if t.recompute_method == "uniform":
            layer_acts = -(-layers // n_rec) * inputs + n_rec * tokens * per_layer
        else:  # block: the first n layers recomputed, the rest kept
            kept = max(0, layers - n_rec)
            layer_acts = min(n_rec, layers) * inputs + kept * tokens * per_layer + tokens * per_layer
    else:  # none, selective (selective recomputes core attention, which flash attention keeps small anyway)
        layer_acts = layers * tokens * per_layer
    if train:
        layer_acts *= pp  # 1F1B: the first stage holds pp micro-batches in flight
    logits = 2 * 4 * tokens * shape.vocab / tp
    out["activations"] = Term(role, "activations", (layer_acts + logits) / GiB,
                              f"{int(tokens)} tokens a micro-batch, recompute {t.recompute}")
    out["context"] = Term(role, "context", CONTEXT_GIB)
    return out


def _fraction(args: list[str]) -> float | None:
    for i, a in enumerate(args):
        if a == "--mem-fraction-static" and i + 1 < len(args):
            try:
                return float(args[i + 1])
            except ValueError:
                return None
        if a.startswith("--mem-fraction-static="):
            try:
                return float(a.split("=", 1)[1])
            except ValueError:
                return None
    return None


def engine_kind(recipe: Recipe) -> str:
    """sglang or reference, as the engine launcher will choose (auto: SGLang where RELAX_SGLANG_PYTHON is set)."""
    kind = recipe.rollout.engine.kind
    if kind != "auto":
        return kind
    env = {**os.environ, **recipe.slurm.env}
    return "sglang" if env.get("RELAX_SGLANG_PYTHON") or recipe.rollout.engine.args else "reference"


def _engine_terms(recipe: Recipe, shape: ModelShape, card: float | None, notes: list[str],
                  problems: list[Problem]) -> dict[str, Term]:
    g = recipe.roles.rollout
    tp_engine = max(1, g.gpus_per_node // max(1, g.tasks_per_node))
    weights = shape.total_params * 2 / tp_engine / GiB  # bf16
    if engine_kind(recipe) == "sglang":
        frac = _fraction(recipe.rollout.engine.args)
        if frac is None:
            frac = SGLANG_DEFAULT_FRACTION
            notes.append(f"rollout: no --mem-fraction-static in rollout.engine.args: planned as SGLang's default, "
                         f"about {frac}")
        static = None if card is None else frac * card
        if static is not None and weights > static:
            problems.append(("rollout.engine.args", recipe.rollout.engine.args,
                             f"SGLang's static memory, --mem-fraction-static {frac} x {card:g} GiB = {static:.1f} GiB, "
                             f"cannot hold the engine's bf16 weights, {weights:.1f} GiB per GPU at TP {tp_engine}. "
                             "Fix: a higher --mem-fraction-static, or more GPUs per engine (roles.rollout.gpus_per_node "
                             "/ tasks_per_node)"))
        return {"static": Term("rollout", "static", static, f"--mem-fraction-static {frac} x card"),
                "context": Term("rollout", "context", CONTEXT_GIB)}
    kv = REFERENCE_MAX_BATCH * recipe.train.max_seq_len * shape.layers * 2 * shape.kv_heads * shape.head_dim * 2
    return {"static": Term("rollout", "static", weights + kv / GiB,
                           f"reference engine: bf16 weights + KV of {REFERENCE_MAX_BATCH} x {recipe.train.max_seq_len}"),
            "context": Term("rollout", "context", CONTEXT_GIB)}


# ------------------------------------------------------------------------------------------------ the plan ---

def _ranks(g: RoleGroup) -> int:
    return g.nodes * g.tasks_per_node


def _hints(recipe: Recipe, phase: str, colocated: bool, has_actor: bool) -> list[str]:
    """The keys that shrink ``phase``'s memory on a card (the refusal's Fix)."""
    t = recipe.train
    keys = []
    if phase in ("generate", "sync") and not t.offload and colocated:
        keys.append("train.offload: true (the actor's params, grads and optimizer state leave the GPU while the "
                    "engines generate)")
    if phase in ("generate", "sync", "checkpoint") and engine_kind(recipe) == "sglang":
        keys.append("a lower --mem-fraction-static in rollout.engine.args")
    if not has_actor:
        return keys + ["more GPUs per engine (roles.rollout.gpus_per_node / tasks_per_node)"]
    if (phase in ("train", "checkpoint") or phase == "sync" and not t.offload) and not t.optimizer_cpu_offload:
        keys.append("train.optimizer_cpu_offload: true with train.use_precision_aware_optimizer: true")
    if phase == "train":
        keys.append(f"a smaller train.max_tokens_per_micro_batch (now {t.max_tokens_per_micro_batch})")
        if t.recompute != "full":
            keys.append("train.recompute: full")
    keys.append(f"a larger train.tp (now {t.tp}) or train.pp (now {t.pp})")
    return keys


def plan(recipe: Recipe, config: dict) -> tuple[MemoryPlan, list[Problem]]:
    """The plan for ``recipe`` with the model ``config`` (config.json as a mapping), and the problems found while
    making it other than the verdict (an engine whose static memory cannot hold its weights)."""
    shape = ModelShape.from_config(config)
    card = recipe.slurm.gpu_memory_gb
    notes: list[str] = []
    problems: list[Problem] = []
    cards: list[CardPlan] = []
    hints: dict[tuple[str, str], list[str]] = {}
    hosts: dict[str, list[str]] = {}
    for name in ("actor", "rollout", *FORWARD_ROLES, *UNPLANNED_ROLES):
        g = recipe.role(name)
        if g.enabled and g.gpus_per_node > 0:
            hosts.setdefault(g.share_with or name, []).append(name)
    for host, names in hosts.items():
        hg = recipe.role(host)
        label = f"{host}'s GPUs ({hg.nodes} node(s) x {hg.gpus_per_node})"
        for n in names:
            if n in UNPLANNED_ROLES:
                notes.append(f"{n}: not in the plan (its own model); leave room for it on {label}")
        mega = {n: _megatron_terms(recipe, shape, n, _ranks(recipe.role(n)), notes)
                for n in names if n == "actor" or n in FORWARD_ROLES}
        engine = _engine_terms(recipe, shape, card, notes, problems) if "rollout" in names else None
        rest = [t for n, terms in mega.items() if n != "actor" for t in terms.values()]  # forward roles: all phases
        actor = mega.get("actor")
        colocated = actor is not None and engine is not None
        if colocated:
            hands_over = recipe.rollout.engine.offload is not False
            held = [] if recipe.train.offload else [actor[k] for k in ("params", "grads", "optimizer")]
            at_sync = [actor["params"]] if recipe.train.offload else [actor[k] for k in ("params", "grads", "optimizer")]
            buckets = Term("actor", "buckets", (2 * BUCKET_BYTES + shape.embedding_params * 2) / GiB,
                           "two 512 MiB buckets and the gathered embedding")
            phases = [Phase("generate", [engine["static"], engine["context"], *held, actor["context"], *rest]),
                      Phase("train", [*([engine["static"]] if not hands_over else []), engine["context"],
                                      *actor.values(), *rest]),
                      Phase("sync", [engine["static"], engine["context"], *at_sync, buckets, actor["context"], *rest])]
            if recipe.train.offload:  # a save brings the parameters and optimizer state back beside the resumed engines
                phases.append(Phase("checkpoint", [engine["static"], engine["context"], actor["params"],
                                                   actor["optimizer"], actor["context"], *rest]))
            if not hands_over:
                notes.append("rollout.engine.offload: false: the engines keep their static memory while the actor trains")
        elif actor is not None:
            phases = [Phase("train", [*actor.values(), *rest])]
        elif engine is not None:
            phases = [Phase("generate", [*engine.values(), *rest])]
        else:
            phases = [Phase("forward", rest)] if rest else []
        if not phases:
            continue
        cards.append(CardPlan(label, names, phases))
        for p in phases:
            hints[(label, p.name)] = _hints(recipe, p.name, colocated, bool(mega))
    return MemoryPlan(card, cards, notes, hints), problems


def load_config(recipe: Recipe, base: str | Path) -> dict | None:
    """model.path's config.json as a mapping (relative paths against ``base``, as the roles resolve them), or None
    when it cannot be read (the validator's model checks say why)."""
    path = recipe.model.path
    if not path or any(c in path for c in "\n\r\0"):
        return None
    where = Path(path).expanduser()
    where = where if where.is_absolute() else Path(base) / where
    try:
        data = json.loads(read_text(where / "config.json", max_bytes=CONFIG_BYTES))
    except (FileNotFoundError, TextError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def for_recipe(recipe: Recipe, base: str | Path) -> tuple[MemoryPlan | None, list[Problem], str | None]:
    """(plan, problems, why there is no plan): the plan of ``recipe`` from its model's config.json, the problems
    that refuse it (over the card, an engine that cannot hold its weights), or why no plan could be made."""
    config = load_config(recipe, base)
    if config is None:
        return None, [], "model.path's config.json cannot be read here"
    try:
        mp, problems = plan(recipe, config)
    except PlanError as e:
        return None, [], str(e)
    return mp, problems + mp.problems(), None


def check(recipe: Recipe, base: str | Path) -> list[Problem]:
    """The validator's call (``check_files``): what refuses ``recipe``'s memory plan."""
    return for_recipe(recipe, base)[1]


def recipe_problems(recipe: Recipe) -> list[Problem]:
    """The validator's meaning checks of the keys the plan reads (no file needed): ``slurm.gpu_memory_gb`` is a
    size, and megatron-core's optimizer offload runs only on CUDA (its HybridDeviceOptimizer makes CUDA streams and
    moves only CUDA tensors; the precision-aware optimizer needs Transformer Engine)."""
    t, a = recipe.train, recipe.roles.actor
    out: list[Problem] = []
    card = recipe.slurm.gpu_memory_gb
    if card is not None and not card > 0:
        out.append(("slurm.gpu_memory_gb", card, "must be one GPU's memory in GiB, more than 0. Fix: e.g. 80 for an "
                    "80 GB card (relax-doctor prints it on a GPU node), or null for a plan without a verdict"))
    if a.gpus_per_node > 0:
        return out
    for key in ("optimizer_cpu_offload", "use_precision_aware_optimizer"):
        if getattr(t, key):
            out.append((f"train.{key}", True, "needs the actor on GPUs (megatron-core's CPU offload moves CUDA "
                        "tensors on CUDA streams; the precision-aware optimizer needs Transformer Engine), and "
                        f"roles.actor.gpus_per_node = {a.gpus_per_node} is a CPU-only run. Fix: train.{key}: false, "
                        "or give the actor GPUs"))
    return out
