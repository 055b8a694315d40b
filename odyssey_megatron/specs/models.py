"""Llama-2 architectures, in Megatron's argument names.

Values follow the published Llama-2 configs (Touvron et al., 2023, and the Hugging Face
``config.json`` of meta-llama/Llama-2-*-hf): 7B and 13B use multi-head attention, 70B uses
grouped-query attention with 8 KV groups; all use RoPE base 10000, RMSNorm epsilon 1e-5,
SwiGLU, untied embeddings and a 32000-token vocabulary.
"""

from __future__ import annotations

from typing import Any

MODEL_SPECS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=11008,
        num_attention_heads=32,
        num_query_groups=32,
        vocab_size=32000,
        seq_length=4096,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_epsilon=1e-5,
    ),
    "llama2-13b": dict(
        num_layers=40,
        hidden_size=5120,
        ffn_hidden_size=13824,
        num_attention_heads=40,
        num_query_groups=40,
        vocab_size=32000,
        seq_length=4096,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_epsilon=1e-5,
    ),
    "llama2-70b": dict(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        vocab_size=32000,
        seq_length=4096,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_epsilon=1e-5,
    ),
}


def model_spec(name: str) -> dict[str, Any]:
    """A copy of the shipped architecture called ``name``; a KeyError names the known ones."""
    try:
        return dict(MODEL_SPECS[name])
    except KeyError:
        raise KeyError(f"unknown model spec {name!r}; known: {', '.join(sorted(MODEL_SPECS))}") from None
