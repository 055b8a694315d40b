"""Megatron-Bridge recipes read as odyssey recipes, as Bridge writes them.

A Megatron user's recipe is Megatron-Bridge's ``ConfigContainer`` as YAML, hand-written or
dumped by ``ConfigContainer.to_yaml()``: TP, PP and the architecture under ``model`` (flat,
as Bridge 0.3's GPT provider writes it, or nested under ``model.transformer`` as current
Bridge does), batch sizes under ``train``, then ``optimizer``, ``ddp``, ``rng``,
``dataset``, ``tokenizer``, ``logger`` and ``mixed_precision``; the data-parallel size
comes from the world size; ``scheduler`` and ``optimizer.min_lr`` give the learning-rate
schedule, run by Megatron-Core's own scheduler. With ``odyssey:`` (and ``cluster:``) sections added it is an
odyssey recipe: ``BridgeRecipe.translate`` renames its keys onto ``config.RecipeConfig``'s,
the same validation runs, and ``user_error`` names the keys of an error as the user wrote them.

Bridge's instantiation markers (``_target_``, ``_call_``, ...) are skipped and its
encodings of dtypes and functions read as their dotted names. Every key is checked against
the fields of the dataclass Bridge serialized it from, as the Bridge version the recipe reads
as wrote it (``bridge_fields.closest_version``; an unknown key's error names it): a field read is
renamed; a field the plugin does not use is named once in one note when it differs from
its default; a field that changes what runs (MoE, FP8, recomputation, a non-Llama layer)
must stay at Megatron-Core's default, or it is an error naming it. All unknown keys come in
one error. Nothing is defaulted silently: the architecture, batch sizes and precision must
be in the file unless a Hugging Face config supplies the architecture, and the optimizer's
defaults are Bridge's recipes' own.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from odyssey_megatron.bridge_fields import (BRIDGE_VERSIONS, REQUIRED, checked_sections, closest_version, encode,
                                            megatron_core_version, section_fields, transformer_fields)
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.optimizer_shards import REPLICAS
from odyssey_megatron.units import GIB

__all__ = ["BridgeRecipe", "is_bridge_recipe"]

KEYS = {
    "model.tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
    "model.pipeline_model_parallel_size": "parallel.pipeline_model_parallel_size",
    "model.num_layers": "model.num_layers",
    "model.hidden_size": "model.hidden_size",
    "model.ffn_hidden_size": "model.ffn_hidden_size",
    "model.num_attention_heads": "model.num_attention_heads",
    "model.num_query_groups": "model.num_query_groups",
    "model.vocab_size": "model.vocab_size",
    "model.seq_length": "model.seq_length",
    "model.share_embeddings_and_output_weights": "model.tie_embeddings",
    "model.rotary_base": "model.rope_theta",
    "model.layernorm_epsilon": "model.norm_epsilon",
    "model.spec": "model.spec",
    "train.global_batch_size": "training.global_batch_size",
    "train.micro_batch_size": "training.micro_batch_size",
    "train.train_iters": "training.train_iters",
    "optimizer.lr": "training.lr",
    "optimizer.clip_grad": "training.clip_grad",
    "optimizer.weight_decay": "training.weight_decay",
    "optimizer.adam_beta1": "training.adam_beta1",
    "optimizer.adam_beta2": "training.adam_beta2",
    "optimizer.adam_eps": "training.adam_eps",
    "optimizer.min_lr": "training.min_lr",
    **{f"scheduler.{key}": f"training.{key}" for key in (
        "lr_warmup_iters", "lr_warmup_fraction", "lr_warmup_init", "lr_decay_style", "lr_decay_iters",
        "lr_wsd_decay_style", "lr_wsd_decay_iters", "start_weight_decay", "end_weight_decay",
        "weight_decay_incr_style")},
    "rng.seed": "training.seed",
    "dataset.seq_length": "model.seq_length",
    "dataset.sequence_length": "model.seq_length",
    "dataset.data_path": "data.corpus",
    "dataset.path_to_cache": "data.cache_dir",
    "tokenizer.tokenizer_model": "data.tokenizer",
    "logger.wandb_project": "logger.wandb_project",
    "logger.wandb_exp_name": "logger.wandb_exp_name",
    "logger.wandb_entity": "logger.wandb_entity",
    "logger.wandb_save_dir": "logger.wandb_save_dir",
    "logger.log_interval": "logger.log_interval",
}
"""Bridge key -> odyssey key. Two Bridge keys for one setting must agree; a ``null`` where
Bridge's field is optional leaves the odyssey default (e.g. ``dataset.path_to_cache``)."""

