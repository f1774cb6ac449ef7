"""Multi-turn rollouts against an environment written to Relax's ``BaseInteractionEnv`` contract.

``rollout.interaction_env_path`` (or Relax's ``rollout_interaction_env_path`` in the ``custom_config_path`` YAML)
names a module with ``build_env(sample=None, args=None, **_)``. The env it builds has ``reset() -> (obs, info)``,
``step(response_text) -> (obs, done, info)`` or, as Relax's homepage (and gymnasium) has it, ``(obs, reward,
terminated, truncated, info)`` (:func:`step_result`), ``close()`` and optionally ``format_observation(obs)``; sync or
async. Observations are Relax's dicts ``{"obs_str": str, "role": "user", ...}``. A five-value step's reward is kept
with its turn (``rollout_traces[i]["reward"]``) and in ``metadata["step_rewards"]`` (one per such step, in order),
which the reward function reads; it must be a finite number, or the env has failed its sample.

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
bound (``context``), ``max_turns`` (``turns``), the env's ``done`` (or ``terminated``), the env's ``truncated``
(``env_truncated``, TRUNCATED), or an abort. Every stop is recorded in
``metadata["rollout_stop_reason"]``, with ``rollout_turns`` and per-turn ``rollout_traces``. An env that raises,
times out or returns something malformed fails only its sample: status FAILED, loss mask all 0, reward 0, the
reason logged and in ``metadata["env_error"]``; under ``reward_error_policy: fail`` it fails the step instead.

**Images** (a vision-language model): every request carries the sample's images so far as ``image_data`` (the
prompt's, then each observation's, in token order). An observation's images are Relax's
``obs["multi_modal_data"]["image"]`` (one or a list: PIL images, bytes, base64, paths; else the ``image`` values of
``format_observation``'s content parts), read and sized as the data's (``data.image_min/max_token_num``); the
observation's tokens get one ``<|image_pad|>`` run per image (:func:`encode_observation`), and the images join
``multimodal_inputs["images"]``, from which the exchange writes the trainer's ``pixel_values`` and
``image_grid_thw`` (Relax merges ``image_data`` and ``multimodal_train_inputs`` per turn the same way). A bad image
is an env error of its sample. An observation with images is never cut: one that does not fit ends the rollout
(``context``), whatever ``rollout.turn_truncation`` says. A model turn with a vision token id (``<|vision_start|>``,
``<|image_pad|>``, ``<|video_pad|>``) ends the rollout there (``vision_token``, TRUNCATED): a later request would
carry an image pad without its image, and the trainer takes every vision token before the sample's last image for
an image.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import math
import numbers
import sys
from typing import TYPE_CHECKING, Any, Callable, Protocol

from relax_hpc.errors import PermanentError
from relax_hpc.multimodal import IMAGE_PAD, IMAGE_PLACEHOLDER, TEXT_IMAGE_MARKER, VISION_TOKENS
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

    async def request(self, ids: list[int], sp: SamplingParams, *, who: str,
                      image_data: list | None = None) -> Generation: ...  # image_data only when there are images

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


def encode_observation(tokenizer: Any, obs: dict, env: Any, chat: bool,
                       images: list | None = None) -> tuple[list[int], str]:
    """An observation's tokens as a continuation of the conversation: with a chat template, the dummy-prefix trick
    (render DUMMY + [message] with the generation prompt, keep what comes after DUMMY, drop a leading BOS), so the
    turn boundary is the template's; without one, the text's own tokens.

    ``images`` (PIL, read and sized by :func:`observation_images`): the message's image content parts (or, without
    a chat template, Relax's ``<image>`` markers in ``obs_str``; none: the images go first) become the model's
    placeholders, each expanded to one ``<|image_pad|>`` per image token (:func:`relax_hpc.multimodal.encode_ids`)."""
    message = env.format_observation(obs) if hasattr(env, "format_observation") else \
        {"role": obs.get("role", "user"), "content": obs["obs_str"]}
    text = obs["obs_str"]
    if not chat:
        if images:
            text = text.replace(TEXT_IMAGE_MARKER, IMAGE_PLACEHOLDER) if TEXT_IMAGE_MARKER in text else \
                IMAGE_PLACEHOLDER * len(images) + text
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    else:
        if images:
            message = _with_image_parts(message, len(images))
        base = tokenizer.apply_chat_template(_DUMMY, tokenize=True)
        full = tokenizer.apply_chat_template(_DUMMY + [message], tokenize=True, add_generation_prompt=True)
        ids = list(full[len(base):])
        if ids and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id:
            ids = ids[1:]
    if images:
        from relax_hpc.multimodal import encode_ids

        ids = encode_ids(str(tokenizer.name_or_path), ids, images)["input_ids"][0].tolist()
    return ids, (tokenizer.decode(ids) if chat else text)


def _with_image_parts(message: dict, n: int) -> dict:
    """``message`` with an image content part per image: as it is when it has them (Relax's ``format_observation``
    form), Relax's ``<image>`` markers in string content made parts, else ``n`` image parts before the text."""
    content = message.get("content")
    if isinstance(content, list):
        if any(isinstance(c, dict) and (c.get("type") == "image" or "image" in c) for c in content):
            return message
        return {**message, "content": [{"type": "image"}] * n + list(content)}
    text = content if isinstance(content, str) else ""
    if TEXT_IMAGE_MARKER in text:
        from relax_hpc.rollout.data import image_parts

        return image_parts({**message, "content": text})
    return {**message, "content": [{"type": "image"}] * n + ([{"type": "text", "text": text}] if text else [])}


