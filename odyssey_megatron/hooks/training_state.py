"""One rank's training state, block by block, so that it outlives a plan generation.

Recovery moves blocks (``blocks.Block``: a transformer layer, "embedding" or "output"):
a rank keeps the blocks its next stage still needs, drops the rest and receives the
missing ones (the restorer's ``Transfer``: one block's weights and optimizer state, one
TP shard). So the state is kept per block, in global parameter names (a layer's tensors
are named alike on whichever stage holds it; a tied output copy is the embedding), and a
block exports to the flat dict of tensors a transfer sends or a checkpoint file holds:

    param/<global name>       fp32 weights: the master copy where the model trains in bf16/fp16
    exp_avg/<global name>     Adam's first moment (fp32)
    exp_avg_sq/<global name>  Adam's second moment (fp32)
    step                      Adam's step count (int64; a block's tensors step together)

``TrainingState.initial`` draws a stage's blocks from the seed once, exactly as
``hooks.model.init_stage_parameters`` does; after that the state, not the seed, is the
source. What a stage holds and what one block's export looks like follow from the model
config alone (``blocks``: ``stage_blocks``, ``state_entries``), so a receiver can allocate
(``empty_block``) before a transfer arrives. ``hooks.stage_optimizer.StageOptimizer`` is
Megatron-Core's optimizer over a stage model built around a state's tensors: it trains
them in place and reads them back per block.

There is no RNG state to carry: the Llama stages have no dropout (``transformer_config``
sets both rates to 0) and a step draws no random number. Megatron forks its
model-parallel RNG stream around attention dropout, but dropout with p=0 draws nothing,
and training data are addressed by (step, micro-batch), not drawn.
``tests/test_training_state.py`` checks that training leaves the global generator and
every tracker stream as it found them; a model with dropout would need them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from odyssey_megatron.blocks import (
    EXP_AVG,
    EXP_AVG_SQ,
    PARAM,
    STATE_KINDS,
    STEP,
    Block,
    StageSpec,
    block_of_parameter,
    block_sort_key,
    stage_parameter_shapes,
    state_entries,
)
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.hooks.global_weights import initial_shard

__all__ = ["BlockState", "TrainingState", "empty_block"]


@dataclass
class BlockState:
    """One block's TP shard on this rank: weights and Adam state by global parameter name."""

    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int

    @property
    def device(self) -> torch.device:
        """Where the block's tensors are: its step goes with them."""
        return next(iter(self.params.values())).device

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The flat dict a transfer sends: the tensors themselves, not copies, and the step
        as a tensor on their device (a P2P op on an NCCL group refuses a host tensor)."""
        tensors = {STEP: torch.tensor(self.step, dtype=torch.int64, device=self.device)}
        for kind, named in zip(STATE_KINDS, (self.params, self.exp_avg, self.exp_avg_sq)):
            tensors.update({f"{kind}/{name}": tensor for name, tensor in named.items()})
        return tensors

    @classmethod
    def from_tensors(cls, block: Block, tensors: Mapping[str, torch.Tensor]) -> "BlockState":
        """The inverse of ``to_tensors``; ValueError naming the key if ``tensors`` is not
        one block's complete fp32 state."""
        step = tensors.get(STEP)
        if step is None or step.dim() != 0 or step.is_floating_point() or step.is_complex() or int(step) < 0:
            raise ValueError(f"block {block!r}: {STEP}: need a non-negative integer scalar tensor")
        named: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in STATE_KINDS}
        for key, tensor in tensors.items():
            if key == STEP:
                continue
            kind, _, name = key.partition("/")
            if kind not in named or not name:
                raise ValueError(f"block {block!r}: {key}: keys are {STEP} or <{'|'.join(STATE_KINDS)}>/<parameter name>")
            try:
                owner = block_of_parameter(name)
            except ValueError:
                owner = None
            if owner != block:
                raise ValueError(f"block {block!r}: {key}: not a parameter of this block")
            if tensor.dtype != torch.float32:
                raise ValueError(f"block {block!r}: {key}: dtype {tensor.dtype}, the state holds torch.float32")
            named[kind][name] = tensor
        names = set(named[PARAM])
        if not names:
            raise ValueError(f"block {block!r}: no {PARAM}/<parameter name> tensors")
        for kind in (EXP_AVG, EXP_AVG_SQ):
            missing, unmatched = sorted(names - set(named[kind])), sorted(set(named[kind]) - names)
            if missing:
                raise ValueError(f"block {block!r}: {kind}/{missing[0]}: missing")
            if unmatched:
                raise ValueError(f"block {block!r}: {kind}/{unmatched[0]}: no {PARAM}/{unmatched[0]} for it")
        for name in sorted(names):
            shapes = {kind: tuple(named[kind][name].shape) for kind in STATE_KINDS}
            if len(set(shapes.values())) > 1:
                raise ValueError(f"block {block!r}: {name}: shapes differ across {shapes}")
        return cls(named[PARAM], named[EXP_AVG], named[EXP_AVG_SQ], int(step))


