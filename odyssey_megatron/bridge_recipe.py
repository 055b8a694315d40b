"""Megatron-Bridge recipes read as odyssey recipes.

A Megatron user's recipe is Megatron-Bridge's ``ConfigContainer`` as YAML: TP, PP and the
architecture under ``model`` (Megatron-Core's TransformerConfig and GPTModelProvider
names), batch sizes under ``train``, ``optimizer``, ``rng``, ``dataset``, ``tokenizer``
and ``logger``; the data-parallel size is derived from the world size. With ``odyssey:``
(and ``cluster:``) sections added it is an odyssey recipe: ``BridgeRecipe.translate``
renames its keys onto ``config.RecipeConfig``'s by the tables below, the same validation
runs, and ``user_error`` names the keys of an error as the user wrote them.

Bridge sections the plugin has no use for are dropped and named in one note, as are known
keys it does not use inside the sections it reads; any other key is an error, so a typo
never passes silently. Names checked against Megatron-Bridge's ``training/config.py`` and
Megatron-Core 0.16's TransformerConfig and OptimizerConfig.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from odyssey_megatron.errors import ConfigError

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
    "model.params_dtype": "model.params_dtype",
    "train.global_batch_size": "training.global_batch_size",
    "train.micro_batch_size": "training.micro_batch_size",
    "train.train_iters": "training.train_iters",
    "optimizer.lr": "training.lr",
    "optimizer.clip_grad": "training.clip_grad",
    "optimizer.weight_decay": "training.weight_decay",
    "optimizer.adam_beta1": "training.adam_beta1",
    "optimizer.adam_beta2": "training.adam_beta2",
    "optimizer.adam_eps": "training.adam_eps",
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
}
"""Bridge key -> odyssey key. Two Bridge keys for one setting must agree."""

DTYPES = {
    **{name: "bf16" for name in ("bf16", "bfloat16", "torch.bfloat16", "bf16-mixed")},
    **{name: "fp16" for name in ("fp16", "float16", "torch.float16", "16-mixed")},
    **{name: "fp32" for name in ("fp32", "float32", "torch.float32", "32-true")},
}
"""Bridge's spellings of model.params_dtype (its ``str_to_dtype``; YAML dumps write ``torch.bfloat16``)."""

PRECISION_FLAGS = {"model.bf16": "bf16", "model.fp16": "fp16"}
"""Megatron's mixed-precision switches: true sets model.params_dtype."""

FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "model.context_parallel_size": ((1,), "Odyssey plans over TP x PP x DP"),
    "model.virtual_pipeline_model_parallel_size": ((None,), "interleaved pipelines are not planned"),
    "model.sequence_parallel": ((False,), "the plugin's layers do not split sequences"),
    "model.normalization": (("RMSNorm",), "the model is Llama-shaped"),
    "model.gated_linear_unit": ((True,), "the model is Llama-shaped (SwiGLU)"),
    "model.activation_func": (("silu",), "the model is Llama-shaped (SwiGLU)"),
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

UNUSED = frozenset({
    "model.make_vocab_size_divisible_by", "model.init_method_std", "model.init_model_with_meta_device",
    "model.transformer_impl", "model.cross_entropy_loss_fusion", "model.masked_softmax_fusion",
    "model.apply_rope_fusion", "model.gradient_accumulation_fusion", "model.deallocate_pipeline_outputs",
    "train.eval_interval", "train.eval_iters", "train.exit_interval", "train.manual_gc",
    "train.manual_gc_interval", "train.manual_gc_eval",
    "optimizer.min_lr", "optimizer.use_distributed_optimizer", "optimizer.bf16", "optimizer.fp16",
    "dataset.num_workers", "dataset.split", "dataset.random_seed", "dataset.reset_attention_mask",
    "dataset.reset_position_ids", "dataset.eod_mask_loss", "dataset.data_sharding", "dataset.dataloader_type",
    "dataset.num_dataset_builder_threads", "dataset.skip_getting_attention_mask_from_dataset",
    "tokenizer.vocab_size", "tokenizer.use_tokenizer_vocab_size",
    "logger.log_interval", "logger.tensorboard_dir", "logger.log_timers_to_tensorboard", "logger.log_throughput",
})
"""Known Bridge keys in the sections read that the plugin does not use (the learning rate
is constant; each rank's optimizer is Megatron's non-distributed one): named in the note."""

READ_SECTIONS = ("model", "train", "optimizer", "rng", "dataset", "tokenizer", "logger")
OWN_SECTIONS = ("cluster", "odyssey")
"""The plugin's sections, the same in both layouts, validated by its schema."""
IGNORED_SECTIONS = (
    "env_vars", "rerun_state_machine", "optimizer_config_override_provider", "ddp", "validation", "scheduler",
    "checkpoint", "dist", "ft", "straggler", "nvrx_straggler", "profiling", "peft", "comm_overlap",
    "mixed_precision", "tensor_inspect", "inprocess_restart",
)
"""ConfigContainer's other sections: dropped (mixed_precision too: model.params_dtype,
model.bf16 or model.fp16 set the dtype)."""

ODYSSEY_ONLY_SECTIONS = ("parallel", "training", "data")
_KNOWN = {**KEYS, **PRECISION_FLAGS, **FIXED, **dict.fromkeys(UNUSED)}
_BRIDGE_ONLY_MODEL_KEYS = {key.partition(".")[2] for key in _KNOWN if key.startswith("model.")} - {
    odyssey.partition(".")[2] for odyssey in KEYS.values() if odyssey.startswith("model.")
}
"""Keys under ``model`` that only Bridge's layout has: a sign of it."""


