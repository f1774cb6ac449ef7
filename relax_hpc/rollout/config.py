"""The recipe's ``rollout:``, ``data:`` and ``genrm:`` sections: generation, rewards and eval, the prompts, and the
judge model (Relax's rollout, data, reward and eval flags; see docs/rollout.md).

Pure Python on purpose: the recipe validator imports this on the login node (no torch, no httpx). Field types
stay within what :mod:`relax_hpc.recipe.validate` understands; the comment after each field is its documentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from relax_hpc.engines.config import EngineConfig  # the engines' own section: rollout.engine


@dataclass
class DataConfig:
    """Prompt data (Relax's data flags; see docs/rollout.md)."""

    path: str | None = None  # JSONL or Parquet prompts: a file or a directory of them (Relax --prompt-data)
    input_key: str = "prompt"  # record field with the prompt: a string, or chat messages with apply_chat_template
    label_key: str | None = "label"  # record field that becomes sample.label; null = no label
    metadata_key: str | None = "metadata"  # record field (mapping or JSON string) that becomes sample.metadata; optional per record
    tool_key: str | None = "tools"  # record field with tool schemas passed to the chat template
    apply_chat_template: bool = False  # format prompts with the tokenizer's chat template (add_generation_prompt)
    apply_chat_template_kwargs: str | None = None  # JSON object of extra chat-template arguments, e.g. '{"enable_thinking": false}'
    system_prompt: str | None = None  # with apply_chat_template: a system message put first when a record has none
    shuffle: bool = False  # shuffle prompts, reshuffled every epoch (Relax --rollout-shuffle)
    seed: int | None = None  # data order seed (Relax --rollout-seed); null = run.seed
    eval_prompt_data: dict[str, str] = field(default_factory=dict)  # eval sets: name -> JSONL/Parquet path (Relax --eval-prompt-data)
    eval_input_key: str | None = None  # input_key of the eval sets; null = input_key
    eval_label_key: str | None = None  # label_key of the eval sets; null = label_key
    multimodal_keys: dict[str, str] = field(default_factory=dict)  # modality -> record field (Relax --multimodal-keys), e.g. {image: images} or {audio: audios}: paths (relative to the data file), bytes or base64, one or a list; "image", "video" (a list of frames, or an animated GIF/PNG/WebP) and "audio" (an omni model's); one of them a recipe
    image_min_token_num: int | None = None  # images smaller than this many image tokens are enlarged (Relax --image-min-token-num); null = the model processor's min_pixels
    image_max_token_num: int | None = None  # images larger than this many image tokens are shrunk (Relax --image-max-token-num); null = the model processor's max_pixels
    media_roots: list[str] = field(default_factory=list)  # directories besides the data file's own that a row's image paths may lie in (symlinks resolved); relative to the submit directory. Any other path fails its sample
    allow_media_urls: bool = False  # fetch http(s) image URLs a row names; false: such a row fails its sample (data: URLs and base64 are always read)
    max_image_pixels: int | None = None  # an image over this many pixels (width × height, read from its header before decoding) fails its sample; null = the model processor's max_pixels (what it would resize to anyway)
    max_prompt_pixels: int | None = None  # a row whose images add up to more pixels fails its sample; null = 4 × max_image_pixels
    max_audio_seconds: float | None = None  # an audio clip longer than this (read from its header before decoding) fails its sample; null = what the model's processor takes (its chunk_length)
    video_fps: float = 2.0  # the rate a row's video frames were taken at (a frame list has no clock); the model sees them at 2 a second (Qwen's rate): every (video_fps / 2)-th frame
    video_max_frames: int | None = None  # at most this many frames of a video (evenly spaced) reach the model; null = all (up to 768)


BUILTIN_REWARD_NAMES = ("math", "exact_match", "f1", "dummy", "dapo", "deepscaler", "multiple_choice", "gpqa", "random",
                        "remote_rm", "dapo-genrm")
"""The values ``rollout.rm_type`` takes besides ``boxed_<name>``: the keys of
:data:`relax_hpc.rollout.rewards.BUILTIN_REWARDS`, named here so the recipe's check needs no reward code."""
AWAITED_REWARDS = ("remote_rm", "dapo-genrm")  # scored by the reward runner itself, never as boxed_<name>


@dataclass
class AttachDefaults:
    """sbatch options of attached jobs (relax-scale --attach, the autoscaler) where relax-scale gives none;
    unset: the run's own slurm.* values."""

    partition: str | None = None  # e.g. a preemptible partition
    time: str | None = None
    qos: str | None = None
    account: str | None = None
    constraint: str | None = None
    mem: str | None = None
    extra: list[str] = field(default_factory=list)  # more #SBATCH options, e.g. ["--reservation=r1"]


ATTACH_OPTIONS = tuple(f.name for f in fields(AttachDefaults) if f.name != "extra")
"""The sbatch options relax-scale --attach takes one by one (``--partition`` ...); anything else goes in ``extra``."""


@dataclass
class AutoscaleConfig:
    """relax-scale by itself, on the run's own signals (fully_async only; docs/elastic.md, "The autoscaler")."""

    enabled: bool = False
    min: int | None = None  # engines never fewer (scale-in stops here); null = the engines the run starts with
    max: int | None = None  # engines never more; required when enabled
    step: int = 1  # engines added or drained per decision
    window: int = 2  # steps in a row a signal must hold before a decision
    scale_out_wait_ratio: float = 0.2  # scale out when the trainer waited for samples more than this share of the step interval
    scale_out_queue_per_engine: float | None = None  # also scale out when more requests than this waited per engine for a free slot, on average over the generate; null = off
    scale_in_idle_ratio: float = 0.5  # scale in when rollout sat idle at the staleness gate more than this share
    scale_out_cooldown_s: float = 120.0  # after any scale operation, no scale-out for this long
    scale_in_cooldown_s: float = 300.0  # after any scale operation, no scale-in for this long
    attach: bool = False  # add engines as attached jobs (rollout.elastic.attach's options) instead of job steps


@dataclass
class ElasticConfig:
    """Engines added and removed while the run goes (relax-scale; docs/elastic.md)."""

    drain_timeout_s: float = 30.0  # scale-in: requests in flight on a leaving engine finish within this, or are re-issued
    join_timeout_s: float = 1800.0  # scale-out: an engine asked for that has not joined by then is given up (attached: its job is cancelled)
    max_engines: int | None = None  # no scale-out beyond this many engines in all; null = no limit
    attach: AttachDefaults = field(default_factory=AttachDefaults)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)


