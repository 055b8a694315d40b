"""Every field a Megatron-Bridge ``ConfigContainer`` section may hold, with its default, for
each Bridge version the plugin reads (``BRIDGE_VERSIONS``; the README names them).

Megatron-Core's dataclasses that Bridge serializes (``TransformerConfig``, ``GPTModel``'s
constructor, ``OptimizerConfig``, ``DistributedDataParallelConfig``, ``GPTDatasetConfig``)
are asked from the installed Megatron-Core: a hand list would miss the next field. A Bridge
release pins its own Megatron-LM commit, so each version also lists what its pinned
Megatron-Core writes beyond (or with another default than) the installed 0.16.1.

Bridge's own dataclasses are not installed with the plugin, which must not need Bridge: their
fields and defaults are tables here, read from Bridge's source at each release tag (the
comment above each version names the tag, the files and the Megatron-LM commit it pins).
``to_yaml()`` writes every dataclass field of each section (``dataclasses.fields``, sorted by
``yaml.safe_dump``), so a dump carries exactly these names.

Values are compared as Bridge writes them in YAML: a torch dtype or a function as its
dotted name (``torch.bfloat16``, ``torch.nn.functional.silu``), a tuple as a list.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
from typing import Any, Iterable, Mapping

__all__ = ["BRIDGE_VERSIONS", "REQUIRED", "BridgeVersion", "closest_version", "encode", "megatron_core_version",
           "section_fields", "transformer_fields"]

REQUIRED = object()
"""The default of a field that has none: the recipe must give it."""


@dataclasses.dataclass(frozen=True)
class BridgeVersion:
    """One Megatron-Bridge release: the fields its ``to_yaml()`` writes in each section."""

    name: str
    """The release, as the README names it (``0.3.1``)."""
    sections: Mapping[str, Mapping[str, Any]]
    """Bridge's own section dataclasses, field -> default; under ``dataset`` and ``model``
    the fields Bridge's ``GPTDatasetConfig`` and GPT provider add to Megatron-Core's."""
    pinned_core: Mapping[str, Mapping[str, Any]]
    """``model``, ``optimizer``, ``ddp``, ``dataset``: the fields of the Megatron-Core that the
    release pins that are not the installed 0.16.1's, or whose default differs there."""


NESTED_MODEL_FIELDS: Mapping[str, Any] = {"generation_config": None, "logit_dtype": None,
                                          "extra_checkpoint_metadata": None}
"""The outer half of the nested ``model`` layout (``model.transformer.*`` holds TransformerConfig)
of Bridge main after 0.6.0, beyond the provider's fields: Megatron-LM's ``GPTModelConfig``
(``logit_dtype``, ``extra_checkpoint_metadata``) and Bridge's ``BridgeGPTModelConfig``."""

