"""Text documents for pretraining, always read by ``datasets.load_dataset`` from local files.

Sources, all through the same ``load_dataset(builder, data_files=...)`` call:

- ``wikitext-2`` / ``wikitext-103`` (the paper's workload): the raw WikiText parquet files
  of a Hugging Face hub cache (``Salesforce/wikitext``), when a copy is there;
- a local path: a ``.txt`` file (one document per line, as WikiText's raw files), a
  ``.jsonl``/``.json`` or ``.parquet`` file with a ``text`` column, or a directory of them;
- ``python-docstrings`` (the offline default): real English prose already on every
  machine, the docstrings of the Python standard library, written once to a JSONL file.

Nothing is ever downloaded: no hub name reaches ``load_dataset``, only files.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
import zlib
from pathlib import Path
from typing import Iterator, Optional

from odyssey_megatron.specs.corpora import CORPUS_SPECS, PYTHON_DOCSTRINGS

__all__ = ["corpus_files", "load_corpus", "python_docstrings"]

_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_WIKITEXT_REPOS = ("datasets--Salesforce--wikitext", "datasets--wikitext")
_MIN_DOCSTRING_CHARS = 40
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib"}


def python_docstrings(root: Path) -> Iterator[str]:
    """Module, class and function docstrings (cleaned, at least a sentence long) of every
    Python file under ``root``, in path order; test suites and installed packages skipped."""
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a file from another Python version or encoding: not needed
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
                    yield doc


def _docstring_file(cache_dir: Path, root: Optional[Path]) -> Path:
    """The docstrings of ``root`` (default: this Python's standard library) as JSONL, written once."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    tag = f"{sys.version_info.major}.{sys.version_info.minor}-{zlib.crc32(str(root.resolve()).encode()):08x}"
    if root != Path(sysconfig.get_paths()["stdlib"]):
        tag = f"{root.name}-{tag}"
    path = cache_dir / f"{PYTHON_DOCSTRINGS}-{tag}.jsonl"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        with partial.open("w", encoding="utf-8") as out:
            for doc in python_docstrings(root):
                out.write(json.dumps({"text": doc}) + "\n")
        os.replace(partial, path)  # readers never see half a file
    return path


def _wikitext_files(name: str, hub_cache: Optional[Path]) -> list[Path]:
    from huggingface_hub import constants

    hub_cache = Path(hub_cache or constants.HF_HUB_CACHE)
    config = CORPUS_SPECS[name]
    for repo in _WIKITEXT_REPOS:
        files = sorted((hub_cache / repo / "snapshots").glob(f"*/{config}/train-*.parquet"))
        if files:
            snapshot = files[-1].parent  # one snapshot; several revisions may be cached
            return sorted(snapshot.glob("train-*.parquet"))
    raise ValueError(
        f"corpus {name}: no copy in the Hugging Face hub cache {hub_cache} "
        f"({_WIKITEXT_REPOS[0]}/snapshots/*/{config}/train-*.parquet); nothing is downloaded: "
        "fetch it with the hub tools, or name a local file or directory"
    )


def _local_files(path: Path) -> list[Path]:
    if not path.exists():
        raise ValueError(f"corpus {path}: no such file or directory")
    files = sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"corpus {path}: no {', '.join(_BUILDERS)} files in it")
    kinds = {_BUILDERS.get(p.suffix) for p in files}
    if None in kinds:
        raise ValueError(f"corpus {path}: a file must end in {', '.join(_BUILDERS)}")
    if len(kinds) > 1:
        raise ValueError(f"corpus {path}: mixes {' and '.join(sorted(kinds))} files; use one kind")
    return files


def corpus_files(source: str, *, cache_dir: Path, hub_cache: Optional[Path] = None,
                 docstring_root: Optional[Path] = None) -> list[Path]:
    """The local files behind ``source`` (see the module docstring)."""
    if source == PYTHON_DOCSTRINGS:
        return [_docstring_file(Path(cache_dir), docstring_root)]
    if source in CORPUS_SPECS:
        return _wikitext_files(source, hub_cache)
    return _local_files(Path(source))


def load_corpus(source: str, *, cache_dir: Path, hub_cache: Optional[Path] = None,
                docstring_root: Optional[Path] = None):
    """The documents of ``source`` as a ``datasets.Dataset`` with a ``text`` column.

    ``cache_dir`` holds the docstring corpus and datasets' Arrow cache; ``hub_cache``
    (default: huggingface_hub's) is where WikiText is looked for; ``docstring_root``
    replaces the standard library as the docstring source (tests use a small package).
    ValueError says what is missing.
    """
    import datasets

    files = corpus_files(source, cache_dir=cache_dir, hub_cache=hub_cache, docstring_root=docstring_root)
    documents = datasets.load_dataset(
        _BUILDERS[files[0].suffix], data_files=[str(f) for f in files], split="train",
        cache_dir=str(Path(cache_dir) / "datasets"),
    )
    if "text" not in documents.column_names:
        raise ValueError(f"corpus {source}: needs a 'text' column; has {', '.join(documents.column_names)}")
    return documents
