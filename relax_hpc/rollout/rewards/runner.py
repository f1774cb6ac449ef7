"""The reward runner: custom reward functions (Relax's contract), the built-ins by ``rm_type``, group rewards,
timeouts and failure reporting (:mod:`relax_hpc.rollout.rewards` has the whole contract)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import math
import numbers
import traceback as tb
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from relax_hpc.plugins import load_plugin
from relax_hpc.rollout.rewards.builtin import builtin_reward, dapo_genrm_reward, remote_rm
from relax_hpc.rollout.sample import Sample, SampleStatus, reward_value
from relax_hpc.threads import in_daemon_thread

# the run's relax_hpc.recipe.Recipe, by its attributes: rollout/ imports nothing of the recipe (which imports rollout's
# config and checks)
Recipe = Any

if TYPE_CHECKING:
    from relax_hpc.rollout.config import RolloutConfig

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Custom reward functions
# --------------------------------------------------------------------------------------------------


REWARD_PARAMS = ("args", "sample")
"""How a reward function is called: ``reward_func(args, sample)`` (``samples``, a list, with ``group_rm``)."""
GENERATE_PARAMS = ("args", "sample", "sampling_params")
"""How a custom generate function is called (plus ``evaluation=`` when it takes it), as Relax calls it."""


def load_function(path: str, what: str = "rollout.custom_rm_path", *,
                  params: Sequence[str] | None = REWARD_PARAMS) -> Callable[..., Any]:
    """The reward function at ``path`` (:func:`~relax_hpc.plugins.load_plugin`): Relax's dotted form
    ``package.module.function`` (``--custom-rm-path``), ``package.module:function`` or
    ``path/to/file.py:function`` (relative to the directory the run was submitted from). Errors are
    :class:`~relax_hpc.plugins.PluginError` (ImportError for a missing module or name, TypeError for a
    non-callable or a wrong signature), each naming ``what``, the value and the fix.
    """
    return load_plugin(path, what, params=params)


def _is_async(fn: Callable[..., Any]) -> bool:
    try:
        fn = inspect.unwrap(fn)
    except ValueError:
        pass
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)
    return call is not None and inspect.iscoroutinefunction(call)


# --------------------------------------------------------------------------------------------------
# args: what a Relax reward function receives
# --------------------------------------------------------------------------------------------------


def relax_args(recipe: Recipe) -> SimpleNamespace:
    """The ``args`` a Relax reward/generate function receives, built from the typed recipe (the one place).

    Every field of ``algorithm`` under its own name (they are Relax's names already); the ``data`` and
    ``rollout`` fields under Relax's names (``rollout.max_response_len`` → ``args.rollout_max_response_len``,
    ``data.path`` → ``args.prompt_data``, ...); then every key of ``rollout.custom_config_path`` (a YAML
    mapping, Relax's ``--custom-config-path``). relax_hpc itself never reads settings from this namespace:
    they come from the recipe. So a YAML key that names one of the attributes above with another value is
    refused (it would reach the reward function but not the run): set it in the recipe instead.
    """
    d, r = recipe.data, recipe.rollout
    a: dict[str, Any] = dataclasses.asdict(recipe.algorithm)
    a.update(
        prompt_data=d.path, input_key=d.input_key, label_key=d.label_key, metadata_key=d.metadata_key,
        tool_key=d.tool_key, apply_chat_template=d.apply_chat_template,
        apply_chat_template_kwargs=d.apply_chat_template_kwargs, system_prompt=d.system_prompt,
        rollout_shuffle=d.shuffle, rollout_seed=d.seed if d.seed is not None else recipe.run.seed,
        eval_prompt_data=dict(d.eval_prompt_data), eval_input_key=d.eval_input_key, eval_label_key=d.eval_label_key,
    )
    a.update(
        n_samples_per_prompt=r.n_samples_per_prompt, rollout_batch_size=r.rollout_batch_size,
        rollout_max_response_len=r.max_response_len, rollout_max_prompt_len=r.max_prompt_len,
        rollout_temperature=r.temperature, rollout_top_p=r.top_p, rollout_top_k=r.top_k,
        rollout_stop=list(r.stop), rollout_stop_token_ids=list(r.stop_token_ids),
        rollout_skip_special_tokens=r.skip_special_tokens,
        sglang_server_concurrency=r.sglang_server_concurrency, max_retries=r.max_retries,
        rm_type=r.rm_type, custom_rm_path=r.custom_rm_path, reward_key=r.reward_key,
        eval_reward_key=r.eval_reward_key if r.eval_reward_key is not None else r.reward_key,
        group_rm=r.group_rm, reward_max_concurrency=r.reward_max_concurrency,
        reward_error_policy=r.reward_error_policy, custom_config_path=r.custom_config_path,
        reward_timeout_s=r.reward_timeout_s, request_timeout_s=r.request_timeout_s,
        log_passrate=r.log_passrate, eval_interval=r.eval_interval,
        skip_eval_before_train=r.skip_eval_before_train, n_samples_per_eval_prompt=r.n_samples_per_eval_prompt,
        eval_temperature=r.eval_temperature, eval_top_p=r.eval_top_p, eval_top_k=r.eval_top_k,
        eval_max_response_len=r.eval_max_response_len, custom_generate_function_path=r.custom_generate_function_path,
        hf_checkpoint=recipe.model.path,
    )
    if r.max_turns is not None:  # Relax's multi-turn code reads args.max_turns (from its custom config)
        a["max_turns"] = r.max_turns
    if r.interaction_env_path is not None:
        a["rollout_interaction_env_path"] = r.interaction_env_path
    if r.custom_config_path:
        custom = load_custom_config(r.custom_config_path)
        clash = {k: (a[k], v) for k, v in custom.items() if k in a and a[k] != v}
        if clash:
            shown = "; ".join(f"{k}: {v!r} (the recipe gives {was!r})" for k, (was, v) in clash.items())
            raise ValueError(f"rollout.custom_config_path = {r.custom_config_path!r} sets args the recipe already "
                             f"sets, to other values: {shown}. relax_hpc runs with the recipe's values, so your "
                             "reward function would see settings the run does not use. Fix: set them in the "
                             "recipe (docs/rollout.md lists where each Relax flag lives) and drop them from the "
                             "YAML, or rename the keys")
        a.update(custom)
    return SimpleNamespace(**a)


def load_custom_config(path: str) -> dict[str, Any]:
    """Relax's ``--custom-config-path``: a YAML mapping whose keys become ``args`` attributes."""
    import yaml

    try:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"rollout.custom_config_path = {path!r}: cannot read ({e.strerror})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"rollout.custom_config_path = {path!r} must hold a YAML mapping, got {type(cfg).__name__}")
    return cfg


# --------------------------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------------------------

_SHOW = 300


def _clip(x: Any) -> str:
    s = x if isinstance(x, str) else repr(x)
    return s if len(s) <= _SHOW else s[:_SHOW] + f"... [{len(s) - _SHOW} more chars]"


@dataclass
class RewardFailure:
    """One sample whose reward could not be computed, with what it was scored on and why."""

    index: int | None
    group_index: int | None
    prompt: Any
    response: str
    label: Any
    error: BaseException
    traceback: str
    source: str  # which reward: the custom_rm_path or "rm_type <name>"
    sample: Sample | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def error_text(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"

    def __str__(self) -> str:
        return (f"sample index={self.index} group_index={self.group_index}: reward {self.source} raised "
                f"{self.error_text}\n    prompt: {_clip(self.prompt)}\n    response: {_clip(self.response)}\n"
                f"    label: {_clip(self.label)}")

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "group_index": self.group_index, "prompt": self.prompt,
                "response": self.response, "label": self.label, "error": self.error_text,
                "traceback": self.traceback, "source": self.source}


def positive_seconds(cfg: RolloutConfig, name: str, what: str = "") -> float:
    """``rollout.<name>`` as a positive, finite number of seconds, or ValueError naming it and its default."""
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        default = {f.name: f.default for f in dataclasses.fields(cfg)}[name]  # the schema's, stated there only
        raise ValueError(f"rollout.{name} = {value!r}: must be a positive number of seconds "
                         f"({what}default {default:g})")
    return float(value)


class RewardTimeout(TimeoutError):
    """A reward call ran longer than ``rollout.reward_timeout_s``."""


class RewardError(RuntimeError):
    """Rewards failed and ``reward_error_policy`` is ``fail``; ``failures`` has the report of each sample, in
    sample order (the order the caller gives, never the order the reward calls happened to finish in)."""

    def __init__(self, failures: list[RewardFailure]) -> None:
        self.failures = list(failures)
        shown = "\n".join(f"  - {f}" for f in self.failures[:5])
        more = f"\n  ... and {len(self.failures) - 5} more" if len(self.failures) > 5 else ""
        first_tb = self.failures[0].traceback if self.failures else ""
        super().__init__(
            f"the reward function failed for {len(self.failures)} sample(s) "
            f"(rollout.reward_error_policy = fail; set it to skip to give such samples reward 0 and go on):\n"
            f"{shown}{more}\nTraceback of the first failure:\n{first_tb}"
        )


# --------------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------------


class RewardRunner:
    """Scores samples with the custom reward function or a built-in, ``reward_max_concurrency`` calls at a time.

    Its settings are the recipe's ``rollout`` section (``custom_rm_path``, ``rm_type``, ``reward_key``,
    ``eval_reward_key``, ``group_rm``, ``reward_max_concurrency``, ``reward_error_policy``,
    ``reward_timeout_s``); ``args`` (:func:`relax_args` of the recipe) is what the custom function receives.
    """

    def __init__(self, recipe: Recipe) -> None:
        self.cfg = cfg = recipe.rollout
        self.args = relax_args(recipe)  # for the user's function only
        if cfg.reward_error_policy not in ("skip", "fail"):
            raise ValueError(f"rollout.reward_error_policy must be 'skip' or 'fail', got {cfg.reward_error_policy!r}")
        self.timeout_s = positive_seconds(cfg, "reward_timeout_s")
        self.fn = load_function(cfg.custom_rm_path) if cfg.custom_rm_path else None
        self.fn_is_async = self.fn is not None and _is_async(self.fn)
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: Any = None
        self.failures: list[RewardFailure] = []  # every failure seen by this runner (skip policy keeps going)

    def reward_key(self, evaluation: bool = False) -> str | None:
        """``rollout.reward_key``; for eval ``rollout.eval_reward_key`` when it is set."""
        if evaluation and self.cfg.eval_reward_key is not None:
            return self.cfg.eval_reward_key
        return self.cfg.reward_key

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            self._sem, self._sem_loop = asyncio.Semaphore(self.cfg.reward_max_concurrency), loop
        return self._sem

    # --- one call ------------------------------------------------------------------------------------
    async def _call_custom(self, payload: Sample | list[Sample], **kwargs: Any) -> Any:
        """The custom function under ``reward_timeout_s``. A sync one runs in its own daemon thread: a call
        stuck there cannot be killed, so on timeout it is abandoned (it never holds up the loop's or the
        interpreter's shutdown, as asyncio.to_thread's executor would)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.fn_is_async:
                    return await self.fn(self.args, payload, **kwargs)
                result = await in_daemon_thread(self.fn, self.args, payload, **kwargs,
                                                thread_name=f"reward {getattr(self.fn, '__name__', self.fn)}")
                if inspect.isawaitable(result):
                    result = await result
                return result
        except TimeoutError:
            raise RewardTimeout(
                f"timed out after {self.timeout_s:g} s (rollout.reward_timeout_s = {self.timeout_s:g}; raise it "
                f"if the reward legitimately takes longer, or find why it hangs)") from None

    async def _score_one(self, sample: Sample, reward_key: str | None, **kwargs: Any) -> Any:
        if self.fn is not None:
            return await self._call_custom(sample, **kwargs)
        meta = sample.metadata if isinstance(sample.metadata, dict) else {}
        rm_type = meta.get("rm_type") or self.cfg.rm_type
        if not rm_type:
            raise ValueError("no reward is configured: set rollout.custom_rm_path or rollout.rm_type "
                             "(or give this record a metadata.rm_type)")
        if rm_type == "remote_rm":  # Relax's async built-in: the server gets the whole sample
            value = await remote_rm(self.cfg.rm_url, sample.prompt, sample.response, sample.label,
                                    timeout_s=self.timeout_s)
        elif rm_type == "dapo-genrm":  # Relax's LLM judge rule, on the run's judge engines
            from relax_hpc.rollout import genrm

            value = await dapo_genrm_reward(sample.prompt, sample.response, sample.label, meta, genrm.generate)
        else:
            value = builtin_reward(rm_type, sample.response, sample.label, meta)
        # a dict (dapo's {score, acc, pred}, a remote server's object) is read through reward_key as it is
        return {reward_key: value} if reward_key and not isinstance(value, dict) else value

    def _source(self, sample: Sample | None = None) -> str:
        if self.cfg.custom_rm_path:
            return self.cfg.custom_rm_path
        meta = sample.metadata if sample is not None and isinstance(sample.metadata, dict) else {}
        return f"rm_type {meta.get('rm_type') or self.cfg.rm_type!r}"

    def _fail(self, sample: Sample, error: BaseException, trace: str) -> RewardFailure:
        f = RewardFailure(index=sample.index, group_index=sample.group_index, prompt=sample.prompt,
                          response=sample.response, label=sample.label, error=error, traceback=trace,
                          source=self._source(sample), sample=sample)
        self.failures.append(f)
        return f

    @staticmethod
    def _check(value: Any, reward_key: str | None) -> None:
        """A reward is a finite real number, or a dict holding one under ``reward_key``. Strictly: "0.5" and
        True would pass ``float()``, but a reward function returning them has a bug the run must not hide."""
        where = "the reward"
        if isinstance(value, dict):
            if not reward_key or reward_key not in value:
                reward_value(value, reward_key)  # raises, naming the missing key or the unset rollout.reward_key
            value, where = value[reward_key], f"the reward[{reward_key!r}] (rollout.reward_key)"
        if isinstance(value, (bool, str, bytes)):
            ok = False
        elif isinstance(value, numbers.Real):
            ok = True
        else:  # torch / numpy 0-d values: their item() must be a real, non-bool number
            item = getattr(value, "item", None)
            try:
                inner = item() if callable(item) and getattr(value, "ndim", 0) == 0 else None
            except (TypeError, ValueError, RuntimeError):
                inner = None
            ok = isinstance(inner, numbers.Real) and not isinstance(inner, bool)
        if not ok:
            raise TypeError(f"{where} must be a finite number (int or float), got {type(value).__name__} "
                            f"{_clip(repr(value))}")
        try:
            v = float(value)
        except OverflowError:  # an int past float64
            v = math.inf if value > 0 else -math.inf
        if not math.isfinite(v):
            raise ValueError(f"{where} is {v}, not a finite number")
        if abs(v) > _raw_reward_max():
            raise ValueError(f"{where} is {v:g}, not a finite number in float32, the dtype of the exchange's "
                             f"raw_reward column (|reward| <= {_raw_reward_max():.7g}): it would be stored as "
                             f"{'inf' if v > 0 else '-inf'}")

    # --- public --------------------------------------------------------------------------------------
    async def score_group(self, samples: list[Sample], *, evaluation: bool = False, apply_policy: bool = True,
                          **kwargs: Any) -> list[RewardFailure]:
        """Set ``reward`` on every sample of one group; returns this group's failures in sample order. With
        ``apply_policy`` (default) the policy is applied here; a caller scoring many groups passes False and
        calls :meth:`apply_policy` once over all of them, so a ``fail`` report lists them in sample order."""
        key = self.reward_key(evaluation)
        if self.cfg.group_rm and self.fn is not None:
            failures = await self._score_as_group(samples, key, **kwargs)
        else:
            failures = await self._score_each(samples, key, **kwargs)
        if apply_policy:
            self.apply_policy(failures)
        return failures

    async def _score_as_group(self, samples: list[Sample], key: str | None, **kwargs: Any) -> list[RewardFailure]:
        try:
            async with self._semaphore():
                values = await self._call_custom(list(samples), **kwargs)
            if not isinstance(values, (list, tuple)) or len(values) != len(samples):
                got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
                raise TypeError(f"with rollout.group_rm the reward function must return a list of one reward "
                                f"per sample ({len(samples)}), got {got}")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            trace = tb.format_exc()
            return [self._fail(s, e, trace) for s in samples]
        failures = []
        for s, v in zip(samples, values):
            try:
                self._check(v, key)
                s.reward = v
            except Exception as e:
                failures.append(self._fail(s, e, tb.format_exc()))
        return failures

    async def _score_each(self, samples: list[Sample], key: str | None, **kwargs: Any) -> list[RewardFailure]:
        async def one(s: Sample) -> RewardFailure | None:
            try:
                if s.reward is not None:  # a custom generate function scored it already (Relax's rule): checked
                    self._check(s.reward, key)
                    return None
                async with self._semaphore():
                    v = await self._score_one(s, key, **kwargs)
                self._check(v, key)
                s.reward = v
                return None
            except asyncio.CancelledError:
                raise
            except Exception as e:
                return self._fail(s, e, tb.format_exc())

        return [f for f in await asyncio.gather(*(one(s) for s in samples)) if f is not None]  # gather keeps order

    async def score_groups(self, groups: list[list[Sample]], *, evaluation: bool = False,
                           **kwargs: Any) -> list[RewardFailure]:
        """:meth:`score_group` for every group, concurrently; the policy is applied once to all failures, in
        sample order (under ``fail``, :class:`RewardError` reports every failing sample of every group)."""
        results = await asyncio.gather(*(self.score_group(g, evaluation=evaluation, apply_policy=False, **kwargs)
                                         for g in groups))
        failures = [f for r in results for f in r]
        self.apply_policy(failures)
        return failures

    def apply_policy(self, failures: list[RewardFailure]) -> None:
        """``fail``: raise :class:`RewardError` listing ``failures`` in the order given; ``skip``: reward 0 and
        status FAILED for each, logged."""
        if not failures:
            return
        if self.cfg.reward_error_policy == "fail":
            raise RewardError(failures)
        for f in failures:
            f.sample.reward = 0.0
            f.sample.status = SampleStatus.FAILED
            f.sample.metadata["reward_error"] = f.error_text
        for f in failures:
            log.warning("reward failed, sample gets reward 0 and status FAILED (reward_error_policy = skip): %s\n%s",
                        f, f.traceback)


@functools.cache
def _raw_reward_max() -> float:
    """The largest magnitude the exchange's ``raw_reward`` column holds (its dtype, read where it is defined)."""
    from relax_hpc.exchange.fields import finite_max  # imported here: the recipe validator imports this module

    return finite_max("raw_reward")