OPTIONAL = frozenset({"model.num_query_groups", "model.spec", "dataset.seq_length", "dataset.sequence_length",
                      "dataset.data_path", "dataset.path_to_cache", "tokenizer.tokenizer_model", "logger.wandb_project",
                      "logger.wandb_exp_name", "logger.wandb_entity", "logger.wandb_save_dir", "optimizer.min_lr",
                      "scheduler.lr_warmup_fraction", "scheduler.lr_decay_iters", "scheduler.lr_wsd_decay_iters",
                      "scheduler.start_weight_decay", "scheduler.end_weight_decay"})
"""Mapped Bridge fields that are Optional in Bridge: null means not given."""

BRIDGE_OPTIMIZER_DEFAULTS = {"training.lr": 3e-4, "training.weight_decay": 0.1, "training.adam_beta1": 0.9,
                             "training.adam_beta2": 0.95, "training.adam_eps": 1e-8, "training.clip_grad": 1.0}
"""Where a recipe leaves them out, Bridge's pretraining recipes' optimizer settings
(``distributed_fused_adam_with_cosine_annealing`` in Bridge 0.3.1's ``recipes/utils``)."""
BRIDGE_SCHEDULER_DEFAULTS = {"training.lr_decay_style": "linear"}
"""Where a recipe leaves them out, the defaults of Bridge's ``SchedulerConfig`` that differ
from the plugin's (whose default decay is constant, as its recipes trained before)."""

REQUIRED_SETTINGS = {
    "model.num_layers": "model.num_layers", "model.hidden_size": "model.hidden_size",
    "model.ffn_hidden_size": "model.ffn_hidden_size", "model.num_attention_heads": "model.num_attention_heads",
    "model.vocab_size": "model.vocab_size", "model.seq_length": "model.seq_length",
    "model.tie_embeddings": "model.share_embeddings_and_output_weights",
    "training.global_batch_size": "train.global_batch_size", "training.micro_batch_size": "train.micro_batch_size",
    "training.train_iters": "train.train_iters",
}
"""Odyssey key -> Bridge key of the settings a Bridge recipe must give, since Bridge's Python
recipe, not its YAML, supplies them; the model's may come from a Hugging Face config instead."""
ARCHITECTURE = frozenset(key for key in REQUIRED_SETTINGS if key.startswith("model."))

PRECISION = ("model.params_dtype", "model.bf16", "model.fp16")
"""The model's precision fields, read where ``mixed_precision`` is null or absent."""
DTYPES = {
    **{name: "bf16" for name in ("bf16", "bfloat16", "torch.bfloat16", "bf16-mixed")},
    **{name: "fp16" for name in ("fp16", "float16", "torch.float16", "16-mixed")},
    **{name: "fp32" for name in ("fp32", "float32", "torch.float32", "32-true")},
}
"""Bridge's spellings of model.params_dtype (its ``str_to_dtype``; YAML dumps write ``torch.bfloat16``)."""
MIXED_PRECISION = {"bf16_mixed": "bf16", "bf16-mixed": "bf16", "fp16_mixed": "fp16", "fp16-mixed": "fp16"}
"""Bridge's mixed-precision recipes without FP8/FP4 -> the dtype they train in."""
FP16_REFUSAL = ("fp16 training needs a loss scaler (Megatron's DynamicGradScaler), which the plugin's training "
                "loop does not apply, so small gradients would vanish; use bf16_mixed, or null for fp32")

HF_REFERENCES = ("model.hf_model_id", "model.spec")
"""Where a Bridge recipe names the Hugging Face model it was built from (``hf_model_id``:
Bridge 0.3's provider field; the nested layout records it under
``model.extra_checkpoint_metadata``), or the plugin's own ``model.spec``."""
DISTRIBUTED_OPTIMIZER = ("optimizer.use_distributed_optimizer", "ddp.use_distributed_optimizer")

FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "model.context_parallel_size": ((1,), "Odyssey plans over TP x PP x DP"),
    "model.virtual_pipeline_model_parallel_size": ((None,), "interleaved pipelines are not planned"),
    "model.sequence_parallel": ((False,), "the plugin's layers do not split sequences"),
    "model.normalization": (("RMSNorm",), "the model is Llama-shaped"),
    "model.gated_linear_unit": ((True,), "the model is Llama-shaped (SwiGLU)"),
    "model.activation_func": (("silu", "torch.nn.functional.silu"), "the model is Llama-shaped (SwiGLU)"),
    "model.position_embedding_type": (("rope",), "the model is Llama-shaped"),
    "model.add_bias_linear": ((False,), "the model is Llama-shaped"),
    "model.hidden_dropout": ((0.0,), "the plugin trains without dropout"),
    "model.attention_dropout": ((0.0,), "the plugin trains without dropout"),
    "optimizer.optimizer": (("adam",), "workers step Adam"),
    "dataset.blend": ((None,), "the plugin reads text: give a file or directory as dataset.data_path"),
    "dataset.blend_per_split": ((None,), "the plugin reads text: give a file or directory as dataset.data_path"),
    "tokenizer.tokenizer_type": (
        ("HuggingFaceTokenizer", "NullTokenizer"),
        "HuggingFaceTokenizer reads a local tokenizer directory given as tokenizer.tokenizer_model; "
        "with NullTokenizer the plugin trains a byte-level BPE on the corpus",
    ),
}
"""Bridge key -> (the values the plugin runs with, why): anything else is an error."""