@dataclass
class RolloutConfig:
    """Generation, rewards and eval (Relax's rollout/reward/eval flags; see docs/rollout.md)."""

    # --- batch and sampling --------------------------------------------------------------------------
    n_samples_per_prompt: int = 8  # samples per prompt: one group
    rollout_batch_size: int = 8  # prompts per rollout step
    max_response_len: int = 16  # max new tokens per sample (Relax --rollout-max-response-len)
    max_prompt_len: int | None = None  # drop prompts longer than this many tokens; null = keep all
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    stop: list[str] = field(default_factory=list)  # stop strings
    stop_token_ids: list[int] = field(default_factory=list)  # stop token ids besides EOS
    skip_special_tokens: bool = False  # drop special tokens from the response text
    custom_generate_function_path: str | None = None  # Relax's generate(args, sample, sampling_params[, evaluation]) -> Sample, talking to args.sglang_router_ip:port (docs/agentic.md)
    interaction_env_path: str | None = None  # multi-turn: a module with build_env(sample, args) (Relax's BaseInteractionEnv); null = Relax's rollout_interaction_env_path from custom_config_path, else single-turn
    max_turns: int | None = None  # multi-turn: model turns per rollout; null = max_turns from custom_config_path
    max_context_len: int | None = None  # multi-turn: prompt + every turn, in tokens (Relax --rollout-max-context-len); null = train.max_seq_len (never more)
    turn_truncation: Literal["stop", "continue"] = "stop"  # multi-turn: a turn cut at max_response_len stops the rollout (Relax) or goes to the env like any turn
    env_step_timeout_s: float = 60.0  # multi-turn: a build_env/reset/step/close call running longer fails its sample
    # --- dynamic sampling (DAPO; see relax_hpc/rollout/dynamic.py) ---------------------------------------
    dynamic_sampling_filter_path: str | None = None  # group filter fn(args, samples) -> bool | .keep, e.g. relax_hpc.rollout.dynamic.check_reward_nonzero_std; draw groups until rollout_batch_size pass
    over_sampling_batch_size: int | None = None  # groups drawn per dynamic sampling round (>= rollout_batch_size); null = rollout_batch_size
    dynamic_sampling_max_rounds: int = 8  # rounds per step before the run stops with a clear error (the filter drops almost everything); 0 = no limit
    partial_rollout: bool = False  # fully_async: abort the groups still running once a step has enough, continue them next step (needs over_sampling_batch_size > rollout_batch_size)
    partial_rollout_max_aborted_count: int | None = None  # a sample aborted this often is left to finish; null = no limit
    mask_offpolicy_in_partial_rollout: bool = False  # loss mask 0 on the tokens a sample had when it was aborted
    sample_filter_path: str | None = None  # fn(args, groups) called once per step; may set sample.remove_sample (zero loss mask, still normalized)
    stream_groups: int = 0  # streaming within a step: a chunk of this many whole groups as soon as they are done (in group order), announced at once so the forward roles and the actor start on it; 0 = one chunk per step
    # --- engines -------------------------------------------------------------------------------------
    sglang_server_concurrency: int = 512  # max in-flight generate requests per engine
    batch_group_requests: bool = True  # a group of plain single-turn samples is one /generate (SGLang's batch form), not n
    max_retries: int = 3  # times one request is retried after an error on an engine that is still alive (with exponential backoff and jitter)
    request_timeout_s: float = 600.0  # total deadline of one generate request (connect, send, whole answer, retries)
    engine: EngineConfig = field(default_factory=EngineConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    external_engines: list[dict[str, str]] = field(default_factory=list)  # engines started by anyone that serve this run too: [{url, key_file}], key_file an absolute path of mode 0600 (docs/elastic.md)
    # --- rewards -------------------------------------------------------------------------------------
    rm_type: str | None = None  # built-in reward: math, exact_match, f1, dummy, dapo, deepscaler, multiple_choice, gpqa, random, remote_rm, boxed_<type>; sample.metadata["rm_type"] wins
    rm_url: str | None = None  # remote_rm's reward server, http(s)://...: gets POST {prompt, response, label}, answers a JSON number or object (Relax --rm-url)
    custom_rm_path: str | None = None  # your reward function, 'package.module.function' (Relax --custom-rm-path)
    reward_key: str | None = None  # key of the scalar reward when the reward function returns a dict
    eval_reward_key: str | None = None  # reward_key for eval; null = reward_key
    group_rm: bool = False  # call the custom reward once per group: reward_func(args, samples) -> list
    reward_max_concurrency: int = 64  # reward calls in flight at once
    reward_error_policy: Literal["skip", "fail"] = "fail"  # a reward that raises: fail = stop the run with the report; skip = reward 0, status FAILED, go on
    reward_timeout_s: float = 300.0  # a reward call (or group_rm call) running longer is a failed reward (under reward_error_policy)
    custom_config_path: str | None = None  # YAML whose keys become attributes of the args your reward function receives
    log_passrate: bool = False  # also log rollout/passrate/pass@k over each group
    # --- eval ----------------------------------------------------------------------------------------
    eval_interval: int | None = None  # eval every N rollout steps (and at the last one); null = never
    skip_eval_before_train: bool = False  # no eval at step 0 before training
    n_samples_per_eval_prompt: int = 1  # samples per eval prompt (pass@k for k = 1, 2, 4, ... up to this)
    eval_temperature: float | None = None  # null = temperature
    eval_top_p: float | None = None  # null = top_p
    eval_top_k: int | None = None  # null = top_k
    eval_max_response_len: int | None = None  # null = max_response_len


@dataclass
class GenRMSampling:
    """The judge's sampling defaults (Relax's ``--genrm-sampling-config``, with its service's fallbacks);
    a reward function's ``sampling_params`` override them per call."""

    temperature: float = 0.2
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: int = 1024
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenRMConfig:
    """A generative reward model (LLM judge) on engines of its own (``roles.genrm``): frozen weights, never synced.
    Reward functions call :func:`relax_hpc.rollout.genrm.generate`; ``rollout.rm_type: dapo-genrm`` uses it."""

    model_path: str | None = None  # Relax's --genrm-model-path; setting it needs roles.genrm.enabled
    sampling: GenRMSampling = field(default_factory=GenRMSampling)
    request_timeout_s: float = 600.0  # one judge call, retries included
    retries: int = 3  # attempts on a transport error or 5xx, each on the next live judge (Relax: 3)
