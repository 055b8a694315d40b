"""Megatron-Core integration: accelerator backends now; process groups from a plan,
model building, layer-granular gradient sync and the CPU shim come with the runtime."""

from odyssey_megatron.hooks.accelerator import ACCELERATOR_KINDS, Accelerator, select_accelerator

__all__ = ["ACCELERATOR_KINDS", "Accelerator", "select_accelerator"]