UNUSED_MODEL = frozenset({
    "apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
    "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "gradient_accumulation_fusion", "persist_layer_norm",
    "memory_efficient_layer_norm", "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "attention_backend",
    "transformer_impl", "transformer_layer_spec", "use_transformer_engine_full_layer_spec",
    "use_transformer_engine_op_fuser", "use_te_rng_tracker", "use_kitchen", "use_kitchen_attention",
    "kitchen_attention_backend", "deallocate_pipeline_outputs", "batch_p2p_comm", "batch_p2p_sync",
    "async_tensor_model_parallel_allreduce", "overlap_p2p_comm", "overlap_p2p_comm_warmup_flush",
    "use_ring_exchange_p2p", "pipeline_model_parallel_comm_backend", "defer_embedding_wgrad_compute",
    "wgrad_deferral_limit", "clone_scatter_output_in_embedding", "scatter_embedding_sequence_parallel",
    "symmetric_ar_type", "barrier_with_L1_time", "timers", "config_logger_dir", "init_method",
    "output_layer_init_method", "init_method_std", "embedding_init_method", "embedding_init_method_std",
    "perform_initialization", "use_cpu_initialization", "init_model_with_meta_device", "finalize_model_grads_func",
    "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func", "enable_cuda_graph",
    "external_cuda_graph", "deterministic_mode", "disable_parameter_transpose_cache", "flash_decode", "test_mode",
    "variable_seq_lengths", "hetereogenous_dist_checkpoint", "log_max_attention_logit", "pipeline_dtype",
    "autocast_dtype", "offload_modules", "make_vocab_size_divisible_by", "should_pad_vocab", "parallel_output",
    "fp16_lm_cross_entropy", "restore_modelopt_state", "use_arbitrary_attention_mask", "mtp_enabled",
    "rope_scaling_factor", "generation_config", "logit_dtype", "extra_checkpoint_metadata", "hf_model_id",
    "hf_model_revision",
})
"""Model fields that do not change the plan or the result the plugin trains to: kernels,
fusions, communication overlap, initialisation, hooks Bridge sets at run time, provenance;
``rope_scaling_factor`` is read only with ``rope_scaling``, which must stay false. Every
other model field must stay at Megatron-Core's default."""
UNUSED_MODEL_PREFIXES = ("tp_comm_", "cuda_graph_", "inference_")
UNUSED_OPTIMIZER = frozenset({
    "decoupled_min_lr", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
    "hysteresis", "sgd_momentum", "overlap_param_gather", "overlap_param_gather_with_optimizer_step",
    "barrier_with_L1_time", "log_num_zeros_in_grad", "timers", "config_logger_dir", "pin_cpu_grads",
    "pin_cpu_params", "use_torch_optimizer_for_cpu_offload", "overlap_cpu_optimizer_d2h_h2d",
    "apply_wd_to_qk_layernorm", "store_param_remainders", "bf16", "fp16", "params_dtype",
})
"""Optimizer fields without effect here: decoupled learning rates are not scheduled, loss
scaling is fp16's, SGD and Muon are other optimizers, and the precision flags are set from
``mixed_precision`` as Bridge sets them."""
UNUSED_OPTIMIZER_PREFIXES = ("muon_",)
MUST_STAY_DEFAULT = {
    "ddp": frozenset({"use_megatron_fsdp", "use_custom_fsdp", "data_parallel_sharding_strategy",
                      "num_distributed_optimizer_instances", "fp8_param_gather"}),
    "train": frozenset({"rampup_batch_size", "train_samples", "iterations_to_skip", "skip_train"}),
    "dataset": frozenset(), "rng": frozenset(), "tokenizer": frozenset(), "logger": frozenset(),
    "scheduler": frozenset({"no_weight_decay_cond_type", "lr_decay_samples", "lr_warmup_samples",
                            "lr_wsd_decay_samples", "max_steps"}),
}
"""In these sections every field not read is unused (how gradients are reduced, data loaded,
runs logged, the scheduler's sample counts, which Bridge derives from the iteration keys the
plugin reads, and its checkpoint options) except these, which change what runs: FSDP, batch
ramp-up, training or scheduling by samples, a schedule stretched past ``train_iters``
(``max_steps``), another rule for which parameters take no weight decay."""