def observation_images(obs: dict, env: Any, tokenizer: Any, image_tokens: tuple, media: Any = None,
                       max_image_pixels: int | None = None) -> list:
    """The observation's images as PIL RGB, sized as the data's (``data.image_min/max_token_num``): Relax's
    ``obs["multi_modal_data"]["image"]`` (one or a list), else the ``image`` values of ``format_observation``'s
    content parts. PIL images, bytes, base64 and paths (:func:`relax_hpc.multimodal.load_image`). An image that
    cannot be used, or images for a model without vision, is an :class:`EnvError`."""
    mm = obs.get("multi_modal_data") or {}
    if not isinstance(mm, dict):
        raise EnvError(f"the observation's multi_modal_data is {type(mm).__name__}: Relax's form is "
                       "{'image': [images]}")
    refs = mm.get("image")
    vision = tokenizer is not None and _vision_ids(tokenizer) is not None
    if refs is None and vision and hasattr(env, "format_observation"):  # a text model's observations: text only
        content = env.format_observation(obs).get("content")
        refs = [c["image"] for c in content if isinstance(c, dict) and c.get("image") is not None] \
            if isinstance(content, list) else None
    if refs is None or (isinstance(refs, list) and not refs):
        return []
    refs = refs if isinstance(refs, (list, tuple)) else [refs]
    if not vision:
        raise EnvError(f"the observation has {len(refs)} image(s), but the model has no vision ({IMAGE_PAD} is not "
                       "in its tokenizer): serve a Qwen2.5-VL or Qwen3-VL model.path")
    from relax_hpc.multimodal import ImageError, load_image, pixel_budgets, resize_to_tokens

    model_dir, out = str(tokenizer.name_or_path), []
    per_image = pixel_budgets(model_dir, max_image_pixels, None)[0] if media is not None else None
    for n, ref in enumerate(refs):
        try:
            img = ref.convert("RGB") if hasattr(ref, "convert") and hasattr(ref, "size") else \
                load_image(ref, media, per_image, "data.max_image_pixels" if per_image is not None else None)
            out.append(resize_to_tokens(img, model_dir, *image_tokens))
        except ImageError as e:
            raise EnvError(f"the observation's image {n} cannot be used: {e}") from None
    return out


