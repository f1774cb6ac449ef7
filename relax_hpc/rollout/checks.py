"""The checks of the recipe's ``rollout:``, ``data:``, ``genrm:`` sections and of the roles that serve them (the
judge, the OPD teacher, the elastic engines), beside :mod:`relax_hpc.rollout.config`, which defines those sections.

:func:`relax_hpc.recipe.validate.check` calls them in its order. The recipe arrives typed ``Any``: rollout/ imports
nothing of :mod:`relax_hpc.recipe` (the recipe imports this module). Only config-level modules are imported, all at
module level: the sections and the reward names (:mod:`relax_hpc.rollout.config`), the key-file rules
(:mod:`relax_hpc.engines.keys`), the plugin spec grammar (:mod:`relax_hpc.plugins`) and the media bounds
(:mod:`relax_hpc.media_bounds`); none loads rollout's runtime (the data reader, the rewards, the driver), so loading
a recipe on a login node does not either (tests/recipe/test_layering.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import fields
from typing import Any

from relax_hpc.engines.keys import KeyFileError, check_url, read_key_file
from relax_hpc.media_bounds import MAX_AUDIO_SECONDS, MAX_IMAGE_PIXELS, MAX_VIDEO_FRAMES
from relax_hpc.plugins import FORMS, PluginError, parse_spec
from relax_hpc.rollout.config import AWAITED_REWARDS, BUILTIN_REWARD_NAMES

Problem = tuple[str, object, str]


def check_data(data_cfg: Any, rollout_cfg: Any) -> list[Problem]:
    """Meaning checks of the ``data``/``rollout`` sections (:class:`~relax_hpc.rollout.config.DataConfig`,
    :class:`~relax_hpc.rollout.config.RolloutConfig`): no file access, so the recipe validator runs them on a login
    node; keys carry their section."""
    out: list[Problem] = []

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
            chat_template_kwargs(kwargs)
        except ValueError as e:
            out.append(("data.apply_chat_template_kwargs", kwargs, str(e).split(": ", 1)[-1]))
    if data_cfg.seed is not None:
        need(data_cfg.seed >= 0, "data.seed", data_cfg.seed, "must be 0 or more, or null for run.seed")
    out += _check_media(data_cfg)
    return out


MODALITIES = ("image", "audio", "video")  # data.multimodal_keys' keys read
RELAX_MODALITIES = ("image", "video", "audio")


def _check_media(d: Any) -> list[Problem]:
    """``data.multimodal_keys`` and the image token bounds: known modalities, a column name each, sane bounds."""
    out: list[Problem] = []
    mk = d.multimodal_keys
    if isinstance(mk, str):  # Relax passes it as JSON text
        out.append(("data.multimodal_keys", mk, "must be a mapping, not text. Fix: multimodal_keys: {image: images} "
                                                "(modality: the record field)"))
        mk = {}
    for k, col in (mk or {}).items():
        if k not in MODALITIES:
            why = "is not read yet (only images, videos and audio are)" if k in RELAX_MODALITIES else \
                f"is not a modality (Relax's are {', '.join(RELAX_MODALITIES)})"
            out.append((f"data.multimodal_keys.{k}", col, f"{k!r} {why}. Fix: remove it; image: COLUMN and audio: "
                                                         "COLUMN are supported"))
        elif not isinstance(col, str) or not col.strip():
            out.append((f"data.multimodal_keys.{k}", col, f"must name the record field that holds the {k}s. "
                                                         f"Fix: e.g. {k}: {k}s"))
    if isinstance(mk, dict) and mk.get("image") and mk.get("audio"):
        out.append(("data.multimodal_keys", mk, "images and audio in one prompt are not wired yet (an omni prompt "
                                                "with both needs 3-D positions in the actor). Fix: one of them"))
    if isinstance(mk, dict) and mk.get("video") and (mk.get("image") or mk.get("audio")):
        # Qwen2.5-Omni's thinker takes both (transformers' get_rope_index, use_audio_in_video); relax_hpc's does not
        omni = "; the omni actor (relax_hpc.train.omni) runs the thinker's language model with 1-D positions and no " \
            "vision tower, and video with audio needs its 3-D M-RoPE positions" if mk.get("audio") else ""
        out.append(("data.multimodal_keys", mk, "videos beside images or audio in one recipe are not wired yet (a "
                                                f"row reads one modality{omni}). Fix: video alone (a Qwen2.5-VL "
                                                "model.path) or audio alone (an omni thinker)"))
    out += _check_video(d, mk if isinstance(mk, dict) else {})
    secs = d.max_audio_seconds
    if secs is not None:
        if not isinstance(secs, (int, float)) or not 0 < secs <= MAX_AUDIO_SECONDS:
            out.append(("data.max_audio_seconds", secs, f"must be more than 0 and at most {MAX_AUDIO_SECONDS:g} "
                                                        "seconds (the most relax_hpc reads of a clip), or null"))
        elif not (mk if isinstance(mk, dict) else {}).get("audio"):
            out.append(("data.max_audio_seconds", secs, "bounds audio clips, but data.multimodal_keys has no audio "
                                                        "column. Fix: set data.multimodal_keys: {audio: COLUMN}, or "
                                                        "null this"))
    lo, hi = d.image_min_token_num, d.image_max_token_num
    for key, v in (("data.image_min_token_num", lo), ("data.image_max_token_num", hi)):
        if v is not None and v < 1:
            out.append((key, v, "must be at least 1 image token, or null for the model processor's bound"))
    if lo is not None and hi is not None and 1 <= hi < lo:
        out.append(("data.image_max_token_num", hi, f"is below data.image_min_token_num = {lo}. Fix: max >= min"))
    per_image, per_prompt = d.max_image_pixels, d.max_prompt_pixels
    if per_image is not None and not 1 <= per_image <= MAX_IMAGE_PIXELS:
        out.append(("data.max_image_pixels", per_image, f"must be 1 to {MAX_IMAGE_PIXELS} pixels (the most relax_hpc "
                                                        "decodes), or null for the model processor's max_pixels"))
    if per_prompt is not None and per_prompt < 1:
        out.append(("data.max_prompt_pixels", per_prompt, "must be at least 1 pixel, or null for 4 × "
                                                          "data.max_image_pixels"))
    roots = d.media_roots
    if not isinstance(roots, list) or not all(isinstance(x, str) and x.strip() and "\0" not in x for x in roots):
        out.append(("data.media_roots", roots, "must be a list of directories. Fix: e.g. [/datasets/images]"))
    media = isinstance(mk, dict) and bool(mk.get("image") or mk.get("audio") or mk.get("video"))
    if not (mk or {}).get("image"):  # they act on the files and pixels of a row's images: without images, nothing
        for key, v, default in (("data.media_roots", roots, []), ("data.allow_media_urls", d.allow_media_urls, False),
                                ("data.max_image_pixels", per_image if not (mk or {}).get("video") else None, None),
                                ("data.max_prompt_pixels", per_prompt if not (mk or {}).get("video") else None,
                                 None)):  # a video's frames are bounded by them too
            if v != default and not (media and key in ("data.media_roots", "data.allow_media_urls")):  # audio's too
                out.append((key, v, "acts on a row's images, but data.multimodal_keys has no image column. Fix: set "
                                    "data.multimodal_keys: {image: COLUMN}, or remove this key"))
    if (lo is not None or hi is not None) and not (mk or {}).get("image"):
        key = "data.image_min_token_num" if lo is not None else "data.image_max_token_num"
        out.append((key, lo if lo is not None else hi, "bounds images, but data.multimodal_keys has no image column. "
                                                      "Fix: set data.multimodal_keys: {image: COLUMN}, or null this"))
    return out


def _check_video(d: Any, mk: dict) -> list[Problem]:
    """``data.video_fps`` and ``data.video_max_frames``: positive, bounded, and only with a video column."""
    out: list[Problem] = []
    fps, most = d.video_fps, d.video_max_frames
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 1000:
        out.append(("data.video_fps", fps, "must be the rate of a row's video frames, more than 0 and at most 1000 "
                                           "frames a second (default 2.0: Qwen's)"))
    if most is not None and (isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= MAX_VIDEO_FRAMES):
        out.append(("data.video_max_frames", most, f"must be 1 to {MAX_VIDEO_FRAMES} frames a video, or null for "
                                                   f"all (up to {MAX_VIDEO_FRAMES})"))
    if not mk.get("video"):
        for key, v, default in (("data.video_fps", fps, 2.0), ("data.video_max_frames", most, None)):
            if v != default:
                out.append((key, v, "samples a row's video frames, but data.multimodal_keys has no video column. "
                                    "Fix: set data.multimodal_keys: {video: COLUMN}, or remove this key"))
    return out


def chat_template_kwargs(value: str | dict | None) -> dict[str, Any]:
    """``data.apply_chat_template_kwargs``: a JSON object string, as Relax's flag takes it (or a dict). ValueError
    names the key, the value and the fix (the data reader raises it as its DataError)."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"data.apply_chat_template_kwargs is not JSON ({e.msg}): {value!r}. "
                         "Fix: e.g. '{\"enable_thinking\": false}'") from None
    if not isinstance(out, dict):
        raise ValueError(f"data.apply_chat_template_kwargs must be a JSON object, got {value!r}")
    return out


