"""Prompt datasets (JSONL, Parquet) and the data source that hands out rollout batches, with a resumable cursor.

Relax's data contract (``--prompt-data``, ``--input-key``, ``--label-key``, ``--metadata-key``,
``--apply-chat-template``, ``--rollout-shuffle``/``--rollout-seed``):

- one record per prompt; ``input_key`` holds the prompt: a string, or OpenAI-style messages
  (``[{"role": ..., "content": ...}]``) when ``apply_chat_template`` is on;
- ``label_key`` (optional) becomes ``sample.label``; ``metadata_key`` (optional per record) becomes
  ``sample.metadata`` (a mapping, or a JSON string of one); it may carry ``rm_type``;
- with ``apply_chat_template`` the messages (a bare string counts as one user message; ``system_prompt``
  is put first when set; ``tool_key`` supplies tools) go through ``tokenizer.apply_chat_template(...,
  tokenize=False, add_generation_prompt=True, **apply_chat_template_kwargs)`` and ``sample.prompt`` is the
  resulting text, as in Relax.

:class:`PromptDataset` reads files eagerly and reports the file, the line (JSONL) or row (Parquet) and the
key for any bad record. :class:`RolloutDataSource` walks it epoch by epoch (reshuffled per epoch from
``seed + epoch`` when ``shuffle``), and returns groups of ``n_samples_per_prompt`` independent copies with
``group_index``/``index`` set. Its cursor (:meth:`RolloutDataSource.state_dict`) is plain JSON.

No torch here; pyarrow and transformers are imported only when a Parquet file or a tokenizer is used, so
the recipe validator can import :func:`check_config` on a login node.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from relax_hpc.errors import PermanentError
from relax_hpc.rollout.sample import Sample

if TYPE_CHECKING:  # relax_hpc.recipe imports this module (validate: check_config), so only for annotations
    from relax_hpc.recipe.schema import DataConfig, RolloutConfig


class DataError(ValueError, PermanentError):
    """A dataset record or file that cannot be used; the message names the file, line/row and key. Permanent:
    the data reads the same after a restart, so the run fails at once with it."""


@dataclass(frozen=True)
class DataKeys:
    """Which record fields are the prompt, label, metadata and tools (Relax's ``--*-key`` flags)."""

    input_key: str = "input"
    label_key: str | None = None
    metadata_key: str | None = "metadata"
    tool_key: str | None = "tools"


# --------------------------------------------------------------------------------------------------
# Reading records
# --------------------------------------------------------------------------------------------------


def expand_paths(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Files from a path, a directory (its *.jsonl, *.json and *.parquet, sorted) or a list of those."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix in (".jsonl", ".json", ".parquet") and q.is_file())
            if not found:
                raise DataError(f"{p}: directory has no .jsonl, .json or .parquet files")
            out += found
        elif p.exists():
            out.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    if not out:
        raise DataError("no data files given")
    return out


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for every record of a JSONL or Parquet file; ``where`` is "file:line N" / "file row N"."""
    path = Path(path)
    if path.suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        yield from _read_jsonl(path)


def _read_jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{where}: each line must be a JSON object, got {type(rec).__name__}")
            yield where, rec


def _read_parquet(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path}: cannot read as Parquet ({type(e).__name__}: {e})") from None
    row = 0
    for batch in pf.iter_batches():
        for rec in batch.to_pylist():
            yield f"{path}: row {row}", rec
            row += 1


# --------------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------------


class PromptDataset:
    """The prompts of one or more files as template :class:`Sample` objects (no group/index yet).

    ``tokenizer``: a HF tokenizer (or a path to load one from); needed for ``apply_chat_template`` and
    ``max_prompt_len``. With a tokenizer every sample's ``tokens`` are its prompt ids
    (``tokenizer.encode(prompt, add_special_tokens=False)``: the chat template already has them).
    Prompts longer than ``max_prompt_len`` tokens are dropped (Relax's ``--rollout-max-prompt-len``);
    :attr:`num_filtered` counts them.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Iterable[str | os.PathLike],
        *,
        keys: DataKeys = DataKeys(),
        tokenizer: Any = None,
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: dict[str, Any] | None = None,
        system_prompt: str | None = None,
        max_prompt_len: int | None = None,
    ) -> None:
        self.files = expand_paths(paths)
        self.keys = keys
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.system_prompt = system_prompt
        self.max_prompt_len = max_prompt_len
        if apply_chat_template and tokenizer is None:
            raise DataError("apply_chat_template needs a tokenizer (model.path); none was given")
        if max_prompt_len is not None and tokenizer is None:
            raise DataError("max_prompt_len needs a tokenizer (model.path) to count prompt tokens; none was given")
        self.num_filtered = 0
        self.samples: list[Sample] = []
        for f in self.files:
            for where, rec in read_records(f):
                sample = self._to_sample(where, rec)
                if sample is not None:
                    self.samples.append(sample)
        if not self.samples:
            why = f" ({self.num_filtered} longer than max_prompt_len = {max_prompt_len})" if self.num_filtered else ""
            raise DataError(f"{', '.join(map(str, self.files))}: no usable prompts{why}")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]

    def _to_sample(self, where: str, rec: dict[str, Any]) -> Sample | None:
        k = self.keys
        if k.input_key not in rec:
            raise DataError(f"{where}: missing key {k.input_key!r} (data.input_key); the record has {_keys(rec)}")
        raw = rec[k.input_key]
        label = None
        if k.label_key:
            if k.label_key not in rec:
                raise DataError(f"{where}: missing key {k.label_key!r} (data.label_key); the record has {_keys(rec)}")
            label = rec[k.label_key]
        metadata: dict[str, Any] = {}
        if k.metadata_key and rec.get(k.metadata_key) is not None:
            metadata = rec[k.metadata_key]
            if isinstance(metadata, str):
                try:
                    metadata = json.loads(metadata)
                except json.JSONDecodeError:
                    raise DataError(f"{where}: key {k.metadata_key!r} (data.metadata_key) is a string "
                                    "that is not JSON; it must be a mapping or a JSON object") from None
            if not isinstance(metadata, dict):
                raise DataError(f"{where}: key {k.metadata_key!r} (data.metadata_key) must be a mapping, "
                                f"got {type(metadata).__name__}")
        tools = rec.get(k.tool_key) if k.tool_key else None
        prompt = self._prompt_text(where, raw, tools)
        sample = Sample(prompt=prompt, label=label, metadata=metadata)
        if self.tokenizer is not None:
            sample.tokens = list(self.tokenizer.encode(prompt, add_special_tokens=False))
            if self.max_prompt_len is not None and len(sample.tokens) > self.max_prompt_len:
                self.num_filtered += 1
                return None
        return sample

    def _prompt_text(self, where: str, raw: Any, tools: Any) -> str:
        key = self.keys.input_key
        if not self.apply_chat_template:
            if isinstance(raw, str):
                return raw
            if _is_messages(raw):
                raise DataError(f"{where}: key {key!r} holds chat messages; set data.apply_chat_template: true "
                                "(and model.path for the tokenizer) to turn them into a prompt")
            raise DataError(f"{where}: key {key!r} must be a string prompt, got {type(raw).__name__}")
        if isinstance(raw, str):
            messages = [{"role": "user", "content": raw}]
        elif _is_messages(raw):
            messages = [dict(m) for m in raw]
        else:
            raise DataError(f"{where}: key {key!r} must be a string or a list of chat messages "
                            "({'role': ..., 'content': ...}), got " + type(raw).__name__)
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError:
                raise DataError(f"{where}: key {self.keys.tool_key!r} (data.tool_key) is not JSON") from None
        kwargs = dict(self.apply_chat_template_kwargs)
        if tools:
            kwargs["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as e:
            raise DataError(f"{where}: the tokenizer's chat template failed on this record "
                            f"({type(e).__name__}: {e})") from e


def _is_messages(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(m, dict) and "role" in m for m in x)


def _keys(rec: dict[str, Any]) -> str:
    return "keys " + ", ".join(repr(k) for k in rec) if rec else "no keys"


def load_tokenizer(path: str | os.PathLike) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# --------------------------------------------------------------------------------------------------
# Data source with a cursor
# --------------------------------------------------------------------------------------------------


class RolloutDataSource:
    """Hands out prompt groups in a deterministic order and remembers where it is.

    Order: epoch ``e`` visits every prompt once, in file order, or, with ``shuffle``, in the order of
    ``random.Random(seed + e).shuffle`` (so a resumed run sees exactly the prompts it would have). A batch
    that runs past the end of an epoch continues into the next one.

    Cursor: ``epoch``, ``offset`` (prompts of this epoch already handed out), ``sample_group_index`` and
    ``sample_index`` (the next ids to assign; ids never repeat across epochs). A group's index counts the prompts
    handed out before it, so it is ``epoch · len(dataset) + offset``: the journal audit reads a trained group's
    epoch from it (:func:`relax_hpc.exchange.audit.epochs`). :meth:`state_dict` /
    :meth:`load_state_dict` save and restore it; :meth:`save`/:meth:`load` do so through a JSON file,
    written atomically.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        dataset: PromptDataset | list[Sample],
        *,
        rollout_batch_size: int,
        n_samples_per_prompt: int = 1,
        shuffle: bool = False,
        seed: int = 42,
    ) -> None:
        if rollout_batch_size < 1:
            raise ValueError(f"rollout_batch_size must be at least 1, got {rollout_batch_size}")
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be at least 1, got {n_samples_per_prompt}")
        self.dataset = dataset
        self.rollout_batch_size = rollout_batch_size
        self.n_samples_per_prompt = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self.sample_group_index = 0
        self.sample_index = 0
        self._order: list[int] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _current_order(self) -> list[int]:
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        return self._order

    def next_prompts(self, num_prompts: int | None = None) -> list[Sample]:
        """The next ``num_prompts`` (default ``rollout_batch_size``) prompt templates, advancing the cursor."""
        n = self.rollout_batch_size if num_prompts is None else num_prompts
        out: list[Sample] = []
        while len(out) < n:
            order = self._current_order()
            if self.offset >= len(order):
                self.epoch += 1
                self.offset = 0
                self._order = None
                continue
            out.append(self.dataset[order[self.offset]])
            self.offset += 1
        return out

    def get_samples(self, num_groups: int | None = None) -> list[list[Sample]]:
        """The next ``num_groups`` (default ``rollout_batch_size``) groups of ``n_samples_per_prompt`` samples.

        Each sample is an independent copy of its prompt's template (its metadata can be edited without
        touching the others) with ``group_index`` and ``index`` set.
        """
        groups = []
        for template in self.next_prompts(num_groups):
            group = []
            for _ in range(self.n_samples_per_prompt):
                group.append(template.copy(group_index=self.sample_group_index, index=self.sample_index))
                self.sample_index += 1
            self.sample_group_index += 1
            groups.append(group)
        return groups

    next_batch = get_samples

    def __iter__(self) -> Iterator[list[list[Sample]]]:
        while True:
            yield self.get_samples()

    # --- cursor --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "num_prompts": len(self.dataset),
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``. The dataset (its size), shuffle and seed must be those it was saved with."""
        for key, mine in (("num_prompts", len(self.dataset)), ("shuffle", self.shuffle), ("seed", self.seed)):
            if key in state and state[key] != mine:
                raise DataError(
                    f"cannot resume the data cursor: it was saved with {key} = {state[key]!r}, "
                    f"this run has {mine!r}. Fix: use the same data files and data.shuffle/data.seed as the saved run"
                )
        if not 0 <= int(state["offset"]) <= len(self.dataset):
            raise DataError(f"cannot resume the data cursor: offset {state['offset']} is outside the dataset "
                            f"of {len(self.dataset)} prompts")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.sample_group_index = int(state.get("sample_group_index", 0))
        self.sample_index = int(state.get("sample_index", 0))
        self._order = None

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike) -> None:
        with open(path) as f:
            self.load_state_dict(json.load(f))