WHY_DEFAULT = (
    (("num_moe_experts", "moe_", "expert_"), "mixture of experts; the plugin trains dense Llama layers"),
    (("fp8", "fp4", "first_last_layers_bf16", "num_layers_at_"), "FP8/FP4 training; the plugin trains bf16 or fp32"),
    (("recompute_", "distribute_saved_activations"), "activation recomputation; the plugin plans memory without it"),
    (("cpu_offloading", "fine_grained_activation_offloading", "optimizer_cpu_offload", "optimizer_offload_fraction"),
     "offloading to host memory, which the plugin does not plan"),
    (("rope_scaling", "rotary_", "seq_len_interpolation_factor", "mrope_section", "no_rope_freq"),
     "a RoPE variant; the plugin's layers rotate with plain RoPE"),
    (("mtp_",), "multi-token prediction"),
    (("use_megatron_fsdp", "use_custom_fsdp", "data_parallel_sharding_strategy", "num_distributed_optimizer_"),
     "sharded data parallelism; the plugin keeps whole layers per rank"),
    (("rampup_batch_size", "train_samples", "iterations_to_skip", "skip_train"),
     "the plugin runs train_iters steps of global_batch_size samples"),
    (("no_weight_decay_cond",), "the plugin's weight decay skips biases and 1-D tensors, as Megatron's default"),
)
"""Why a field must stay at its default, by prefix; other model fields change the layer."""

READ_SECTIONS = ("model", "train", "optimizer", "scheduler", "ddp", "rng", "dataset", "tokenizer", "logger")
OWN_SECTIONS = ("cluster", "odyssey")
"""The plugin's sections, the same in both layouts, validated by its schema."""
IGNORED_SECTIONS = (
    "env_vars", "rerun_state_machine", "optimizer_config_override_provider", "validation", "checkpoint", "dist",
    "ft", "straggler", "nvrx_straggler", "profiling", "comm_overlap", "tensor_inspect", "inprocess_restart",
)
"""ConfigContainer's other sections: how Bridge checkpoints, validates, logs and launches; their
keys checked where ``bridge_fields`` has their fields, then dropped and named in the note."""
ODYSSEY_ONLY_SECTIONS = ("parallel", "training", "data")
SECTIONS = (*READ_SECTIONS, *OWN_SECTIONS, *IGNORED_SECTIONS, "mixed_precision", "peft")
_BRIDGE_ONLY_MODEL_KEYS = (
    {key.partition(".")[2] for key in [*KEYS, *FIXED, *PRECISION, *HF_REFERENCES] if key.startswith("model.")}
    | {"transformer", "_target_"}
) - {odyssey.partition(".")[2] for odyssey in KEYS.values() if odyssey.startswith("model.")} - {"params_dtype"}
"""Keys under ``model`` that only Bridge's layout has: a sign of it (asked without
importing Megatron-Core, which odyssey-layout recipes never need)."""
MARKERS = frozenset({"_target_", "_call_", "_partial_", "_args_", "_builder_"})
"""Keys Bridge adds for instantiation (its ``instantiate_utils``), not settings."""


def plain(value: Any) -> Any:
    """Bridge's YAML encodings as plain values: markers dropped, a reference to a dtype or
    function (``{_target_: torch.bfloat16, _call_: false}``) as its dotted name, and an enum
    member, which Bridge writes as a call of its class on its value
    (``{_target_: signal.Signals, _call_: true, _args_: [15]}``), as that value."""
    if isinstance(value, dict):
        rest = {key: plain(item) for key, item in value.items() if key not in MARKERS}
        if "_target_" in value and value.get("_call_") is False and not rest:
            return value["_target_"]
        args = value.get("_args_")
        if value.get("_call_") is True and isinstance(args, list) and len(args) == 1 and not rest:
            return plain(args[0])
        return rest
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def _settings(section: str, body: dict) -> dict[str, tuple[str, Any]]:
    """A read section's settings: flat key (``model.num_layers``) -> (the key as written, value);
    ``model.transformer.*`` and the nested layout's HF reference come up to ``model.*``."""
    out = {}
    for key, value in body.items():
        if section == "model" and key == "transformer" and isinstance(value, dict):
            out.update({f"model.{name}": (f"model.transformer.{name}", item) for name, item in value.items()})
            continue
        if section == "model" and key == "extra_checkpoint_metadata" and isinstance(value, dict):
            if "hf_model_id" in value:
                out["model.hf_model_id"] = ("model.extra_checkpoint_metadata.hf_model_id", value["hf_model_id"])
        out[f"{section}.{key}"] = (f"{section}.{key}", value)
    return out


