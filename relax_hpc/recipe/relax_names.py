"""Relax's command-line flag names and where each lives in a relax_hpc recipe.

Why a table: people come from Relax with its flags in their head (``--num-rollout``, ``--hf-checkpoint``) and
write them into a recipe. A "did you mean" by spelling points at the wrong key (``num_rollout`` is not
``runs_root``); this table points at the right one, or says plainly that relax_hpc has no such feature yet.
Names are Relax's flags with ``_`` for ``-`` and no leading dashes (docs/migrating-from-relax.md).
A value is a recipe key (``section.field``), ``key: value`` where Relax's flag is a value of one key
(``--fully-async`` is ``mode: fully_async``; ``<--flag>``: the value of that flag), or None: no equivalent yet.
tests/recipe/test_validate.py checks that every key named here exists in the schema.
"""

from __future__ import annotations

RELAX_NAMES: dict[str, str | None] = {
    # --- topology, mode, resources ---------------------------------------------------------------------
    "fully_async": "mode: fully_async",
    "colocate": "mode: colocate",
    "hybrid": None,
    "resource": "roles",  # {role: [1, GPUs]}: each role's nodes, GPUs and ranks (from_relax.size_roles)
    "actor_num_nodes": "roles.actor.nodes",
    "actor_num_gpus_per_node": "roles.actor.gpus_per_node",
    "rollout_num_gpus": "roles.rollout",
    "num_gpus_per_node": "roles",
    "rollout_num_gpus_per_engine": "roles.rollout",  # an engine's TP: gpus_per_node / tasks_per_node
    "ref_actor_config": "forward",  # reference's and actor_fwd's own TP/PP, sequence parallel, token budget
    "offload": "train.offload", "offload_train": "train.offload", "offload_rollout": "rollout.engine.offload",
    "debug_rollout_only": None, "debug_train_only": None,
    "train_backend": None,
    # --- data ------------------------------------------------------------------------------------------
    "prompt_data": "data.path",
    "input_key": "data.input_key",
    "label_key": "data.label_key",
    "metadata_key": "data.metadata_key",
    "tool_key": "data.tool_key",
    "apply_chat_template": "data.apply_chat_template",
    "apply_chat_template_kwargs": "data.apply_chat_template_kwargs",
    "system_prompt": "data.system_prompt",
    "rollout_shuffle": "data.shuffle",
    "rollout_seed": "data.seed",
    "num_rollout": "run.steps",
    "num_epoch": None,
    "rollout_batch_size": "rollout.rollout_batch_size",
    "n_samples_per_prompt": "rollout.n_samples_per_prompt",
    "over_sampling_batch_size": "rollout.over_sampling_batch_size",
    "custom_prompt_path": None,
    "multimodal_keys": "data.multimodal_keys",
    "image_min_token_num": "data.image_min_token_num", "image_max_token_num": "data.image_max_token_num",
    "data_source_path": None,
    # --- rollout, sampling, engines --------------------------------------------------------------------
    "hf_checkpoint": "model.path",
    "rollout_temperature": "rollout.temperature",
    "rollout_top_p": "rollout.top_p",
    "rollout_top_k": "rollout.top_k",
    "rollout_max_response_len": "rollout.max_response_len",
    "rollout_max_prompt_len": "rollout.max_prompt_len",
    "rollout_max_context_len": "rollout.max_context_len",
    "rollout_stop": "rollout.stop",
    "rollout_stop_token_ids": "rollout.stop_token_ids",
    "rollout_skip_special_tokens": "rollout.skip_special_tokens",
    "sglang_server_concurrency": "rollout.sglang_server_concurrency",
    "rollout_function_path": None,
    "custom_generate_function_path": "rollout.custom_generate_function_path",
    "partial_rollout": "rollout.partial_rollout",
    "partial_rollout_max_aborted_count": "rollout.partial_rollout_max_aborted_count",
    "mask_offpolicy_in_partial_rollout": "rollout.mask_offpolicy_in_partial_rollout",
    "dynamic_sampling_filter_path": "rollout.dynamic_sampling_filter_path",
    "rollout_sample_filter_path": "rollout.sample_filter_path",
    "buffer_filter_path": None,
    "update_weights_interval": None,
    "sglang_config": None,
    # --- rewards ---------------------------------------------------------------------------------------
    "rm_type": "rollout.rm_type",
    "custom_rm_path": "rollout.custom_rm_path",
    "reward_key": "rollout.reward_key",
    "eval_reward_key": "rollout.eval_reward_key",
    "group_rm": "rollout.group_rm",
    "reward_max_concurrency": "rollout.reward_max_concurrency",
    "custom_config_path": "rollout.custom_config_path",
    "rm_url": "rollout.rm_url",
    "rm_type_fallback": None,
    "custom_reward_post_process_path": None,
    "genrm_model_path": "genrm.model_path",
    "genrm_num_gpus": "roles.genrm",
    "genrm_num_gpus_per_engine": None,
    "genrm_engine_config": None,
    "genrm_sampling_config": "genrm.sampling",
    "defer_reward_to_post_process": None,
    # --- eval ------------------------------------------------------------------------------------------
    "eval_interval": "rollout.eval_interval",
    "eval_prompt_data": "data.eval_prompt_data",
    "eval_input_key": "data.eval_input_key",
    "eval_label_key": "data.eval_label_key",
    "skip_eval_before_train": "rollout.skip_eval_before_train",
    "n_samples_per_eval_prompt": "rollout.n_samples_per_eval_prompt",
    "eval_temperature": "rollout.eval_temperature",
    "eval_top_p": "rollout.eval_top_p",
    "eval_top_k": "rollout.eval_top_k",
    "eval_max_response_len": "rollout.eval_max_response_len",
    "log_passrate": "rollout.log_passrate",
    "eval_config": None,
    # --- algorithm and loss ----------------------------------------------------------------------------
    **{name: f"algorithm.{name}" for name in (
        "advantage_estimator", "eps_clip", "eps_clip_high", "eps_clip_c", "kl_coef", "use_kl_loss", "kl_loss_coef",
        "kl_loss_type", "use_unbiased_kl", "entropy_coef", "disable_rewards_normalization",
        "disable_grpo_std_normalization", "normalize_advantages", "sapo_tau_pos", "sapo_tau_neg",
        "use_rollout_logprobs", "use_tis", "tis_clip", "tis_clip_low", "custom_tis_function_path",
        "get_mismatch_metrics", "calculate_per_token_loss", "use_opsm", "opsm_delta", "ref_update_interval")},
    "disable_compute_advantages_and_returns": None,  # advantages always come from the rewards here (no SFT path)
    "loss_type": None, "custom_loss_function_path": None, "gamma": None, "lambd": None,
    "ref_load": None,
    # LoRA (docs/lora.md): --lora-rank 0 (Relax's default) is no LoRA (from_relax._lora)
    "lora_rank": "train.lora.rank", "lora_alpha": "train.lora.alpha", "lora_dropout": "train.lora.dropout",
    "lora_target_modules": "train.lora.target_modules", "lora_adapter_mode": "train.lora.mode: adapter",
    # --- on-policy distillation (relax/utils/opd/opd_utils.py add_opd_arguments) -----------------------
    "use_opd": "opd.enabled",
    "opd_type": "opd.teacher_url: <--opd-teacher-url>",  # sglang: a teacher server; megatron is refused
    "opd_teacher_url": "opd.teacher_url",
    "opd_teacher_timeout_s": "opd.teacher_timeout_s",
    "opd_kl_coef": "opd.kl_coef",
    "opd_loss_coef": "opd.loss_coef",
    "opd_only_reward": "opd.only_reward",
    "opd_disable_rl_reward": "opd.only_reward",  # Relax's alias of --opd-only-reward
    "opd_kl_type": "opd.kl_type",
    "opd_jsd_alpha": "opd.jsd_alpha",
    "opd_norm_mode": "opd.norm_mode",
    "opd_token_selection": "opd.token_selection",
    "opd_log_prob_top_k": "opd.log_prob_top_k",
    "opd_per_token_clip": "opd.per_token_clip",
    "opd_is_clip": "opd.is_clip",
    "opd_log_prob_min_clamp": "opd.log_prob_min_clamp",
    "teacher_hf_checkpoint": "opd.teacher_model_path",  # served by roles.teacher (a managed teacher)
    "opd_teacher_load": None, "opd_teacher_ckpt_step": None,
    "teacher_num_gpus_per_engine": None, "opd_teacher_routes": None, "opd_teacher_key": None,
    "opd_teacher_prompt_key": None, "opd_teacher_image_key": None, "opd_teacher_video_key": None,
    "opd_teacher_audio_key": None,
    # --- training, optimizer, parallelism (Megatron names included) ------------------------------------
    "global_batch_size": "train.global_batch_size",
    "micro_batch_size": "train.micro_batch_size",
    "lr": "train.lr",
    "min_lr": "train.min_lr",
    "lr_warmup_iters": "train.lr_warmup_steps",
    "lr_decay_style": "train.lr_decay",
    "lr_decay_iters": "train.lr_decay_steps",
    "weight_decay": "train.weight_decay",
    "adam_beta1": "train.adam_beta1",
    "adam_beta2": "train.adam_beta2",
    "adam_eps": "train.adam_eps",
    "clip_grad": "train.clip_grad",
    "use_distributed_optimizer": "train.use_distributed_optimizer",
    "bf16": "train.bf16", "fp16": None,
    "seed": "run.seed",
    "tensor_model_parallel_size": "train.tp",
    "pipeline_model_parallel_size": "train.pp",
    "context_parallel_size": None, "expert_model_parallel_size": "train.ep",
    "use_rollout_routing_replay": "train.routing_replay", "use_routing_replay": None,  # R3; R2 not yet
    "sequence_parallel": "train.sequence_parallel",
    "recompute_granularity": "train.recompute",
    "recompute_activations": "train.recompute: selective",  # Megatron's older spelling of selective recompute
    "recompute_method": "train.recompute_method",
    "recompute_num_layers": "train.recompute_num_layers",
    "num_steps_per_rollout": "train.num_steps_per_rollout",
    "use_dynamic_batch_size": "train.max_tokens_per_micro_batch: <--max-tokens-per-gpu>",
    "max_tokens_per_gpu": "train.max_tokens_per_micro_batch",
    "log_probs_max_tokens_per_gpu": "train.logprob_max_tokens_per_micro_batch",
    "balance_data": "train.balance_data",
    "optimizer_cpu_offload": "train.optimizer_cpu_offload",
    "overlap_cpu_optimizer_d2h_h2d": "train.overlap_cpu_optimizer_d2h_h2d",
    "use_precision_aware_optimizer": "train.use_precision_aware_optimizer",
    "optimizer": None, "context_parallel_size": None, "expert_tensor_parallel_size": None,
    "attention_dropout": None, "hidden_dropout": None, "attention_backend": None,
    "accumulate_allreduce_grads_in_fp32": None, "attention_softmax_in_fp32": None,
    # --- async -----------------------------------------------------------------------------------------
    "max_staleness": "max_staleness",
    "num_iters_per_train_update": None, "num_data_storage_units": None,
    # --- fault tolerance, checkpoint, logging ----------------------------------------------------------
    "max_global_restart": "checkpoint.max_restarts",
    "use_fault_tolerance": None, "use_health_check": None,
    "save_interval": "checkpoint.interval",
    "max_actor_ckpt_to_keep": "checkpoint.keep",
    "load": None, "save": None, "save_hf": None,
    "megatron_to_hf_mode": None, "warm_hf_checkpoint_page_cache": None,
    "use_tensorboard": "logging.tensorboard",
    "tb_project_name": None, "tb_experiment_name": None, "use_clearml": None, "use_metrics_service": None,
    "timeline_dump_dir": None,
    "use_streaming_dataset": None, "streaming_buffer_size": None,
    "notify_urls": "logging.notify_urls",
    # W&B (logging.wandb, docs/metrics.md); the key goes in WANDB_API_KEY or ~/.netrc, never in a recipe; the
    # files go to RUN_DIR/wandb and the run id comes from the run directory (one W&B run across requeues)
    "use_wandb": "logging.wandb.mode: online",
    "wandb_project": "logging.wandb.project",
    "wandb_group": "logging.wandb.group",
    "wandb_team": "logging.wandb.entity",
    "wandb_host": "logging.wandb.host",
    "wandb_mode": "logging.wandb.mode",
    "wandb_key": None, "wandb_dir": None, "wandb_run_id": None, "disable_wandb_random_suffix": None,
    "wandb_always_use_train_step": None,
}

