"""The recipe checks that read the filesystem: the data, the model's directory and config.json, the run root, the
user functions the recipe names (loaded with :func:`relax_hpc.plugins.load_plugin`), the custom config YAML and
the memory plan. ``relax-submit`` runs them through :mod:`relax_hpc.launch.preflight`; the roles, which reload the
recipe elsewhere, do not (:func:`relax_hpc.recipe.validate.check` is the part that reads nothing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import stat
from pathlib import Path

import yaml

from relax_hpc.algo.config import PLUGIN_CALLS
from relax_hpc.multimodal import VLM_MODEL_TYPES
from relax_hpc.plugins import PluginError, load_plugin
from relax_hpc.recipe.memory_plan import check as check_memory
from relax_hpc.recipe.reader import TextError, parse_yaml, read_text, yaml_error_message
from relax_hpc.recipe.schema import Recipe
from relax_hpc.rollout import checks as rollout_checks
from relax_hpc.rollout.data import DataError, check_data_files, expand_paths
from relax_hpc.rollout.multiturn import env_factory
from relax_hpc.rollout.rewards import GENERATE_PARAMS, REWARD_PARAMS, relax_args

Problem = tuple[str, object, str]

log = logging.getLogger(__name__)


def check_files(recipe: Recipe, cwd: str | Path | None = None) -> list[Problem]:
    """Checks that read the filesystem, so ``relax-submit`` runs them (through preflight) and the roles, which
    reload the recipe elsewhere, do not. Relative paths are resolved as the roles resolve them
    (``relax_hpc.roles.runtime.resolve``): against the directory the run is submitted from, ``cwd``."""
    base = Path.cwd() if cwd is None else Path(cwd)
    problems = _check_data_paths(recipe, base)
    problems += _check_media_roots(recipe, base)
    problems += _check_model_dirs(recipe, base)
    problems += _check_runs_root(recipe, base)
    problems += _check_context(recipe, base)
    problems += _check_plugins(recipe, base)
    problems += _check_custom_config(recipe, base)
    problems += check_memory(recipe, base)  # the memory plan against slurm.gpu_memory_gb (memory_plan.py)
    return problems


def _check_custom_config(r: Recipe, base: Path) -> list[Problem]:
    """``rollout.custom_config_path`` is read as the rollout role reads it (relax_args): an unreadable file or
    a key that contradicts the recipe is refused here instead of when the role starts, after the queue."""
    path = r.rollout.custom_config_path
    if not path or any(c in path for c in "\n\r\0"):
        return []
    try:  # read within the recipe's bounds first: a FIFO, a device or an alias bomb here would hang relax_args
        parse_yaml(read_text(_resolve(path, base)))
    except FileNotFoundError:
        pass  # relax_args says "cannot read"
    except (TextError, yaml.YAMLError) as e:
        text = yaml_error_message(e) if isinstance(e, yaml.YAMLError) else str(e)
        return [("rollout.custom_config_path", path, f"{text} (relative paths are relative to the directory you "
                 f"submit from, {base}). Fix: a YAML file of Relax's custom config keys")]
    resolved = dataclasses.replace(r, rollout=dataclasses.replace(r.rollout, custom_config_path=str(_resolve(path, base))))
    try:
        args = relax_args(resolved)
    except ValueError as e:
        return [("rollout.custom_config_path", path, str(e))]
    if r.rollout.interaction_env_path:  # known without the YAML: check already judged the lengths
        return []
    return rollout_checks.check_lengths(r, bool(getattr(args, "rollout_interaction_env_path", None)))


def _resolve(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def _check_model_dirs(r: Recipe, base: Path) -> list[Problem]:
    """A model is a Hugging Face directory with its config.json; ``/dev/null``, a file or a missing directory
    were accepted and failed only when a role loaded the weights, after the queue."""
    out: list[Problem] = []
    teacher = r.opd.teacher_model_path if r.opd is not None else None
    for key, val in (("model.path", r.model.path), ("genrm.model_path", r.genrm.model_path),
                     ("opd.teacher_model_path", teacher)):
        if val is None or any(c in val for c in "\n\r\0"):
            continue  # unset, or refused by the string checks
        wrong = _model_dir_problem(_resolve(val, base))
        if wrong:
            out.append((key, val, f"{wrong} (relative paths are relative to the directory you submit from, "
                                  f"{base}). Fix: the model's Hugging Face directory (config.json, tokenizer, "
                                  "weights), as an absolute path or relative to where you run relax-submit"))
        elif key == "model.path":
            out += _check_model_kind(r, val, (_model_config(_resolve(val, base))[0] or {}).get("model_type"))
    return out


def _check_model_kind(r: Recipe, val: str, kind: object) -> list[Problem]:
    """What model.path's kind (config.json's model_type) rules out: a vision tower to freeze needs a VLM; a VLM
    trains in padded micro-batches on one pipeline stage (relax_hpc.train.vlm refuses the rest when the actor
    builds, after the queue: refused here before submitting)."""
    out: list[Problem] = []
    vlm = kind in VLM_MODEL_TYPES
    out += _check_omni_kind(r, val, kind)
    video = (r.data.multimodal_keys if isinstance(r.data.multimodal_keys, dict) else {}).get("video")
    if video and kind != "qwen2_5_vl":  # the actor's bridge takes videos for Qwen2.5-VL only (train/vlm.py)
        out.append(("data.multimodal_keys.video", video, f"model.path {val!r} (model_type {kind!r}) takes no videos "
                    "here: megatron-bridge 0.3.1 runs them for Qwen2.5-VL only (its Qwen3-VL asserts none). Fix: a "
                    "Qwen2.5-VL model.path (model_type qwen2_5_vl), or remove the video column"))
    if r.model.freeze_vision and not vlm:
        out.append(("model.freeze_vision", True, f"model.path {val!r} is a text model (model_type {kind!r}): "
                    "it has no vision tower to freeze. Fix: model.freeze_vision: false, or a "
                    f"vision-language model.path (model_type one of {list(VLM_MODEL_TYPES)})"))
    if not vlm:
        return out
    for attr in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch"):
        value = getattr(r.train, attr)
        if value is not None:
            out.append((f"train.{attr}", value, f"packs micro-batches (THD), but model.path {val!r} is a "
                        f"vision-language model (model_type {kind!r}): packing is not wired for M-RoPE and images. "
                        f"Fix: remove train.{attr} (padded micro-batches of train.micro_batch_size samples)"))
    if r.train.pp != 1:
        out.append(("train.pp", r.train.pp, f"model.path {val!r} is a vision-language model (model_type {kind!r}): "
                    "pipeline stages after the first are not wired for it. Fix: train.pp: 1"))
    return out


def _check_omni_kind(r: Recipe, val: str, kind: object) -> list[Problem]:
    """Audio needs an omni thinker's model.path (relax_hpc.train.omni), which trains frozen-tower, padded, on one
    pipeline stage: refused here, before the queue, rather than when the actor builds or the engine answers 400."""
    from relax_hpc.audio import OMNI_MODEL_TYPES

    out: list[Problem] = []
    omni = kind in OMNI_MODEL_TYPES
    mk = r.data.multimodal_keys if isinstance(r.data.multimodal_keys, dict) else {}
    if mk.get("audio") and not omni:
        hint = " (the whole Qwen2.5-Omni: give its thinker's directory)" if kind == "qwen2_5_omni" else ""
        out.append(("data.multimodal_keys.audio", mk["audio"], f"model.path {val!r} (model_type {kind!r}) has no "
                    f"audio tower this build runs{hint}. Fix: an omni thinker's model.path (model_type one of "
                    f"{list(OMNI_MODEL_TYPES)}), or remove the audio column"))
    if not r.model.freeze_audio:
        out.append(("model.freeze_audio", False, "training the audio tower is not wired yet (the weight sync sends "
                    "the language model only). Fix: model.freeze_audio: true"))
    if not omni:
        return out
    if mk.get("image"):
        out.append(("data.multimodal_keys.image", mk["image"], f"model.path {val!r} is an omni thinker: images "
                    "in its prompts are not wired yet (3-D positions in the actor). Fix: audio only"))
    for attr in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch"):
        value = getattr(r.train, attr)
        if value is not None:
            out.append((f"train.{attr}", value, f"packs micro-batches (THD), but model.path {val!r} is an omni "
                        f"thinker: packing is not wired for audio. Fix: remove train.{attr}"))
    if r.train.pp != 1:
        out.append(("train.pp", r.train.pp, f"model.path {val!r} is an omni thinker: its audio tower sits on one "
                    "pipeline stage. Fix: train.pp: 1"))
    return out


def _model_dir_problem(where: Path) -> str | None:
    try:
        mode = where.stat().st_mode
    except FileNotFoundError:
        return f"there is no directory {str(where)!r}"
    except (OSError, ValueError) as e:
        return f"{str(where)!r} cannot be read ({getattr(e, 'strerror', None) or e})"
    if not stat.S_ISDIR(mode):
        return f"{str(where)!r} is not a directory"
    _, wrong = _model_config(where)
    return wrong


_CONFIG_BYTES = 16 << 20  # a config.json is a few KB; one with a large label map still fits


def _model_config(where: Path) -> tuple[dict | None, str | None]:
    """The model directory's config.json as a mapping, or why not (read within the recipe's bounds)."""
    config = where / "config.json"
    try:
        data = json.loads(read_text(config, max_bytes=_CONFIG_BYTES))
    except FileNotFoundError:
        return None, f"{str(where)!r} has no config.json"
    except TextError as e:
        return None, f"{str(config)!r} {e}"
    except (ValueError, RecursionError) as e:
        return None, f"{str(config)!r} is not JSON ({type(e).__name__}: {e})"
    if not isinstance(data, dict):
        return None, f"{str(config)!r} is not a JSON object"
    return data, None


def _check_runs_root(r: Recipe, base: Path) -> list[Problem]:
    """``run.runs_root`` is made at submit if missing: what exists of it must be directories."""
    val = r.run.runs_root
    if any(c in val for c in "\n\r\0%\\"):
        return []  # refused by the string checks
    where = _resolve(val, base)
    for p in (where, *where.parents):
        try:
            mode = p.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):  # the first part that exists says
            continue
        except (OSError, ValueError) as e:
            return [("run.runs_root", val, f"{str(p)!r} cannot be read ({getattr(e, 'strerror', None) or e}). "
                     "Fix: a directory you can write, or one that can be made")]
        if not stat.S_ISDIR(mode):
            return [("run.runs_root", val, f"{str(p)!r} is not a directory, so no run directory can be made under "
                     f"it. Fix: a directory you can write (default ./runs)")]
        return []
    return []


def _check_data_paths(r: Recipe, base: Path) -> list[Problem]:
    """A missing prompt file, or a bad record in one, failed only when the rollout role read it, after the job had
    waited in the queue. The first rows of each dataset are read here as the role reads them
    (:func:`relax_hpc.rollout.data.check_data_files`); what does not refuse (blank lines skipped, some prompts
    over max_prompt_len) is logged."""
    paths = {"data.path": r.data.path, **{f"data.eval_prompt_data.{k}": v for k, v in r.data.eval_prompt_data.items()}}
    out: list[Problem] = []
    found: dict[str, Path] = {}
    for key, val in paths.items():
        if val is None or any(c in val for c in "\n\r\0"):
            continue  # unset, or already refused by the string checks
        where = _resolve(val, base)
        try:
            expand_paths(where)
            found[key] = where
        except DataError as e:
            out.append((key, val, f"{e} (relative paths are relative to the directory you submit from, {base}). "
                                  "Fix: give an existing JSONL/Parquet file or a directory of them, "
                                  "as an absolute path or relative to where you run relax-submit"))
    model = r.model.path
    model_dir = _resolve(model, base) if model and not any(c in model for c in "\n\r\0") else None
    problems, notes = check_data_files(r.data, r.rollout, found, model_dir)
    for note in notes:
        log.warning("%s", note)
    return out + [(key, paths[key], msg) for key, msg in problems]


def _check_media_roots(r: Recipe, base: Path) -> list[Problem]:
    """``data.media_roots``: each an existing directory (a typo would fail every row that names a file there, one
    sample at a time, after the queue)."""
    out: list[Problem] = []
    for i, root in enumerate(r.data.media_roots):
        if not isinstance(root, str) or not root.strip() or "\0" in root:
            continue  # refused by check_data
        if not _resolve(root, base).is_dir():
            out.append((f"data.media_roots[{i}]", root, f"is not a directory (relative paths are relative to the "
                        f"directory you submit from, {base}). Fix: an existing directory that holds the dataset's "
                        "images, or remove it"))
    return out


def _check_plugins(r: Recipe, base: Path) -> list[Problem]:
    """A function reference that does not load (a typo, a missing file, a wrong signature) failed only when a
    role first called it: at the first reward or the first training step, after the job had queued and the
    engines had started. Load each one here as the roles will (relative to the submit directory, which is their
    working directory) and check it accepts the call they make.

    Not refused: a module that exists but imports a package missing on this machine (the job may run in a
    container or another environment); that is logged. Bad forms were already refused by :func:`check`."""
    refs = [("rollout.custom_rm_path", r.rollout.custom_rm_path, REWARD_PARAMS, ()),
            ("rollout.dynamic_sampling_filter_path", r.rollout.dynamic_sampling_filter_path, ("args", "samples"), ()),
            ("rollout.sample_filter_path", r.rollout.sample_filter_path, ("args", "groups"), ()),
            ("rollout.custom_generate_function_path", r.rollout.custom_generate_function_path, GENERATE_PARAMS, ()),
            ("rollout.interaction_env_path", r.rollout.interaction_env_path and env_factory(r.rollout.interaction_env_path),
             (), ("sample", "args"))]
    refs += [(f"algorithm.{k}", getattr(r.algorithm, k), params, kw) for k, (params, kw) in PLUGIN_CALLS.items()]
    out: list[Problem] = []
    for key, spec, params, keywords in refs:
        if spec is None:
            continue
        try:
            load_plugin(spec, key, params=params, keywords=keywords, base=base)
        except PluginError as e:
            if e.kind == "dependency":
                log.warning("not checked here: %s", e)
            elif e.kind != "syntax":
                out.append((key, spec, e.message))
    return out


def _check_context(r: Recipe, base: Path) -> list[Problem]:
    """Prompt + response longer than the model's context fails (or silently truncates) inside the engine, at
    step 1; the model's config.json says its limit, so compare before submitting."""
    limit, config = _max_positions(r.model.path, base)
    if limit is None:
        return []
    ro = r.rollout
    if ro.max_prompt_len is None:
        if ro.max_response_len <= limit:
            return []
        return [("rollout.max_response_len", ro.max_response_len,
                 f"is longer than the model's context, max_position_embeddings = {limit} in {config}. "
                 f"Fix: at most {limit} tokens minus the longest prompt; set rollout.max_prompt_len too, so that "
                 f"max_prompt_len + max_response_len <= {limit}")]
    total = ro.max_prompt_len + ro.max_response_len
    if total <= limit:
        return []
    return [("rollout.max_response_len", ro.max_response_len,
             f"rollout.max_prompt_len + rollout.max_response_len = {ro.max_prompt_len} + {ro.max_response_len} = "
             f"{total} tokens, more than the model's context, max_position_embeddings = {limit} in {config}. "
             f"Fix: lower either so that their sum is at most {limit}")]


def _max_positions(model_path: str | None, base: Path) -> tuple[int | None, Path | None]:
    """``max_position_embeddings`` of the model's config.json (or of its ``text_config``); None when there is no
    model directory, no config.json or no such key: then there is nothing to check against."""
    if model_path is None or any(c in model_path for c in "\n\r\0"):
        return None, None
    config = _resolve(model_path, base) / "config.json"
    data, _ = _model_config(config.parent)  # a bad model directory is _check_model_dirs' to report
    if data is None:
        return None, None
    for section in (data, data.get("text_config") if isinstance(data, dict) else None):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, config
    return None, None