def _bridge_signs(recipe: Mapping) -> list[str]:
    sections = [str(s) for s in recipe
                if s in READ_SECTIONS + IGNORED_SECTIONS + ("_target_", "mixed_precision") and s not in ("model", "logger")]
    model = recipe.get("model")
    keys = [f"model.{k}" for k in model if k in _BRIDGE_ONLY_MODEL_KEYS] if isinstance(model, Mapping) else []
    return sections + keys


def is_bridge_recipe(recipe: DictConfig) -> bool:
    """Whether the file is in Megatron-Bridge's layout (it has ``train:``, TP under
    ``model``, ``_target_``, ...); one mixing both layouts is an error naming the odyssey section."""
    signs = _bridge_signs(OmegaConf.to_container(recipe, resolve=False))
    mixed = [section for section in ODYSSEY_ONLY_SECTIONS if section in recipe]
    if signs and mixed:
        raise _mixed_layouts(mixed[0], signs[0])
    return bool(signs)


def _mixed_layouts(section: str, sign: str) -> ConfigError:
    return ConfigError(section, f"is the odyssey layout's section, but this recipe is Megatron-Bridge's (it has "
                                f"{sign}); write it in Bridge's sections (model, train, optimizer, rng, dataset, "
                                "tokenizer) or use the odyssey layout alone")


def _same(value: Any, allowed: Any) -> bool:
    return value == allowed and isinstance(value, bool) == isinstance(allowed, bool)


def _at_default(value: Any, default: Any) -> bool:
    """Whether a value is its field's default; null, [] and {} are all "none"."""
    if default is REQUIRED:
        return False
    empty = (None, [], {})
    return (value in empty and default in empty) or _same(encode(value), default)


