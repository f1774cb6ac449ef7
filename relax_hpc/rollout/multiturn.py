"""Multi-turn rollouts against an environment written to Relax's ``BaseInteractionEnv`` contract.

``rollout.interaction_env_path`` (or Relax's ``rollout_interaction_env_path`` in the ``custom_config_path`` YAML)
names a module with ``build_env(sample=None, args=None, **_)``. The env it builds has ``reset() -> (obs, info)``,
``step(response_text) -> (obs, done, info)``, ``close()`` and optionally ``format_observation(obs)``; sync or async.
Observations are Relax's dicts ``{"obs_str": str, "role": "user", ...}``.

One rollout, turn by turn (Relax's reference loop, ``examples/deepeyes/rollout.py``):

1. ``/generate`` with the tokens so far (prompt, then every turn), through the driver (routing, retries, dead
   engines, weight versions), at most ``max_response_len`` new tokens and never past the context bound;
2. the engine's output ids are appended as they are, with loss mask 1 and their log-probs: tokens in, tokens out,
   never re-tokenized;
3. ``env.step(text)`` under ``rollout.env_step_timeout_s``;
4. unless done, the observation is encoded as a continuation (:func:`encode_observation`, the one place that knows
   the chat template's turn boundary) and appended with loss mask 0 and log-prob 0.

The context bound is ``rollout.max_context_len``, else ``train.max_seq_len`` (validation refuses a larger one): the
prompt and every turn, the env's included, so no sample is longer than the trainer accepts. An observation that
would leave no room for one more response token does not go in whole: with ``rollout.turn_truncation: stop``
(Relax's rule for a cut turn) the rollout ends there, without it; with ``continue`` it is cut to the longest head
of its text that fits (:func:`fit_observation`) and the model answers it. Either way the trace says how many of its
tokens were left out (``obs_truncated``), and ``rollout/truncated_observations`` counts them (the driver's step metrics).
A prompt as long as the bound leaves no room at all: a :class:`~relax_hpc.errors.PermanentError` that names
``rollout.max_prompt_len`` (which drops such prompts) as the fix.

It stops on the engine's length limit (``truncated_by: response``; with ``rollout.turn_truncation: continue`` such a
turn goes to the env like any other, for tasks whose answers are exactly ``max_response_len`` tokens), the context
bound (``context``), ``max_turns`` (``turns``), the env's ``done``, or an abort. Every stop is recorded in
``metadata["rollout_stop_reason"]``, with ``rollout_turns`` and per-turn ``rollout_traces``. An env that raises,
times out or returns something malformed fails only its sample: status FAILED, loss mask all 0, reward 0, the
reason logged and in ``metadata["env_error"]``; under ``reward_error_policy: fail`` it fails the step instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol

from relax_hpc.errors import PermanentError
from relax_hpc.rollout.errors import RolloutError
from relax_hpc.rollout.sample import Sample, SampleStatus, sample_seed
from relax_hpc.threads import in_daemon_thread

if TYPE_CHECKING:
    from relax_hpc.engines.client import Generation, SamplingParams

log = logging.getLogger(__name__)

_DUMMY = [{"role": "system", "content": "x"}, {"role": "user", "content": "x"}]


def env_factory(path: str) -> str:
    """The ``build_env`` of an env module named as Relax names it (``examples.x.env_x``) or as a file."""
    return f"{path}:build_env" if path.endswith(".py") else f"{path}.build_env"


class EngineSession(Protocol):
    """What a multi-turn rollout needs of the engines, for one batch (the driver gives one)."""

    tokenizer: Any
    fail_on_env_error: bool  # rollout.reward_error_policy = fail: an env failure fails the batch, not the sample

    def prompt_ids(self, sample: Sample) -> list[int]: ...

    async def request(self, ids: list[int], sp: SamplingParams, *, who: str) -> Generation: ...

    def response_text(self, gen: Generation) -> str: ...


class EnvError(RuntimeError):
    """The environment raised, timed out or broke its contract, for one sample."""


async def _call(fn: Callable, *args: Any, timeout: float | None) -> Any:
    """Call a sync or async env method under ``timeout`` seconds (a sync one runs on a thread of its own)."""
    coro = fn(*args) if inspect.iscoroutinefunction(fn) else in_daemon_thread(fn, *args, thread_name="env-call")
    name = getattr(fn, "__name__", "env call")
    try:
        return await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        raise EnvError(f"{name}() took longer than {timeout} s (rollout.env_step_timeout_s)") from None
    except Exception as e:  # the env's own code: it fails its sample, not the step
        raise EnvError(f"{name}() raised {type(e).__name__}: {e}") from e


def encode_observation(tokenizer: Any, obs: dict, env: Any, chat: bool) -> tuple[list[int], str]:
    """An observation's tokens as a continuation of the conversation: with a chat template, the dummy-prefix trick
    (render DUMMY + [message] with the generation prompt, keep what comes after DUMMY, drop a leading BOS), so the
    turn boundary is the template's; without one, the text's own tokens."""
    message = env.format_observation(obs) if hasattr(env, "format_observation") else \
        {"role": obs.get("role", "user"), "content": obs["obs_str"]}
    text = obs["obs_str"]
    if not chat:
        return list(tokenizer.encode(text, add_special_tokens=False)), text
    base = tokenizer.apply_chat_template(_DUMMY, tokenize=True)
    full = tokenizer.apply_chat_template(_DUMMY + [message], tokenize=True, add_generation_prompt=True)
    ids = list(full[len(base):])
    if ids and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id:
        ids = ids[1:]
    return ids, tokenizer.decode(ids)


def fit_observation(tokenizer: Any, obs: dict, env: Any, chat: bool, room: int) -> tuple[list[int], str] | None:
    """The observation in at most ``room`` tokens: its own tokens cut to ``room`` without a chat template; with
    one, the longest head of its text whose encoding fits (a binary search), so the template's turn boundary and
    generation prompt stay whole. None when not one character of it fits."""
    if room < 1:
        return None
    if not chat:
        ids = list(tokenizer.encode(obs["obs_str"], add_special_tokens=False))[:room]
        return (ids, tokenizer.decode(ids)) if ids else None
    text, best = obs["obs_str"], None
    lo, hi = 0, len(text)  # the longest head that fits has lo..hi characters
    while lo < hi:
        mid = (lo + hi + 1) // 2
        got = encode_observation(tokenizer, {**obs, "obs_str": text[:mid]}, env, chat)
        if len(got[0]) <= room:
            lo, best = mid, got
        else:
            hi = mid - 1
    return best


def _observation(tokenizer: Any, obs: Any, env: Any, mt: MultiTurn, room: int | None) -> tuple[list[int], str, int]:
    """(tokens, text, tokens left out) of the env's observation within ``room`` tokens (None: no bound), the room
    one more answer token leaves: whole if it fits; else cut (``mt.continue_truncated``) or nothing (the rollout
    ends). An error of the env's ``format_observation`` is an :class:`EnvError`, as its other calls."""
    try:
        ids, text = encode_observation(tokenizer, _check_obs(obs, "env.step"), env, mt.chat)
        if room is None or len(ids) <= room:
            return ids, text, 0
        cut = fit_observation(tokenizer, obs, env, mt.chat, room) if mt.continue_truncated else None
    except EnvError:
        raise
    except Exception as e:  # format_observation is the env's code too
        raise EnvError(f"the observation could not be encoded: {type(e).__name__}: {e}") from e
    return (cut[0], cut[1], len(ids) - len(cut[0])) if cut else ([], "", len(ids))


