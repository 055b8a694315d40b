"""Every field a Megatron-Bridge ``ConfigContainer`` section may hold, with its default,
asked from the dataclasses Bridge serializes: Megatron-Core's ``TransformerConfig``,
``GPTModel``'s constructor, ``OptimizerConfig``, ``DistributedDataParallelConfig`` and
``GPTDatasetConfig``, as installed. A hand list would miss the next Megatron-Core field.

Bridge's own dataclasses (its training, RNG, scheduler, logger and tokenizer configs, the GPT
provider's extra fields) are not installed with the plugin, which must not need Bridge;
their names and defaults are listed here from Megatron-Bridge 0.3.1's
``training/config.py``, ``training/tokenizers/config.py`` and ``models/gpt_provider.py``,
and from Megatron-LM's ``training/models`` (the nested ``model.transformer`` layout).

Values are compared as Bridge writes them in YAML: a torch dtype or a function as its
dotted name (``torch.bfloat16``, ``torch.nn.functional.silu``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from typing import Any, Mapping

__all__ = ["REQUIRED", "encode", "megatron_core_version", "section_fields", "transformer_fields"]

REQUIRED = object()
"""The default of a field that has none: the recipe must give it."""

BRIDGE_MODEL_FIELDS: Mapping[str, Any] = {
    "seq_length": REQUIRED, "make_vocab_size_divisible_by": 128, "should_pad_vocab": False,
    "hf_model_id": None, "mtp_enabled": False, "restore_modelopt_state": False, "rotary_scaling_factor": None,
    "tp_comm_overlap_cfg": None, "transformer_layer_spec": None, "use_arbitrary_attention_mask": None,
    "use_transformer_engine_full_layer_spec": False, "use_transformer_engine_op_fuser": False,
    "generation_config": None, "logit_dtype": None, "extra_checkpoint_metadata": None,
}
"""The GPT provider's fields beyond TransformerConfig and GPTModel's constructor (Bridge's
``GPTModelProvider``; ``logit_dtype`` and ``extra_checkpoint_metadata`` are on Megatron-LM's
``GPTModelConfig``, the outer half of the nested layout)."""

BRIDGE_SECTIONS: Mapping[str, Mapping[str, Any]] = {
    "train": {
        "micro_batch_size": REQUIRED, "global_batch_size": REQUIRED, "train_iters": REQUIRED,
        "rampup_batch_size": None, "decrease_batch_size_if_needed": False, "empty_unused_memory_level": 0,
        "check_weight_hash_across_dp_replicas_interval": None, "train_sync_interval": None, "train_samples": None,
        "exit_interval": None, "exit_duration_in_mins": None, "exit_signal_handler": False, "exit_signal": None,
        "exit_signal_handler_for_dataloader": False, "manual_gc": False, "manual_gc_interval": 0,
        "manual_gc_eval": True, "iterations_to_skip": [], "eval_iters": 100, "eval_interval": 1000,
        "skip_train": False,
    },
    "rng": {"seed": 1234, "te_rng_tracker": False, "inference_rng_tracker": False, "data_parallel_random_init": False},
    "scheduler": {
        "lr_decay_style": "linear", "lr_wsd_decay_style": "exponential", "lr_decay_iters": None,
        "lr_decay_samples": None, "lr_wsd_decay_iters": None, "lr_wsd_decay_samples": None,
        "lr_warmup_fraction": None, "lr_warmup_iters": 0, "lr_warmup_samples": 0, "lr_warmup_init": 0.0,
        "override_opt_param_scheduler": False, "use_checkpoint_opt_param_scheduler": False,
        "start_weight_decay": None, "end_weight_decay": None, "weight_decay_incr_style": "constant",
        "no_weight_decay_cond_type": None, "lr_warmup_steps": None, "lr_decay_steps": None, "wd_incr_steps": None,
        "wsd_decay_steps": None,
    },
    "tokenizer": {
        "legacy_tokenizer": False, "metadata_path": None, "vocab_size": None, "vocab_file": None, "merge_file": None,
        "vocab_extra_ids": 0, "tokenizer_type": None, "tokenizer_model": None, "special_tokens": None,
        "chat_template": None, "tiktoken_pattern": None, "tiktoken_num_special_tokens": 1000,
        "tiktoken_special_tokens": None, "tokenizer_prompt_format": None, "image_tag_type": None,
        "hf_tokenizer_kwargs": {}, "sp_tokenizer_kwargs": {},
    },
    "logger": {
        "log_interval": 100, "log_params_norm": False, "log_throughput": False, "log_throughput_to_tensorboard": False,
        "throughput_window_size": 100, "log_progress": False, "timing_log_level": 0, "timing_log_option": "minmax",
        "tensorboard_dir": None, "tensorboard_log_interval": 1, "tensorboard_queue_size": 1000,
        "log_timers_to_tensorboard": False, "log_loss_scale_to_tensorboard": True,
        "log_validation_ppl_to_tensorboard": False, "log_memory_to_tensorboard": False, "memory_keys": None,
        "log_l2_norm_grad_to_tensorboard": False, "log_runtime_to_tensorboard": False, "runtime_time_unit": "hours",
        "log_world_size_to_tensorboard": False, "wandb_project": None, "wandb_exp_name": None,
        "wandb_save_dir": None, "wandb_entity": None, "mlflow_experiment": None, "mlflow_run_name": None,
        "mlflow_tracking_uri": None, "mlflow_tags": None, "logging_level": 20, "filter_warnings": True,
        "modules_to_filter": None, "set_level_for_all_loggers": False, "log_energy": False,
        "save_config_filepath": None,
    },
}
"""Bridge's own sections: TrainingConfig, RNGConfig, SchedulerConfig (its ``*_steps`` are the
sample counts ``finalize`` derives), TokenizerConfig, LoggerConfig."""

BRIDGE_DATALOADER_FIELDS: Mapping[str, Any] = {
    "dataloader_type": None, "num_workers": 8, "data_sharding": True, "pin_memory": True,
    "persistent_workers": False, "trust_remote_code": None, "seq_length": None, "data_path": None,
}
"""Bridge's ``DataloaderConfig``, mixed into its GPTDatasetConfig; ``seq_length`` is its alias
of ``sequence_length``; ``data_path`` is the plugin's: a text file or directory to train on."""

