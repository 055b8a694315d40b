"""Typed YAML with one-line errors: a YAML file and ``key=value`` overrides merged onto a
structured omegaconf schema (one dataclass per section, each ``__post_init__`` validating
its own fields with the ``require`` helpers), every problem one ``ConfigError`` naming the
key and what is allowed. Knows nothing of any one file's keys: the recipe (``config``) and
the simulator's scenarios (``simulator.scenario``) are both read with it.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, get_args, get_type_hints

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from odyssey_megatron import limits
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.input_files import load_yaml_mapping

__all__ = [
    "Choice",
    "Defaults",
    "build_structured",
    "choice",
    "load_structured",
    "one_of",
    "read_layers",
    "require",
    "require_at_most",
    "require_non_negative",
    "require_plain_numbers",
    "require_positive",
]


def require(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(key, problem)


def _key(section: str, name: str) -> str:
    return f"{section}.{name}" if section else name


def require_plain_numbers(section: str, obj: Any) -> None:
    """Every float field finite and every integer within 64 bits. Call first in a
    ``__post_init__``: inf passes every ``> 0`` check and nan fails them with a confusing
    message; both surface much later as ZeroDivisionError, OverflowError or NaN output."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(_key(section, f.name), f"must be a finite number; got {value}")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limits.INT64:
            raise ConfigError(_key(section, f.name), f"must fit a signed 64-bit integer; got {value}")


def require_positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value > 0, _key(section, name), f"must be > 0, got {value}")


def require_non_negative(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value >= 0, _key(section, name), f"must be >= 0, got {value}")


def require_at_most(section: str, obj: Any, limit: float, why: str, *names: str) -> None:
    for name in names:
        limits.require_at_most(_key(section, name), getattr(obj, name), limit, why)


class Choice(str, Enum):
    """A fixed choice. Every member's name is its value, which is how omegaconf reads it
    from YAML; it compares, hashes, formats and serialises as that string, so code reading
    a config needs no ``.value`` (``enum.StrEnum``, which Python 3.10 lacks)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


def one_of(kind: type[Choice]) -> str:
    return f"must be one of {', '.join(member.value for member in kind)}"


def choice(key: str, kind: type[Choice], value: Any) -> Choice:
    """``value`` as a member of ``kind``: configs built in Python pass plain strings."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(key, f"{one_of(kind)}; got {value!r}") from None


def _choice_type(schema: DictConfig, key: str) -> Optional[type[Choice]]:
    """The Choice enum of the field at ``key`` (also inside Optional and List), if it is one."""
    parent_path, _, leaf = key.rpartition(".")
    node = OmegaConf.select(schema, parent_path) if parent_path else schema
    if not isinstance(node, DictConfig) or node._metadata.object_type is None:
        return None
    hint = get_type_hints(node._metadata.object_type).get(leaf.split("[")[0])
    return next((t for t in (hint, *get_args(hint)) if isinstance(t, type) and issubclass(t, Choice)), None)


def _explain(exc: OmegaConfBaseException, schema: DictConfig) -> ConfigError:
    """Turn omegaconf's multi-line error into one line naming the key and what is allowed."""
    key = getattr(exc, "full_key", None) or "config"
    message = str(exc).splitlines()[0]
    if isinstance(exc, MissingMandatoryValue):
        return ConfigError(key, "must be given")
    kind = _choice_type(schema, key)
    if kind is not None and message.startswith(("Invalid value '", "Incompatible value '", "Value ")):
        value = getattr(exc, "value", None)
        value = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
        return ConfigError(key, f"{one_of(kind)}; got {value!r}")
    if "not in struct" in message or "Key '" in message and "not in" in message:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        section = OmegaConf.select(schema, parent) if parent else schema
        allowed = sorted(section.keys()) if isinstance(section, DictConfig) else []
        return ConfigError(key, f"unknown key; allowed here: {', '.join(map(str, allowed))}")
    if "Value '" in message or "could not be converted" in message or "Invalid type" in message:
        field_type = None
        parent_path, _, leaf = key.rpartition(".")
        node = OmegaConf.select(schema, parent_path) if parent_path else schema
        if isinstance(node, DictConfig):
            field_type = next((f.type for f in fields(node._metadata.object_type) if f.name == leaf), None)
        expected = getattr(field_type, "__name__", None) or str(field_type).replace("typing.", "")
        return ConfigError(key, f"{message.rstrip('.')}; expected {expected}")
    return ConfigError(key, message)


