"""No tensor is made without saying where, on a path that feeds a collective, a P2P op or a
restored state: on CPU every device is the host, so a ``torch.tensor(...)`` that lands on
the host there lands on the host on a GPU too, where NCCL refuses it. Read from the source
with ``ast``; the few host-only uses are allowed by name, each with the reason."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "odyssey_megatron"

FACTORIES = {"tensor", "empty", "zeros", "ones", "full"}
"""``torch.<name>(...)`` calls that allocate: each needs ``device=``."""

COLLECTIVE_PATHS = [
    "hooks/training_state.py", "hooks/grad_sync.py", "hooks/stage_optimizer.py", "hooks/weight_grad.py",
    "hooks/process_groups.py", "hooks/collective_guard.py", "hooks/stage_step.py",
    "runtime/checkpoint.py", "runtime/rank/block_transfer.py", "runtime/rank/entering.py",
    "runtime/rank/executor.py", "runtime/rank/emulation.py", "runtime/rank/staggered_step.py",
    "runtime/rank/plan_runner.py", "runtime/rank/snapshots.py", "runtime/rank/megatron_1f1b.py",
    "runtime/rank/live_step.py", "snapshot/keeper.py", "snapshot/parity.py", "snapshot/restore.py",
    "restorer/transfer.py",
]
"""Modules whose tensors enter a collective, a P2P op or a restored state."""

HOST_ONLY = {
    ("snapshot/keeper.py", "*"): "keeper buffers are host memory (memfd) by design",
    ("snapshot/parity.py", "*"): "parity is encoded in host memory, over gloo groups, which move host tensors",
    ("hooks/collective_guard.py", "track"): "connects gloo groups only: gloo moves host tensors",
}
"""(module, function or "*" for the whole module) -> why its allocations belong on the host."""


def _unplaced(path: Path) -> list[tuple[str, int, str]]:
    """(enclosing function, line, call) of each ``torch.<factory>(...)`` without ``device=``."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in FACTORIES and isinstance(child.func.value, ast.Name)
                    and child.func.value.id == "torch"
                    and not any(keyword.arg == "device" for keyword in child.keywords)):
                found.append((name, child.lineno, ast.unparse(child)))
            visit(child, name)

    visit(ast.parse(path.read_text(), filename=str(path)), "<module>")
    return found


def test_every_tensor_made_on_a_collective_path_names_its_device():
    missing = [path for path in COLLECTIVE_PATHS if not (PACKAGE / path).is_file()]
    assert not missing, f"modules listed here no longer exist (update COLLECTIVE_PATHS): {missing}"
    unplaced = [f"odyssey_megatron/{path}:{line} in {function}: {call}"
                for path in COLLECTIVE_PATHS for function, line, call in _unplaced(PACKAGE / path)
                if (path, "*") not in HOST_ONLY and (path, function) not in HOST_ONLY]
    assert not unplaced, ("tensors made without device= (pass the block's, the rank's or "
                          "hooks.accelerator.required_device(group)):\n" + "\n".join(unplaced))


def test_the_lint_finds_a_host_tensor_made_without_a_device(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("import torch\n\ndef to_tensors(step):\n    return torch.tensor(step, dtype=torch.int64)\n\n"
                      "def placed(step, device):\n    return torch.tensor(step, device=device)\n")
    assert _unplaced(source) == [("to_tensors", 4, "torch.tensor(step, dtype=torch.int64)")]