@functools.lru_cache(maxsize=8)
def _vision_ids(tokenizer: Any) -> frozenset[int] | None:
    """The tokenizer's ids of :data:`~relax_hpc.multimodal.VISION_TOKENS`, None when it has no ``<|image_pad|>``
    (a text model)."""
    ids = set()
    for t in VISION_TOKENS:
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tokenizer.unk_token_id and tokenizer.convert_ids_to_tokens(i) == t:
            ids.add(i)
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    return frozenset(ids) if isinstance(pad, int) and pad in ids else None


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


def _observation(tokenizer: Any, obs: Any, env: Any, mt: MultiTurn,
                 room: int | None) -> tuple[list[int], str, int, list]:
    """(tokens, text, tokens left out, images) of the env's observation within ``room`` tokens (None: no bound), the
    room one more answer token leaves: whole if it fits; else cut (``mt.continue_truncated``, text only: an image is
    never cut) or nothing (the rollout ends). An error of the env's ``format_observation`` or a bad image is an
    :class:`EnvError`, as its other calls."""
    try:
        obs = _check_obs(obs, "env.step")
        images = observation_images(obs, env, tokenizer, mt.image_tokens, mt.media, mt.max_image_pixels)
        ids, text = encode_observation(tokenizer, obs, env, mt.chat, images)
        if room is None or len(ids) <= room:
            return ids, text, 0, images
        cut = fit_observation(tokenizer, obs, env, mt.chat, room) if mt.continue_truncated and not images else None
    except EnvError:
        raise
    except Exception as e:  # format_observation is the env's code too; ImageError: its images and placeholders
        raise EnvError(f"the observation could not be encoded: {type(e).__name__}: {e}") from e
    return (cut[0], cut[1], len(ids) - len(cut[0]), []) if cut else ([], "", len(ids), [])


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
    # data.image_min/max_token_num: an observation's images are sized as the data's
    image_tokens: tuple[int | None, int | None] = (None, None)
    # where an observation's image paths may lie and how big an image may be: the data's (an env may pass a row's
    # paths on, and a row is untrusted input); None: the data file's rules do not apply (tests building a MultiTurn)
    media: Any = None
    max_image_pixels: int | None = None