# Why a flag has no key (its RELAX_NAMES value is None, or its key is not in this schema): printed in the recipe's
# header by relax-submit --from-relax-args. Not here: "not supported yet".
WHY: dict[str, str] = {
    "hybrid": "not supported yet: relax_hpc's modes are colocate and fully_async",
    "fp16": "not supported yet: relax_hpc trains in bf16 (train.bf16: true) or fp32",
    "num_iters_per_train_update": "not supported: Relax's trainer takes N batches from its stream per weight "
                                  "update; relax_hpc syncs the weights after every rollout step, whose batch the "
                                  "actor takes whole as train.num_steps_per_rollout optimizer steps. The same "
                                  "updates per sync: a rollout step N times as large with num_steps_per_rollout: N "
                                  "(rollout.stream_groups lets its forward passes start on the groups done first)",
    "balance_data": "not supported yet: data-parallel ranks take contiguous shares of each mini-batch",
    "use_streaming_dataset": "not needed: relax_hpc reads the prompt files whole at the start (data.path) and walks "
                             "them in shuffled epochs",
    "streaming_buffer_size": "not needed: no streaming dataset (see --use-streaming-dataset)",
    "use_fault_tolerance": "always on in relax_hpc: a dead engine is found and started again "
                           "(rollout.engine.max_restarts; docs/reliability.md)",
    "use_health_check": "always on in relax_hpc: every role sends heartbeats (logging.heartbeat_timeout_s) and a "
                        "failed step restarts from the latest checkpoint (checkpoint.max_restarts)",
    "attention_backend": "relax_hpc lets Megatron pick the kernel (Transformer Engine's fused attention where TE is "
                         "installed, else PyTorch SDPA)",
    "accumulate_allreduce_grads_in_fp32": "always so in relax_hpc: gradients are reduced in fp32",
    "attention_softmax_in_fp32": "always so in relax_hpc (megatron-core's default)",
    "attention_dropout": "relax_hpc trains with no dropout (log-probs must be deterministic)",
    "hidden_dropout": "relax_hpc trains with no dropout (log-probs must be deterministic)",
    "optimizer": "relax_hpc's optimizer is Adam with decoupled weight decay (Relax's default, adam)",
    "context_parallel_size": "not supported yet: no context parallelism (1 is the only value)",
    "expert_tensor_parallel_size": "not supported yet: experts are split by train.ep only (1 is the only value)",
    "num_data_storage_units": "not needed: samples travel as files in the run directory (no TransferQueue)",
    "warm_hf_checkpoint_page_cache": "not needed: it pre-reads the HF files; what is trained is the same",
    "megatron_to_hf_mode": "relax_hpc always converts with megatron-bridge (Relax's bridge mode)",
    "load": "relax_hpc resumes a run from its own directory's checkpoints: relax-submit --resume RUN_DIR",
    "save": "relax_hpc saves into the run directory (RUN_DIR/checkpoints; checkpoint.interval, checkpoint.keep)",
    "ref_load": "relax_hpc's reference starts from model.path (refreshed from the actor with "
                "algorithm.ref_update_interval)",
    "use_clearml": "not supported: relax_hpc logs to TensorBoard (logging.tensorboard) and W&B (logging.wandb)",
    "use_metrics_service": "not needed: the controller gathers every role's metrics itself (RUN_DIR/metrics.jsonl, "
                           "TensorBoard in RUN_DIR/tensorboard)",
    "tb_project_name": "not needed: TensorBoard's files go to the run's directory, named by the run (run.name)",
    "tb_experiment_name": "not needed: TensorBoard's files go to the run's directory, named by the run (run.name)",
    "timeline_dump_dir": "not supported yet: per-step timings are in metrics.jsonl (perf/*)",
    "offload_train": "not in this relax_hpc: the actor keeps its memory while the engines generate",
    "optimizer_cpu_offload": "not in this relax_hpc: the optimizer state stays on the GPU",
    "overlap_cpu_optimizer_d2h_h2d": "not in this relax_hpc: the optimizer state stays on the GPU",
    "use_precision_aware_optimizer": "not in this relax_hpc: the optimizer keeps fp32 state",
}
# Flags whose value here is what relax_hpc always does: {flag: (the value, what relax_hpc does)}
SAME_AS_HERE: dict[str, tuple[str, str]] = {
    "optimizer": ("adam", "relax_hpc's optimizer (Adam, decoupled weight decay)"),
    "context_parallel_size": ("1", "relax_hpc's only value (no context parallelism)"),
    "expert_tensor_parallel_size": ("1", "relax_hpc's only value"),
    "attention_dropout": ("0.0", "as relax_hpc always trains"),
    "hidden_dropout": ("0.0", "as relax_hpc always trains"),
    "megatron_to_hf_mode": ("bridge", "as relax_hpc always converts (megatron-bridge)"),
    "num_iters_per_train_update": ("1", "as relax_hpc takes each step's batch whole"),
    "num_data_storage_units": ("1", "not needed: samples travel as files in the run directory"),
}
# Megatron's model-architecture flags (Relax's scripts/models/*.sh MODEL_ARGS): relax_hpc reads the architecture from
# model.path's config.json (megatron-bridge), so these are left out, named in one note
ARCHITECTURE = frozenset({
    "swiglu", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "use_rotary_position_embeddings", "disable_bias_linear", "normalization", "norm_epsilon",
    "rotary_base", "vocab_size", "kv_channels", "qk_layernorm", "untie_embeddings_and_output_weights",
    "position_embedding_type", "max_position_embeddings", "seq_length", "make_vocab_size_divisible_by",
    "add_qkv_bias", "use_rope_scaling", "rotary_percent", "num_experts", "moe_ffn_hidden_size", "moe_router_topk",
    "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
    "moe_router_score_function", "moe_router_pre_softmax", "apply_layernorm_1p", "init_method_std",
})