_HTTP_URL = re.compile(r"https?://[^\s/?#]+[^\s]*")


def known_rm_type(name: str) -> bool:
    """Whether ``relax_hpc.rollout.rewards.builtin_reward`` scores ``name``: a built-in, or ``boxed_<built-in>``."""
    while name.startswith("boxed_"):
        name = name[len("boxed_"):]
    return name in BUILTIN_REWARD_NAMES


def check_rm_type(r: Any) -> list[Problem]:
    """An unknown built-in reward failed only at the first reward call (step 1, after the engines started).
    With ``custom_rm_path`` set, rm_type is only passed to that function, which may use names of its own."""
    rm, url = r.rollout.rm_type, r.rollout.rm_url
    out: list[Problem] = []
    if url is not None and not _HTTP_URL.fullmatch(url):
        out.append(("rollout.rm_url", url, "is not an http(s) URL. Fix: the reward server's address, e.g. "
                    "'http://rm-host:8000/score'"))
    if rm is None or r.rollout.custom_rm_path is not None:
        return out
    if rm == "remote_rm":
        if url is None:
            out.append(("rollout.rm_url", url, "is required with rollout.rm_type remote_rm (Relax --rm-url): each "
                        "sample is POSTed there as {prompt, response, label}. Fix: set rollout.rm_url to the reward "
                        "server's http(s) URL"))
        return out
    boxed_awaited = rm.startswith("boxed_") and rm.split("boxed_")[-1] in AWAITED_REWARDS
    if known_rm_type(rm) and not boxed_awaited:
        return out
    known = ", ".join(BUILTIN_REWARD_NAMES)
    what = (f"is refused: {rm.split('boxed_')[-1]} reads the whole response itself, so it has no boxed_ form"
            if boxed_awaited and known_rm_type(rm) else
            "is not a built-in reward of relax_hpc (Relax's ifbench, openr1mm, geo3k and mopd are not built in)")
    return out + [("rollout.rm_type", rm, f"{what}. Fix: use one of {known}, or boxed_<one of them> (e.g. "
                   "boxed_math), or write your reward function and set rollout.custom_rm_path")]


