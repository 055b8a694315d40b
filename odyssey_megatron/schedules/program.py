"""The step program: what every worker runs in one step of a plan generation.

The decision center prices a plan on op lists it picks (plain 1F1B, or split backwards
where they pay, ``estimator.step_schedule``) and decides whether staggered optimizer
steps pay; it then publishes exactly those choices beside the plan, so a rank runs what
was priced and needs neither the estimator nor a cost profile. Stamped with its
generation: a program is never run on another generation's plan. The run directory keeps
it whole beside the plan (``publish``/``read_published``); the controller publishes each
worker's op list apart (``runtime.protocol``), and a worker checks its own against the
plan (``check_own_ops``).

Workers are named by their id, fixed at launch (``plan`` speaks of workers too); which
process rank a worker has in the current world is decided where groups are built
(``hooks.process_groups.RankMap``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.schedules.ops import BACKWARD, FORWARD, WEIGHT_GRAD, Op

OP_KINDS = (FORWARD, BACKWARD, WEIGHT_GRAD)


@dataclass(frozen=True)
class StepProgram:
    generation: int
    """The plan generation this program belongs to."""
    ops: Mapping[int, tuple[Op, ...]]
    """Op lists, in the order each worker runs them: every live worker's where the program
    is made and published, the reader's own only on a worker (``runtime.protocol``)."""
    staggered_optimizer: bool
    """Each rank steps its optimizer without waiting for the global gradient norm
    (``runtime.rank.staggered_step``): the estimator found it shortens the step."""
    split_backward: bool
    """Some worker of the plan splits its backwards (its list has weight-gradient ops).
    Published, not read off the op lists a worker holds: every stage of a pipeline must
    agree whether Megatron's 1F1B can run it, whatever its own list holds."""

    def ops_of(self, worker: int) -> tuple[Op, ...]:
        if worker not in self.ops:
            raise ValueError(f"worker {worker} has no op list in the step program of generation {self.generation}")
        return self.ops[worker]

    def to_dict(self) -> dict[str, Any]:
        """Ops as compact ``[kind, pipeline, stage, micro_batch]`` lists per worker id."""
        return {
            "generation": self.generation,
            "staggered_optimizer": self.staggered_optimizer,
            "split_backward": self.split_backward,
            "ops": {str(worker): ops_to_json(ops) for worker, ops in sorted(self.ops.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepProgram":
        return cls(generation=int(data["generation"]),
                   ops={int(worker): ops_from_json(listed, worker=int(worker)) for worker, listed in data["ops"].items()},
                   staggered_optimizer=bool(data["staggered_optimizer"]), split_backward=bool(data["split_backward"]))


def ops_to_json(ops: tuple[Op, ...]) -> list[list]:
    """One worker's op list as ``[kind, pipeline, stage, micro_batch]`` lists."""
    return [list(op) for op in ops]


def ops_from_json(listed: Any, *, worker: int) -> tuple[Op, ...]:
    """The op list ``ops_to_json`` wrote for ``worker``; ValueError, naming the op, on a malformed one."""
    ops = []
    for op in listed:
        if not (isinstance(op, list) and len(op) == 4 and op[0] in OP_KINDS
                and all(isinstance(v, int) and not isinstance(v, bool) for v in op[1:])):
            raise ValueError(f"step program op {op!r} of worker {worker} is not [kind, pipeline, stage, "
                             f"micro_batch] with kind in {OP_KINDS}")
        ops.append(Op(*op))
    return tuple(ops)


def _given(plan: ExecutionPlan, only: int | None = None) -> dict[int, set[tuple[int, int, int]]]:
    """(pipeline, stage, micro-batch) of every op the plan gives each worker (``plan.executor``),
    or ``only`` that worker's: its stage's micro-batches, and those it runs for failed stages."""
    given: dict[int, set[tuple[int, int, int]]] = {}
    for pi, si, stage in plan.stage_positions():
        if stage.worker is not None and only in (None, stage.worker):
            given.setdefault(stage.worker, set()).update((pi, si, m) for m in plan.pipelines[pi].micro_batches)
    for r in plan.reroutes:
        pipeline = plan.pipelines[r.pipeline]
        if pipeline.stages[r.stage].worker is None and only in (None, r.worker):
            mine = set(r.micro_batches).intersection(pipeline.micro_batches)
            given.setdefault(r.worker, set()).update((r.pipeline, r.stage, m) for m in mine)
    return given


def _executor(plan: ExecutionPlan, op: Op) -> int | None:
    """The worker the plan has run ``op``'s micro-batch at its stage; None: the plan has no such op."""
    if not 0 <= op.pipeline < len(plan.pipelines):
        return None
    pipeline = plan.pipelines[op.pipeline]
    if not 0 <= op.stage < pipeline.num_stages or op.micro_batch not in pipeline.micro_batches:
        return None
    try:
        return plan.executor(op.pipeline, op.stage, op.micro_batch)
    except KeyError:
        return None


def _check_ops(plan: ExecutionPlan, worker: int, ops: tuple[Op, ...], given: set[tuple[int, int, int]]) -> None:
    """Raise ValueError unless ``ops`` runs each forward and backward of ``given`` (what the
    plan gives ``worker``) once, and nothing else but weight-gradient halves of those backwards."""
    seen = set()
    for op in ops:
        if op in seen:
            raise ValueError(f"step program runs {op} twice on worker {worker}")
        seen.add(op)
        if (op.pipeline, op.stage, op.micro_batch) in given:
            continue
        owner = _executor(plan, op)
        if owner is None:
            raise ValueError(f"step program op {op} of worker {worker} is not part of plan generation {plan.generation}")
        raise ValueError(f"step program gives {op} to worker {worker}; the plan gives it to {owner}")
    if sum(op.kind != WEIGHT_GRAD for op in seen) < 2 * len(given):  # distinct and each given: too few
        missing = {Op(kind, *position) for position in given for kind in (FORWARD, BACKWARD)} - seen
        raise ValueError(f"step program never runs {len(missing)} op(s) the plan gives worker {worker}, "
                         f"e.g. {min(missing)}")


def check_program(plan: ExecutionPlan, program: StepProgram) -> None:
    """Raise ValueError unless ``program`` belongs to ``plan``: same generation, an op list
    for exactly the plan's live workers, every op of the plan run once, by the worker the
    plan names for it, and ``split_backward`` set exactly where some list splits a backward
    (the controller checks the whole program before publishing it)."""
    if program.generation != plan.generation:
        raise ValueError(f"step program of generation {program.generation} does not belong to plan generation "
                         f"{plan.generation}")
    if set(program.ops) != set(plan.workers):
        raise ValueError(f"step program has op lists for workers {sorted(program.ops)}, "
                         f"the plan's live workers are {sorted(plan.workers)}")
    given = _given(plan)
    for worker, ops in program.ops.items():
        _check_ops(plan, worker, ops, given.get(worker, set()))
    split = any(op.kind == WEIGHT_GRAD for ops in program.ops.values() for op in ops)
    if program.split_backward != split:
        raise ValueError(f"step program says split_backward={program.split_backward}, its op lists "
                         f"{'split' if split else 'split no'} backwards")


def check_own_ops(plan: ExecutionPlan, program: StepProgram, worker: int) -> None:
    """Raise ValueError unless ``worker``'s op list in ``program`` is what ``plan`` gives it:
    each forward and backward the plan has it run, once, weight-gradient halves of those
    backwards only where the program splits backwards, and nothing else (a worker that
    holds its own list alone checks that much of ``check_program``)."""
    if program.generation != plan.generation:
        raise ValueError(f"step program of generation {program.generation} does not belong to plan generation "
                         f"{plan.generation}")
    ops = program.ops_of(worker)
    _check_ops(plan, worker, ops, _given(plan, worker).get(worker, set()))
    if not program.split_backward and any(op.kind == WEIGHT_GRAD for op in ops):
        raise ValueError(f"worker {worker}'s op list splits backwards; its program says none does")


def publish(plan: ExecutionPlan, program: StepProgram, *, checked: bool = False) -> dict[str, Any]:
    """The plan as the run directory keeps it: the plan's JSON with its whole step program,
    checked first unless ``checked`` (the caller's ``check_program`` passed: at 16,384 ranks
    a check is about half a second)."""
    if not checked:
        check_program(plan, program)
    return {**plan.to_dict(), "step_program": program.to_dict()}


def read_published(data: Mapping[str, Any]) -> tuple[ExecutionPlan, StepProgram]:
    """The plan and step program of a published plan (``publish``), checked to belong together."""
    if "step_program" not in data:
        raise ValueError("the published plan has no step_program")
    plan = ExecutionPlan.from_dict(dict(data))
    program = StepProgram.from_dict(data["step_program"])
    check_program(plan, program)
    return plan, program