def _yaml_value(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _unused(section: str, name: str) -> bool:
    """Whether a known field of ``section`` does not change what the plugin runs."""
    if section == "model":
        return name in UNUSED_MODEL or name.startswith(UNUSED_MODEL_PREFIXES)
    if section == "optimizer":
        return name in UNUSED_OPTIMIZER or name.startswith(UNUSED_OPTIMIZER_PREFIXES)
    return name not in MUST_STAY_DEFAULT[section]


def _why_default(name: str) -> str:
    return next((why for prefixes, why in WHY_DEFAULT if name.startswith(prefixes)),
                "it changes the layer, which the plugin builds as Llama's")


def _unknown(keys: list[str], settings: Mapping[str, tuple[str, Any]], version: str) -> ConfigError:
    hints = []
    bridge_names = {odyssey: bridge for bridge, odyssey in reversed(KEYS.items())}
    for key in keys:
        section, _, name = key.partition(".")
        if not name:
            close = difflib.get_close_matches(section, SECTIONS, n=1)
        elif key in bridge_names:
            close = [bridge_names[key]]
        else:
            known = [*section_fields(section, version)] if section in checked_sections() else []
            close = [f"{section}.{match}" for match in difflib.get_close_matches(name, known, n=1)]
        if close:
            hints.append(f"{close[0]} for {settings[key][0] if key in settings else key}")
    written = ", ".join(settings[key][0] if key in settings else key for key in keys)
    versions = " and ".join(v.name for v in BRIDGE_VERSIONS)
    problem = (f"{'unknown key' if len(keys) == 1 else 'unknown keys'}: not fields of Megatron-Core "
               f"{megatron_core_version()}'s TransformerConfig, GPTModel, OptimizerConfig, "
               f"DistributedDataParallelConfig or GPTDatasetConfig, nor of Megatron-Bridge {version}'s config classes "
               f"(of the Bridge versions read, {versions}, the one that knows most of this file's keys)")
    if hints:
        problem += f" (did you mean: {'; '.join(hints)})"
    return ConfigError(written, problem)


def resolve_hf_reference(key: str, reference: Any) -> str:
    """A Hugging Face model reference (a local directory or config.json, or a hub id already
    in the local Hugging Face cache: nothing is downloaded) as the path of its config.json."""
    if not isinstance(reference, str) or not reference.strip():
        raise ConfigError(key, f"must name a Hugging Face model (a local directory holding config.json, or a hub id "
                               f"in the local Hugging Face cache); got {reference!r}")
    if Path(reference).exists():
        return reference
    if re.fullmatch(r"[\w.-]+/[\w.-]+", reference):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(reference, "config.json")
        if isinstance(cached, str):
            return cached
    raise ConfigError(key, f"{reference} is neither a local path nor a Hugging Face hub id with a config.json in the "
                           "local Hugging Face cache (HF_HUB_CACHE), and nothing is downloaded; fetch it first "
                           f"(hf download {reference} config.json) or give a local directory")


@dataclass(frozen=True)
class BridgeRecipe:
    """A Bridge recipe (file and overrides merged) renamed onto the odyssey layout."""

    recipe: DictConfig
    """The same settings in the odyssey layout."""
    names: dict[str, str]
    """Odyssey key -> the Bridge key the user wrote (or would write) for it."""
    ignored: tuple[str, ...]
    """Sections, then keys, the plugin does not use (keys only where not at their default)."""
    at_default: int
    """Known fields left at their defaults that the plugin does not read."""
    distributed_optimizer: Optional[str]
    """The key that asked for Megatron's distributed optimizer, if one did."""
    bridge_version: str
    """The Bridge version whose fields the recipe was checked against (``closest_version``)."""

    @classmethod
    def translate(cls, recipe: DictConfig, cli: DictConfig) -> "BridgeRecipe":
        """Merge the file and its overrides (both Bridge-shaped) and rename them; an unknown
        or unsupported key is a ConfigError naming the Bridge key."""
        settings: dict[str, tuple[str, Any]] = {}
        own: dict[str, dict] = {}
        ignored: dict[str, None] = {}
        unknown: list[str] = []
        unread_fields: list[str] = []  # keys checked against Bridge's field tables, not read as settings
        nested = False
        for layer in (recipe, cli):
            for section, body in plain(OmegaConf.to_container(layer, resolve=False)).items():
                if section in ODYSSEY_ONLY_SECTIONS:
                    raise _mixed_layouts(section, _bridge_signs(OmegaConf.to_container(recipe, resolve=False))[0])
                if section == "mixed_precision":
                    settings["mixed_precision"] = ("mixed_precision", body)
                    if isinstance(body, dict):  # a MixedPrecisionConfig, not a recipe name
                        unread_fields += [f"{section}.{name}" for name in body]
                elif section == "peft":
                    if body is not None:
                        raise ConfigError("peft", "adapters (LoRA, DoRA) are fine-tuning, which the plugin does not "
                                                  "run; it pretrains whole models: leave peft null")
                elif section in IGNORED_SECTIONS:
                    ignored[section] = None
                    if section in checked_sections() and isinstance(body, dict):
                        unread_fields += [f"{section}.{name}" for name in body]
                elif section in READ_SECTIONS + OWN_SECTIONS:
                    if not isinstance(body, dict):
                        raise ConfigError(section, f"is a section and must be a mapping of its keys; got {body!r}")
                    if section in OWN_SECTIONS:
                        own.setdefault(section, {}).update(body)
                        continue
                    nested = nested or isinstance(body.get("transformer"), dict)
                    settings.update(_settings(section, body))
                elif section != "_target_":
                    unknown.append(str(section))
        fields = [key for key in settings if key.partition(".")[0] in READ_SECTIONS and key not in KEYS]
        version, unknown_fields = closest_version([*fields, *dict.fromkeys(unread_fields)])
        unknown += unknown_fields
        if unknown:
            raise _unknown(unknown, settings, version)
        return cls._from_settings(settings, own, ignored, nested=nested, version=version)

    @classmethod
    def _from_settings(cls, settings: dict[str, tuple[str, Any]], own: dict[str, dict], ignored: dict[str, None],
                       *, nested: bool, version: str) -> "BridgeRecipe":
        values: dict[str, Any] = {}
        names = _default_names(nested)
        at_default, changed, distributed_optimizer = 0, [], None
        for key, (written, value) in settings.items():
            if value == "???":
                raise ConfigError(written, "??? is not a value; give one or leave the key out")
            section, _, name = key.partition(".")
            if key in KEYS:
                target = KEYS[key]
                if value is None and key in OPTIONAL:
                    continue
                if target in values and values[target] != value:
                    raise ConfigError(written, f"must agree with {names[target]} ({values[target]!r}), which sets "
                                               f"the same; got {value!r}")
                if target not in values:
                    names[target] = written
                values[target] = value
            elif key in FIXED:
                allowed, why = FIXED[key]
                if not any(_same(value, a) for a in allowed):
                    raise ConfigError(written, f"must be {' or '.join(map(_yaml_value, allowed))} ({why}); "
                                               f"got {_yaml_value(value)}")
            elif key in DISTRIBUTED_OPTIMIZER:
                if value is True and (distributed_optimizer is None or key == DISTRIBUTED_OPTIMIZER[0]):
                    distributed_optimizer = written
            elif key in PRECISION or key == "mixed_precision" or key == "model.kv_channels":
                continue  # read below, with the other fields they depend on
            elif _at_default(value, section_fields(section, version)[name]):
                at_default += 1
            elif _unused(section, name):
                ignored[written] = None
            else:
                changed.append((written, name, value, section_fields(section, version)[name]))
        if changed:
            raise _changes_what_runs(changed)
        values["model.params_dtype"] = _dtype(settings, names)
        if names["model.params_dtype"] == "mixed_precision":  # Bridge overrides the model's precision fields
            ignored.update((settings[key][0], None) for key in PRECISION
                           if key in settings and not _at_default(settings[key][1],
                                                                  section_fields("model", version)[key[6:]]))
        _check_kv_channels(settings, values)
        missing = [bridge for odyssey, bridge in REQUIRED_SETTINGS.items() if odyssey not in values]
        if any(key not in values for key in ARCHITECTURE) and "model.spec" not in values:
            reference = settings.get("model.hf_model_id")
            if reference is not None and reference[1] is not None:
                values["model.spec"] = resolve_hf_reference(reference[0], reference[1])
                names["model.spec"] = reference[0]
        if "model.spec" in values:
            missing = [key for key in missing if not key.startswith("model.")]
        if missing:
            raise ConfigError(", ".join(_written(key, nested) for key in missing),
                              "missing: a Bridge YAML file alone does not carry what Bridge's Python recipe sets, and "
                              "the plugin assumes nothing; give them, or point model.hf_model_id (or model.spec) at a "
                              "Hugging Face config.json for the architecture")
        for target, value in {**BRIDGE_OPTIMIZER_DEFAULTS, **BRIDGE_SCHEDULER_DEFAULTS}.items():
            values.setdefault(target, value)
        if distributed_optimizer is not None:
            if own.get("odyssey", {}).get("distributed_optimizer", True) is not True:
                raise ConfigError("odyssey.distributed_optimizer", f"must agree with {distributed_optimizer} (true), "
                                                                   "which sets the same; leave it out")
            values["odyssey.distributed_optimizer"] = True
            names["odyssey.distributed_optimizer"] = distributed_optimizer
        out = {section: own[section] for section in OWN_SECTIONS if section in own}
        for target, value in values.items():
            section, _, key = target.partition(".")
            out.setdefault(section, {})[key] = value
        return cls(recipe=OmegaConf.create(out), names=names, ignored=tuple(ignored), at_default=at_default,
                   distributed_optimizer=distributed_optimizer, bridge_version=version)

    def user_error(self, exc: ConfigError) -> ConfigError:
        """``exc`` (about the odyssey layout) with every key named as in the user's recipe."""
        names = {**self.names, "parallel.data_parallel_size": "the data-parallel size (world size / (TP x PP))"}
        pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")\b")
        rename = lambda text: pattern.sub(lambda m: names[m.group(1)], text)  # noqa: E731
        return ConfigError(rename(exc.key), rename(exc.problem))

    def notes(self, optimizer_bytes: tuple[float, float]) -> list[str]:
        """The lines to print once the recipe is read: what the plugin does not use, and what
        the distributed optimizer the recipe asked for holds per rank (``optimizer_bytes``:
        a full copy's bytes per rank and a sharded one's, ``profile_file.optimizer_bytes_per_rank``)."""
        sections = [name for name in self.ignored if "." not in name]
        keys = [name for name in self.ignored if "." in name]
        parts = ([f"sections {', '.join(sections)}"] if sections else []) + ([f"keys {', '.join(keys)}"] if keys else [])
        if self.at_default:
            parts.append(f"{self.at_default} more field{'s' if self.at_default > 1 else ''} at {'their' if self.at_default > 1 else 'its'} default")
        lines = [f"Megatron-Bridge recipe: not used by the odyssey plugin: {'; '.join(parts)}"] if parts else []
        if self.distributed_optimizer is not None:
            full, sharded = optimizer_bytes
            lines.append(f"{self.distributed_optimizer}: true shards the optimizer state (fp32 master weights and "
                         f"Adam moments) over the data-parallel peers, every part on {REPLICAS} of them: "
                         f"{sharded / GIB:.1f} GiB per rank here instead of {full / GIB:.1f} GiB; plan and simulate "
                         "price it, odyssey train does not run it yet")
        return lines

    def plan_error(self, problem: str, optimizer_bytes: tuple[float, float]) -> ConfigError:
        """No plan of the recipe's layout fits memory: say so in Bridge's keys, with the
        optimizer state each rank holds (``optimizer_bytes`` as ``notes`` takes them)."""
        pp, tp = self.names["parallel.pipeline_model_parallel_size"], self.names["parallel.tensor_model_parallel_size"]
        full, sharded = optimizer_bytes
        cause = (f"; each rank holds {sharded / GIB:.1f} GiB of optimizer state, sharded by {self.distributed_optimizer}"
                 if self.distributed_optimizer is not None else
                 f"; each rank holds a full copy of the optimizer state ({full / GIB:.1f} GiB; "
                 "optimizer.use_distributed_optimizer: true would shard it)")
        return ConfigError(pp, f"{problem}{cause}; raise {pp} or {tp}, or use devices with more memory")


