"""Enter a new plan's layout: send and receive its block transfers, then keep the new stage.

After a failure the survivors form a new world (``hooks.process_groups.RankMap``) and each
rank must end holding exactly the blocks of its stage in the new plan: it keeps what it
already holds, receives the rest over point-to-point ops, and sends what others lack.

How a plan names a transfer: the restorer (``restorer.transfer``) writes one ``Transfer``
per TP shard, its ``src`` and ``dst`` being *launch* ranks, ``worker * TP + k`` (worker w
launched with ranks w*TP .. w*TP+TP-1, and keeps its id when the world shrinks). So TP
rank k of the source worker sends shard k to TP rank k of the destination worker;
``shard_moves`` turns that into this world's ranks.

Every rank derives the same list of moves from the plan, and each block's tensors go in
the order ``hooks.training_state.empty_block`` gives from the model config alone, so the
receiver allocates its buffers before anything arrives and no metadata crosses the wire.
All sends and receives are posted at once and waited on before ``keep``, so a block a rank
receives never replaces one it still has to send. Waits use the group's timeout: gloo
raises on a dead peer, and a hung one fails when the timeout fires.

A rank that cannot do its part (it is to send a block it does not hold, or would end
without a block of its stage) says so before anything moves: the ranks agree in one small
all-reduce, so every rank raises at once instead of waiting on a send that never comes.
A block received must have taken the generation's committed steps, as the blocks a rank
kept have (``runtime.rank.entering`` checks those before the transfer): its Adam step
count comes with it, and a rank holding a block at another step would train it on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from odyssey_megatron.blocks import STEP, Block, worker_blocks
from odyssey_megatron.config import ModelConfig
from odyssey_megatron.hooks.accelerator import required_device
from odyssey_megatron.hooks.process_groups import RankMap
from odyssey_megatron.hooks.training_state import TrainingState, empty_block
from odyssey_megatron.plan import ExecutionPlan, Transfer

__all__ = ["ShardMove", "TransferReport", "check_rank_part", "execute_transfers", "shard_moves"]


@dataclass(frozen=True)
class ShardMove:
    """One of a plan's transfers in this world's ranks."""

    transfer: Transfer
    src: int
    dst: int

    @property
    def block(self) -> Block:
        return self.transfer.layer


@dataclass(frozen=True)
class TransferReport:
    """What one rank moved entering a plan, for the recovery record."""

    sent: tuple[Block, ...]
    """Blocks sent, one per transfer this rank is the source of, in plan order."""
    received: tuple[Block, ...]
    """Blocks received, in plan order."""
    bytes_sent: int
    bytes_received: int
    held: tuple[Block, ...]
    """The blocks held afterwards: exactly those of the rank's new stage, in model order."""
    seconds: float
    """From the call to the new stage's blocks being held, the agreement included."""


def shard_moves(plan: ExecutionPlan, ranks: RankMap) -> tuple[ShardMove, ...]:
    """``plan.transfers`` in this world's ranks, in plan order; ValueError naming the
    transfer for one that cannot run over P2P in this world."""
    tp = plan.tensor_parallel_size
    if ranks.tensor_parallel_size != tp:
        raise ValueError(f"ranks: tensor_parallel_size {ranks.tensor_parallel_size}, the plan's is {tp}")
    moves = []
    for t in plan.transfers:
        if t.src is None:
            raise ValueError(f"transfer {t}: src is None, the block must be read from a checkpoint, not sent")
        (src_worker, src_tp), (dst_worker, dst_tp) = divmod(t.src, tp), divmod(t.dst, tp)
        for role, worker in (("source", src_worker), ("destination", dst_worker)):
            if worker not in ranks.workers:
                raise ValueError(f"transfer {t}: {role} worker {worker} is not in this world (workers {ranks.workers})")
        if src_tp != dst_tp:
            raise ValueError(f"transfer {t}: TP rank {src_tp} sends to TP rank {dst_tp}; shard k goes to TP rank k")
        if src_worker == dst_worker:
            raise ValueError(f"transfer {t}: worker {src_worker} sends to itself")
        moves.append(ShardMove(t, ranks.rank(src_worker, src_tp), ranks.rank(dst_worker, dst_tp)))
    return tuple(moves)


def check_rank_part(
    moves: Sequence[ShardMove], *, rank: int, state: TrainingState, keep: Sequence[Block], model: ModelConfig,
    tp_size: int,
) -> None:
    """ValueError unless ``rank`` can do its part of ``moves``: it holds every block it sends,
    shaped as ``model`` has it, and its blocks to ``keep`` are all held or received."""
    for move in moves:
        if move.src != rank:
            continue
        if move.block not in state.blocks:
            raise ValueError(f"transfer {move.transfer}: rank {rank}, its source, does not hold block {move.block!r} "
                             f"(it holds {state.held()})")
        mismatch = _layout_mismatch(state.export(move.block), empty_block(model, move.block, tp_size=tp_size,
                                                                         device=torch.device("meta")))
        if mismatch:
            raise ValueError(f"transfer {move.transfer}: rank {rank} holds block {move.block!r} with {mismatch}")
    coming = {move.block for move in moves if move.dst == rank}
    missing = [block for block in keep if block not in state.blocks and block not in coming]
    if missing:
        raise ValueError(f"rank {rank}: blocks {missing} of its new stage are neither held nor received by a transfer")