BRIDGE_0_3_1 = BridgeVersion(
    # Tag v0.3.1 (March 2026): src/megatron/bridge/training/config.py (TrainingConfig, RNGConfig, LoggerConfig,
    # CheckpointConfig, DistributedInitConfig, ProfilingConfig, RerunStateMachineConfig, TensorInspectConfig,
    # FaultToleranceConfig, StragglerDetectionConfig, NVRxStragglerDetectionConfig, InProcessRestartConfig;
    # DataloaderConfig mixed into GPTDatasetConfig), training/tokenizers/config.py, training/comm_overlap.py,
    # training/mixed_precision.py (MixedPrecisionConfig, which a dump writes where the recipe set one rather than
    # a recipe name) and models/gpt_provider.py. It pins Megatron-LM 55ac708 (core_v0.16.1): the installed
    # Megatron-Core, nothing beyond.
    # train's batch sizes and train_iters default to None in Bridge; the plugin requires them (REQUIRED).
    name="0.3.1",
    sections={
        "train": {
            "micro_batch_size": REQUIRED, "global_batch_size": REQUIRED, "rampup_batch_size": None,
            "decrease_batch_size_if_needed": False, "empty_unused_memory_level": 0,
            "check_weight_hash_across_dp_replicas_interval": None, "train_sync_interval": None, "train_iters":
            REQUIRED, "train_samples": None, "exit_interval": None, "exit_duration_in_mins": None,
            "exit_signal_handler": False, "exit_signal": 15, "exit_signal_handler_for_dataloader": False,
            "manual_gc": False, "manual_gc_interval": 0, "manual_gc_eval": True, "iterations_to_skip": [],
            "eval_iters": 100, "eval_interval": 1000, "skip_train": False
        },
        "scheduler": {  # SchedulerConfig (its ``*_steps`` are the sample counts ``finalize`` derives)
            "lr_decay_style": "linear", "lr_wsd_decay_style": "exponential", "lr_decay_iters": None,
            "lr_decay_samples": None, "lr_wsd_decay_iters": None, "lr_wsd_decay_samples": None,
            "lr_warmup_fraction": None, "lr_warmup_iters": 0, "lr_warmup_samples": 0, "lr_warmup_init": 0.0,
            "override_opt_param_scheduler": False, "use_checkpoint_opt_param_scheduler": False,
            "start_weight_decay": None, "end_weight_decay": None, "weight_decay_incr_style": "constant",
            "no_weight_decay_cond_type": None, "lr_warmup_steps": None, "lr_decay_steps": None, "wd_incr_steps": None,
            "wsd_decay_steps": None,
        },
        "rng": {
            "seed": 1234, "te_rng_tracker": False, "inference_rng_tracker": False, "data_parallel_random_init":
            False
        },
        "tokenizer": {
            "legacy_tokenizer": False, "metadata_path": None, "vocab_size": None, "vocab_file": None, "merge_file":
            None, "vocab_extra_ids": 0, "tokenizer_type": None, "tokenizer_model": None, "special_tokens": None,
            "chat_template": None, "tiktoken_pattern": None, "tiktoken_num_special_tokens": 1000,
            "tiktoken_special_tokens": None, "tokenizer_prompt_format": None, "image_tag_type": None,
            "hf_tokenizer_kwargs": {}, "sp_tokenizer_kwargs": {}
        },
        "logger": {
            "log_interval": 100, "log_params_norm": False, "log_throughput": False, "log_throughput_to_tensorboard":
            False, "throughput_window_size": 100, "log_progress": False, "timing_log_level": 0, "timing_log_option":
            "minmax", "tensorboard_dir": None, "tensorboard_log_interval": 1, "tensorboard_queue_size": 1000,
            "log_timers_to_tensorboard": False, "log_loss_scale_to_tensorboard": True,
            "log_validation_ppl_to_tensorboard": False, "log_memory_to_tensorboard": False, "memory_keys": None,
            "log_l2_norm_grad_to_tensorboard": False, "log_runtime_to_tensorboard": False, "runtime_time_unit":
            "hours", "log_world_size_to_tensorboard": False, "wandb_project": None, "wandb_exp_name": None,
            "wandb_save_dir": None, "wandb_entity": None, "mlflow_experiment": None, "mlflow_run_name": None,
            "mlflow_tracking_uri": None, "mlflow_tags": None, "logging_level": 20, "filter_warnings": True,
            "modules_to_filter": None, "set_level_for_all_loggers": False, "log_energy": False,
            "save_config_filepath": None
        },
        "checkpoint": {
            "save": None, "save_interval": None, "most_recent_k": -1, "save_optim": True, "save_rng": True, "load":
            None, "load_optim": True, "load_main_params_from_ckpt": False, "load_rng": True,
            "non_persistent_save_interval": None, "non_persistent_ckpt_type": None,
            "non_persistent_global_ckpt_dir": None, "non_persistent_local_ckpt_dir": None,
            "non_persistent_local_ckpt_algo": "fully_parallel", "finetune": False, "pretrained_checkpoint": None,
            "ckpt_step": None, "use_checkpoint_args": False, "exit_on_missing_checkpoint": False, "ckpt_format":
            "torch_dist", "ckpt_convert_format": None, "ckpt_convert_save": None, "fully_parallel_save": True,
            "async_save": False, "use_persistent_ckpt_worker": True, "fully_parallel_load": False,
            "ckpt_assume_constant_structure": False, "strict_fsdp_dtensor_load": False, "dist_ckpt_strictness":
            "assume_ok_unexpected", "dist_ckpt_optim_fully_reshardable": False,
            "distrib_optim_fully_reshardable_mem_efficient": False, "save_tokenizer_assets": True, "replication":
            False, "replication_jump": None, "replication_factor": 2
        },
        "dist": {
            "distributed_backend": "nccl", "distributed_timeout_minutes": 10, "align_grad_reduce": True,
            "local_rank": 0, "lazy_init": False, "use_megatron_fsdp": False,
            "use_torch_fsdp2": False, "nccl_communicator_config_path": None, "use_tp_pp_dp_mapping": False,
            "use_gloo_process_groups": True, "use_sharp": False, "sharp_enabled_group": None,
            "high_priority_stream_groups": None, "external_gpu_device_mapping": False,
            "enable_megatron_core_experimental": False, "distributed_timeout_seconds_after_init": None,
            "disable_jit_fuser": False, "use_decentralized_pg": False
        },
        "profiling": {
            "use_nsys_profiler": False, "profile_step_start": 10, "profile_step_end": 12, "use_pytorch_profiler":
            False, "profile_ranks": [0], "record_memory_history": False, "memory_snapshot_path": "snapshot.pickle",
            "record_shapes": False, "nvtx_ranges": False
        },
        "rerun_state_machine": {
            "error_injection_rate": 0, "error_injection_type": "transient_error", "rerun_mode": "disabled",
            "check_for_nan_in_loss": True, "check_for_spiky_loss": False, "spiky_loss_factor": 10.0
        },
        "comm_overlap": {
            "tp_comm_overlap": REQUIRED, "tp_comm_overlap_cfg": None, "tp_comm_bootstrap_backend": "nccl",
            "overlap_p2p_comm": None, "batch_p2p_comm": None, "overlap_grad_reduce": None, "overlap_param_gather":
            None, "overlap_param_gather_with_optimizer_step": None, "align_param_gather": None, "bucket_size": None,
            "defer_embedding_wgrad_compute": None, "wgrad_deferral_limit": None, "data_parallel_size": None,
            "overlap_moe_expert_parallel_comm": None, "delay_wgrad_compute": None
        },
        "tensor_inspect": {
            "enabled": False, "features": None, "feature_dirs": None, "log_dir": None, "init_training_step": 0
        },
        "ft": {
            "enable_ft_package": False, "calc_ft_timeouts": False, "simulate_fault": False, "simulated_fault_type":
            "random", "simulated_fault_rank": None, "simulated_fault_base_delay": 0
        },
        "straggler": {
            "log_straggler": False, "enable_straggler_on_startup": True, "straggler_ctrlr_port": 65535,
            "straggler_minmax_count": 1, "disable_straggler_on_startup": False
        },
        "nvrx_straggler": {
            "enabled": False, "report_time_interval": 300.0, "calc_relative_gpu_perf": True,
            "calc_individual_gpu_perf": True, "num_gpu_perf_scores_to_print": 5, "gpu_relative_perf_threshold": 0.7,
            "gpu_individual_perf_threshold": 0.7, "stop_if_detected": False, "enable_logging": True,
            "profiling_interval": 1, "logger_name": "megatron.bridge.NVRxStragglerDetection"
        },
        "inprocess_restart": {
            "enabled": False, "max_iterations": None, "monitor_thread_interval": 1.0, "monitor_process_interval":
            1.0, "progress_watchdog_interval": 1.0, "heartbeat_interval": 30.0, "soft_timeout": 60.0,
            "hard_timeout": 90.0, "heartbeat_timeout": 60.0, "barrier_timeout": 120.0, "completion_timeout": 120.0,
            "last_call_wait": 1.0, "termination_grace_time": 1.0, "granularity": "node", "active_world_size": None,
            "empty_cuda_cache": True, "max_rank_faults": None, "monitor_process_logdir": None
        },
        "mixed_precision": {
            "fp32": False, "fp16": False, "bf16": False, "params_dtype": None, "pipeline_dtype": None,
            "autocast_dtype": None, "autocast_enabled": False, "grad_reduce_in_fp32": True, "fp8": None,
            "fp8_recipe": "tensorwise", "first_last_layers_bf16": False, "fp8_margin": 0, "fp8_amax_history_len": 1,
            "fp8_amax_compute_algo": "most_recent", "fp8_wgrad": True, "fp8_dot_product_attention": False,
            "fp8_multi_head_attention": False, "fp8_param": None, "fp8_param_gather": False, "fp4": None,
            "fp4_recipe": "nvfp4", "loss_scale": None, "initial_loss_scale": 4294967296, "min_loss_scale": 1.0,
            "loss_scale_window": 1000, "hysteresis": 2, "num_layers_at_start_in_bf16": 0,
            "num_layers_at_end_in_bf16": 0, "reuse_grad_buf_for_mxfp8_param_ag": False,
        },
        "dataset": {
            "dataloader_type": None, "num_workers": 8, "data_sharding": True, "pin_memory": True,
            "persistent_workers": False, "trust_remote_code": None
        },
        "model": {
            "make_vocab_size_divisible_by": 128, "rotary_scaling_factor": None, "tp_comm_overlap_cfg": None,
            "use_transformer_engine_full_layer_spec": False, "use_transformer_engine_op_fuser": False,
            "transformer_layer_spec": None, "hf_model_id": None, "should_pad_vocab": False,
            "mtp_enabled": False, "restore_modelopt_state": False, "use_arbitrary_attention_mask": None
        },
    },
    pinned_core={},
)
"""Bridge 0.3.1: Llama recipes in ``recipes/llama/llama2.py`` and ``llama3.py``; flat ``model``."""