def check_dynamic_sampling(ro: Any, mode: str) -> list[Problem]:
    """Over-sampling without a filter or partial rollout would draw more groups and keep the first ones, and
    partial rollout without over-sampling never aborts anything: knobs that do nothing are refused."""
    out: list[Problem] = []
    osb = ro.over_sampling_batch_size
    if ro.partial_rollout and mode != "fully_async":
        out.append(("rollout.partial_rollout", True, "needs mode: fully_async: which groups finish first depends "
                    "on timing, and colocate mode promises steps that come out the same on a resume. Fix: set "
                    "mode: fully_async, or remove this key"))
    elif ro.partial_rollout and (osb is None or osb <= ro.rollout_batch_size):
        out.append(("rollout.partial_rollout", True, f"needs rollout.over_sampling_batch_size above "
                    f"rollout.rollout_batch_size = {ro.rollout_batch_size}: the groups beyond it are the ones "
                    f"aborted at the step's end. Fix: e.g. over_sampling_batch_size: {2 * ro.rollout_batch_size}"))
    if not ro.partial_rollout:
        for key in ("partial_rollout_max_aborted_count", "mask_offpolicy_in_partial_rollout"):
            if getattr(ro, key) not in (None, False):
                out.append((f"rollout.{key}", getattr(ro, key), "only acts with rollout.partial_rollout: true. "
                            "Fix: set that too, or remove this key"))
    if ro.max_turns is not None and ro.max_turns < 1:
        out.append(("rollout.max_turns", ro.max_turns, "must be at least 1 model turn. Fix: e.g. 2"))
    if ro.max_context_len is not None and ro.max_context_len < 2:
        out.append(("rollout.max_context_len", ro.max_context_len, "must be at least 2 tokens or null. Fix: e.g. 4096"))
    if ro.env_step_timeout_s <= 0:
        out.append(("rollout.env_step_timeout_s", ro.env_step_timeout_s, "must be positive. Fix: e.g. 60"))
    if ro.partial_rollout and ro.interaction_env_path:
        out.append(("rollout.partial_rollout", True, "does not work with rollout.interaction_env_path yet (a "
                    "multi-turn rollout is not aborted and continued). Fix: use one of the two"))
    if ro.partial_rollout and ro.custom_generate_function_path:
        out.append(("rollout.partial_rollout", True, "does not work with rollout.custom_generate_function_path yet "
                    "(a custom function cannot be aborted and continued). Fix: use one of the two"))
    if ro.partial_rollout_max_aborted_count is not None and ro.partial_rollout_max_aborted_count < 1:
        out.append(("rollout.partial_rollout_max_aborted_count", ro.partial_rollout_max_aborted_count,
                    "must be at least 1 or null (no limit). Fix: e.g. 3"))
    if osb is not None and ro.dynamic_sampling_filter_path is None and not ro.partial_rollout:
        out.append(("rollout.over_sampling_batch_size", osb, "only acts with rollout.dynamic_sampling_filter_path "
                    "or rollout.partial_rollout (it is the number of groups drawn per round). Fix: set the filter, "
                    "e.g. relax_hpc.rollout.dynamic.check_reward_nonzero_std, or remove this key"))
    elif osb is not None and osb < ro.rollout_batch_size:
        out.append(("rollout.over_sampling_batch_size", osb, f"must be at least rollout.rollout_batch_size = "
                    f"{ro.rollout_batch_size} (groups drawn per round; Relax's rule). Fix: e.g. "
                    f"{2 * ro.rollout_batch_size}, or null for rollout_batch_size"))
    if ro.dynamic_sampling_max_rounds < 0:
        out.append(("rollout.dynamic_sampling_max_rounds", ro.dynamic_sampling_max_rounds,
                    "must be 0 (no limit) or more. Fix: e.g. 8"))
    return out