def execute_transfers(
    *,
    plan: ExecutionPlan,
    state: TrainingState,
    rank: int,
    ranks: RankMap,
    model: ModelConfig,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    on_moved: Callable[[], None] | None = None,
    committed: int | None = None,
) -> TransferReport:
    """Run ``plan.transfers`` and leave ``state`` holding exactly this rank's new stage.

    Collective: every rank of ``ranks``' world calls it, with the same plan, after the new
    world is formed. ``group`` (default: the default group) must span that world; its
    timeout bounds every wait. Received blocks are allocated on ``device`` (the rank's; the
    group's backend moves its tensors, ``hooks.accelerator.required_device``). Raises
    ValueError, before anything moves and on every rank, when a transfer cannot run
    (``shard_moves``) or a rank cannot do its part (``check_rank_part``). ``on_moved`` is
    called once this rank's first block has moved (its sends or receives waited on),
    before it waits on the others (where the backend coalesces them into one work: after
    all): where a fault injector acts. ``committed``: the steps every block received must
    have taken (the generation's start step), RuntimeError naming those that have not,
    before they are held; None: not checked."""
    start = time.perf_counter()
    if model.num_layers != plan.num_layers:
        raise ValueError(f"model.num_layers {model.num_layers}, the plan has {plan.num_layers} layers")
    tp = plan.tensor_parallel_size
    moves = shard_moves(plan, ranks)
    keep = worker_blocks(plan, ranks.worker(rank), tied=model.tie_embeddings)
    try:
        check_rank_part(moves, rank=rank, state=state, keep=keep, model=model, tp_size=tp)
        refusal = None
    except ValueError as error:
        refusal = error
    refusing = _refusing_ranks(refusal is not None, rank=rank, world_size=ranks.world_size, group=group)
    if refusal is not None:
        raise refusal
    if refusing:
        raise ValueError(f"ranks {refusing} cannot do their part of plan generation {plan.generation}'s transfers "
                         "(their errors say why); nothing was moved")

    ops: list[dist.P2POp] = []
    first_block_ops = 0
    """How many of ``ops`` move this rank's first block."""
    sent, received, incoming = [], [], []
    bytes_sent = bytes_received = 0
    for move in moves:
        if move.src == rank:
            tensors = state.export(move.block)
            for key in empty_block(model, move.block, tp_size=tp, device=torch.device("meta")):
                tensor = tensors[key].contiguous()  # a TP shard of dim 1 is a strided view
                ops.append(dist.P2POp(dist.isend, tensor, move.dst, group))
                bytes_sent += tensor.nbytes
            sent.append(move.block)
        if move.dst == rank:
            buffers = empty_block(model, move.block, tp_size=tp, device=device)
            ops.extend(dist.P2POp(dist.irecv, buffer, move.src, group) for buffer in buffers.values())
            bytes_received += sum(buffer.nbytes for buffer in buffers.values())
            received.append(move.block)
            incoming.append((move.block, buffers))
        first_block_ops = first_block_ops or len(ops)
    if ops:
        works = dist.batch_isend_irecv(ops)
        first = first_block_ops if len(works) == len(ops) else len(works)
        for work in works[:first]:
            work.wait()
        if on_moved is not None:
            on_moved()
        for work in works[first:]:
            work.wait()
    if committed is not None:
        _check_received_steps(incoming, committed=committed, generation=plan.generation)
    for block, buffers in incoming:
        state.receive(block, buffers)
    state.keep(keep)
    return TransferReport(sent=tuple(sent), received=tuple(received), bytes_sent=bytes_sent,
                          bytes_received=bytes_received, held=tuple(state.held()),
                          seconds=time.perf_counter() - start)


def _check_received_steps(incoming: Sequence[tuple[Block, dict[str, torch.Tensor]]], *, committed: int,
                          generation: int) -> None:
    """RuntimeError, as ``entering`` fails for a block held at another step, unless every
    block received has taken exactly ``committed`` steps."""
    stale = {block: int(buffers[STEP]) for block, buffers in incoming if int(buffers[STEP]) != committed}
    if stale:
        raise RuntimeError(f"blocks received at steps {stale}; generation {generation} starts after "
                           f"{committed} committed steps")


def _layout_mismatch(held: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor]) -> str | None:
    """The first key, in sending order, that ``held`` lacks or holds with another shape or
    dtype than ``wanted``; else a key ``wanted`` has not; else None."""
    for key, want in wanted.items():
        if key not in held:
            return f"no {key}"
        have = held[key]
        if have.shape != want.shape or have.dtype != want.dtype:
            return f"{key} of shape {tuple(have.shape)} {have.dtype}, the model needs {tuple(want.shape)} {want.dtype}"
    extra = [key for key in held if key not in wanted]
    return f"{extra[0]}, which the model has not" if extra else None


def _refusing_ranks(refused: bool, *, rank: int, world_size: int, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's verdict on its own part, so that all ranks stop together."""
    flags = torch.zeros(world_size, dtype=torch.int32, device=required_device(group))
    flags[rank] = int(refused)
    dist.all_reduce(flags, group=group)
    return [r for r, flag in enumerate(flags.tolist()) if flag]
