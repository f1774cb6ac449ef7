"""DAPO dynamic sampling and over-sampling: draw prompt groups in rounds until enough of them pass a filter.

``rollout.dynamic_sampling_filter_path`` names a group filter with Relax's contract, ``fn(args, samples)`` →
a bool or an object with ``keep`` (and ``reason``), e.g. :func:`check_reward_nonzero_std`, which drops a group
whose rewards are all equal (GRPO gives it zero advantage: it would train nothing). Each round draws
``rollout.over_sampling_batch_size`` groups (default ``rollout_batch_size``) from the data cursor, generates
and scores them, and keeps the groups that pass, in data order, until ``rollout_batch_size`` are kept.

Why whole rounds and a rewind, where Relax aborts the requests in flight once it has enough: the step must come
out the same when it is generated again (a resume, a damaged chunk). Every round's request seeds are a function
of (``run.seed``, step, round), and the cursor is moved to just after the last group kept, so the prompts
drawn but not needed are drawn again by the next step (Relax puts its surplus back into the data buffer: the
same effect) and the groups that failed the filter before it are consumed. Without a filter the step is one
round of ``rollout_batch_size`` groups with the seeds it always had.

``rollout.sample_filter_path`` (Relax's ``--rollout-sample-filter-path``) is called once per step with the
step's groups, ``fn(args, groups)``, and may set ``sample.remove_sample``: the sample's loss mask becomes zero,
and it still counts in the group normalization.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

from relax_hpc.errors import PermanentError
from relax_hpc.rollout.driver import RolloutDriver, RolloutResult, BatchCounters, first_error
from relax_hpc.rollout.sample import Sample, SampleStatus, sample_seed
from relax_hpc.rundir import fsync_dir


@dataclass
class DynamicFilterOutput:
    """What a group filter returns (Relax's type); a plain bool is accepted too."""

    keep: bool
    reason: str | None = None


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards are not all equal (DAPO); a group of one sample is kept (no spread to test)."""
    rewards = [s.get_reward_value(args) for s in samples]
    keep = len(rewards) <= 1 or statistics.pstdev(rewards) > 0.0
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


class DynamicSamplingError(RuntimeError):
    pass


def _out_of_rounds(what: str, kept: int, target: int, max_rounds: int, per_round: int, generated: int,
                   drops: Counter) -> DynamicSamplingError:
    return DynamicSamplingError(
        f"{what} kept {kept} of rollout.rollout_batch_size = {target} groups after "
        f"rollout.dynamic_sampling_max_rounds = {max_rounds} rounds of {per_round} groups ({generated} generated; "
        f"dropped: {dict(drops)}). The filter drops almost everything: the data may be too easy or too hard for "
        "the model now. Fix: raise over_sampling_batch_size or dynamic_sampling_max_rounds (0: no limit), or "
        "change the data or the filter")


def _filter_metrics(generated: int, dropped: Counter) -> dict[str, float]:
    out = {"rollout/dynamic_sampling_generated_groups": float(generated),
           "rollout/dynamic_sampling_filtered_ratio": sum(dropped.values()) / generated if generated else 0.0}
    out.update({f"rollout/dynamic_filter/drop_{reason}": float(n) for reason, n in dropped.items()})
    return out


def round_seed(base: int, round_no: int) -> int:
    """The request seed base of round ``round_no`` of a step seeded ``base``: round 0 keeps ``base`` (a run
    without a filter samples as it always did); later rounds hash it (keys below -1, which no sample has)."""
    return base if round_no == 0 else sample_seed(base, -2 - round_no)


def _verdict(out: Any) -> tuple[bool, str | None]:
    if isinstance(out, bool) or out is None or isinstance(out, (int, float)):
        return bool(out), None
    keep = getattr(out, "keep", None)
    if keep is None:
        raise TypeError(f"a dynamic sampling filter returned {type(out).__name__}: return a bool or an object "
                        "with .keep (and .reason), e.g. relax_hpc.rollout.dynamic.DynamicFilterOutput")
    return bool(keep), getattr(out, "reason", None)


class PartialStateError(PermanentError):
    """The buffer a data cursor names cannot be read back (missing, damaged, or not the one it names)."""


@dataclass
class PartialRollout:
    """Partial rollout's state across steps: the groups aborted at a step's end, or generated and not needed,
    which the next step continues first; and Relax's two settings.

    The buffer is rollout state, like the data cursor, and travels with it: after each step the rollout role
    writes it to a file (:meth:`save`) whose reference goes into the step's ``data_state``, which the controller
    keeps per step and saves in the checkpoint; a step generated again, a restarted role and a resumed run load
    the buffer that goes with the cursor they start from (:meth:`load`). Its encoding is :meth:`state_dict`."""

    buffer: list[list[Sample]] = dataclasses.field(default_factory=list)
    mask_offpolicy: bool = False  # loss mask 0 on the tokens a sample had when it was aborted
    max_aborted: int | None = None  # a sample aborted this often is never aborted again (it finishes)

    STATE_VERSION: ClassVar[int] = 1
    DIR: ClassVar[str] = "partial_rollout"  # under the run directory

    def state_dict(self) -> dict[str, Any]:
        """The buffer as plain JSON: per group, the fields its samples share (the prompt, its token ids and label
        once) and each sample's own (:meth:`Sample.to_dict`, fields at their default left out)."""
        return {"version": self.STATE_VERSION, "groups": [_pack_group(g) for g in self.buffer]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The buffer of ``state`` (None or no groups: an empty buffer), replacing this one's."""
        state = state or {}
        if state.get("version", self.STATE_VERSION) != self.STATE_VERSION:
            raise PartialStateError(f"partial rollout buffer version {state.get('version')!r}: this relax_hpc reads "
                                    f"version {self.STATE_VERSION}. Fix: resume with the relax_hpc that wrote it")
        self.buffer = [_unpack_group(g) for g in state.get("groups", [])]

    def save(self, run_path: str | os.PathLike, step: int) -> dict[str, Any]:
        """Write the buffer as it is after step ``step`` to ``RUN_DIR/partial_rollout/`` (:meth:`file_name`)
        (whole and fsynced before this returns) and return its reference for the step's ``data_state``: the
        file (relative to the run directory), its groups and samples, size and sha256. An empty buffer writes
        no file."""
        groups, samples = len(self.buffer), sum(len(g) for g in self.buffer)
        if not groups:
            return {"groups": 0, "samples": 0}
        try:
            data = json.dumps(self.state_dict(), separators=(",", ":"), allow_nan=True).encode()
        except TypeError as e:  # a sample field the dataset or a reward put there that JSON cannot hold
            raise PartialStateError(f"partial rollout: a buffered sample cannot be saved as JSON ({e}); its "
                                    "metadata, label and reward must be JSON values") from None
        sha = hashlib.sha256(data).hexdigest()
        rel = f"{self.DIR}/{self.file_name(step, sha)}"  # never overwritten: a step generated again has a name of its own
        path = Path(run_path) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return {"file": rel, "groups": groups, "samples": samples, "size": len(data), "sha256": sha}

    @staticmethod
    def file_name(step: int, sha256: str) -> str:
        """The saved buffer's file name: the step it is after, and its content's hash (a step generated again in a
        later attempt saves another buffer under another name, and a checkpoint naming the first still finds it)."""
        return f"after_{int(step):08d}_{sha256[:16]}.json"

    @staticmethod
    def file_step(name: str) -> int | None:
        """The step of a file :meth:`file_name` named (None for any other name)."""
        parts = name.removesuffix(".json").split("_")
        return int(parts[1]) if len(parts) == 3 and parts[0] == "after" and parts[1].isdigit() else None

    def load(self, run_path: str | os.PathLike, ref: dict[str, Any] | None) -> None:
        """The buffer that :meth:`save` returned ``ref`` for (None, or no groups: an empty buffer)."""
        if not ref or not ref.get("groups"):
            self.buffer = []
            return
        path = Path(run_path) / ref["file"]
        fix = ("Fix: restore the file, or resume with rollout.partial_rollout: false, which drops the buffer (its "
               f"{ref['groups']} prompt groups are then never trained)")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise PartialStateError(f"partial rollout: {path} is missing; it holds the buffer that goes with the "
                                    f"data cursor this step starts from. {fix}") from None
        if len(data) != ref["size"] or hashlib.sha256(data).hexdigest() != ref["sha256"]:
            raise PartialStateError(f"partial rollout: {path} is not the buffer the data cursor names ({len(data)} "
                                    f"bytes, {ref['size']} expected, or a different checksum). {fix}")
        self.load_state_dict(json.loads(data))


def _pack_group(group: list[Sample]) -> dict[str, Any]:
    """One group: the fields all its samples have alike once (``shared``), each sample's others (``samples``),
    the prompt's token ids once (``prompt_tokens``, each sample keeping its response's), defaults left out."""
    blank = _BLANK
    dicts = [s.to_dict() for s in group]
    prompts = [s.tokens[:s.prompt_length] for s in group]
    shared_prompt = all(p == prompts[0] for p in prompts)
    if shared_prompt:  # each sample then keeps only its response's ids
        for d, s in zip(dicts, group):
            d["tokens"] = s.tokens[s.prompt_length:]
    first = dicts[0]
    shared = {k: v for k, v in first.items() if all(k in d and d[k] == v for d in dicts[1:])}
    out: dict[str, Any] = {
        "shared": {k: v for k, v in shared.items() if not (k in blank and v == blank[k])},
        "samples": [{k: v for k, v in d.items() if k not in shared and not (k in blank and v == blank[k])}
                    for d in dicts]}
    if shared_prompt:
        out["prompt_tokens"] = prompts[0]
    return out


def _unpack_group(packed: dict[str, Any]) -> list[Sample]:
    group = []
    for own in packed["samples"]:
        d = {**packed["shared"], **own}
        if "prompt_tokens" in packed:
            d["tokens"] = packed["prompt_tokens"] + d.get("tokens", [])
        group.append(Sample.from_dict(d))
    return group


_BLANK = Sample().to_dict()  # the fields at their defaults, left out of the saved buffer


def generate_step(driver: RolloutDriver, data: Any, *, target: int, seed: int, group_filter: Callable | None,
                  args: Any, over_sampling: int | None = None, max_rounds: int = 0,
                  sample_filter: Callable | None = None, partial: PartialRollout | None = None) -> RolloutResult:
    """One rollout step's groups from ``data`` (a :class:`~relax_hpc.rollout.data.RolloutDataSource` at the step's
    cursor; left just after the last group used). See the module docstring; ``max_rounds`` 0 = no limit."""
    if partial is not None:
        return _sample_filtered(asyncio.run(_partial_step(driver, data, partial, target=target, seed=seed,
                                                          group_filter=group_filter, args=args,
                                                          per_round=over_sampling or target,
                                                          max_rounds=max_rounds)), sample_filter, args)
    if group_filter is None:
        result = driver.generate_rollout_sync(data.get_samples(target), seed=seed)
        return _sample_filtered(result, sample_filter, args)
    per_round = over_sampling or target
    kept: list[list[Sample]] = []
    kept_rewards: list[list[float]] = []
    results: list[RolloutResult] = []
    drops: Counter[str] = Counter()
    generated = rounds = 0
    while len(kept) < target:
        if max_rounds and rounds >= max_rounds:
            raise _out_of_rounds("dynamic sampling", len(kept), target, max_rounds, per_round, generated, drops)
        start = data.state_dict()
        res = driver.generate_rollout_sync(data.get_samples(per_round), seed=round_seed(seed, rounds))
        rounds += 1
        results.append(res)
        last_used = -1
        for i, (group, rewards) in enumerate(zip(res.groups(), res.group_rewards())):
            if len(kept) == target:
                break
            generated += 1
            keep, reason = _verdict(group_filter(args, group))
            if keep:
                kept.append(group)
                kept_rewards.append(rewards)
            else:
                drops[reason or "filtered"] += 1
            last_used = i
        if len(kept) == target and last_used + 1 < per_round:  # give back the prompts this step did not need
            data.load_state_dict(start)
            data.get_samples(last_used + 1)
    samples = [s for g in kept for s in g]
    raw = [r for rs in kept_rewards for r in rs]
    rollout_time = sum(r.metrics.get("perf/rollout_time", 0.0) for r in results)
    metrics = driver.batch_metrics(samples, raw, results[0].group_size, rollout_time,
                                   retries=sum(r.retries for r in results))
    metrics["rollout/dynamic_sampling_rounds"] = float(rounds)
    metrics.update(_filter_metrics(generated, drops))
    out = RolloutResult(samples=samples, raw_rewards=raw, metrics=metrics, group_size=results[0].group_size,
                        reward_failures=[f for r in results for f in r.reward_failures],
                        engine_failures=[f for r in results for f in r.engine_failures],
                        retries=sum(r.retries for r in results))
    return _sample_filtered(out, sample_filter, args)


async def _partial_step(driver: RolloutDriver, data: Any, partial: PartialRollout, *, target: int, seed: int,
                        group_filter: Callable | None, args: Any, per_round: int, max_rounds: int) -> RolloutResult:
    """Partial rollout (Relax's ``--partial-rollout``, APRIL): each round puts ``per_round`` groups in flight, the
    buffer's first, and as soon as ``target`` groups are done (and pass the filter) the requests still running
    are aborted. Their samples keep the tokens they have and go back to the buffer with the groups done but not
    needed; the next step continues them first. Which groups finish first depends on timing, so unlike the rest
    of this module a step is not reproducible: it is for ``fully_async`` runs only."""
    sp = driver.sampling_params()
    batch = BatchCounters()
    kept: list[list[Sample]] = []
    leftover: list[list[Sample]] = []
    failures: list = []
    reported: list = []
    drops: Counter[str] = Counter()
    generated = rounds = 0
    t0 = time.monotonic()
    stop = asyncio.Event()

    def protected(s: Sample) -> bool:
        return partial.max_aborted is not None and s.abort_count >= partial.max_aborted

    async def one(group: list[Sample]) -> None:
        nonlocal generated
        todo = [s for s in group if s.status in (SampleStatus.PENDING, SampleStatus.ABORTED)]
        await asyncio.gather(*(driver.generate_sample(s, sp, batch=batch, seed=sample_seed(seed, int(s.index or 0)),
                                                      stop=None if protected(s) else stop) for s in todo))
        if any(s.status in (SampleStatus.PENDING, SampleStatus.ABORTED) for s in group) or len(kept) >= target:
            leftover.append(group)
            return
        if any(s.reward is None for s in group):
            failures.extend(await driver.reward.score_group(group, apply_policy=False))
        generated += 1
        keep, reason = _verdict(group_filter(args, group)) if group_filter is not None else (True, None)
        if not keep:
            drops[reason or "filtered"] += 1
        elif len(kept) < target:
            kept.append(group)
            if len(kept) == target:
                stop.set()
                await driver.abort_inflight()
        else:
            leftover.append(group)

    while len(kept) < target:
        if max_rounds and rounds >= max_rounds:
            raise _out_of_rounds("partial rollout", len(kept), target, max_rounds, per_round, generated, drops)
        groups = partial.buffer[:per_round]
        del partial.buffer[:len(groups)]
        groups += data.get_samples(per_round - len(groups)) if len(groups) < per_round else []
        rounds += 1
        try:
            async with asyncio.TaskGroup() as tg:
                for g in groups:
                    tg.create_task(one(g))
        except BaseExceptionGroup as eg:
            raise first_error(eg) from None
        driver.reward.apply_policy(failures)  # once per round, in the order groups finished
        reported += failures
        failures = []
    aborted = 0
    for g in leftover:
        for s in g:
            if s.status is SampleStatus.ABORTED:
                aborted += 1
                if partial.mask_offpolicy:  # tokens of older weights: kept for context, out of the loss
                    s.loss_mask = [0] * s.response_length
    partial.buffer = leftover + partial.buffer
    samples = [s for g in kept for s in g]
    raw = [s.get_reward_value(reward_key=driver.reward.reward_key(False)) for s in samples]
    metrics = driver.batch_metrics(samples, raw, len(kept[0]), time.monotonic() - t0, retries=batch.retries)
    metrics.update({"rollout/partial_rounds": float(rounds), "rollout/partial_aborted_samples": float(aborted),
                    "rollout/partial_resumed_groups": float(sum(any(s.abort_count for s in g) for g in kept)),
                    "rollout/partial_buffer_groups": float(len(partial.buffer))})
    if group_filter is not None:
        metrics.update(_filter_metrics(generated, drops))
    return RolloutResult(samples=samples, raw_rewards=raw, metrics=metrics, group_size=len(kept[0]),
                         reward_failures=reported, engine_failures=batch.engine_failures, retries=batch.retries)


def _sample_filtered(result: RolloutResult, sample_filter: Callable | None, args: Any) -> RolloutResult:
    if sample_filter is None:
        return result
    sample_filter(args, result.groups())  # Relax passes the step's groups
    removed = 0
    for s in result.samples:
        if s.remove_sample:
            s.loss_mask = [0] * s.response_length
            removed += 1
    result.metrics["rollout/removed_samples_ratio"] = removed / len(result.samples) if result.samples else 0.0
    return result
