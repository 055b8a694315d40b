"""A Hugging Face Llama ``config.json`` read as ``ModelConfig`` fields: a model spec like the
shipped ones in ``specs.models``, so a recipe may name one by path (``model.spec``). The
weights that go with it are converted in ``hooks.hf_llama``; only this reader sits down
here, below ``config``. transformers is imported only when a file is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CONFIG_FILE", "HF_NAMES", "model_fields", "read_model_fields"]

CONFIG_FILE = "config.json"

HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "seq_length": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "norm_epsilon": "rms_norm_eps",
}
"""``ModelConfig`` field -> the ``LlamaConfig`` attribute it is, both ways (RoPE's base sits
in ``rope_parameters`` and the dtype has names of its own)."""


def model_fields(config: Any) -> dict[str, Any]:
    """``ModelConfig`` fields from a transformers ``LlamaConfig``; ValueError names what the
    Megatron stage cannot express."""
    problems = []
    if config.model_type != "llama":
        problems.append(f"model_type is {config.model_type!r}, not 'llama'")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act is {config.hidden_act!r}, not 'silu' (SwiGLU)")
    if config.attention_bias or config.mlp_bias:
        problems.append("attention_bias/mlp_bias are set; the stage has no biases")
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type is {rope['rope_type']!r}; only 'default' RoPE is supported")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        problems.append(f"head_dim {head_dim} * num_attention_heads != hidden_size {config.hidden_size}")
    if problems:
        raise ValueError("not a Llama the stage can build: " + "; ".join(problems))
    fields = {ours: getattr(config, theirs) for ours, theirs in HF_NAMES.items()}
    fields["num_query_groups"] = fields["num_query_groups"] or config.num_attention_heads
    return {**fields, "tie_embeddings": bool(fields["tie_embeddings"]), "norm_epsilon": float(fields["norm_epsilon"]),
            "rope_theta": float(rope.get("rope_theta", 10000.0))}


def read_model_fields(path: str | Path) -> dict[str, Any]:
    """``ModelConfig`` fields from a Hugging Face ``config.json`` (or the directory holding one)."""
    from transformers import LlamaConfig

    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"no Hugging Face config at {path}")
    try:
        config = LlamaConfig.from_json_file(str(path))
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not a readable config.json ({exc})") from None
    return model_fields(config)
