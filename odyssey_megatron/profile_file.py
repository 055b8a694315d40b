"""The profile file: a ``ModelProfile`` as versioned JSON, and the check that it fits a recipe;
and the profile a recipe's plans are priced with (``recipe_profile``: its file, else analytic).

``odyssey profile`` writes one from measurements; ``odyssey.profile: FILE`` makes
``plan`` and ``simulate`` price plans with it instead of the analytic profile, and
``cluster.emulate_device: FILE`` paces a runtime to it. Format version 2::

    {"format": "odyssey-profile", "version": 2,
     "measured_for": {"model.num_layers": 8, "model.hidden_size": 64, ...},
     "source": {...},
     "profile": {"layers": [{"forward_s": ..., "backward_s": ..., ...}, ...],
                 "embedding": {...}, "output": {...}, "p2p_bytes": ..., ...}}

``profile`` holds every ``ModelProfile`` field by name, and ``layers`` (one object per
layer), ``embedding`` and ``output`` every ``BlockCost`` field; fields with a default may
be left out, ``null`` only where the field allows None. Times are seconds per micro-batch
on one rank, sizes bytes, bandwidths bytes/s; every number finite and >= 0, bandwidths,
memory budget and batch shape > 0. ``measured_for`` holds the recipe keys the costs depend
on (``MEASURED_FOR``): a file measured for another model, micro-batch size or TP size is
refused. ``source`` says what measured it (device, timer, repeats); it is for people and
not read. Every problem is one ``ConfigError`` naming the recipe key and the file.

Version 2 added ``op_overhead_s`` and ``optimizer_s_per_param_byte``; a version 1 file,
which has neither, still loads, both taken as nil (what its estimates assumed).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import typing
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from odyssey_megatron import limits
from odyssey_megatron.config import RecipeConfig
from odyssey_megatron.errors import ConfigError
from odyssey_megatron.input_files import read_text
from odyssey_megatron.optimizer_shards import owned_share
from odyssey_megatron.profile import BlockCost, ModelProfile, analytic_profile
from odyssey_megatron.specs import DEVICE_SPECS, device_spec
from odyssey_megatron.units import GIB

__all__ = ["FORMAT", "MEASURED_FOR", "VERSION", "ProfileFile", "analytic_recipe_profile", "check_output",
           "profile_json", "read_profile", "recipe_measured_for", "recipe_profile", "recipe_profile_file",
           "write_profile"]

FORMAT = "odyssey-profile"
VERSION = 2
READS = {1: {"op_overhead_s", "optimizer_s_per_param_byte"}, 2: set()}
"""Versions this odyssey reads, each with the profile fields it lacks."""
MEASURED_FOR = (
    "model.num_layers", "model.hidden_size", "model.ffn_hidden_size", "model.num_attention_heads",
    "model.num_query_groups", "model.vocab_size", "model.seq_length", "model.tie_embeddings", "model.params_dtype",
    "training.micro_batch_size", "parallel.tensor_model_parallel_size",
)
"""Recipe keys a profile's costs depend on."""
_POSITIVE = {"intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth", "allreduce_bandwidth",
             "snapshot_copy_bandwidth", "parity_xor_bandwidth",
             "memory_budget_bytes", "samples_per_micro_batch", "tokens_per_sample"}
"""Fields the estimator divides by or counts with."""
_TOP_LEVEL = ("format", "version", "measured_for", "source", "profile")


@dataclass(frozen=True)
class ProfileFile:
    profile: ModelProfile
    measured_for: Mapping[str, Any]
    """Recipe key -> the value the profile was measured for (``MEASURED_FOR``)."""
    source: Mapping[str, Any]
    """What measured it; informational."""


def recipe_measured_for(config: RecipeConfig) -> dict[str, Any]:
    """The recipe's values of the ``MEASURED_FOR`` keys."""
    values = {}
    for key in MEASURED_FOR:
        section, name = key.split(".")
        values[key] = getattr(getattr(config, section), name)
    return values


def profile_json(profile: ModelProfile, *, measured_for: Mapping[str, Any], source: Mapping[str, Any]) -> dict:
    """The file's JSON object; write it with ``allow_nan=False`` (a profile in a file is finite)."""
    return {"format": FORMAT, "version": VERSION, "measured_for": dict(measured_for), "source": dict(source),
            "profile": asdict(profile)}


