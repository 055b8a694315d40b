"""What Megatron's schedules call on a stage model (``hooks.model``): its forward step
function and the language-model loss the last stage returns. The executor
(``runtime.rank.executor``), Megatron's own 1F1B (``runtime.rank.megatron_1f1b``) and the
profiler (``profiler.stages``) all step a stage through it, so a stage is measured as it runs.
"""

from __future__ import annotations

from functools import partial

import torch

__all__ = ["MicroBatch", "language_model_loss", "stage_forward"]

MicroBatch = dict[str, torch.Tensor]
"""``tokens`` and ``labels`` [micro_batch_size, seq_length], ``position_ids``."""


def language_model_loss(
    labels: torch.Tensor, logits: torch.Tensor, *, scale: float = 1.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean token cross-entropy from full-vocabulary logits, times ``scale`` for the
    backward; the logged value is an unscaled detached clone (Megatron divides the
    returned loss in place)."""
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
    return loss * scale, {"lm loss": loss.detach().clone()}


def stage_forward(data_iterator, model, *, first: bool, last: bool, loss_scale: float = 1.0):
    """Megatron forward_step_func for a stage model: the first stage reads tokens, the last
    stage labels, from the micro-batch the iterator yields (None for middle stages)."""
    batch = next(data_iterator) if data_iterator is not None else None
    tokens = batch["tokens"] if first else None
    position_ids = batch["position_ids"] if batch is not None else None
    output = model(tokens, position_ids, None)
    return output, partial(language_model_loss, batch["labels"], scale=loss_scale) if last else None