def check_streaming(recipe: Any) -> list[Problem]:
    """``rollout.stream_groups``: chunks of whole groups written as they are done. Refused where a step's groups are
    only known, or changed, once the whole step is done."""
    ro, n = recipe.rollout, recipe.rollout.stream_groups
    if n < 0:
        return [("rollout.stream_groups", n, "must be 0 (one chunk per step) or more. Fix: e.g. 4")]
    if not n:
        return []
    out: list[Problem] = []
    why = {"dynamic_sampling_filter_path": "the filter keeps or drops groups round by round, so which groups the step "
                                           "holds is known only at its end",
           "partial_rollout": "which groups the step trains is decided when it has enough and the rest are aborted "
                              "(streaming those is not built yet)",
           "sample_filter_path": "the filter is called once on the whole step's groups and may change any sample"}
    for key, reason in why.items():
        if getattr(ro, key):
            out.append((f"rollout.{key}", getattr(ro, key), f"does not work with rollout.stream_groups = {n}: {reason}. "
                        "Fix: set rollout.stream_groups: 0, or remove this key"))
    if recipe.opd is not None and recipe.opd.enabled:
        out.append(("rollout.stream_groups", n, "does not work with opd: the teacher scores the step's samples after "
                    "the whole step is generated. Fix: rollout.stream_groups: 0"))
    if recipe.train.routing_replay:
        out.append(("rollout.stream_groups", n, "does not work with train.routing_replay yet (the experts' width is "
                    "settled over the whole step). Fix: rollout.stream_groups: 0"))
    return out


