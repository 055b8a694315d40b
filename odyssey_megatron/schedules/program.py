"""The step program: what every worker runs in one step of a plan generation.

The decision center prices a plan on op lists it picks (plain 1F1B, or split backwards
where they pay, ``estimator.step_schedule``) and decides whether staggered optimizer
steps pay; it then publishes exactly those choices beside the plan, so a rank runs what
was priced and needs neither the estimator nor a cost profile. Published as JSON with
the plan (``publish``/``read_published``), stamped with its generation: a program is
never run on another generation's plan.

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
    """Each live worker's op list, in the order it runs them."""
    staggered_optimizer: bool
    """Each rank steps its optimizer without waiting for the global gradient norm
    (``runtime.rank.staggered_step``): the estimator found it shortens the step."""

    @property
    def split_backward(self) -> bool:
        """Some worker splits its backwards (its list has weight-gradient ops)."""
        return any(op.kind == WEIGHT_GRAD for ops in self.ops.values() for op in ops)

    def ops_of(self, worker: int) -> tuple[Op, ...]:
        if worker not in self.ops:
            raise ValueError(f"worker {worker} has no op list in the step program of generation {self.generation}")
        return self.ops[worker]

    def to_dict(self) -> dict[str, Any]:
        """Ops as compact ``[kind, pipeline, stage, micro_batch]`` lists per worker id."""
        return {
            "generation": self.generation,
            "staggered_optimizer": self.staggered_optimizer,
            "ops": {str(worker): [list(op) for op in ops] for worker, ops in sorted(self.ops.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StepProgram":
        ops = {}
        for worker, listed in data["ops"].items():
            for op in listed:
                if len(op) != 4 or op[0] not in OP_KINDS:
                    raise ValueError(f"step program op {op!r} of worker {worker} is not [kind, pipeline, stage, "
                                     f"micro_batch] with kind in {OP_KINDS}")
            ops[int(worker)] = tuple(Op(kind, int(p), int(s), int(m)) for kind, p, s, m in listed)
        return cls(generation=int(data["generation"]), ops=ops,
                   staggered_optimizer=bool(data["staggered_optimizer"]))


def check_program(plan: ExecutionPlan, program: StepProgram) -> None:
    """Raise ValueError unless ``program`` belongs to ``plan``: same generation, an op list
    for exactly the plan's live workers, and every op of the plan run once, by the worker
    the plan names for it (a published program is checked before a rank runs it)."""
    if program.generation != plan.generation:
        raise ValueError(f"step program of generation {program.generation} does not belong to plan generation "
                         f"{plan.generation}")
    if set(program.ops) != set(plan.workers):
        raise ValueError(f"step program has op lists for workers {sorted(program.ops)}, "
                         f"the plan's live workers are {sorted(plan.workers)}")
    expected = set()
    for pi, si, _ in plan.stage_positions():
        for mb in plan.pipelines[pi].micro_batches:
            expected.update({Op(FORWARD, pi, si, mb), Op(BACKWARD, pi, si, mb)})
    seen = set()
    for worker, ops in program.ops.items():
        for op in ops:
            if op in seen:
                raise ValueError(f"step program runs {op} twice")
            seen.add(op)
            if op.kind != WEIGHT_GRAD and op not in expected:
                raise ValueError(f"step program op {op} is not part of plan generation {plan.generation}")
            if plan.executor(op.pipeline, op.stage, op.micro_batch) != worker:
                raise ValueError(f"step program gives {op} to worker {worker}; the plan gives it to "
                                 f"{plan.executor(op.pipeline, op.stage, op.micro_batch)}")
    missing = expected - seen
    if missing:
        raise ValueError(f"step program never runs {len(missing)} op(s) of the plan, e.g. {min(missing)}")
    if any(op.kind == WEIGHT_GRAD and op._replace(kind=BACKWARD) not in expected for op in seen):
        raise ValueError("step program has a weight-gradient op for no backward of the plan")


def publish(plan: ExecutionPlan, program: StepProgram) -> dict[str, Any]:
    """The plan as the controller publishes it: the plan's JSON with its step program."""
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