# Flags Relax reads only while a switch is on (its parser takes them either way): {flag: the switch}. Without the
# switch they change nothing in Relax, so they are carried over only with it; the switch itself sets no key.
ONLY_WITH: dict[str, str] = {"max_tokens_per_gpu": "use_dynamic_batch_size",
                             "log_probs_max_tokens_per_gpu": "use_dynamic_batch_size",
                             # Relax's validate_opd_args returns at once without --use-opd
                             **{name: "use_opd" for name in (
                                 "opd_type", "opd_teacher_url", "opd_teacher_timeout_s", "opd_kl_coef",
                                 "opd_loss_coef", "opd_only_reward", "opd_disable_rl_reward", "opd_kl_type",
                                 "opd_jsd_alpha", "opd_norm_mode", "opd_token_selection", "opd_log_prob_top_k",
                                 "opd_per_token_clip", "opd_is_clip", "opd_log_prob_min_clamp",
                                 "teacher_hf_checkpoint")},
                             **{name: "use_wandb" for name in (
                                 "wandb_project", "wandb_group", "wandb_team", "wandb_host", "wandb_mode")}}
OPD_TYPES = {"sglang": "a teacher SGLang server at opd.teacher_url"}
"""Relax's ``--opd-type`` values relax_hpc has; ``megatron`` (the teacher inside the trainer) is refused."""


def relax_flag(name: str) -> str:
    """A key as Relax's table spells it: ``--num-rollout`` and ``num-rollout`` both become ``num_rollout``."""
    return name.lstrip("-").replace("-", "_")


def cli_flag(name: str) -> str:
    """The table's name as Relax's command line spells it (``num_rollout`` → ``--num-rollout``)."""
    return "--" + name.replace("_", "-")
