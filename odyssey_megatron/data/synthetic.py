"""Random token micro-batches addressed by (step, global micro-batch id), for tests that
need shapes and determinism but no text (the real workload is ``data.indexed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SyntheticTokens:
    """Random token sequences drawn from a generator seeded by (seed, step, micro-batch):
    the same micro-batch is identical on every rank and in every run."""

    vocab_size: int
    seq_length: int
    micro_batch_size: int
    seed: int = 0

    def micro_batch(self, step: int, micro_batch: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(hash((self.seed, step, micro_batch)) & 0x7FFF_FFFF)
        tokens = torch.randint(
            0, self.vocab_size, (self.micro_batch_size, self.seq_length + 1), generator=generator
        )
        positions = torch.arange(self.seq_length).unsqueeze(0).expand(self.micro_batch_size, -1)
        return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": positions}