def _bridge_signs(recipe: Mapping) -> list[str]:
    sections = [str(s) for s in recipe if s in READ_SECTIONS + IGNORED_SECTIONS and s not in ("model", "logger")]
    model = recipe.get("model")
    keys = [f"model.{k}" for k in model if k in _BRIDGE_ONLY_MODEL_KEYS] if isinstance(model, Mapping) else []
    return sections + keys


def is_bridge_recipe(recipe: DictConfig) -> bool:
    """Whether the file is in Megatron-Bridge's layout (it has ``train:``, or TP under
    ``model``, ...); one mixing both layouts is an error naming the odyssey section."""
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


def _setting(bridge_key: str, value: Any) -> tuple[str, Any] | None:
    """(odyssey key, value) that one Bridge setting gives; None for a fixed value checked
    or a precision flag that is off."""
    if bridge_key in KEYS:
        if bridge_key == "model.params_dtype" and isinstance(value, str):
            value = DTYPES.get(value, value)
        return KEYS[bridge_key], value
    if bridge_key in PRECISION_FLAGS:
        if not isinstance(value, bool):
            raise ConfigError(bridge_key, f"must be true or false; got {value!r}")
        return ("model.params_dtype", PRECISION_FLAGS[bridge_key]) if value else None
    if bridge_key in FIXED:
        allowed, why = FIXED[bridge_key]
        if not any(_same(value, a) for a in allowed):
            raise ConfigError(bridge_key, f"must be {' or '.join(map(_yaml_value, allowed))} ({why}); got {value!r}")
        return None
    section = bridge_key.partition(".")[0]
    raise ConfigError(bridge_key, f"unknown key; allowed here: {_allowed_keys(section)}")


def _yaml_value(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _allowed_keys(section: str) -> str:
    return ", ".join(sorted(key.partition(".")[2] for key in _KNOWN if key.startswith(f"{section}.")))


@dataclass(frozen=True)
class BridgeRecipe:
    """A Bridge recipe (file and overrides merged) renamed onto the odyssey layout."""

    recipe: DictConfig
    """The same settings in the odyssey layout."""
    origins: dict[str, str]
    """Odyssey key -> the Bridge key it came from."""
    ignored: tuple[str, ...]
    """Sections, then keys, the plugin does not use."""

    @classmethod
    def translate(cls, recipe: DictConfig, cli: DictConfig) -> "BridgeRecipe":
        """Merge the file and its overrides (both Bridge-shaped) and rename them by the
        tables; an unknown or unsupported key is a ConfigError naming the Bridge key."""
        merged: dict[str, dict] = {}
        ignored: dict[str, None] = {}
        for layer in (recipe, cli):
            for section, body in OmegaConf.to_container(layer, resolve=False).items():
                if section in IGNORED_SECTIONS:
                    ignored[section] = None
                    continue
                if section in ODYSSEY_ONLY_SECTIONS:
                    raise _mixed_layouts(section, _bridge_signs(OmegaConf.to_container(recipe, resolve=False))[0])
                if section not in READ_SECTIONS + OWN_SECTIONS:
                    allowed = ", ".join(sorted(READ_SECTIONS + OWN_SECTIONS + IGNORED_SECTIONS))
                    raise ConfigError(str(section), f"unknown key; allowed here: {allowed}")
                if not isinstance(body, dict):
                    raise ConfigError(section, f"is a section and must be a mapping of its keys; got {body!r}")
                merged.setdefault(section, {}).update(body)
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for section in (s for s in merged if s in READ_SECTIONS):
            for key, value in merged[section].items():
                bridge_key = f"{section}.{key}"
                if value == "???":
                    raise ConfigError(bridge_key, "??? is not a value; give one or leave the key out")
                if bridge_key in UNUSED:
                    ignored[bridge_key] = None
                    continue
                setting = _setting(bridge_key, value)
                if setting is None:
                    continue
                target, value = setting
                if target in values and values[target] != value:
                    raise ConfigError(bridge_key, f"must agree with {origins[target]} ({values[target]!r}), which "
                                                  f"sets the same; got {merged[section][key]!r}")
                values[target] = value
                origins.setdefault(target, bridge_key)
        out = {section: merged[section] for section in OWN_SECTIONS if section in merged}
        for target, value in values.items():
            section, _, key = target.partition(".")
            out.setdefault(section, {})[key] = value
        return cls(recipe=OmegaConf.create(out), origins=origins, ignored=tuple(ignored))

    def user_error(self, exc: ConfigError) -> ConfigError:
        """``exc`` (about the odyssey layout) with every key named as in the user's recipe."""
        names = {odyssey: bridge for bridge, odyssey in reversed(KEYS.items())} | self.origins
        pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")\b")
        rename = lambda text: pattern.sub(lambda m: names[m.group(1)], text)  # noqa: E731
        return ConfigError(rename(exc.key), rename(exc.problem))

    def ignored_note(self) -> str:
        """The one line that names what the plugin does not use."""
        sections = [name for name in self.ignored if "." not in name]
        keys = [name for name in self.ignored if "." in name]
        parts = ([f"sections {', '.join(sections)}"] if sections else []) + ([f"keys {', '.join(keys)}"] if keys else [])
        return f"Megatron-Bridge recipe: ignoring what the odyssey plugin does not use: {'; '.join(parts)}"