def check_context_bound(r: Any) -> list[Problem]:
    """A multi-turn sample grows up to the context bound; one longer than ``train.max_seq_len`` failed the run at
    its first training step ("a sample has 25 tokens, more than train.max_seq_len = 16")."""
    ro, cap = r.rollout, r.train.max_seq_len
    if ro.max_context_len is None or ro.max_context_len <= cap:
        return []
    return [("rollout.max_context_len", ro.max_context_len, f"is more than train.max_seq_len = {cap}, the longest "
             "sample the trainer accepts (a multi-turn sample, prompt and every turn, grows up to "
             f"rollout.max_context_len tokens). Fix: at most {cap}, or null (the bound is then train.max_seq_len), "
             "or raise train.max_seq_len")]


def check_lengths(r: Any, multiturn: bool) -> list[Problem]:
    """Samples longer than the trainer accepts (``train.max_seq_len``), and multi-turn keys without an environment,
    found before the queue. ``multiturn``: whether a multi-turn environment is named (with only a
    ``custom_config_path``, its YAML says: :func:`relax_hpc.launch.files.check_files` calls this then). A custom generate function makes
    its samples itself: only the trainer's own check applies to them."""
    ro, cap = r.rollout, r.train.max_seq_len
    out: list[Problem] = []
    if not multiturn:
        for key in ("max_turns", "max_context_len"):
            if getattr(ro, key) is not None:
                out.append((f"rollout.{key}", getattr(ro, key), "only acts with a multi-turn environment "
                            "(rollout.interaction_env_path, or rollout_interaction_env_path in the custom_config_path "
                            "YAML). Fix: set one, or remove this key"))
    if ro.custom_generate_function_path is not None:
        return out
    bound = min(ro.max_context_len or cap, cap)
    if multiturn and ro.max_prompt_len is not None and ro.max_prompt_len >= bound:
        out.append(("rollout.max_prompt_len", ro.max_prompt_len, f"leaves no room for a response in the multi-turn "
                    f"context bound of {bound} tokens (rollout.max_context_len, else train.max_seq_len = {cap}). "
                    f"Fix: below {bound}, or raise the bound"))
    elif not multiturn and ro.max_prompt_len is not None and ro.max_prompt_len + ro.max_response_len > cap:
        out.append(("rollout.max_response_len", ro.max_response_len, f"rollout.max_prompt_len + "
                    f"rollout.max_response_len = {ro.max_prompt_len} + {ro.max_response_len} = "
                    f"{ro.max_prompt_len + ro.max_response_len} tokens, more than train.max_seq_len = {cap}, the "
                    f"longest sample the trainer accepts. Fix: lower either so that their sum is at most {cap}, or "
                    "raise train.max_seq_len"))
    elif not multiturn and ro.max_response_len >= cap:
        out.append(("rollout.max_response_len", ro.max_response_len, f"leaves no room for a prompt in "
                    f"train.max_seq_len = {cap}, the longest sample (prompt + response) the trainer accepts. Fix: "
                    f"below {cap} by the longest prompt (and set rollout.max_prompt_len, which drops longer "
                    "prompts), or raise train.max_seq_len"))
    return out


def check_genrm(r: Any) -> list[Problem]:
    """A judge role without a model, or a model without judge engines, would validate and do nothing."""
    g, on = r.genrm, r.roles.genrm.enabled
    out: list[Problem] = []
    if on and g.model_path is None:
        out.append(("genrm.model_path", None, "is required with roles.genrm.enabled: true (Relax --genrm-model-path). "
                    "Fix: the judge model's directory, or disable roles.genrm"))
    if g.model_path is not None and not on:
        out.append(("roles.genrm.enabled", False, f"genrm.model_path is set ({g.model_path!r}) but no judge engines "
                    "would run. Fix: set roles.genrm.enabled: true (and its nodes), or remove genrm.model_path"))
    if r.rollout.rm_type == "dapo-genrm" and r.rollout.custom_rm_path is None and not on:
        out.append(("rollout.rm_type", "dapo-genrm", "asks a GenRM judge, and the recipe has none. Fix: set "
                    "genrm.model_path and roles.genrm.enabled: true"))
    if r.roles.genrm.share_with is not None:
        out.append(("roles.genrm.share_with", r.roles.genrm.share_with, "the judge engines need nodes of their own "
                    "here. Fix: remove it and give roles.genrm its own nodes"))
    for key, val in (("request_timeout_s", g.request_timeout_s), ("sampling.max_response_len", g.sampling.max_response_len),
                     ("sampling.top_p", g.sampling.top_p)):
        if val <= 0:
            out.append((f"genrm.{key}", val, "must be more than 0"))
    if g.retries < 1:
        out.append(("genrm.retries", g.retries, "must be at least 1 (the number of attempts of one judge call)"))
    if g.sampling.temperature < 0:
        out.append(("genrm.sampling.temperature", g.sampling.temperature, "must be 0 or more"))
    return out