UNCHANGED_IN_0_6_0 = ("rng", "rerun_state_machine", "comm_overlap", "ft", "straggler", "nvrx_straggler",
                      "inprocess_restart")
"""The sections whose fields and defaults Bridge 0.6.0 kept from 0.3.1."""

BRIDGE_0_6_0 = BridgeVersion(
    # Tag v0.6.0 (August 2026): src/megatron/bridge/training/config.py, whose sections now extend Megatron-LM's
    # megatron/training/config/ (training_config.py: TrainingConfig, ValidationConfig, LoggerConfig,
    # CheckpointConfig, TokenizerConfig; common_config.py: RNGConfig, ProfilingConfig, DistributedInitConfig;
    # resilience_config.py: RerunStateMachineConfig, StragglerDetectionConfig), data/base.py (DataloaderConfig),
    # training/tokenizers/config.py, training/comm_overlap.py, training/mixed_precision.py and models/gpt_provider.py.
    # ``validation`` is a new section; GPTDatasetConfig writes ``seq_length`` (not Megatron-Core's
    # ``sequence_length``) and its own ``data_path`` (Megatron data prefixes; the plugin reads it as its text corpus)
    # and ``per_dataset_sequences_path``.
    # It pins Megatron-LM cd4afff (core_v0.15.0rc7-2018), whose Megatron-Core fields beyond 0.16.1 are pinned_core.
    # DistributedInitConfig.local_rank defaults to $LOCAL_RANK, 0 in a dump made outside a launcher.
    name="0.6.0",
    sections={
        **{section: BRIDGE_0_3_1.sections[section] for section in UNCHANGED_IN_0_6_0},
        "train": {
            "micro_batch_size": REQUIRED, "global_batch_size": REQUIRED, "rampup_batch_size": None,
            "step_batch_size_schedule": None, "decrease_batch_size_if_needed": False, "empty_unused_memory_level":
            0, "check_weight_hash_across_dp_replicas_interval": None, "gpu_sniff_test_interval": None,
            "train_sync_interval": None, "train_iters": REQUIRED, "train_samples": None, "exit_interval": None,
            "exit_duration_in_mins": None, "exit_signal_handler": False, "exit_signal": 15,
            "exit_signal_handler_for_dataloader": False, "exit_signal_handler_for_training": False, "manual_gc":
            False, "manual_gc_interval": 0, "manual_gc_eval": True, "iterations_to_skip": [], "num_epochs": None,
            "check_optimizer_step_success": True, "skip_sync_grad_norm_across_mp": False, "eval_iters": None,
            "eval_interval": None, "skip_train": None
        },
        # SchedulerConfig extends Megatron-LM cd4afff's (training_config.py: the same fields) with max_steps.
        "scheduler": {**BRIDGE_0_3_1.sections["scheduler"], "max_steps": None},
        "validation": {
            "eval_iters": 100, "eval_interval": None, "start_eval_at_iter": None, "eval_global_batch_size": None,
            "eval_micro_batch_size": None, "skip_train": False, "test_mode": False, "full_validation": False,
            "multiple_validation_sets": False, "validation_set_names": None
        },
        "tokenizer": {
            "vocab_size": None, "padded_vocab_size": None, "pad_vocab_size": True, "vocab_file": None, "merge_file":
            None, "vocab_extra_ids": 0, "tokenizer_type": None, "tokenizer_model": None, "metadata_path": None,
            "special_tokens": None, "tiktoken_pattern": None, "tiktoken_num_special_tokens": 1000,
            "tokenizer_sentencepiece_legacy": False, "tokenizer_sentencepiece_ignore_extra_whitespaces": True,
            "tokenizer_hf_no_use_fast": False, "tokenizer_hf_no_include_special_tokens": False, "trust_remote_code":
            False, "null_tokenizer_eod_id": None, "null_tokenizer_pad_id": -1, "chat_template": None,
            "make_vocab_size_divisible_by": 1, "tensor_model_parallel_size": 1, "rank": 0,
            "use_tokenizer_vocab_size": False, "hf_tokenizer_kwargs": {}, "sp_tokenizer_kwargs": {},
            "chat_template_path": None, "tokenizer_prompt_format": None, "image_tag_type": None,
            "force_system_message": False
        },
        "logger": {
            **BRIDGE_0_3_1.sections["logger"],  # and 0.6.0"s new fields, and logging_level"s new default
            "log_memory_interval": None, "log_device_memory_used": False, "log_num_zeros_in_grad": False,
            "log_max_attention_logit": False, "barrier_with_L1_time": True, "logging_level": None,
            "moe_routing_trace_path": None, "moe_routing_trace_max_training_iters": None,
            "moe_routing_trace_capture_logits": False, "moe_routing_trace_capture_hidden_states": False,
            "moe_routing_trace_dump_weights": False, "skip_train_metrics_log": False, "mlflow_description":
            None, "mlflow_log_artifacts": True, "comet_project": None, "comet_experiment_name": None,
            "comet_workspace": None, "comet_api_key": None, "comet_tags": None
        },
        "checkpoint": {
            "save": None, "save_interval": None, "save_params_interval": None, "save_activations_interval": None,
            "save_tokens_per_expert_interval": None, "save_wgrads_interval": None, "save_dgrads_interval": None,
            "save_retain_interval": None, "most_recent_k": -1, "save_optim": True, "save_rng": True, "load": None,
            "load_optim": True, "load_main_params_from_ckpt": False, "load_rng": True,
            "non_persistent_save_interval": None, "non_persistent_ckpt_type": None,
            "non_persistent_global_ckpt_dir": None, "non_persistent_local_ckpt_dir": None,
            "non_persistent_local_ckpt_algo": "fully_parallel", "finetune": False, "pretrained_checkpoint": None,
            "ckpt_step": None, "use_checkpoint_args": False, "use_mp_args_from_checkpoint_args": False,
            "use_tokenizer_model_from_checkpoint_args": True, "exit_on_missing_checkpoint": False, "ckpt_format":
            "torch_dist", "auto_detect_ckpt_format": False, "ckpt_convert_format": None, "ckpt_convert_save": None,
            "ckpt_convert_update_legacy_dist_opt_format": False, "fully_parallel_save": True, "async_save": False,
            "async_strategy": "nvrx", "use_persistent_ckpt_worker": True, "async_ckpt_cpu_priority": 10,
            "async_ckpt_io_priority": 3, "async_ckpt_use_cpu_shm": False, "fully_parallel_load": False,
            "ckpt_fully_parallel_load_exchange_algo": "broadcast", "ckpt_fully_parallel_save_process_group": "dp",
            "ckpt_fully_parallel_load_process_group": "dp", "ckpt_assume_constant_structure": False,
            "ckpt_load_validate_sharding_integrity": True, "strict_fsdp_dtensor_load": False,
            "dist_ckpt_strictness": "assume_ok_unexpected", "dist_ckpt_save_pre_mcore_014": False,
            "dist_ckpt_optim_fully_reshardable": False, "distrib_optim_fully_reshardable_mem_efficient": False,
            "save_tokenizer_assets": True, "replication": False, "replication_jump": None, "replication_factor": 2,
            "verify_integrity": False, "storage_writers_per_rank": 1, "async_write_results_mp_mode": "fork",
            "custom_manager_class": None, "dist_ckpt_workers": 1, "also_save_hf_checkpoint": False,
            "hf_source_path": None, "hf_trust_remote_code": False, "hf_distributed_save": False,
            "hf_save_every_n_ranks": 1
        },
        "dist": {
            "distributed_backend": "nccl", "distributed_timeout_minutes": 10, "align_grad_reduce": True,
            "local_rank": 0, "lazy_mpu_init": False, "use_megatron_fsdp": False,
            "use_torch_fsdp2": False, "nccl_communicator_config_path": None, "use_tp_pp_dp_mapping": False,
            "use_gloo_process_groups": True, "use_sharp": False, "sharp_enabled_group": None,
            "high_priority_stream_groups": [], "distributed_timeout_seconds_after_init": None,
            "flight_recorder_dump_path": None, "flight_recorder_trace_buffer_size": 2000,
            "flight_recorder_dump_on_timeout": True, "flight_recorder_include_stack_trace": False,
            "flight_recorder_include_only_active": True, "flight_recorder_extra_dump_on_exec": True,
            "disable_jit_fuser": False, "external_gpu_device_mapping": False, "enable_megatron_core_experimental":
            False, "use_decentralized_pg": False, "eval_context_parallel_size": None
        },
        "profiling": {
            "use_nsys_profiler": False, "profile_step_start": 10, "profile_step_end": 12, "use_pytorch_profiler":
            False, "pytorch_profiler_collect_shapes": False, "pytorch_profiler_collect_callstack": False,
            "pytorch_profiler_collect_chakra": False, "profile_ranks": [0], "record_memory_history": False,
            "memory_snapshot_path": "/nemo_run/snapshot.pickle", "record_shapes": False, "nvtx_ranges": False
        },
        "tensor_inspect": {
            "enabled": False, "features": None, "feature_dirs": None, "allow_custom_feature_dirs": False, "log_dir":
            None, "init_training_step": 0
        },
        "mixed_precision": {**BRIDGE_0_3_1.sections["mixed_precision"], "fp4_param": None, "fp4_param_gather": False},
        "dataset": {
            "dataloader_type": None, "num_workers": 2, "data_sharding": True, "pin_memory": True, "drop_last": True,
            "persistent_workers": True, "trust_remote_code": None, "dataloader_save": None, "dataloader_load": None,
            "seq_length": REQUIRED, "data_path": None, "per_dataset_sequences_path": None
        },
        "model": {
            "make_vocab_size_divisible_by": 128, "rotary_scaling_factor": None, "yarn_rotary_scaling_factor": None,
            "yarn_original_max_position_embeddings": None, "yarn_beta_fast": None, "yarn_beta_slow": None,
            "yarn_mscale": None, "yarn_mscale_all_dim": None, "yarn_correction_range_round_to_int": None,
            "tp_comm_overlap_cfg": None, "use_transformer_engine_full_layer_spec": False, "dense_grouped_gemm":
            False, "transformer_layer_spec": None, "hf_model_id": None, "hf_model_revision": None,
            "should_pad_vocab": False, "mtp_enabled": False, "restore_modelopt_state": False,
            "use_arbitrary_attention_mask": None
        },
    },
    pinned_core={
        "model": {
            "tensor_parallel_num_weight_shards": None, "gtp_weight_remat_size": 1,
            "expert_tensor_parallel_num_weight_shards": None, "expert_gtp_weight_remat_size": 1,
            "moe_grad_scale_func": None, "mtp_grad_scale_func": None,
            "overlap_dispatch_backward_with_experts_wgrad": False, "cpu_offloading_retain_pinned_cpu_buffers":
            False, "mtp_use_repeated_layer": False, "mtp_detach_heads": False, "mtp_hybrid_override_pattern": None,
            "flash_attention_version": None, "experimental_attention_variant_loss_scale_func": None,
            "dsa_indexer_topk_freq": 1,
            "dsa_indexer_skip_topk_offset": 0, "dsa_kernel_backend": "none", "dsa_indexer_rope_interleaved": False,
            "dsa_indexer_rotate_activation": True, "dsa_indexer_scoring_relu": True, "dsa_indexer_k_norm_epsilon":
            None, "dsa_indexer_k_norm_fp32": False, "use_mup": False, "mup_width_mult": 1.0, "mup_base_hidden_size":
            None, "mup_embedding_mult": 1.0, "mup_output_mult": 1.0, "mup_base_head_dim": None,
            "mup_attn_scale_power": 1.0, "fused_residual_rmsnorm": False, "use_transformer_engine_op_fuser": False,
            "fp8_output_proj": False, "high_priority_a2a_comm_stream": False, "use_grouped_gemm_for_shared_expert":
            False, "moe_shared_expert_glu_interleave_size": None, "moe_router_quantile_balancing_ema": 0.0,
            "moe_router_force_biased": None, "use_grouped_gemm_for_dense_mlp": False, "moe_single_grouped_weight":
            False, "moe_single_grouped_bias": False, "moe_permute_fusion_into_hybridep": False,
            "moe_hybridep_pad_uneven_dispatch_inputs": False, "moe_pad_experts_for_cuda_graph_inference": False,
            "moe_flex_dispatcher_num_sms": None, "moe_deepep_num_sms": None, "moe_hybridep_num_sms": None,
            "moe_hybridep_num_blocks_permute": None, "moe_hybridep_num_blocks_unpermute": None,
            "moe_hybridep_num_sms_preprocessing": 108, "moe_ncclep_static_shape": False, "moe_ncclep_use_symm_mem":
            False, "moe_mlp_glu_interleave_size": None, "moe_expert_rank_capacity_factor": None,
            "cuda_graph_use_single_mempool": True, "cuda_graph_modules": "full", "inference_cuda_graph_scope": None,
            "cuda_graph_scope": None, "nccl_all_reduce_for_prefill": False, "inference_disable_triton_nvls_kernels":
            False, "inference_grouped_gemm_backend": "vllm", "inference_moe_disable_fused_quant_kernels": False,
            "inference_moe_token_dispatcher_type": "nvls", "mamba_training_ssm_states_dtype": None,
            "mlp_chunks_for_training": 1,
            "delay_offload_until_cuda_graph": False, "delta_offload_bytes_across_pp_ranks": 0,
            "activation_offload_fraction": 1.0, "moe_paged_stash": False, "moe_paged_stash_page_size": 64,
            "moe_paged_stash_buffer_size_factor_cuda": 1.1, "moe_paged_stash_buffer_size_factor_cpu": 0.0,
            "fine_grained_offloading_max_inflight_offloads": None
        },
        "optimizer": {
            "muon_nesterov": False, "muon_coefficient_type": "quintic",
            "muon_scalar_optimizer": "adam", "lion_beta1": 0.95, "lion_beta2": 0.98, "soap_shampoo_beta": 0.95,
            "soap_precondition_frequency": 1, "soap_use_kl_shampoo": True, "adaptive_muon_moment2_method":
            "adamuon", "adaptive_muon_beta2": 0.95, "adaptive_muon_eps": 1e-08,
            "use_layer_wise_distributed_optimizer": False, "grad_norm_skip_threshold": math.inf,
            "optimizer_cuda_graph": False
        },
        "ddp": {
            "num_buckets": None, "param_name_patterns_for_fp32_local_accumulation": [], "fp4_param_gather": False,
            "fsdp_db_use_persist_buf_on_alloc_fail": False, "fsdp_all_gather_in_start_param_sync": True,
            "megatron_fsdp_main_params_dtype": "torch.float32", "megatron_fsdp_main_grads_dtype": None,
            "megatron_fsdp_grad_comm_dtype": None, "megatron_fsdp_use_decoupled_grad": False,
            "megatron_fsdp_cuda_graph_mode": False, "megatron_fsdp_enable_fine_grained_param_gather": False,
            "megatron_fsdp_max_pool_double_buffer": False
        },
        "dataset": {
            "inter_document_masking": False
        },
    },
)
"""Bridge 0.6.0: Llama recipes moved to ``recipes/llama/h100/`` with hardware in their names
(``llama2_7b_pretrain_2gpu_h100_bf16_config``); flat ``model``."""