def empty_block(model: ModelConfig, block: Block, *, tp_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Uninitialised tensors keyed, shaped and typed as ``export(block)`` of one TP shard,
    in the order ``blocks.state_entries`` gives. A receiver allocates them before a
    transfer; both sides order the transfer's tensors by it."""
    return {key: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for key, dtype, shape in state_entries(model, block, tp_size=tp_size)}


class TrainingState:
    """The blocks one rank holds: of each, this rank's TP shard."""

    def __init__(self, blocks: Mapping[Block, BlockState] | None = None):
        self.blocks: dict[Block, BlockState] = dict(blocks or {})

    @classmethod
    def initial(
        cls, model: ModelConfig, stage: StageSpec, *, seed: int, tp_rank: int, tp_size: int,
        device: torch.device = torch.device("cpu"),
    ) -> "TrainingState":
        """``stage``'s blocks before training: weights drawn from ``seed`` (``initial_shard``),
        zero moments, step 0 (what Adam starts from)."""
        blocks: dict[Block, BlockState] = {}
        for name, shape in stage_parameter_shapes(model, stage).items():
            param = initial_shard(name, shape, seed=seed, tp_rank=tp_rank, tp_size=tp_size).to(device)
            state = blocks.setdefault(block_of_parameter(name), BlockState({}, {}, {}, 0))
            state.params[name] = param
            state.exp_avg[name] = torch.zeros_like(param)
            state.exp_avg_sq[name] = torch.zeros_like(param)
        return cls(blocks)

    def held(self) -> list[Block]:
        """The blocks held, in model order."""
        return sorted(self.blocks, key=block_sort_key)

    def export(self, block: Block) -> dict[str, torch.Tensor]:
        """``block`` as flat tensors (``BlockState.to_tensors``), to send or save."""
        if block not in self.blocks:
            raise ValueError(f"block {block!r} is not held here; held: {self.held()}")
        return self.blocks[block].to_tensors()

    def receive(self, block: Block, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hold ``block`` from exported tensors (a transfer or a checkpoint), replacing any
        copy held; the tensors are kept, not copied."""
        self.blocks[block] = BlockState.from_tensors(block, tensors)

    def copy(self, device: torch.device) -> "TrainingState":
        """Every block copied to ``device``: the host copy a rank rolls back to."""
        return TrainingState({block: BlockState.from_tensors(block, {key: tensor.to(device, copy=True)
                                                                     for key, tensor in self.export(block).items()})
                              for block in self.blocks})

    def receive_on(self, device: torch.device, block: Block, tensors: Mapping[str, torch.Tensor]) -> None:
        """``receive`` ``block`` with its tensors on ``device``: moved where they are
        elsewhere (a snapshot or a checkpoint read into host memory), kept where they are there."""
        self.receive(block, {key: tensor.to(device) for key, tensor in tensors.items()})

    def keep(self, blocks: Iterable[Block]) -> None:
        """Drop every held block not in ``blocks`` (those the next stage does not hold)."""
        wanted = set(blocks)
        for block in [b for b in self.blocks if b not in wanted]:
            del self.blocks[block]
