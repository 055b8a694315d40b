"""Megatron-Core integration, one concern a module: accelerator backends (``accelerator``),
process groups built from a plan (``process_groups``), stage models on GPTModel
(``model``), a model's weights in global names cut into and merged from their stage and
TP slices, without Megatron-Core (``global_weights``), the forward step Megatron's
schedules call on one (``stage_step``) and Hugging Face Llama weights in and out of them
(``hf_llama``), a rank's per-block training state that outlives a plan
(``training_state``), layer-granular DP gradient sync and clipping (``grad_sync``), split
backwards (``weight_grad``), the hooks a step calls around each op (``op_clock``) and the
reversible CUDA-to-CPU shim for gloo runs (``cpu_shim``)."""

from odyssey_megatron.hooks.accelerator import ACCELERATOR_KINDS, Accelerator, select_accelerator

__all__ = ["ACCELERATOR_KINDS", "Accelerator", "select_accelerator"]