def check_teacher(r: Any) -> list[Problem]:
    """OPD's teacher is the run's own engines (``roles.teacher``, serving ``opd.teacher_model_path``) or a server at
    ``opd.teacher_url``, exactly one; teacher engines without OPD, or a model without them, would do nothing."""
    on, opd = r.roles.teacher.enabled, r.opd if r.opd is not None and r.opd.enabled else None
    out: list[Problem] = []
    if r.roles.teacher.share_with is not None:
        out.append(("roles.teacher.share_with", r.roles.teacher.share_with, "the teacher engines need nodes of their "
                    "own here. Fix: remove it and give roles.teacher its own nodes"))
    if opd is None:
        if on:
            out.append(("roles.teacher.enabled", True, "the teacher engines serve on-policy distillation, and the "
                        "recipe has no opd section that is on. Fix: add opd: {teacher_model_path: <the teacher's "
                        "directory>} (docs/distillation.md), or disable roles.teacher"))
        return out
    if not on and opd.teacher_url is None:
        out.append(("opd.teacher_url", None, "is required when the run has no teacher engines of its own: the "
                    "teacher scores the student's tokens there (Relax --opd-teacher-url). Fix: the teacher SGLang "
                    "server's /generate endpoint, e.g. 'http://teacher-host:30000/generate', or roles.teacher.enabled: "
                    "true with opd.teacher_model_path"))
    if on and opd.teacher_url is not None:
        out.append(("opd.teacher_url", opd.teacher_url, "names a teacher server, and roles.teacher starts the run's "
                    "own teacher engines: the run would ask only one. Fix: remove opd.teacher_url, or disable "
                    "roles.teacher (and remove opd.teacher_model_path)"))
    if on and opd.teacher_model_path is None:
        out.append(("opd.teacher_model_path", None, "is required with roles.teacher.enabled: true (Relax "
                    "--teacher-hf-checkpoint). Fix: the teacher model's directory (it must use the student's "
                    "tokenizer), or disable roles.teacher and set opd.teacher_url"))
    if not on and opd.teacher_model_path is not None:
        out.append(("roles.teacher.enabled", False, f"opd.teacher_model_path is set ({opd.teacher_model_path!r}) but "
                    "no teacher engines would run. Fix: set roles.teacher.enabled: true (and its nodes), or remove "
                    "opd.teacher_model_path"))
    if opd.token_selection != "student_sampled":  # until the exchange carries both models' top-k to the trainer
        out.append(("opd.token_selection", opd.token_selection, "needs the top-k log-probs of the teacher and of the "
                    "student in the training step; the exchange carries the teacher's log-prob of each sampled token "
                    "only (teacher_log_probs). Fix: token_selection: student_sampled, with kl_type reverse_kl or "
                    "low_var_kl and log_prob_top_k 0"))
    return out


def check_external(r: Any) -> list[Problem]:
    """rollout.external_engines: each a URL and an absolute key file of mode 0600 (read where the controller runs)."""
    out: list[Problem] = []
    seen: set[str] = set()
    for i, x in enumerate(r.rollout.external_engines):
        key = f"rollout.external_engines[{i}]"
        if set(x) != {"url", "key_file"}:
            out.append((key, x, "must be {url: http://HOST:PORT, key_file: /absolute/path} and nothing else (the key "
                        "itself never goes in a recipe)"))
            continue
        try:
            url = check_url(x["url"])
            if url in seen:
                out.append((f"{key}.url", x["url"], "is listed twice. Fix: list each engine once"))
            seen.add(url)
        except ValueError as e:
            out.append((f"{key}.url", x["url"], f"{e}. Fix: the address of a running engine"))
        if not os.path.isabs(os.path.expanduser(x["key_file"])):
            out.append((f"{key}.key_file", x["key_file"], "must be an absolute path (the controller reads it from its "
                        "own directory). Fix: the full path of the file holding the engine's API key"))
            continue
        try:
            read_key_file(x["key_file"], f"{key}.key_file")
        except KeyFileError as e:
            out.append((f"{key}.key_file", x["key_file"], str(e)))
    return out


