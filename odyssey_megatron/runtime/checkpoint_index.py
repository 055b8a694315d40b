"""Which checkpoints a run directory holds, which one is complete and newest, and the
marker that names it: file names and JSON manifests only, no torch, so ``odyssey train
--resume`` can check what it resumes from (and that no other user could have written it)
before anything heavy starts. ``runtime.checkpoint`` writes and reads the tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from odyssey_megatron.file_trust import check_private
from odyssey_megatron.run_dir import fsync_directory, write_json

__all__ = [
    "CHECKPOINTS", "checkpoint_directory", "checkpoint_parts", "holds_collective_save", "latest_checkpoint",
    "mark_latest", "parts_complete",
]

CHECKPOINTS = "checkpoint"
_LATEST = "latest.json"
_DCP_METADATA = ".metadata"
"""What ``torch.distributed.checkpoint`` writes last, once every rank's files are written."""


def checkpoint_directory(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step}"


def mark_latest(run_dir: Path, step: int) -> None:
    """Name the checkpoint of ``step`` the one to resume from, once its files are durable."""
    directory = checkpoint_directory(run_dir, step)
    for entries in (directory, directory.parent, Path(run_dir)):
        fsync_directory(entries)
    write_json(directory.parent / _LATEST, {"step": step, "path": directory.name})


def holds_collective_save(directory: Path) -> bool:
    """Whether a checkpoint ``directory`` holds a whole collective save (one DCP save of the step, as earlier versions wrote):
    then it is read, whatever parts a stop or a lost controller wrote beside it (they may be
    cut short; the save holds every block)."""
    return (Path(directory) / _DCP_METADATA).is_file()


def checkpoint_parts(directory: Path) -> list[tuple[Path, dict]]:
    """(part directory, manifest) of every part written under a checkpoint ``directory``."""
    return [(manifest.with_suffix(""), json.loads(manifest.read_text()))
            for manifest in sorted(directory.glob("rank-*.json"))]


def parts_complete(directory: Path, blocks: list, *, tp_size: int) -> list:
    """The blocks of ``blocks`` that no part under ``directory`` holds for some TP rank."""
    held = {(name, part["tp_rank"]) for _, part in checkpoint_parts(directory) for name in part["blocks"]}
    return [b for b in blocks if any((str(b), k) not in held for k in range(tp_size))]


def latest_checkpoint(run_dir: Path) -> Optional[tuple[int, Path]]:
    """The last complete checkpoint of ``run_dir``: (committed steps, directory), or None:
    the one ``latest.json`` names, or a newer one whose parts hold every block (written by
    workers that lost the controller, which no one marked). ConfigError if another user
    could have written it (``file_trust.check_private``)."""
    found = []
    latest = Path(run_dir) / CHECKPOINTS / _LATEST
    if latest.is_file():
        marker = json.loads(latest.read_text())
        found.append((marker["step"], latest.parent / marker["path"]))
    for directory in sorted((Path(run_dir) / CHECKPOINTS).glob("step-*")):
        manifests = [part for _, part in checkpoint_parts(directory)]
        if manifests and all("model_blocks" in part for part in manifests):
            model_blocks = sorted({b for part in manifests for b in part["model_blocks"]})
            if not parts_complete(directory, model_blocks, tp_size=manifests[0]["tp_size"]):
                found.append((manifests[0]["step"], directory))
    if not found:
        return None
    step, directory = max(found, key=lambda candidate: candidate[0])
    check_private(directory, root=run_dir)
    return step, directory
