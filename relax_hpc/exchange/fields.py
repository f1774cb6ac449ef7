"""The one schema of a sample's fields in the exchange: name, dtype, shape, who writes it, which tasks read it.

Every place that writes or reads chunk fields takes its lists from here: the rollout role's chunk writer
(:func:`relax_hpc.train.samples.write_step`), the chunk reader, the broker's per-task field lists (a task
is ready once its chunks carry the fields it reads), the forward roles (which add a side field) and the
actor's batch builder. Names are Relax's where Relax has one.

Kinds: ``fixed`` is one number per sample (a 1-D column), ``ragged`` a variable-length array per sample
(flat data plus offsets in the file), ``json`` one JSON value per sample (for people reading the files and
for metrics, never for the loss).
"""

from __future__ import annotations

from dataclasses import dataclass

ROLLOUT, REFERENCE, ACTOR_FWD = "rollout", "reference", "actor_fwd"


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # fixed | ragged | json
    dtype: str  # numpy dtype name; "json" for json fields
    writer: str  # the role that writes it (a side file for every writer but rollout)
    read_by: tuple[str, ...]  # the tasks that read it: train, logprobs
    doc: str


FIELDS: tuple[Field, ...] = (
    Field("tokens", "ragged", "int64", ROLLOUT, ("train", "logprobs"), "prompt + response token ids"),
    Field("response_length", "fixed", "int64", ROLLOUT, ("train", "logprobs"),
          "response tokens (the last ones of tokens)"),
    Field("loss_mask", "ragged", "float32", ROLLOUT, ("train",), "over the response (0/1)"),
    Field("rollout_log_probs", "ragged", "float32", ROLLOUT, ("train",),
          "the engine's log-prob of each response token"),
    Field("raw_reward", "fixed", "float32", ROLLOUT, ("train",),
          "R: the scalar reward; group normalization (R → R̃) and advantages happen on the training side"),
    Field("index", "fixed", "int64", ROLLOUT, ("train",), "sample.index"),
    Field("group_index", "fixed", "int64", ROLLOUT, (), "the sample's group (its prompt) in the step"),
    Field("rollout_id", "fixed", "int64", ROLLOUT, (),
          "the rollout a segment belongs to (the index of the sample it came from); a whole rollout: its index"),
    Field("weight_version", "json", "json", ROLLOUT, ("train",),
          "the engine's weight version when it finished the sample"),
    Field("status", "json", "json", ROLLOUT, (), "completed / truncated / aborted / failed"),
    Field("prompt", "json", "json", ROLLOUT, (), "for people reading the files"),
    Field("response", "json", "json", ROLLOUT, (), "for people reading the files"),
    Field("label", "json", "json", ROLLOUT, (), "for people reading the files"),
    Field("teacher_log_probs", "ragged", "float32", ROLLOUT, ("train",),
          "on-policy distillation (opd:): the teacher's log-prob of each response token; only OPD runs' chunks"),
    Field("routed_experts", "ragged", "int32", ROLLOUT, ("train",),
          "MoE routing replay (train.routing_replay): the expert ids the engine's router chose, SGLang's "
          "meta_info.routed_experts flattened: [len(tokens) - 1, layers, top_k], -1 rows for tokens no engine ran (the "
          "trainer's router chooses); only in chunks of runs with train.routing_replay"),
    Field("pixel_values", "ragged", "float32", ROLLOUT, ("train", "logprobs"),
          "vision-language models: the image processor's patches of the sample's images, flat [patches, C·T·P·P] "
          "(empty for a sample without images); only in chunks of samples with images"),
    Field("image_grid_thw", "ragged", "int64", ROLLOUT, ("train", "logprobs"),
          "vision-language models: each image's (t, h, w) patch grid, flat [images, 3], in the order of the "
          "image pads in tokens; beside pixel_values"),
    Field("ref_log_probs", "ragged", "float32", REFERENCE, ("train",), "π_ref of each response token"),
    Field("log_probs", "ragged", "float32", ACTOR_FWD, ("train",), "π_old of each response token"),
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

PRODUCER = ROLLOUT  # the writer of a step's main chunk file
# side fields another role adds after the rollout wrote the chunk; the writer's role names its side file
FORWARD_FIELDS = tuple(f.name for f in FIELDS if f.writer in (REFERENCE, ACTOR_FWD))
SIDE_FIELD = {REFERENCE: "ref_log_probs", ACTOR_FWD: "log_probs"}


# rollout fields only some runs' chunks carry (the rollout writes them when its samples have them, and the actor
# reads them where every chunk of the step has them): OPD's teacher log-probs, MoE routing replay's routed experts,
# a vision-language model's processed images
OPTIONAL_ROLLOUT_FIELDS = ("teacher_log_probs", "routed_experts", "pixel_values", "image_grid_thw")
IMAGE_FIELDS = ("pixel_values", "image_grid_thw")  # written together, by the rollout's image processor


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
LOGPROB_FIELDS = task_fields("logprobs")  # what reference/actor_fwd read to compute their side field
