"""The package's imports run downward: every room (a top-level module or package of
``odyssey_megatron``; in ``runtime``, each module or package) sits on a floor, and a room
imports only rooms on its own floor or below, with no circle anywhere. The drawing is read
from the source with ``ast`` (imports inside functions count: they run too), so a new room
must be given a floor here before it can be imported by anyone.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "odyssey_megatron"

FLOORS: list[tuple[str, str]] = [
    ("odyssey_megatron runtime units errors",
     "words every room uses: the package docstrings, units and the one user-error type"),
    ("input_files limits typed_yaml specs timeouts settings optimizer_shards bridge_fields bridge_recipe run_dir "
     "run_lock file_trust plotting runtime.checkpoint_index",
     "facts and files with no notion of a job: bounded reads, size limits, typed YAML with one-line errors, "
     "shipped specs, timeouts and settings views, who keeps which optimizer shard, Megatron-Bridge's layout, files "
     "written whole and trusted, one "
     "controller per run directory, the plotting backend, which checkpoints a run directory holds"),
    ("cluster",
     "which ranks live, and which workers and nodes hold them: the arithmetic every room asks"),
    ("phases config data",
     "the phases of a worker's step (which the recipe's faults name), the recipe, and the training data it names"),
    ("blocks profile profile_file plan",
     "the job as data: which blocks a stage holds and what each weighs, what each block costs (and the profile a "
     "recipe is priced with), the plan"),
    ("schedules",
     "a plan compiled to op lists: data the estimator prices and the runtime runs as priced"),
    ("estimator restorer hooks snapshot runtime.protocol runtime.step_ledger",
     "what a plan costs and what it moves (pure), the Megatron-Core glue, the in-memory snapshots' shares, "
     "keeper memory and parity, and the runtime's one contract with the commit rules both of its sides follow"),
    ("planner profiler runtime.checkpoint runtime.final_model",
     "drafting plans on the pricing below; measuring a profile and saving weights on the hooks"),
    ("decision_center testing",
     "the one stateful door to planning, and the seeded local worlds and fault plans of the tests"),
    ("runtime.rank runtime.control simulator",
     "inside a worker, what outlives the workers, and the simulator: each drives the floors below"),
    ("runtime.train runtime.data_preparation",
     "odyssey train: where the two sides of the runtime meet, and node 0's data, prepared apart from its controller"),
    ("cli report device_check",
     "the commands and what they print, and the check a first GPU machine runs"),
]
"""Lowest first; each floor's rooms and the one-line reason they stand there."""

APART = [("runtime.rank", "runtime.control")]
"""Rooms that never import each other (they meet only in ``runtime.protocol``)."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _room(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "odyssey_megatron"
    if parts[0] == "runtime" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """The package's modules ``path`` imports, each with the line that does."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return [(name, line) for name, line in found if name in modules]


def _arrows() -> dict[tuple[str, str], list[str]]:
    """Room -> room, with the places that draw each arrow."""
    modules = _modules()
    arrows: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in modules.items():
        for target, line in _imports(path, modules):
            if _room(module) != _room(target):
                arrows[_room(module), _room(target)].append(f"{path.relative_to(REPO)}:{line}")
    return arrows


def _floor_of() -> dict[str, int]:
    return {room: floor for floor, (rooms, _) in enumerate(FLOORS) for room in rooms.split()}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return circles


def test_every_room_has_one_floor():
    floor_of = _floor_of()
    named = [room for rooms, _ in FLOORS for room in rooms.split()]
    assert len(named) == len(set(named)), "a room is named on two floors"
    rooms = {_room(module) for module in _modules()}
    assert sorted(rooms - set(floor_of)) == [], "give these rooms a floor in FLOORS"
    assert sorted(set(floor_of) - rooms) == [], "these rooms are gone: take them out of FLOORS"


def test_no_room_imports_a_room_on_a_higher_floor():
    floor_of = _floor_of()
    upward = [f"{a} (floor {floor_of[a]}) -> {b} (floor {floor_of[b]}) at {', '.join(where)}"
              for (a, b), where in sorted(_arrows().items()) if floor_of[a] < floor_of[b]]
    assert not upward, "\n".join(upward)


def test_no_import_circle_between_rooms_or_between_modules():
    rooms: dict[str, set[str]] = defaultdict(set)
    for a, b in _arrows():
        rooms[a].add(b)
    modules = _modules()
    between_modules: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        between_modules[module] |= {target for target, _ in _imports(path, modules) if target != module}
    assert not _circles(rooms), _circles(rooms)
    assert not _circles(between_modules), _circles(between_modules)


def test_the_worker_side_and_the_control_side_meet_only_in_the_protocol():
    arrows = _arrows()
    assert [(a, b) for a, b in APART if (a, b) in arrows or (b, a) in arrows] == []


def test_config_error_is_imported_from_its_one_home():
    elsewhere = []
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "tests").glob("*.py"), *(REPO / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.ImportFrom) and node.module != "odyssey_megatron.errors"
                    and any(alias.name == "ConfigError" for alias in node.names)):
                elsewhere.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not elsewhere, "import ConfigError from odyssey_megatron.errors at " + ", ".join(elsewhere)


def test_no_class_in_the_runtime_grows_past_300_lines():
    """A class that long has taken jobs that belong in rooms of their own (``TrainingRun``
    and ``Worker`` did: issue 41 split them by job)."""
    long = []
    for path in (PACKAGE / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "split by job: " + ", ".join(long)