# --------------------------------------------------------------------------------------------------
# From the recipe
# --------------------------------------------------------------------------------------------------


def parse_chat_template_kwargs(value: str | dict | None) -> dict[str, Any]:
    """``data.apply_chat_template_kwargs``: a JSON object string, as Relax's flag takes it (or a dict)."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"data.apply_chat_template_kwargs is not JSON ({e.msg}): {value!r}. "
                        "Fix: e.g. '{\"enable_thinking\": false}'") from None
    if not isinstance(out, dict):
        raise DataError(f"data.apply_chat_template_kwargs must be a JSON object, got {value!r}")
    return out


def dataset_from_config(data_cfg: DataConfig, rollout_cfg: RolloutConfig, *, tokenizer: Any = None, path: Any = None,
                        input_key: str | None = None, label_key: str | None = None) -> PromptDataset:
    """A :class:`PromptDataset` from the recipe's ``data``/``rollout`` sections (``path`` etc. override them)."""
    keys = DataKeys(
        input_key=input_key or data_cfg.input_key,
        label_key=label_key if label_key is not None else data_cfg.label_key,
        metadata_key=data_cfg.metadata_key,
        tool_key=data_cfg.tool_key,
    )
    path = path if path is not None else data_cfg.path
    if path is None:
        raise DataError("data.path is not set: give the JSONL/Parquet prompt file(s)")
    return PromptDataset(
        path, keys=keys, tokenizer=tokenizer,
        apply_chat_template=data_cfg.apply_chat_template,
        apply_chat_template_kwargs=parse_chat_template_kwargs(data_cfg.apply_chat_template_kwargs),
        system_prompt=data_cfg.system_prompt,
        max_prompt_len=rollout_cfg.max_prompt_len,
    )