_OVERRIDE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``key=value`` arguments as a config; a malformed or repeated key is an error, since
    omegaconf would let the last silently win."""
    seen, cli = set(), OmegaConf.create()
    for item in overrides:
        key, equals, value = item.partition("=")
        if key != key.strip():
            raise ConfigError(item, "an override must look like section.key=value, with no space before '='")
        if not equals or not _OVERRIDE_KEY.fullmatch(key):
            raise ConfigError(item, "an override must look like section.key=value")
        if not value.strip():
            raise ConfigError(key, "has no value after '='; give one (null unsets a setting)")
        if key in seen:
            raise ConfigError(key, "set twice among the overrides; give it once")
        seen.add(key)
        try:
            cli = OmegaConf.merge(cli, OmegaConf.from_dotlist([item]))
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(key, f"the value is not valid YAML: {problem}") from None
    return cli


def _check_shape(layer: Any, schema: DictConfig, prefix: str = "") -> None:
    """Sections must stay mappings, each item of a list of records (a recipe's
    ``odyssey.faults``) must fit its record, and ``???`` (omegaconf's missing-value marker,
    which a merge silently drops) is not a value. ``layer`` is a plain container, unresolved."""
    items = layer.items() if isinstance(layer, dict) else enumerate(layer)
    for key, value in items:
        path = f"{prefix}{key}" if isinstance(layer, dict) else f"{prefix.rstrip('.')}[{key}]"
        if value == "???":
            raise ConfigError(path, "??? is not a value; give one or leave the key out")
        expected = schema.get(key) if isinstance(layer, dict) and isinstance(key, str) and key in schema else None
        if isinstance(expected, DictConfig) and not isinstance(value, dict):
            raise ConfigError(path, f"is a section and must be a mapping of its keys; got {value!r}")
        if isinstance(expected, ListConfig) and not isinstance(value, list):
            raise ConfigError(path, f"must be a list; got {value!r}")
        element_type = expected._metadata.element_type if isinstance(expected, ListConfig) else None
        if is_dataclass(element_type):
            _check_records(value, OmegaConf.structured(element_type), path)
        elif isinstance(value, (dict, list)):
            _check_shape(value, expected if isinstance(expected, DictConfig) else DictConfig({}), f"{path}.")


def _check_records(items: list, schema: DictConfig, path: str) -> None:
    """Each item of a list of structured records against the record's schema, so an error
    names ``path[i].key`` (omegaconf's own, raised in the merge, names the bare key)."""
    for index, item in enumerate(items):
        key = f"{path}[{index}]"
        if not isinstance(item, dict):
            raise ConfigError(key, f"must be a mapping of {', '.join(schema.keys())}; got {item!r}")
        _check_shape(item, schema, f"{key}.")
        try:
            OmegaConf.merge(schema, item)
        except OmegaConfBaseException as exc:
            error = _explain(exc, schema)
            raise ConfigError(f"{key}.{error.key}", error.problem) from None


@contextmanager
def _one_line(schema: DictConfig) -> Iterator[None]:
    """omegaconf's errors, and the ConfigErrors of ``__post_init__`` it wraps, as one ConfigError."""
    try:
        yield
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, ConfigError) else None
        if cause is not None:
            raise cause from None
        raise _explain(exc, schema) from None


Defaults = Callable[[DictConfig, DictConfig], list[DictConfig]]


def read_layers(path: str | Path | None, overrides: Sequence[str], *, flag: str,
                schema: DictConfig) -> tuple[DictConfig, DictConfig]:
    """The YAML file (``flag`` names it in errors) and the dotlist overrides, unmerged."""
    with _one_line(schema):
        loaded = load_yaml_mapping(path, key=flag) if path is not None else OmegaConf.create()
        return loaded, _parse_overrides(overrides)


def build_structured(schema: DictConfig, loaded: DictConfig, cli: DictConfig, *, defaults: Defaults | None = None) -> Any:
    """Merge schema defaults, ``defaults(loaded, cli)`` layers, the file and the overrides,
    then build the dataclasses (their ``__post_init__`` validates). Every problem becomes
    one ConfigError naming the key."""
    with _one_line(schema):
        for layer in (loaded, cli):
            _check_shape(OmegaConf.to_container(layer, resolve=False), schema)
        layers = defaults(loaded, cli) if defaults is not None else []
        return OmegaConf.to_object(OmegaConf.merge(schema, *layers, loaded, cli))


def load_structured(
    schema_type: type,
    path: str | Path | None,
    overrides: Sequence[str],
    *,
    flag: str,
    defaults: Defaults | None = None,
) -> Any:
    """``read_layers`` then ``build_structured``: a config file and its overrides, validated."""
    schema = OmegaConf.structured(schema_type)
    loaded, cli = read_layers(path, overrides, flag=flag, schema=schema)
    return build_structured(schema, loaded, cli, defaults=defaults)