_GPT_MODEL_NAMES = {"max_sequence_length": "seq_length"}
"""GPTModel's constructor names that Bridge's provider spells differently."""
_GPT_MODEL_RUNTIME = {"self", "config", "transformer_layer_spec", "pre_process", "post_process", "mtp_block_spec",
                      "vp_stage", "pg_collection"}
"""GPTModel constructor arguments that are objects passed at build time, not settings."""


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


@functools.cache
def section_fields(section: str) -> dict[str, Any]:
    """Field name -> default of a ConfigContainer section the plugin reads (``model`` flat:
    the nested layout's outer and ``transformer`` fields together)."""
    if section == "model":
        from megatron.core.transformer.transformer_config import TransformerConfig

        return {**BRIDGE_MODEL_FIELDS, **_gpt_model_defaults(), **_dataclass_defaults(TransformerConfig)}
    if section == "optimizer":
        from megatron.core.optimizer import OptimizerConfig

        return _dataclass_defaults(OptimizerConfig)
    if section == "ddp":
        from megatron.core.distributed import DistributedDataParallelConfig

        return _dataclass_defaults(DistributedDataParallelConfig)
    if section == "dataset":
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

        return {**_dataclass_defaults(GPTDatasetConfig), **BRIDGE_DATALOADER_FIELDS}
    return dict(BRIDGE_SECTIONS[section])


@functools.cache
def transformer_fields() -> frozenset[str]:
    """TransformerConfig's field names: the nested layout's ``model.transformer.*``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return frozenset(field.name for field in dataclasses.fields(TransformerConfig))


def megatron_core_version() -> str:
    from megatron.core.package_info import __version__

    return __version__