def check_elastic(r: Any) -> list[Problem]:
    """Scale-out's knobs (docs/elastic.md): spare rollout nodes, drain and join bounds, the attach defaults."""
    out: list[Problem] = []
    for name in (f.name for f in fields(r.roles)):  # the role names, in order (recipe.schema.ROLE_NAMES)
        if name != "rollout" and r.role(name).elastic is not None:
            out.append((f"roles.{name}.elastic", "{...}", "only rollout scales (its engines). Fix: remove it"))
    g, el = r.roles.rollout, r.roles.rollout.elastic
    if el is not None:
        if el.max is not None:  # it would only repeat nodes; accepted and ignored, it looked like a scale-out bound
            out.append(("roles.rollout.elastic.max", el.max, f"is not a setting: rollout's component holds "
                        f"roles.rollout.nodes ({g.nodes}) nodes, and the spare ones beyond elastic.initial are the "
                        f"most relax-scale can add. Fix: remove max, and set roles.rollout.nodes: {el.max} for a "
                        "component of that size (a cap on engines in all is rollout.elastic.max_engines)"))
        if not 1 <= el.initial < g.nodes:
            out.append(("roles.rollout.elastic.initial", el.initial, f"must be 1 to roles.rollout.nodes - 1 "
                        f"({g.nodes - 1}): the rest of the component's nodes are the spare ones relax-scale starts "
                        "engines on. Fix: raise roles.rollout.nodes, or remove roles.rollout.elastic"))
        if g.share_with is not None:
            out.append(("roles.rollout.elastic", "{...}", "needs rollout's own component (share_with is set)"))
    e = r.rollout.elastic
    for key in ("drain_timeout_s", "join_timeout_s"):
        if not getattr(e, key) > 0:
            out.append((f"rollout.elastic.{key}", getattr(e, key), "must be > 0 (seconds)"))
    out += check_external(r)
    initial = (el.initial if el is not None else g.nodes) * g.tasks_per_node
    if e.max_engines is not None and e.max_engines < initial:
        out.append(("rollout.elastic.max_engines", e.max_engines, f"is below the {initial} engines the run starts "
                    "with. Fix: raise it, or null for no limit"))
    a = e.autoscale
    if a.enabled:
        if r.mode != "fully_async":
            out.append(("rollout.elastic.autoscale.enabled", True, "reads fully-async signals (the trainer waiting "
                        "for samples, rollout held at the staleness gate); in colocate the roles take turns by design. "
                        "Fix: mode: fully_async, or disable it"))
        low = a.min if a.min is not None else initial
        if a.max is None or a.max < max(low, 1):
            out.append(("rollout.elastic.autoscale.max", a.max, f"must be set, and at least min ({low}). Fix: the "
                        "most engines the run may have"))
        if a.min is not None and a.min < 1:
            out.append(("rollout.elastic.autoscale.min", a.min, "must be 1 or more, or null (the engines the run "
                        "starts with)"))
        for key in ("step", "window"):
            if getattr(a, key) < 1:
                out.append((f"rollout.elastic.autoscale.{key}", getattr(a, key), "must be 1 or more"))
        for key in ("scale_out_wait_ratio", "scale_in_idle_ratio"):
            if not 0 <= getattr(a, key) <= 1:
                out.append((f"rollout.elastic.autoscale.{key}", getattr(a, key), "must be a share, 0 to 1"))
        q = a.scale_out_queue_per_engine
        if q is not None and not q > 0:
            out.append(("rollout.elastic.autoscale.scale_out_queue_per_engine", q, "must be more than 0 (requests "
                        "waiting per engine), or null to leave the queue out of the decision"))
        for key in ("scale_out_cooldown_s", "scale_in_cooldown_s"):
            if getattr(a, key) < 0:
                out.append((f"rollout.elastic.autoscale.{key}", getattr(a, key), "must be 0 or more (seconds)"))
    for i, x in enumerate(e.attach.extra):
        if not x.startswith("--") or "\n" in x:
            out.append((f"rollout.elastic.attach.extra[{i}]", x, "must be one sbatch option, like '--reservation=r1'"))
    return out