def check_output(path: str | Path, *, key: str, force: bool) -> Path:
    """``path`` as a place to write a profile file, checked before any measuring: in an
    existing, writable directory, and new, unless ``force`` and it holds a profile file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(key, f"{path} is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(key, f"{parent} is not a directory; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(key, f"cannot write in {parent}")
    if os.path.lexists(path):
        if not force:
            raise ConfigError(key, f"{path} exists; give another name, or --force to replace an earlier profile")
        try:
            read_profile(path, key=key)
        except ConfigError:
            raise ConfigError(key, f"{path} is not a profile file; --force replaces only profile files") from None
    return path


def write_profile(path: Path, data: dict) -> None:
    """Write the file whole or not at all (a temporary file renamed into place)."""
    text = json.dumps(data, indent=1, allow_nan=False) + "\n"
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(handle, 0o666 & ~umask)  # as open() would create it, not mkstemp's 0600
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


class _Bad(Exception):
    """A problem at a place in the file; ``read_profile`` adds the key and the path."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where} {problem}")


def read_profile(path: str | Path, *, key: str) -> ProfileFile:
    """The profile file at ``path``; any problem is a ConfigError naming ``key`` and the file."""
    text = read_text(path, key=key)
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ConfigError(key, f"{path}: line {exc.lineno}, column {exc.colno}: {exc.msg}; give a profile JSON file "
                               "(odyssey profile writes one)") from None
    except RecursionError:
        raise ConfigError(key, f"{path}: nested too deeply to be a profile file") from None
    except _Bad as exc:
        raise ConfigError(key, f"{path}: {exc}") from None
    try:
        return _profile_file(data)
    except _Bad as exc:
        raise ConfigError(key, f"{path}: {exc}") from None


def recipe_profile_file(path: str | Path, config: RecipeConfig, *, key: str) -> ModelProfile:
    """The profile in ``path``, refused unless measured for ``config``'s model, micro-batch
    size and TP size; ``odyssey.memory_budget_gib``, when set, replaces its memory budget."""
    loaded = read_profile(path, key=key)
    for name, wanted in recipe_measured_for(config).items():
        if loaded.measured_for[name] != wanted:
            raise ConfigError(key, f"{path} was measured for {name}={loaded.measured_for[name]!r} and the recipe has "
                                   f"{wanted!r}; profile this recipe (odyssey profile --config ...)")
    budget = config.odyssey.memory_budget_gib
    return loaded.profile if budget is None else replace(loaded.profile, memory_budget_bytes=int(budget * GIB))


def recipe_profile(config: RecipeConfig) -> ModelProfile:
    """The profile the recipe's plans are priced with: the file ``odyssey.profile`` names
    (``profile_file``; ConfigError if it is bad or measured for another model), else the
    analytic profile of its model on ``cluster.device``. Each block's optimizer state is
    all of it: with ``odyssey.distributed_optimizer`` the estimator takes each plan's share
    at that plan's holder counts (``estimator.memory.held_profile``), not at the recipe's
    DP size, which a plan after a failure no longer has."""
    if config.odyssey.profile is not None:
        return recipe_profile_file(config.odyssey.profile, config, key="odyssey.profile")
    return analytic_recipe_profile(config, device=config.cluster.device)


def analytic_recipe_profile(config: RecipeConfig, *, device: str) -> ModelProfile:
    """The analytic profile of the recipe's model on the shipped device spec ``device``."""
    model = config.model
    budget = config.odyssey.memory_budget_gib
    return analytic_profile(model, micro_batch_size=config.training.micro_batch_size,
                            tensor_parallel_size=config.parallel.tensor_model_parallel_size,
                            device=device_spec(device), memory_budget_bytes=None if budget is None else int(budget * GIB))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    data = {}
    for name, value in pairs:
        if name in data:
            raise _Bad(f"key {name!r}", "appears twice in one object")
        data[name] = value
    return data


def _no_constant(name: str) -> None:
    raise _Bad(name, "is not a number a profile may hold; numbers are finite")


def _profile_file(data: Any) -> ProfileFile:
    if not isinstance(data, dict):
        raise _Bad("the top level", f"must be an object with {', '.join(_TOP_LEVEL)}")
    if data.get("format") != FORMAT:
        raise _Bad("format", f"must be {FORMAT!r}; got {data.get('format')!r} (not a profile file?)")
    version = data.get("version")
    if isinstance(version, bool) or version not in READS:
        raise _Bad("version", f"{version!r} is not supported; this odyssey reads versions "
                              f"{', '.join(map(str, READS))}")
    unknown = sorted(set(data) - set(_TOP_LEVEL))
    if unknown:
        raise _Bad(unknown[0], f"is not a key of a profile file; known: {', '.join(_TOP_LEVEL)}")
    for name in ("measured_for", "profile"):
        if name not in data:
            raise _Bad(name, "is missing")
    source = data.get("source", {})
    if not isinstance(source, dict):
        raise _Bad("source", "must be an object")
    measured_for = _measured_for(data["measured_for"])
    newer = sorted(READS[version] & set(data["profile"] if isinstance(data["profile"], dict) else ()))
    if newer:
        raise _Bad(f"profile.{newer[0]}", f"is not a field of a version {version} profile")
    profile = ModelProfile(**_fields(ModelProfile, data["profile"], "profile"))
    if profile.num_layers != measured_for["model.num_layers"]:
        raise _Bad("profile.layers", f"lists {profile.num_layers} layers; measured_for says model.num_layers="
                                     f"{measured_for['model.num_layers']}")
    if profile.tie_embeddings != measured_for["model.tie_embeddings"]:
        raise _Bad("profile.tie_embeddings", "differs from measured_for's model.tie_embeddings")
    return ProfileFile(profile=profile, measured_for=measured_for, source=source)