BRIDGE_VERSIONS: tuple[BridgeVersion, ...] = (BRIDGE_0_3_1, BRIDGE_0_6_0)
"""The Bridge versions the plugin reads, oldest first: a recipe is read as the first that knows
every key in it (``closest_version``)."""

_GPT_MODEL_NAMES = {"max_sequence_length": "seq_length"}
"""GPTModel's constructor names that Bridge's provider spells differently."""
_GPT_MODEL_RUNTIME = {"self", "config", "transformer_layer_spec", "pre_process", "post_process", "mtp_block_spec",
                      "vp_stage", "pg_collection"}
"""GPTModel constructor arguments that are objects passed at build time, not settings."""
_PLUGIN_DATASET_FIELDS = {"data_path": None, "seq_length": None}
"""``dataset.data_path``, the plugin's text file or directory to train on (Bridge's own field from
0.4 on), and ``seq_length``, Bridge's alias of ``sequence_length`` (a property before 0.6, so
not dumped, and a field from 0.6 on)."""


def encode(value: Any) -> Any:
    """``value`` as Bridge writes it in YAML: dtypes and functions by dotted name, enums by name."""
    import torch

    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.name
    if inspect.isroutine(value) or isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return value


def _dataclass_defaults(cls: type) -> dict[str, Any]:
    defaults = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = encode(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = encode(field.default_factory())
        else:
            defaults[field.name] = REQUIRED
    return defaults


def _gpt_model_defaults() -> dict[str, Any]:
    from megatron.core.models.gpt.gpt_model import GPTModel

    defaults = {}
    for name, parameter in inspect.signature(GPTModel.__init__).parameters.items():
        if name in _GPT_MODEL_RUNTIME or parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        empty = parameter.default is inspect.Parameter.empty
        defaults[_GPT_MODEL_NAMES.get(name, name)] = REQUIRED if empty else encode(parameter.default)
    return defaults


def _version(name: str) -> BridgeVersion:
    return next(version for version in BRIDGE_VERSIONS if version.name == name)


@functools.cache
def section_fields(section: str, version: str = BRIDGE_VERSIONS[0].name) -> dict[str, Any]:
    """Field name -> default of a ConfigContainer section as Bridge ``version`` writes it
    (``model`` flat: the nested layout's outer and ``transformer`` fields together); empty
    for a section the version does not have."""
    bridge = _version(version)
    own, pinned = bridge.sections.get(section, {}), bridge.pinned_core.get(section, {})
    if section == "model":
        from megatron.core.transformer.transformer_config import TransformerConfig

        core = {**_gpt_model_defaults(), **_dataclass_defaults(TransformerConfig)}
        return {**NESTED_MODEL_FIELDS, **own, **core, **pinned}
    if section == "optimizer":
        from megatron.core.optimizer import OptimizerConfig

        return {**_dataclass_defaults(OptimizerConfig), **pinned}
    if section == "ddp":
        from megatron.core.distributed import DistributedDataParallelConfig

        return {**_dataclass_defaults(DistributedDataParallelConfig), **pinned}
    if section == "dataset":
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

        return {**_dataclass_defaults(GPTDatasetConfig), **pinned, **_PLUGIN_DATASET_FIELDS, **own}
    return dict(own)


def checked_sections() -> frozenset[str]:
    """Every section some version has a field table for (Bridge's ``scheduler`` is read elsewhere)."""
    return frozenset({"model", "optimizer", "ddp", "dataset"}.union(*(v.sections for v in BRIDGE_VERSIONS)))


def closest_version(keys: Iterable[str]) -> tuple[str, list[str]]:
    """The Bridge version a recipe's ``section.field`` keys are read as, and those of its keys
    that version does not know: the first version (oldest first) that knows them all, else the
    one that knows the most (the newest of a tie)."""
    keys = list(keys)
    best: tuple[str, list[str]] | None = None
    for version in BRIDGE_VERSIONS:
        unknown = [key for key in keys if key.partition(".")[2] not in section_fields(key.partition(".")[0],
                                                                                       version.name)]
        if not unknown:
            return version.name, []
        if best is None or len(unknown) <= len(best[1]):
            best = (version.name, unknown)
    return best


@functools.cache
def transformer_fields() -> frozenset[str]:
    """TransformerConfig's field names: the nested layout's ``model.transformer.*``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return frozenset(field.name for field in dataclasses.fields(TransformerConfig))


def megatron_core_version() -> str:
    from megatron.core.package_info import __version__

    return __version__