def _check_obs(obs: Any, where: str) -> dict:
    if not isinstance(obs, dict) or not isinstance(obs.get("obs_str"), str):
        raise EnvError(f"{where} returned {type(obs).__name__} as the observation: Relax's form is a dict "
                       "{'obs_str': str, 'role': 'user'}")
    return obs


@dataclasses.dataclass
class MultiTurn:
    """What the loop needs besides the engines: the env factory and the limits."""

    build_env: Callable
    args: Any
    max_turns: int
    max_context_len: int | None  # prompt + every turn: rollout.max_context_len, else train.max_seq_len; None: no bound
    step_timeout_s: float
    chat: bool  # data.apply_chat_template: observations follow the chat template
    # rollout.turn_truncation = continue: a turn cut at max_response_len is a turn, an observation past the bound is cut
    continue_truncated: bool = False


async def generate_multiturn(engines: EngineSession, mt: MultiTurn, sample: Sample, sp: SamplingParams, *,
                             seed: int | None) -> Sample:
    """One multi-turn rollout of ``sample`` (see the module docstring); the sample is filled in place."""
    prompt_ids = engines.prompt_ids(sample)
    sample.reset_response(prompt_ids)
    traces: list[dict] = []
    md = sample.metadata
    env = None
    try:
        env = await _call(lambda: mt.build_env(sample=sample, args=mt.args), timeout=mt.step_timeout_s)
        await _call(env.reset, timeout=mt.step_timeout_s)
        turn = 0
        if mt.max_context_len is not None and len(prompt_ids) >= mt.max_context_len:
            raise PermanentError(
                f"sample index={sample.index}: its prompt has {len(prompt_ids)} tokens, and the context bound is "
                f"{mt.max_context_len} (rollout.max_context_len, else train.max_seq_len): no room for a response. "
                f"Fix: set rollout.max_prompt_len below {mt.max_context_len} (longer prompts are dropped), or raise "
                "train.max_seq_len")
        while True:
            budget = None if mt.max_context_len is None else mt.max_context_len - len(sample.tokens)
            if budget is not None and budget <= 0:
                sample.status, md["rollout_stop_reason"] = SampleStatus.TRUNCATED, "context"
                break
            new = sp.max_new_tokens if budget is None else min(sp.max_new_tokens or budget, budget)
            turn_sp = dataclasses.replace(sp, max_new_tokens=new,
                                          sampling_seed=None if seed is None else sample_seed(seed, turn))
            gen = await engines.request(list(sample.tokens), turn_sp, who=f"sample index={sample.index} turn {turn + 1}")
            text = engines.response_text(gen)
            sample.append_response(gen.output_ids, text, gen.output_logprobs,
                                   loss_mask_value=0 if sample.remove_sample else 1)
            sample.update_from_meta_info(gen.meta_info)
            turn += 1
            trace = {"turn": turn, "response": text, "output_ids": list(gen.output_ids)}
            traces.append(trace)
            if gen.aborted:
                sample.status, md["rollout_stop_reason"] = SampleStatus.ABORTED, "abort"
                break
            if gen.truncated:
                hit_budget = budget is not None and new == budget
                trace["truncated"] = True
                if hit_budget or not mt.continue_truncated:
                    sample.status = SampleStatus.TRUNCATED
                    md["rollout_stop_reason"] = "context" if hit_budget else "response"
                    break
            out = await _call(env.step, text, timeout=mt.step_timeout_s)
            if not isinstance(out, tuple) or len(out) != 3:
                raise EnvError(f"env.step returned {type(out).__name__}: Relax's form is (obs, done, info)")
            obs, done, info = out
            trace["info"] = info if isinstance(info, dict) else {}
            if done:
                sample.status, md["rollout_stop_reason"] = SampleStatus.COMPLETED, "done"
                break
            if turn >= mt.max_turns:
                sample.status, md["rollout_stop_reason"] = SampleStatus.COMPLETED, "turns"
                break
            room = None if mt.max_context_len is None else mt.max_context_len - len(sample.tokens) - 1
            ids, obs_text, left_out = _observation(engines.tokenizer, obs, env, mt, room)
            if left_out:
                trace["obs_truncated"] = left_out
                if not ids:
                    sample.status, md["rollout_stop_reason"] = SampleStatus.TRUNCATED, "context"
                    break
            trace["obs"] = obs_text
            sample.append_response(ids, obs_text, [0.0] * len(ids), loss_mask_value=0)
    except EnvError as e:
        _env_failed(sample, str(e), engines)
    finally:
        md["rollout_turns"] = len(traces)
        md["rollout_traces"] = traces
        if env is not None and hasattr(env, "close"):
            try:
                await _call(env.close, timeout=mt.step_timeout_s)
            except EnvError as e:  # a close that fails changes nothing of the sample
                log.warning("sample index=%s: %s", sample.index, e)
    return sample


def _env_failed(sample: Sample, why: str, engines: EngineSession) -> None:
    if engines.fail_on_env_error:
        raise RolloutError(f"sample index={sample.index}: the environment failed: {why} "
                           "(rollout.reward_error_policy = fail; 'skip' fails only the sample)")
    log.error("sample index=%s: the environment failed, the sample is FAILED with loss mask 0: %s", sample.index, why)
    sample.metadata["env_error"] = why
    sample.metadata["rollout_stop_reason"] = "env_error"
    if sample.response_length == 0:
        pad = getattr(engines.tokenizer, "eos_token_id", None) or 0
        sample.append_response([int(pad)], "", [0.0], loss_mask_value=0)
    sample.loss_mask = [0] * sample.response_length
    sample.status = SampleStatus.FAILED
    sample.reward = 0.0