def _measured_for(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _Bad("measured_for", "must be an object of recipe keys")
    missing = [k for k in MEASURED_FOR if k not in data]
    if missing:
        raise _Bad("measured_for", f"lacks {missing[0]}; it names {', '.join(MEASURED_FOR)}")
    unknown = sorted(set(data) - set(MEASURED_FOR))
    if unknown:
        raise _Bad(f"measured_for.{unknown[0]}", f"is not a key it names; known: {', '.join(MEASURED_FOR)}")
    for name, value in data.items():
        if not isinstance(value, (bool, int, str)) or isinstance(value, float):
            raise _Bad(f"measured_for.{name}", f"must be a recipe value (integer, string or boolean); got {value!r}")
    return dict(data)


def _fields(cls: type, data: Any, where: str) -> dict[str, Any]:
    """``cls``'s constructor arguments from ``data``, each checked against its type."""
    if not isinstance(data, dict):
        raise _Bad(where, f"must be an object of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise _Bad(f"{where}.{unknown[0]}", f"is not a {cls.__name__} field; known: {', '.join(known)}")
    values = {}
    for name, f in known.items():
        if name not in data:
            if f.default is MISSING:
                raise _Bad(f"{where}.{name}", "is missing")
            continue
        values[name] = _value(hints[name], data[name], f"{where}.{name}", positive=name in _POSITIVE)
    if cls is BlockCost and (values.get("weight_grad_s") or 0.0) > values["backward_s"]:
        raise _Bad(f"{where}.weight_grad_s", f"({values['weight_grad_s']}) is part of backward_s "
                                             f"({values['backward_s']}) and cannot exceed it")
    return values


def _value(hint: Any, value: Any, where: str, *, positive: bool) -> Any:
    if hint == tuple[BlockCost, ...]:
        if not isinstance(value, list):
            raise _Bad(where, "must be a list of BlockCost objects")
        return tuple(BlockCost(**_fields(BlockCost, item, f"{where}[{i}]")) for i, item in enumerate(value))
    if hint is BlockCost:
        return BlockCost(**_fields(BlockCost, value, where))
    if hint == (float | None) and value is None:
        return None
    if hint is bool:
        if not isinstance(value, bool):
            raise _Bad(where, f"must be true or false; got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (hint is int and isinstance(value, float)):
        kind = "an integer" if hint is int else "a number"
        raise _Bad(where, f"must be {kind}; got {value!r}")
    if isinstance(value, int) and value > limits.INT64:
        raise _Bad(where, f"must fit a signed 64-bit integer; got {value}")
    if value < 0 or (positive and value == 0) or not math.isfinite(value):
        raise _Bad(where, f"must be {'> 0' if positive else '>= 0'}; got {value!r}")
    return value if hint is int else float(value)


def optimizer_bytes_per_rank(config: RecipeConfig) -> tuple[float, float]:
    """Bytes of optimizer state per rank: a full copy of its stage's, and what the
    distributed optimizer keeps (``optimizer_shards.owned_share`` of it)."""
    from odyssey_megatron.blocks import EMBEDDING, OUTPUT

    profile = analytic_recipe_profile(config, device=config.cluster.device)
    blocks = [EMBEDDING, *range(profile.num_layers), OUTPUT]
    full = sum(profile.block(block).optimizer_bytes for block in blocks) / config.parallel.pipeline_model_parallel_size
    return full, full * owned_share(config.parallel.data_parallel_size)


def emulated_profile(config: RecipeConfig) -> ModelProfile | None:
    """The profile ``cluster.emulate_device`` paces the runtime's ops to (None: off): a
    shipped device's analytic profile of the recipe's model, or a profile file measured
    for it; ConfigError naming the key otherwise."""
    name = config.cluster.emulate_device
    if name is None:
        return None
    if name in DEVICE_SPECS:
        return analytic_recipe_profile(config, device=name)
    if Path(name).exists():
        return recipe_profile_file(name, config, key="cluster.emulate_device")
    raise ConfigError("cluster.emulate_device", f"must be one of {', '.join(sorted(DEVICE_SPECS))} or a profile "
                                                f"JSON file; no such file: {name}")