def _default_names(nested: bool) -> dict[str, str]:
    names = {}
    for bridge, odyssey in reversed(KEYS.items()):
        names[odyssey] = _written(bridge, nested)
    return names


def _written(key: str, nested: bool) -> str:
    """The key as the recipe's layout spells it."""
    section, _, name = key.partition(".")
    return f"model.transformer.{name}" if nested and section == "model" and name in transformer_fields() else key


def _changes_what_runs(changed: list[tuple[str, str, Any, Any]]) -> ConfigError:
    keys = ", ".join(written for written, *_ in changed)
    each = "; ".join(f"{written} is {_yaml_value(encode(value))} ({_why_default(name)})"
                     for written, name, value, _ in changed)
    defaults = ", ".join(_yaml_value(default) for *_, default in changed)
    return ConfigError(keys, f"{'changes' if len(changed) == 1 else 'change'} what runs and the plugin cannot run "
                             f"{'it' if len(changed) == 1 else 'them'}: {each}; leave "
                             f"{'it' if len(changed) == 1 else 'them'} at Megatron-Core's default ({defaults})")


def _dtype(settings: Mapping[str, tuple[str, Any]], names: dict[str, str]) -> str:
    """The dtype the recipe trains in: ``mixed_precision`` as Bridge applies it (it overrides
    the model's precision fields), else the model's ``params_dtype``/``bf16``/``fp16``."""
    if "mixed_precision" in settings and settings["mixed_precision"][1] is not None:
        value = settings["mixed_precision"][1]
        dtype = _mixed_precision_dtype(value)
        names["model.params_dtype"] = "mixed_precision"
    else:
        given = {key: settings[key] for key in PRECISION if key in settings}
        if not given and "mixed_precision" not in settings:
            raise ConfigError("mixed_precision", "missing: Bridge's Python recipe sets it (bf16_mixed for Llama) and "
                                                 "the plugin assumes nothing; give bf16_mixed, or null for fp32 (then "
                                                 "model.params_dtype, model.bf16 or model.fp16 decide)")
        dtype, origin = "fp32", None
        for key, (written, value) in given.items():
            if key == "model.params_dtype":
                this = DTYPES.get(value) if isinstance(value, str) else None
                if this is None:
                    raise ConfigError(written, "must be one of bf16, fp16, fp32 (Bridge writes torch.bfloat16, "
                                               f"torch.float16, torch.float32); got {value!r}")
            elif not isinstance(value, bool):
                raise ConfigError(written, f"must be true or false; got {value!r}")
            elif not value:
                continue
            else:
                this = key.rpartition(".")[2]
            if origin is not None and this != dtype:
                raise ConfigError(written, f"must agree with {origin} ({dtype!r}), which sets the same; got {value!r}")
            dtype, origin = this, written
        names["model.params_dtype"] = origin or "mixed_precision"
    if dtype == "fp16":
        raise ConfigError(names["model.params_dtype"], f"is fp16: {FP16_REFUSAL}")
    return dtype