async def generate_multiturn(engines: EngineSession, mt: MultiTurn, sample: Sample, sp: SamplingParams, *,
                             seed: int | None) -> Sample:
    """One multi-turn rollout of ``sample`` (see the module docstring); the sample is filled in place."""
    prompt_ids = engines.prompt_ids(sample)
    sample.reset_response(prompt_ids)
    traces: list[dict] = []
    step_rewards: list[float] = []  # the five-value step's, in turn order (a sample generated again starts afresh)
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
            images = (sample.multimodal_inputs or {}).get("images") or None
            who = f"sample index={sample.index} turn {turn + 1}"
            gen = await engines.request(list(sample.tokens), turn_sp, who=who,
                                        **({"image_data": list(images)} if images else {}))
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
            obs, reward, done, env_truncated, info = step_result(out, env)
            trace["info"] = info if isinstance(info, dict) else {}
            if reward is not None:  # the five-value form: the turn's reward, for the reward function
                trace["reward"] = reward
                step_rewards.append(reward)
            if done:
                sample.status, md["rollout_stop_reason"] = SampleStatus.COMPLETED, "done"
                break
            if env_truncated:  # gymnasium's truncated: the env cut the episode short (a time limit of its own)
                sample.status, md["rollout_stop_reason"] = SampleStatus.TRUNCATED, "env_truncated"
                break
            if turn >= mt.max_turns:
                sample.status, md["rollout_stop_reason"] = SampleStatus.COMPLETED, "turns"
                break
            vision = _vision_ids(engines.tokenizer) if engines.tokenizer is not None else None
            if vision and not vision.isdisjoint(gen.output_ids):  # a next request would hold a pad without image
                trace["vision_token"] = True
                sample.status, md["rollout_stop_reason"] = SampleStatus.TRUNCATED, "vision_token"
                break
            room = None if mt.max_context_len is None else mt.max_context_len - len(sample.tokens) - 1
            ids, obs_text, left_out, obs_images = _observation(engines.tokenizer, obs, env, mt, room)
            if left_out:
                trace["obs_truncated"] = left_out
                if not ids:
                    sample.status, md["rollout_stop_reason"] = SampleStatus.TRUNCATED, "context"
                    break
            trace["obs"] = obs_text
            if obs_images:  # a new dict and list: the samples of a group share their prompt's
                from relax_hpc.multimodal import png_base64

                mm = sample.multimodal_inputs or {}
                sample.multimodal_inputs = {**mm, "images": [*(mm.get("images") or []),
                                                             *(png_base64(im) for im in obs_images)]}
                trace["obs_images"] = len(obs_images)
            sample.append_response(ids, obs_text, [0.0] * len(ids), loss_mask_value=0)
    except EnvError as e:
        _env_failed(sample, str(e), engines)
    finally:
        md["rollout_turns"] = len(traces)
        md["rollout_traces"] = traces
        if step_rewards:
            md["step_rewards"] = step_rewards
        else:
            md.pop("step_rewards", None)
        if env is not None and hasattr(env, "close"):
            try:
                await _call(env.close, timeout=mt.step_timeout_s)
            except EnvError as e:  # a close that fails changes nothing of the sample
                log.warning("sample index=%s: %s", sample.index, e)
    return sample


def env_name(env: Any) -> str:
    """The env as an error names it: its class and the file it was loaded from."""
    cls = type(env)
    where = getattr(sys.modules.get(cls.__module__), "__file__", None) or cls.__module__
    return f"{cls.__qualname__} ({where})"


def step_result(out: Any, env: Any) -> tuple[Any, float | None, bool, bool, Any]:
    """``env.step``'s answer as (obs, reward, terminated, truncated, info): Relax's three values ``(obs, done,
    info)`` (reward None, truncated False) or the five of its homepage and gymnasium, ``(obs, reward, terminated,
    truncated, info)``. Anything else, or a reward that is not a finite real number, is an :class:`EnvError`
    naming the env: the reward goes to the reward function and from it into training, where every number is
    checked."""
    if not isinstance(out, tuple) or len(out) not in (3, 5):
        got = f"a tuple of {len(out)} values" if isinstance(out, tuple) else type(out).__name__
        raise EnvError(f"env.step of {env_name(env)} returned {got}: Relax's forms are 3 values (obs, done, info) "
                       "or 5 values (obs, reward, terminated, truncated, info)")
    if len(out) == 3:
        obs, done, info = out
        return obs, None, bool(done), False, info
    obs, reward, terminated, truncated, info = out
    return obs, _step_reward(reward, env), bool(terminated), bool(truncated), info


def _step_reward(value: Any, env: Any) -> float:
    """A per-step reward as a float: a real number (numpy / torch 0-d values too), not bool or str, finite and
    within float32 (the exchange's reward column)."""
    v = value.item() if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)) else value
    if isinstance(v, (bool, str, bytes)) or not isinstance(v, numbers.Real):
        raise EnvError(f"env.step of {env_name(env)} returned the reward {v!r} ({type(value).__name__}): the "
                       "five-value form's reward must be a finite number (int or float)")
    try:
        f = float(v)
    except OverflowError:  # an int past float64
        f = math.inf
    if not math.isfinite(f) or abs(f) > _FLOAT32_MAX:
        raise EnvError(f"env.step of {env_name(env)} returned the reward {v!r}: not a finite number (float32); "
                       "a per-step reward goes into training, fix the env")
    return f


_FLOAT32_MAX = 3.4028234663852886e38


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
