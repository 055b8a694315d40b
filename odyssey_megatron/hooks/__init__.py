"""Megatron-Core integration, one concern a module: accelerator backends (``accelerator``),
process groups built from a plan (``process_groups``), stage models on GPTModel
(``model``), a rank's per-block weights and Adam state that outlive a plan
(``training_state``), layer-granular DP gradient sync and clipping (``grad_sync``), split
backwards (``weight_grad``) and the reversible CUDA-to-CPU shim for gloo runs (``cpu_shim``)."""

from odyssey_megatron.hooks.accelerator import ACCELERATOR_KINDS, Accelerator, select_accelerator

__all__ = ["ACCELERATOR_KINDS", "Accelerator", "select_accelerator"]