def eval_datasets_from_config(data_cfg: DataConfig, rollout_cfg: RolloutConfig, *,
                              tokenizer: Any = None) -> dict[str, PromptDataset]:
    """``data.eval_prompt_data`` (name → path) as datasets, read with ``eval_input_key``/``eval_label_key``."""
    return {
        name: dataset_from_config(data_cfg, rollout_cfg, tokenizer=tokenizer, path=path,
                                  input_key=data_cfg.eval_input_key, label_key=data_cfg.eval_label_key)
        for name, path in data_cfg.eval_prompt_data.items()
    }


def data_source_from_config(dataset: PromptDataset, data_cfg: DataConfig, rollout_cfg: RolloutConfig,
                            run_seed: int = 1234) -> RolloutDataSource:
    seed = data_cfg.seed if data_cfg.seed is not None else run_seed
    return RolloutDataSource(
        dataset, rollout_batch_size=rollout_cfg.rollout_batch_size,
        n_samples_per_prompt=rollout_cfg.n_samples_per_prompt,
        shuffle=data_cfg.shuffle, seed=seed,
    )


def check_config(data_cfg: DataConfig, rollout_cfg: RolloutConfig) -> list[tuple[str, object, str]]:
    """Meaning checks of the ``data``/``rollout`` sections: (key, value, "problem. Fix: ...") triples.

    Pure Python (no torch, no file access) so the recipe validator can run it on a login node.
    """
    out: list[tuple[str, object, str]] = []

    def need(ok: bool, key: str, value: object, msg: str) -> None:
        if not ok:
            out.append((key, value, msg))

    r = rollout_cfg
    need(r.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt", r.n_samples_per_prompt, "must be at least 1")
    need(r.rollout_batch_size >= 1, "rollout.rollout_batch_size", r.rollout_batch_size, "must be at least 1")
    need(r.max_response_len >= 1, "rollout.max_response_len", r.max_response_len, "must be at least 1 token")
    need(r.temperature >= 0, "rollout.temperature", r.temperature, "must be 0 or more")
    need(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
    need(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", r.top_k, "must be -1 (off) or at least 1")
    if r.max_prompt_len is not None:
        need(r.max_prompt_len >= 1, "rollout.max_prompt_len", r.max_prompt_len, "must be at least 1 or null")
    need(r.sglang_server_concurrency >= 1, "rollout.sglang_server_concurrency", r.sglang_server_concurrency,
         "must be at least 1 request per engine")
    need(r.reward_max_concurrency >= 1, "rollout.reward_max_concurrency", r.reward_max_concurrency,
         "must be at least 1")
    need(r.max_retries >= 0, "rollout.max_retries", r.max_retries, "must be 0 or more")
    from relax_hpc.plugins import FORMS, PluginError, parse_spec

    for key, example in (("custom_rm_path", "examples.my_algo.reward_my_algo.reward_func (Relax's form)"),
                         ("dynamic_sampling_filter_path", "relax_hpc.rollout.dynamic.check_reward_nonzero_std"),
                         ("sample_filter_path", "my_filters.py:drop_long"),
                         ("custom_generate_function_path", "examples.my_agent.rollout.generate")):
        path = getattr(r, key)
        if path is None:
            continue
        try:
            parse_spec(path, f"rollout.{key}")
            ok = True
        except PluginError:
            ok = False
        need(ok, f"rollout.{key}", path, f"must be {FORMS}. Fix: e.g. {example}")
    # no custom_rm_path and no rm_type is fine here: rm_type may come per sample from metadata["rm_type"]
    # (a sample with neither is a reward failure)
    if r.eval_interval is not None:
        need(r.eval_interval >= 1, "rollout.eval_interval", r.eval_interval, "must be at least 1 or null (no eval)")
        need(bool(data_cfg.eval_prompt_data), "data.eval_prompt_data", data_cfg.eval_prompt_data,
             f"is empty but rollout.eval_interval = {r.eval_interval}. Fix: add name: path entries, "
             "or set rollout.eval_interval to null")
    need(r.n_samples_per_eval_prompt >= 1, "rollout.n_samples_per_eval_prompt", r.n_samples_per_eval_prompt,
         "must be at least 1")
    kwargs = data_cfg.apply_chat_template_kwargs
    if kwargs:
        try:
            parse_chat_template_kwargs(kwargs)
        except DataError as e:
            out.append(("data.apply_chat_template_kwargs", kwargs, str(e).split(": ", 1)[-1]))
    if data_cfg.seed is not None:
        need(data_cfg.seed >= 0, "data.seed", data_cfg.seed, "must be 0 or more, or null for run.seed")
    return out
