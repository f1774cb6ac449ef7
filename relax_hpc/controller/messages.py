"""The tasks the controller hands to the roles and the results the roles report: one dataclass per kind.

The one description of what a task carries and what its result holds (docs/controller.md says what each task
does). On the wire (the control socket, :mod:`relax_hpc.controller.protocol`) a task is the JSON object that
``next_task`` returns, ``{"id": int, "kind": str, <the fields of its class>}``, and a result is the ``result``
object of ``task_done``: the fields of the kind's result class, or :class:`TaskError`'s ``{"error",
"restartable"}`` when the task failed. Both ends go through these classes: the controller
(:mod:`relax_hpc.controller.training`) builds tasks and decodes results with :func:`decode_result`; a role's
:func:`relax_hpc.roles.tasks.serve` decodes each task with :func:`decode_task` before its handler sees it and
sends the handler's result with ``to_dict()``.

Every message is checked where it is made and where it is decoded: a missing field, a field its class does not
have, or a value of the wrong type raises :class:`MessageError`, which names the message, the field, the
expected type and what came (a task the role cannot decode fails with that text). A field's annotation is
what its JSON value must be: ``int`` (not a bool), ``float`` (an int too), ``str``, ``bool``, ``X | None``,
``list[X]``, ``dict[str, X]``, ``dict``/``list`` (any contents), ``Any``, or one of the :data:`NESTED` types.

The nested types are decoded here, once, for every reader: a field typed :class:`~relax_hpc.exchange.refs.ChunkRef`
or :class:`~relax_hpc.exchange.refs.SideRef` holds that object (made from its JSON object when the message is
made or decoded; a malformed one is a :class:`MessageError` naming the field), and goes on the wire as its
``to_dict()``. Other nested values are JSON on purpose: engines ``{name: url}``; ``data_state``, the rollout role's
own state (its data source's ``state_dict()`` and partial rollout's buffer reference), which the controller
only keeps, forwards and checkpoints; failures and weight checks, which it only logs.

A field with a default may be absent (it then has its default); every field is sent, except those marked
``omit_none`` (sent only when not None).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Union

from relax_hpc.exchange.refs import ChunkRef, SideRef  # plain data: a message never loads h5py

DOC = "relax_hpc/controller/messages.py"
NESTED = (ChunkRef, SideRef)  # typed fields inside a message: JSON objects on the wire (their to_dict/from_dict)


class MessageError(ValueError):
    """A task or result that is not what its kind says: names the message, the field, the expected type, what came."""

    def __init__(self, message: str, field: str, expected: str, got: str):
        self.message, self.field, self.expected, self.got = message, field, expected, got
        super().__init__(f"malformed {message}: field {field!r}: expected {expected}, got {got} "
                         f"(controller and role disagree about the protocol; see {DOC})")


def _omit_none(default: Any = None) -> Any:
    """A field that may be absent and is sent only when not None."""
    return field(default=default, metadata={"omit_none": True})


def _short(v: Any, n: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= n else text[:n] + "..."


def _what(v: Any) -> str:
    return "null" if v is None else f"{type(v).__name__} {_short(v)}"


def _type_name(tp: Any) -> str:
    if tp is Any:
        return "any value"
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_args(tp):
        return f"{typing.get_origin(tp).__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _fits(value: Any, tp: Any) -> bool:
    """Whether a value is of annotation ``tp`` (see the module's docstring for the ones understood)."""
    if tp is Any:
        return True
    if tp in NESTED:
        return isinstance(value, tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is list or origin is list:
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if tp is dict or origin is dict:
        return isinstance(value, dict) and (not args or all(_fits(k, args[0]) and _fits(v, args[1])
                                                             for k, v in value.items()))
    raise TypeError(f"{DOC}: annotation {tp!r} is not one a message field may have")


def _has_nested(tp: Any) -> bool:
    return tp in NESTED or any(_has_nested(a) for a in typing.get_args(tp))


def _typed(value: Any, tp: Any) -> Any:
    """A JSON value as annotation ``tp`` holds it: the :data:`NESTED` objects decoded from their dicts; a value of
    the wrong shape is returned as it is (the type check then names it)."""
    if tp in NESTED:
        return tp.from_dict(value) if isinstance(value, Mapping) else value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        nested = [a for a in args if _has_nested(a)]
        return _typed(value, nested[0]) if nested and value is not None else value
    if origin is list and args and isinstance(value, list):
        return [_typed(v, args[0]) for v in value]
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        return {k: _typed(v, args[1]) for k, v in value.items()}
    return value


def _json(value: Any) -> Any:
    """A field's value as it goes on the wire: the :data:`NESTED` objects as their dicts."""
    if isinstance(value, NESTED):
        return value.to_dict()
    if isinstance(value, list):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value


class Message:
    """What tasks and results share: checked fields, ``to_dict`` and a validating ``from_dict``."""

    kind: ClassVar[str]
    what: ClassVar[str]  # "task" or "result"

    @classmethod
    def _name(cls) -> str:
        return f"{cls.kind} {cls.what}"

    @classmethod
    def _hints(cls) -> dict[str, Any]:
        hints = cls.__dict__.get("_hints_cache")
        if hints is None:
            hints = typing.get_type_hints(cls)
            cls._hints_cache = hints  # type: ignore[attr-defined]
        return hints

    def __post_init__(self) -> None:
        hints = self._hints()
        for f in dataclasses.fields(self):
            value, tp = getattr(self, f.name), hints[f.name]
            if _has_nested(tp):  # made from JSON (decoded, or a dict given in code): the typed objects
                try:
                    value = _typed(value, tp)
                except (KeyError, TypeError, ValueError) as e:
                    raise MessageError(self._name(), f.name, _type_name(tp),
                                       f"{_what(value)} ({type(e).__name__}: {e})") from None
                object.__setattr__(self, f.name, value)  # frozen: set once, here
            if not _fits(value, tp):
                raise MessageError(self._name(), f.name, _type_name(tp), _what(value))

    def _payload(self) -> dict[str, Any]:
        hints = self._hints()
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (f.metadata.get("omit_none") and v is None):
                out[f.name] = _json(v) if _has_nested(hints[f.name]) else v
        return out

    def to_dict(self) -> dict[str, Any]:
        return self._payload()

    @classmethod
    def _decode(cls, d: Any, envelope: tuple[str, ...] = ()) -> Any:
        name = cls._name()
        if not isinstance(d, Mapping):
            raise MessageError(name, "(the message)", "a JSON object", _what(d))
        hints = cls._hints()
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in d.items():
            if key not in fields and key not in envelope:
                known = ", ".join([*envelope, *fields]) or "none"
                raise MessageError(name, key, f"no such field (known: {known})", _what(value))
        for f in fields.values():
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.name not in d:
                raise MessageError(name, f.name, _type_name(hints[f.name]), "nothing (missing)")
        return cls(**{k: v for k, v in d.items() if k in fields})


# ------------------------------------------------------------------------------------------- tasks ---


@dataclass(frozen=True, kw_only=True)
class TaskMessage(Message):
    """A task: ``{"id", "kind", <fields>}`` on the wire. The controller sets ``id`` when it assigns it."""

    what: ClassVar[str] = "task"
    id: int = 0

    def to_dict(self) -> dict[str, Any]:
        payload = self._payload()
        return {"id": payload.pop("id"), "kind": self.kind, **payload}

    @classmethod
    def from_dict(cls, d: Any) -> Any:
        """The task ``d`` (a role's ``next_task`` reply); :class:`MessageError` unless it is one of this kind."""
        if isinstance(d, Mapping):
            if "id" not in d:
                raise MessageError(cls._name(), "id", "int", "nothing (missing)")
            if d.get("kind") != cls.kind:
                raise MessageError(cls._name(), "kind", repr(cls.kind), _what(d.get("kind")))
        return cls._decode(d, envelope=("kind",))


@dataclass(frozen=True, kw_only=True)
class StartEnginesTask(TaskMessage):
    """rollout: report the data cursor (its engines are job steps of their own, which join by themselves);
    genrm / teacher: report the judge / teacher engines (no cursor)."""

    kind: ClassVar[str] = "start_engines"


@dataclass(frozen=True, kw_only=True)
class ConnectTask(TaskMessage):
    """actor: load checkpoint ``load`` if set (a resumed run), build the weight-sync group with ``engines`` and
    ``followers`` (forward roles that get every sync too: actor_fwd)."""

    kind: ClassVar[str] = "connect"
    engines: dict[str, str]  # {name: url}
    load: str | None  # a checkpoint root, or None (a fresh run)
    followers: dict[str, str] = field(default_factory=dict)  # {role: url}
    nodes: dict[str, str] | None = _omit_none()  # {engine name: its node}: a node's actor rank sends it the weights


@dataclass(frozen=True, kw_only=True)
class GenerateTask(TaskMessage):
    """rollout: generate step ``step`` on ``engines`` from the rollout state ``data_state`` (after step−1): the data
    cursor and, with partial rollout, the reference of the buffer saved with it (opaque here: the rollout role's)."""

    kind: ClassVar[str] = "generate"
    step: int
    engines: dict[str, str]  # the live ones, {name: url}
    seq: int  # the producer's chunk sequence number (the broker's next_seq)
    data_state: dict | None  # the rollout state (cursor, buffer ref) after step−1; None: where the data source stands
    judges: dict[str, str] = field(default_factory=dict)  # the genrm role's engines {name: url}, if it runs
    # OPD (opd:): the teacher role's engines {name: url}, or {"opd.teacher_url": url} (an external teacher)
    teachers: dict[str, str] = field(default_factory=dict)
    # streaming within a step: the places (seq − this seq) of the chunks an earlier attempt announced (chunk_ready);
    # it writes the others
    streamed: list[int] | None = _omit_none()


@dataclass(frozen=True, kw_only=True)
class LogprobsTask(TaskMessage):
    """reference / actor_fwd: add per-token log-probs as side field ``field`` (default: the role's) to ``chunks``."""

    kind: ClassVar[str] = "logprobs"
    chunks: list[ChunkRef]
    field: str | None = _omit_none()
    version: str | None = _omit_none()  # a follower: the synced weights to compute with (step N-1's for step N)


@dataclass(frozen=True, kw_only=True)
class FollowTask(TaskMessage):
    """actor_fwd: serve the weight-update API on rank 0, so the actor's syncs reach it like an engine."""

    kind: ClassVar[str] = "follow"


@dataclass(frozen=True, kw_only=True)
class LoadTask(TaskMessage):
    """reference / actor_fwd: load the model weights of the checkpoint at ``path`` (root or step dir)."""

    kind: ClassVar[str] = "load"
    path: str


@dataclass(frozen=True, kw_only=True)
class TrainTask(TaskMessage):
    """actor: one train step on step ``step``'s ``chunks``."""

    kind: ClassVar[str] = "train"
    step: int
    chunks: list[ChunkRef]  # with their side files


@dataclass(frozen=True, kw_only=True)
class StageTask(TaskMessage):
    """actor, streaming within a step: π_old of step ``step``'s ``chunks`` that have landed (a forward pass per chunk
    with the weights the actor holds: those step ``step`` starts from), kept for its ``train``."""

    kind: ClassVar[str] = "stage"
    step: int
    chunks: list[ChunkRef]


@dataclass(frozen=True, kw_only=True)
class SyncTask(TaskMessage):
    """actor: push the weights to ``engines`` as weight version ``version``."""

    kind: ClassVar[str] = "sync"
    version: str
    engines: dict[str, str]  # the live ones, {name: url}; empty: the ones of the last connect
    snapshot: str | None = _omit_none()  # also write the weights there as an HF directory (external engines)
    nodes: dict[str, str] | None = _omit_none()  # {engine name: its node}, as in ConnectTask
    # train.overlap_sync: the id under which the actor reports the push's landing (a "land" task it is never sent),
    # once it answered this task at the snapshot and pushes behind the next train; None: the push is this task
    land: int | None = _omit_none()


@dataclass(frozen=True, kw_only=True)
class CheckpointTask(TaskMessage):
    """actor: save a checkpoint under ``RUN_DIR/checkpoints``; ``extra`` is saved with it (step, data cursor)."""

    kind: ClassVar[str] = "checkpoint"
    extra: dict


@dataclass(frozen=True, kw_only=True)
class EvalTask(TaskMessage):
    """rollout: generate and score every ``data.eval_prompt_data`` set with the engines' current weights (those
    synced after step ``step``; 0: the model on disk, before training); no chunk is written."""

    kind: ClassVar[str] = "eval"
    step: int
    judges: dict[str, str] = field(default_factory=dict)  # as GenerateTask's
    engines: dict[str, str] | None = None  # {name: url}: ready, with step ``step``'s weights (the registry's)


@dataclass(frozen=True, kw_only=True)
class StopTask(TaskMessage):
    """every role: leave the task loop (the controller stops the engine steps itself)."""

    kind: ClassVar[str] = "stop"


# ----------------------------------------------------------------------------------------- results ---


@dataclass(frozen=True, kw_only=True)
class ResultMessage(Message):
    """A task's result: the ``result`` object of ``task_done``, just its fields."""

    what: ClassVar[str] = "result"

    @classmethod
    def from_dict(cls, d: Any) -> Any:
        """The result ``d``; :class:`MessageError` unless it has this kind's fields, of their types."""
        return cls._decode(d)


@dataclass(frozen=True, kw_only=True)
class TaskError(ResultMessage):
    """Any task that failed: the report (``Type: message``) fails the run with it; ``restartable`` (the machinery
    broke, e.g. an engine process died) lets the controller restart the steps from the latest checkpoint."""

    kind: ClassVar[str] = "error"
    error: str
    restartable: bool = False


@dataclass(frozen=True, kw_only=True)
class StartEnginesResult(ResultMessage):
    kind: ClassVar[str] = "start_engines"
    engines: dict[str, str]  # genrm: {"judge<rank>": url}; teacher: {"teacher<rank>": url}; rollout: none
    pids: dict[str, int] = field(default_factory=dict)  # by engine name
    nodes: dict[str, str] = field(default_factory=dict)  # by engine name
    data_state: dict | None = None  # the rollout state at the start (a fresh run's step 1 starts from it)


@dataclass(frozen=True, kw_only=True)
class ConnectResult(ResultMessage):
    kind: ClassVar[str] = "connect"
    engines: list[str]  # the names of the engines in the weight-sync group
    loaded_step: int | None = None  # the step of the checkpoint loaded, if one was
    weights: str = ""  # how the weights travel to the engines (the sender's path and backend), said to the user


@dataclass(frozen=True, kw_only=True)
class GenerateResult(ResultMessage):
    kind: ClassVar[str] = "generate"
    chunks: list[ChunkRef]
    metrics: dict[str, Any] = field(default_factory=dict)  # rollout/*, perf/*
    n: int = 0  # samples
    weight_versions: list[str] = field(default_factory=list)  # the weight versions the samples carry
    data_state: dict | None = None  # the rollout state (cursor, buffer ref) after this step
    reward_failures: list[dict] = field(default_factory=list)  # the first ones, with their samples
    engine_failures: list[dict] = field(default_factory=list)  # {"name", "url", "error"}
    dead_engines: dict[str, str] = field(default_factory=dict)  # {name: why}
    engine_requests: dict[str, int] = field(default_factory=dict)  # {name: requests it was sent in this step}


@dataclass(frozen=True, kw_only=True)
class LogprobsResult(ResultMessage):
    kind: ClassVar[str] = "logprobs"
    sides: list[SideRef] = field(default_factory=list)  # one per chunk, in the task's order
    metrics: dict[str, Any] = field(default_factory=dict)  # perf/ref_log_probs_time (reference), perf/log_probs_time (actor_fwd)


@dataclass(frozen=True, kw_only=True)
class FollowResult(ResultMessage):
    kind: ClassVar[str] = "follow"
    url: str  # where the actor's WeightSender reaches it


@dataclass(frozen=True, kw_only=True)
class LoadResult(ResultMessage):
    kind: ClassVar[str] = "load"
    step: int  # the checkpoint's step


@dataclass(frozen=True, kw_only=True)
class TrainResult(ResultMessage):
    kind: ClassVar[str] = "train"
    metrics: dict[str, Any] = field(default_factory=dict)  # train/*, perf/train_time, perf/train_get_data_time
    skipped: list[str] | None = _omit_none()  # why optimizer steps were not applied (train.nonfinite: skip)


@dataclass(frozen=True, kw_only=True)
class SyncResult(ResultMessage):
    kind: ClassVar[str] = "sync"
    metrics: dict[str, Any] = field(default_factory=dict)  # perf/weight_sync_*, weights/*
    engine_versions: dict[str, str | None] = field(default_factory=dict)  # the version each engine reports
    checks: dict[str, dict] = field(default_factory=dict)  # per engine: the spot fingerprint check
    dead_engines: dict[str, str] = field(default_factory=dict)  # found dead at the sync: {name: why}
    follower_versions: dict[str, str | None] = field(default_factory=dict)  # {role: the version it holds}
    landing: bool | None = _omit_none()  # True: the weights were snapshotted and go out behind the next train


@dataclass(frozen=True, kw_only=True)
class CheckpointResult(ResultMessage):
    kind: ClassVar[str] = "checkpoint"
    path: str  # the checkpoint's step dir
    metrics: dict[str, Any] = field(default_factory=dict)  # perf/save_model_time


@dataclass(frozen=True, kw_only=True)
class EvalResult(ResultMessage):
    kind: ClassVar[str] = "eval"
    metrics: dict[str, float] = field(default_factory=dict)  # eval/<name>, eval/<name>-pass@k, ..., perf/eval_time


@dataclass(frozen=True, kw_only=True)
class StopResult(ResultMessage):
    kind: ClassVar[str] = "stop"


@dataclass(frozen=True, kw_only=True)
class StageResult(ResultMessage):
    kind: ClassVar[str] = "stage"
    metrics: dict[str, Any] = field(default_factory=dict)  # perf/actor_stage_time


TASKS: dict[str, type[TaskMessage]] = {c.kind: c for c in (
    StartEnginesTask, ConnectTask, GenerateTask, LogprobsTask, FollowTask, LoadTask, TrainTask, SyncTask,
    CheckpointTask, EvalTask, StopTask, StageTask)}
RESULTS: dict[str, type[ResultMessage]] = {c.kind: c for c in (
    StartEnginesResult, ConnectResult, GenerateResult, LogprobsResult, FollowResult, LoadResult, TrainResult,
    SyncResult, CheckpointResult, EvalResult, StopResult, StageResult)}


def decode_task(d: Any) -> TaskMessage:
    """The task object of a ``next_task`` reply, as its kind's class; :class:`MessageError` if it is malformed."""
    if not isinstance(d, Mapping):
        raise MessageError("task", "(the message)", "a JSON object", _what(d))
    kind = d.get("kind")
    if kind not in TASKS:
        raise MessageError("task", "kind", f"one of {', '.join(TASKS)}", _what(kind))
    return TASKS[kind].from_dict(d)


def decode_result(kind: str, d: Any) -> ResultMessage:
    """The result of a task of ``kind``: a :class:`TaskError` if it has ``error``, else ``RESULTS[kind]``."""
    if isinstance(d, Mapping) and "error" in d:
        return TaskError.from_dict(d)
    if kind not in RESULTS:
        raise MessageError("result", "kind", f"one of {', '.join(RESULTS)}", _what(kind))
    return RESULTS[kind].from_dict(d)


def encode_result(kind: str, result: ResultMessage | None) -> dict[str, Any]:
    """What a role sends for a task of ``kind``: ``result.to_dict()``; None is the kind's empty result (a kind
    whose result has required fields must return one). :class:`MessageError` for a result of another kind."""
    cls = RESULTS.get(kind)
    if cls is None:
        raise MessageError("result", "kind", f"one of {', '.join(RESULTS)}", _what(kind))
    if result is None:
        try:
            result = cls()
        except TypeError:
            raise MessageError(cls._name(), "(the message)", cls.__name__, "None") from None
    if type(result) is not cls:
        raise MessageError(cls._name(), "(the message)", cls.__name__, type(result).__name__)
    return result.to_dict()