def _mixed_precision_dtype(value: Any) -> str:
    if isinstance(value, str):
        if value in MIXED_PRECISION:
            return MIXED_PRECISION[value]
        if re.search(r"fp8|fp4", value):
            raise ConfigError("mixed_precision", f"{value} trains with FP8/FP4 (Transformer Engine), which the plugin "
                                                 "does not run; use bf16_mixed, or null for fp32")
        raise ConfigError("mixed_precision", f"must be bf16_mixed, fp16_mixed or null (fp32); got {value!r}")
    if isinstance(value, dict):
        low_bits = [key for key in ("fp8", "fp4") if value.get(key) not in (None, False)]
        if low_bits:
            raise ConfigError(f"mixed_precision.{low_bits[0]}", "FP8/FP4 training (Transformer Engine) is not run by "
                                                                "the plugin; leave it null")
        return "bf16" if value.get("bf16") else "fp16" if value.get("fp16") else "fp32"
    raise ConfigError("mixed_precision", f"must be a recipe name (bf16_mixed) or null; got {value!r}")


def _check_kv_channels(settings: Mapping[str, tuple[str, Any]], values: Mapping[str, Any]) -> None:
    """``kv_channels`` (the head size) must be hidden_size / num_attention_heads, as Llama's is."""
    if "model.kv_channels" not in settings or settings["model.kv_channels"][1] is None:
        return
    written, value = settings["model.kv_channels"]
    hidden, heads = values.get("model.hidden_size"), values.get("model.num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and value != hidden // heads:
        raise ConfigError(written, f"must be null or hidden_size / num_attention_heads = {hidden // heads} (the "
                                   f"plugin's attention has heads of that size); got {value!r}")
