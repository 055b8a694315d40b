"""Reading the files a user hands to ``odyssey``: bounded in size, decoded as UTF-8 and
parsed, every problem one ``ConfigError`` naming the file, where, and what to do.

The bytes are checked here first, so a binary, UTF-16 or pickle file gets a sentence
rather than a ``UnicodeDecodeError``. YAML is composed once to find its shape (a mapping,
not too deep) and then loaded by omegaconf's own loader, which refuses duplicate keys,
unknown tags and alias bombs. libyaml's composer recurses in C and crashes the process on
very deep nesting, so text that could nest deeply is composed by PyYAML's Python composer,
whose recursion limit is an exception.
"""

from __future__ import annotations

import codecs
import io
import stat
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from odyssey_megatron.errors import ConfigError

__all__ = ["MAX_FILE_BYTES", "MAX_YAML_DEPTH", "MAX_YAML_NODES", "load_yaml_mapping", "read_text"]

MAX_FILE_BYTES = 64 * 2**20
"""Largest recipe, scenario or trace read; far above any real one, small enough to hold."""
MAX_YAML_NODES = 10_000
"""YAML nodes after alias expansion; a recipe has about a hundred."""
MAX_YAML_DEPTH = 32
"""Nesting levels; a recipe has three."""
_FAST_COMPOSE_DEPTH = 1_000
"""Below this bound on nesting, libyaml's composer is safe (it crashes near 100,000)."""

_BOMS = [
    (codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"),
]


def read_text(path: str | Path, *, key: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The file's text (a UTF-8 byte-order mark dropped); ``key`` names it in errors."""
    if not str(path).strip():
        raise ConfigError(key, "is empty; give the path of a file")
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ConfigError(key, f"no such file: {path}") from None
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(key, f"{path} is a directory; give a file")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(key, f"{path} is not a regular file (a device, pipe or socket cannot be read whole)")
    too_big = f"{path} is larger than {max_bytes // 2**20} MiB, the most read"
    if info.st_size > max_bytes:
        raise ConfigError(key, too_big)
    try:
        with path.open("rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise ConfigError(key, too_big)
    return _decode(data, path, key)


def _decode(data: bytes, path: Path, key: str) -> str:
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            raise ConfigError(key, f"{path} is {encoding} text; save it as UTF-8")
    if b"\0" in data:
        raise ConfigError(key, f"{path} is binary (it holds NUL bytes); give a UTF-8 text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            key, f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); save it as UTF-8"
        ) from None
    return text.removeprefix("\ufeff")


def load_yaml_mapping(path: str | Path, *, key: str) -> DictConfig:
    """The YAML mapping in ``path``; empty files, lists, scalars, syntax errors, tabs,
    duplicate keys, tags, deep nesting and alias bombs are ConfigErrors naming ``key``."""
    text = read_text(path, key=key)
    where = f"{path}:"
    try:
        root = _compose(text)
    except RecursionError:
        raise ConfigError(key, f"{where} nested more than {MAX_YAML_DEPTH} levels deep") from None
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"{where} {_yaml_problem(exc, text)}") from None
    if root is None:
        raise ConfigError(key, f"{path} holds no settings (it is empty or only comments)")
    if not isinstance(root, yaml.MappingNode):
        kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
        raise ConfigError(key, f"{path} must hold a mapping of sections (key: value), not {kind}")
    depth = _depth(root)
    if depth is None:
        raise ConfigError(key, f"{where} an alias refers to the node that holds it")
    if depth > MAX_YAML_DEPTH:
        raise ConfigError(key, f"{where} nested {depth} levels deep; at most {MAX_YAML_DEPTH} are read")
    try:
        return OmegaConf.load(io.StringIO(text), max_yaml_expanded_nodes=MAX_YAML_NODES)
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"{where} {_yaml_problem(exc, text)}") from None
    except OmegaConfBaseException as exc:
        problem = str(exc).splitlines()[0].rstrip(".")
        raise ConfigError(key, f"{where} {problem}; plain YAML values only (numbers, strings, booleans, lists, mappings)") from None


def _compose(text: str) -> yaml.Node | None:
    lines = text.splitlines() or [""]
    could_nest = text.count("[") + text.count("{") + max(map(len, lines))
    loader = yaml.CSafeLoader if could_nest < _FAST_COMPOSE_DEPTH and yaml.__with_libyaml__ else yaml.SafeLoader
    return yaml.compose(text, Loader=loader)


def _depth(root: yaml.Node) -> int | None:
    """Nesting depth, each shared (aliased) node measured once, without recursion; stops
    counting past MAX_YAML_DEPTH; None for an alias cycle."""
    too_deep = MAX_YAML_DEPTH + 1
    depth: dict[int, int] = {}
    entered: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        children = _children(node)
        if finished:
            depth[id(node)] = 1 + max((depth[id(child)] for child in children), default=0)
            if depth[id(node)] > MAX_YAML_DEPTH:
                return too_deep
            continue
        if id(node) in depth:
            continue
        if id(node) in entered:
            return None
        entered.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in depth)
    return depth[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    return []


def _yaml_problem(exc: yaml.YAMLError, text: str) -> str:
    """One line from PyYAML's multi-line message: where, what, and a hint for tabs."""
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        return f"line {line}: character #x{exc.character:04x} is not allowed in YAML"
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = (exc.problem or exc.context or "invalid YAML").strip()
        if "constructor for the tag" in problem:
            problem += "; tags are not allowed, plain YAML values only"
        if "expan" in problem:  # omegaconf's alias-expansion limits
            problem = f"aliases expand past {MAX_YAML_NODES:,} nodes or 100 times the text; write the values out"
        if mark is None:
            return problem
        source_line = text.splitlines()[mark.line] if mark.line < len(text.splitlines()) else ""
        if "\t" in source_line[: mark.column + 1]:
            problem += " (a tab: YAML indents with spaces)"
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return str(exc).splitlines()[0]
