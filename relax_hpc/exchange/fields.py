"""The one schema of a sample's fields in the exchange: name, dtype, shape, who writes it, which tasks read it.

The sample seam has two sample types: the rollout's :class:`~relax_hpc.rollout.sample.Sample` (the producer's)
and the trainer's :class:`~relax_hpc.train.batch.TrainingSample` (the consumer's); between them the chunk, whose
fields are this table. Every place that writes or reads chunk fields takes its lists from here: the rollout's
chunk writer (:func:`relax_hpc.rollout.write.write_step`: a field's value is the Sample attribute of its name
unless the writer has a builder for it, the ``source`` below), the chunk reader, the broker's per-task field
lists (a task is ready once its chunks carry the fields it reads), the forward roles (which add a side field),
the trainer's data plan (:mod:`relax_hpc.train.plan`: a field with a ``sample`` attribute fills that attribute
of each TrainingSample; a ``logprob`` field is checked at the trainer's door) and the micro-batch builder
(:mod:`relax_hpc.train.batch`: the ``response`` fields it stacks). A new per-sample field is its producer (the
Sample attribute and the code that sets it), a row here, and its consumer (the TrainingSample attribute and the
code that uses it). Names are Relax's where Relax has one.

Kinds: ``fixed`` is one number per sample (a 1-D column), ``ragged`` a variable-length array per sample
(flat data plus offsets in the file), ``json`` one JSON value per sample (for people reading the files and
for metrics, never for the loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLLOUT, REFERENCE, ACTOR_FWD = "rollout", "reference", "actor_fwd"


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # fixed | ragged | json
    dtype: str  # numpy dtype name; "json" for json fields
    writer: str  # the role that writes it (a side file for every writer but rollout)
    read_by: tuple[str, ...]  # the tasks that read it: train, logprobs
    doc: str
    source: str = ""  # who writes it, in code: what the writer reads (a Sample attribute) or which code computes it
    per: str = "sample"  # a value per: sample | token (of tokens) | response (token) | media (the processor's rows)
    sample: str | None = None  # the TrainingSample attribute the data plan fills from it (None: not carried so)
    optional: bool = False  # a rollout field only some runs' chunks carry (the writer writes it where samples have it)
    logprob: bool = False  # log-probs: finite and at most LOGPROB_TOLERANCE where the trainer reads them


_MEDIA = "the model's processor (relax_hpc.rollout.write's media builders: multimodal.py, audio.py)"

FIELDS: tuple[Field, ...] = (
    Field("tokens", "ragged", "int64", ROLLOUT, ("train", "logprobs"), "prompt + response token ids",
          source="Sample.tokens", per="token"),
    Field("response_length", "fixed", "int64", ROLLOUT, ("train", "logprobs"),
          "response tokens (the last ones of tokens)", source="Sample.response_length"),
    Field("loss_mask", "ragged", "float32", ROLLOUT, ("train",), "over the response (0/1)",
          source="Sample.loss_mask (None: all ones)", per="response", sample="loss_mask"),
    Field("rollout_log_probs", "ragged", "float32", ROLLOUT, ("train",),
          "the engine's log-prob of each response token", source="Sample.rollout_log_probs (None: empty)",
          per="response", sample="rollout_log_probs", logprob=True),
    Field("raw_reward", "fixed", "float32", ROLLOUT, ("train",),
          "R: the scalar reward; group normalization (R → R̃) and advantages happen on the training side",
          source="RolloutResult.raw_rewards (the reward functions', through reward_key)"),
    Field("index", "fixed", "int64", ROLLOUT, ("train",), "sample.index", source="Sample.index (None: -1)"),
    Field("group_index", "fixed", "int64", ROLLOUT, (), "the sample's group (its prompt) in the step",
          source="Sample.group_index (None: -1)"),
    Field("rollout_id", "fixed", "int64", ROLLOUT, (),
          "the rollout a segment belongs to (the index of the sample it came from); a whole rollout: its index",
          source="Sample.rollout_id (None: Sample.index, or -1)"),
    Field("weight_version", "json", "json", ROLLOUT, ("train",),
          "the engine's weight version when it finished the sample", source="Sample.weight_version"),
    Field("status", "json", "json", ROLLOUT, (), "completed / truncated / aborted / failed",
          source="Sample.status.value"),
    Field("prompt", "json", "json", ROLLOUT, (), "for people reading the files", source="Sample.prompt"),
    Field("response", "json", "json", ROLLOUT, (), "for people reading the files", source="Sample.response"),
    Field("label", "json", "json", ROLLOUT, (), "for people reading the files", source="Sample.label"),
    Field("teacher_log_probs", "ragged", "float32", ROLLOUT, ("train",),
          "on-policy distillation (opd:): the teacher's log-prob of each response token; only OPD runs' chunks",
          source="Sample.teacher_log_probs (set by the rollout role's teacher call, rollout/teacher.py)",
          per="response", sample="teacher_log_probs", optional=True, logprob=True),
    Field("routed_experts", "ragged", "int32", ROLLOUT, ("train",),
          "MoE routing replay (train.routing_replay): the expert ids the engine's router chose, SGLang's "
          "meta_info.routed_experts flattened: [len(tokens) - 1, layers, top_k], -1 rows for tokens no engine ran (the "
          "trainer's router chooses); only in chunks of runs with train.routing_replay. Checked by "
          "routed_experts_problem: ids in [0, num_experts), a token's top_k of a layer distinct, as many rows as "
          "tokens, layers × top_k a row",
          source="Sample.routed_experts (engines/client.py's decode_routed_experts; -1 rows: roles/rollout.py)",
          per="token", sample="routed_experts", optional=True),
    Field("pixel_values", "ragged", "float32", ROLLOUT, ("train", "logprobs"),
          "vision-language models: the image processor's patches of the sample's images, flat [patches, C·T·P·P] "
          "(empty for a sample without images); only in chunks of samples with images",
          source=f"Sample.multimodal_inputs['images'] through {_MEDIA}", per="media", sample="pixel_values",
          optional=True),
    Field("image_grid_thw", "ragged", "int64", ROLLOUT, ("train", "logprobs"),
          "vision-language models: each image's (t, h, w) patch grid, flat [images, 3], in the order of the "
          "image pads in tokens; beside pixel_values",
          source="beside pixel_values", per="media", sample="image_grid_thw", optional=True),
    Field("pixel_values_videos", "ragged", "float32", ROLLOUT, ("train", "logprobs"),
          "vision-language models: the image processor's patches of the sample's videos (their frames in pairs), flat "
          "[patches, C·T·P·P] (empty for a sample without videos); only in chunks of samples with videos",
          source=f"Sample.multimodal_inputs['videos'] through {_MEDIA}", per="media", sample="pixel_values_videos",
          optional=True),
    Field("video_grid_thw", "ragged", "int64", ROLLOUT, ("train", "logprobs"),
          "vision-language models: each video's (t, h, w) patch grid, flat [videos, 3], in the order of the video "
          "pads in tokens; beside pixel_values_videos (frames shown at multimodal.MODEL_FPS)",
          source="beside pixel_values_videos", per="media", sample="video_grid_thw", optional=True),
    Field("input_features", "ragged", "float32", ROLLOUT, ("train", "logprobs"),
          "omni models: the feature extractor's log-mel frames of the sample's audio clips, flat [frames, mel] "
          "(clips one after another; empty for a sample without audio); only in chunks of samples with audio",
          source=f"Sample.multimodal_inputs['audios'] through {_MEDIA}", per="media", sample="input_features",
          optional=True),
    Field("audio_feature_lens", "ragged", "int64", ROLLOUT, ("train", "logprobs"),
          "omni models: each clip's frames in input_features, in the order of the audio pads in tokens",
          source="beside input_features", per="media", sample="audio_feature_lens", optional=True),
    Field("ref_log_probs", "ragged", "float32", REFERENCE, ("train",), "π_ref of each response token",
          source="the reference role's forward (roles/forward.py), a side file", per="response",
          sample="ref_log_probs", logprob=True),
    Field("log_probs", "ragged", "float32", ACTOR_FWD, ("train",), "π_old of each response token",
          source="the actor_fwd role's forward (roles/forward.py), a side file", per="response",
          sample="old_log_probs", logprob=True),
)
BY_NAME = {f.name: f for f in FIELDS}

# The values a number field may hold, checked where numbers enter (the rollout client, the reward runner) and again
# at the trainer's door (relax_hpc.train.plan): a log-prob is never above 0, beyond float rounding of a
# near-certain token's (far below this); and every number must be finite in the dtype its column stores it in.
LOGPROB_TOLERANCE = 1e-3


def finite_max(name: str) -> float:
    """The largest magnitude field ``name``'s column stores as a finite number (its float dtype's max)."""
    import numpy as np  # here: the recipe validator imports modules that import this one

    return float(np.finfo(BY_NAME[name].dtype).max)


UNROUTED = -1  # routed_experts of a token no engine ran: its rows are all -1, and the trainer's router picks


@dataclass(frozen=True)
class Routing:
    """What a model's ``routed_experts`` rows are: ``layers`` × ``top_k`` expert ids a token, each in
    ``[0, num_experts)``. From the model's config.json (:meth:`from_config`) on the rollout side, from the built
    model's routers on the trainer's."""

    layers: int
    top_k: int
    num_experts: int

    @property
    def width(self) -> int:
        """Expert ids a token: one row of ``routed_experts``."""
        return self.layers * self.top_k

    @classmethod
    def from_config(cls, config: Any) -> Routing | None:
        """A HF ``config.json`` (a dict; a VLM's ``text_config``): ``num_hidden_layers``, ``num_experts_per_tok``
        and ``num_experts`` (Qwen-MoE; DeepSeek's ``n_routed_experts``, Mixtral's ``num_local_experts``); None for a
        dense model or a config without them."""
        if not isinstance(config, dict):
            return None
        if isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        layers, k = config.get("num_hidden_layers"), config.get("num_experts_per_tok")
        experts = next((config[key] for key in ("num_experts", "n_routed_experts", "num_local_experts")
                        if isinstance(config.get(key), int)), None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (layers, k, experts)):
            return None
        return cls(layers, k, experts)


def routed_experts_problem(ids: Any, tokens: int, routing: Routing | None = None, *,
                           unrouted: bool = False) -> str | None:
    """What is wrong with one sample's ``routed_experts`` ``ids`` (any integer array: flat, or ``[tokens, width]``),
    or None. ``tokens``: the rows it must have (the tokens the engine ran: ``len(tokens) - 1`` in a chunk).
    Checked: integer ids; a whole number of ids a token, every token a row; with ``routing`` (the model's), the
    width ``layers × top_k`` (a row for an extra layer is refused), each id in ``[0, num_experts)`` and each
    (token, layer)'s ``top_k`` ids distinct (a router picks k different experts); without it only ids >= 0.
    ``unrouted``: a (token, layer) may be all :data:`UNROUTED` (-1: no recorded routing, as the chunk's rows of
    tokens no engine ran), never partly. An engine's answer has no -1 (``unrouted`` False). Vectorized: an
    engine's answer at 48 layers × top-8 is ~400 ids a token."""
    import numpy as np  # here: the recipe validator imports modules that import this one

    a = np.asarray(ids)
    if a.dtype.kind not in "iu":
        return f"expert ids of dtype {a.dtype}, not integers"
    if routing is not None and a.size != tokens * routing.width:
        why = [f"{a.size // routing.width} rows of {routing.width}"] if a.size % routing.width == 0 else []
        if tokens > 0 and a.size % tokens == 0:
            why.append(f"{a.size // tokens} ids a token: a row for an extra or a missing layer, or another model")
        return (f"{a.size} expert ids, not {tokens} tokens × {routing.layers} layers × top-{routing.top_k} = "
                f"{tokens * routing.width}" + (f" ({'; or '.join(why)})" if why else ""))
    if tokens < 1 or a.size == 0 or a.size % tokens:
        return (f"{a.size} expert ids for {tokens} tokens: not a whole number a token "
                "(SGLang's [tokens the engine ran, layers, top_k])")
    width = a.size // tokens
    k = routing.top_k if routing is not None else width  # unknown top-k: a token's row is one group
    g = a.reshape(tokens, width // k, k).astype(np.int64)
    whole = (g == UNROUTED).all(-1, keepdims=True) if unrouted else np.zeros((*g.shape[:2], 1), dtype=bool)
    checks = [(g < 0) & ~whole, "below 0" + (" and not a whole -1 row (no recorded routing)" if unrouted else "")]
    if routing is not None:
        srt = np.sort(g, axis=-1)
        dup = np.zeros_like(g, dtype=bool)
        dup[..., 1:] = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
        checks += [g >= routing.num_experts, f"outside [0, {routing.num_experts}) (the model's num_experts)",
                   dup, f"repeated (a router picks top-{k} distinct experts)"]
    for bad, what in zip(checks[::2], checks[1::2]):
        hit = np.argwhere(bad)
        if hit.size:
            t, layer = int(hit[0][0]), int(hit[0][1])
            where = f"token {t}, layer {layer}" if routing is not None else f"token {t}"
            return f"{where} has expert ids {g[t, layer].tolist()}: an id {what}"
    return None


PRODUCER = ROLLOUT  # the writer of a step's main chunk file
# side fields another role adds after the rollout wrote the chunk; the writer's role names its side file
FORWARD_FIELDS = tuple(f.name for f in FIELDS if f.writer in (REFERENCE, ACTOR_FWD))
SIDE_FIELD = {REFERENCE: "ref_log_probs", ACTOR_FWD: "log_probs"}


# rollout fields only some runs' chunks carry (the rollout writes them when its samples have them, and the actor
# reads them where every chunk of the step has them): OPD's teacher log-probs, MoE routing replay's routed experts,
# a vision-language model's processed images
OPTIONAL_ROLLOUT_FIELDS = tuple(f.name for f in FIELDS if f.optional)
IMAGE_FIELDS = ("pixel_values", "image_grid_thw")  # written together, by the rollout's image processor
AUDIO_FIELDS = ("input_features", "audio_feature_lens")  # written together, by the rollout's feature extractor
VIDEO_FIELDS = ("pixel_values_videos", "video_grid_thw")  # written together, by the rollout's image processor
MEDIA_FIELDS = IMAGE_FIELDS + VIDEO_FIELDS + AUDIO_FIELDS  # read beside tokens by every forward, where the chunks have them


def rollout_fields(optional: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every field the rollout role writes, in schema order: the ones every chunk has, and these ``optional``
    ones (of :data:`OPTIONAL_ROLLOUT_FIELDS`)."""
    return tuple(f.name for f in FIELDS if f.writer == ROLLOUT
                 and (f.name not in OPTIONAL_ROLLOUT_FIELDS or f.name in optional))


def task_fields(task: str, writers: tuple[str, ...] = (ROLLOUT,)) -> tuple[str, ...]:
    """The fields task ``task`` reads that these writers provide (the run's roles decide which side fields exist),
    but the optional rollout fields (a task reads those where its chunks have them)."""
    return tuple(f.name for f in FIELDS if task in f.read_by and f.writer in writers
                 and f.name not in OPTIONAL_ROLLOUT_FIELDS)


TRAIN_FIELDS = task_fields("train")  # what the actor reads from the rollout's chunk
# also read by the actor where the chunk has them (chunks written before rollout_id existed do not): with segments
# (a rollout returned as several samples) group normalization goes by group and rollout
SEGMENT_FIELDS = ("group_index", "rollout_id")
# what the trainer's data plan carries on each TrainingSample (relax_hpc.train.plan fills them from the columns)
SAMPLE_FIELDS = tuple(f for f in FIELDS if f.sample is not None)
# the log-prob columns, checked at the trainer's door (finite, at most LOGPROB_TOLERANCE)
LOGPROB_COLUMNS = tuple(f.name for f in FIELDS if f.logprob)
# the per-response-token values the micro-batch stacks [samples, longest response] (as TrainingSample names them)
RESPONSE_VALUES = tuple(f.sample for f in FIELDS if f.per == "response" and f.sample is not None)
LOGPROB_FIELDS = task_fields("logprobs")  # what reference/actor_fwd read to compute their side field
