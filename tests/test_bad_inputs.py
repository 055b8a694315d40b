"""Bad inputs to ``odyssey plan`` and ``odyssey simulate`` (issue 18), as a careless or
hostile user would give them: files, YAML, values, flags, output locations, environment.

The invariant, for every case: the command returns 2 (3 where nothing can recover), prints
nothing on stdout and exactly one line on stderr that names the culprit (the key, flag or
file), and no file is written or changed. The cases run in-process through ``main`` for
speed; a few run as real processes to show no traceback reaches stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from odyssey_megatron.cli import main

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes/llama2_7b/ascend_910b_32.yaml")
TINY = str(REPO / "recipes/llama2_7b/tiny_cpu.yaml")
BRIDGE = str(REPO / "recipes/llama2_7b/bridge_tiny.yaml")
SCENARIO = f"""recipe: {TINY}
duration_hours: 0.5
failures: {{rate_per_device_hour: 0.5}}
systems: [odyssey, checkpoint]
oobleck_tolerated_failures: 1
wandb_mode: disabled
"""
TRACE_HEADER = "time_s,device,event\n"


@dataclass
class Bad:
    argv: list[str]
    culprit: tuple[str, ...]
    """Substrings the error line must hold: the key, flag or file, and often what is wrong."""
    files: dict[str, str | bytes] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    code: int = 2


def _culprit(culprit: str | tuple[str, ...]) -> tuple[str, ...]:
    return (culprit,) if isinstance(culprit, str) else culprit


def plan(*args: str, culprit, files=None, env=None, code: int = 2) -> Bad:
    return Bad(["plan", "--config", RECIPE, *args], _culprit(culprit), files or {}, env or {}, code)


def bridge(*args: str, culprit, env=None) -> Bad:
    """A Megatron-Bridge-shaped recipe; its overrides use Bridge's layout too."""
    return Bad(["plan", "--config", BRIDGE, *args], _culprit(culprit), {}, env or {})


def recipe(text: str | bytes, culprit, name: str = "r.yaml") -> Bad:
    return Bad(["plan", "--config", f"@TMP/{name}"], _culprit(culprit), {name: text})


def sim(*args: str, culprit, files=None, env=None) -> Bad:
    return Bad(["simulate", "--scenario", "@TMP/s.yaml", *args], _culprit(culprit), files or {}, env or {})


def scenario(text: str | bytes, culprit) -> Bad:
    return Bad(["simulate", "--scenario", "@TMP/s.yaml"], _culprit(culprit), {"s.yaml": text})


def trace(text: str | bytes, culprit) -> Bad:
    return sim("failures.process=trace", "failures.trace=@TMP/t.csv", culprit=culprit, files={"t.csv": text})


VALID = Path(RECIPE).read_text()
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcde", "bcdef")
)
NESTED = "".join("  " * i + f"k{i}:\n" for i in range(40)) + "  " * 40 + "x: 1\n"

FILE_CASES = {
    "missing file": Bad(["plan", "--config", "@TMP/absent.yaml"], ("--config", "no such file")),
    "directory": Bad(["plan", "--config", "@TMP"], ("--config", "is a directory")),
    "device file": Bad(["plan", "--config", "/dev/null"], ("--config", "not a regular file")),
    "empty": recipe("", ("--config", "holds no settings")),
    "whitespace only": recipe("  \n\n   \n", ("--config", "holds no settings")),
    "comments only": recipe("# nothing\n# here\n", ("--config", "holds no settings")),
    "unclosed bracket": recipe("model: [\n", ("--config", "line 2")),
    "unclosed quote": recipe('model:\n  spec: "llama2-7b\n', ("--config", "r.yaml")),
    "tab indent": recipe("model:\n\tspec: llama2-7b\n", ("--config", "tab")),
    "bad indent": recipe("model:\n  spec: llama2-7b\n num_layers: 4\n", ("--config", "line 3")),
    "mapping in value": recipe("model: spec: llama2-7b\n", ("--config", "line 1")),
    "duplicate section": recipe(VALID + "model:\n  num_layers: 4\n", ("--config", "duplicate key model")),
    "duplicate key": recipe("model:\n  num_layers: 4\n  num_layers: 8\n", ("--config", "duplicate key num_layers")),
    "truncated yaml": recipe(VALID[: VALID.index("pipeline_model") + 8], ("--config", "r.yaml")),
    "truncated json": recipe('{"model": {"spec": "llama2-7b"', ("--config", "r.yaml")),
    "json array": recipe("[1, 2, 3]", ("--config", "not a list")),
    "yaml list": recipe("- 1\n- 2\n", ("--config", "not a list")),
    "scalar": recipe("42\n", ("--config", "not a single value")),
    "bare word": recipe("hello\n", ("--config", "not a single value")),
    "binary": recipe(bytes(range(256)), ("--config", "binary")),
    "random bytes": recipe(hashlib.sha512(b"odyssey").digest() * 8, ("--config", "r.yaml")),
    "utf-16 bom": recipe(VALID.encode("utf-16"), ("--config", "UTF-16")),
    "utf-16 no bom": recipe(VALID.encode("utf-16-le"), ("--config", "binary")),
    "utf-32": recipe(VALID.encode("utf-32"), ("--config", "UTF-32")),
    "latin-1": recipe("model:\n  spec: caf\xe9\n".encode("latin-1"), ("--config", "not UTF-8")),
    "pickle": recipe(pickle.dumps({"model": {"num_layers": 4}}), ("--config", "r.yaml")),
    "pickle protocol 0": recipe(pickle.dumps({"model": 1}, protocol=0), ("--config", "not a single value")),
    "nul byte": recipe("model:\n  spec: llama2-7b\0\n", ("--config", "binary")),
    "control character": recipe("model:\n  spec: \x07\n", ("--config", "#x0007")),
    "python object tag": recipe("model: !!python/object/apply:os.system ['true']\n", ("--config", "tags are not")),
    "python name tag": recipe("model: !!python/name:os.system\n", ("--config", "tags are not")),
    "custom tag": recipe("model: !include other.yaml\n", ("--config", "tags are not")),
    "set tag": recipe("model: !!set {a}\n", ("--config", "r.yaml")),
    "two documents": recipe("model: {}\n---\nmodel: {}\n", ("--config", "another document")),
    "unhashable key": recipe("? [a]\n: 1\n", ("--config", "unhashable")),
    "integer key": recipe("1: 2\n", ("1", "unknown key")),
    "deep flow nesting": recipe("a: " + "[" * 100_000 + "]" * 100_000, ("--config", "nested")),
    "deep block nesting": recipe(NESTED, ("--config", "nested")),
    "alias bomb": recipe(ALIAS_BOMB, ("--config", "aliases expand")),
    "recursive alias": recipe("a: &a [*a]\n", ("--config", "alias")),
    "mixed layouts": recipe("train:\n  micro_batch_size: 1\nparallel:\n  data_parallel_size: 2\n",
                            ("parallel", "Megatron-Bridge", "train")),
    "bridge section null": recipe("train:\nodyssey:\n  policy: auto\n", ("train", "must be a mapping")),
    "bridge unknown section in file": recipe("train:\n  train_iters: 2\nschedular:\n  lr_warmup_iters: 2\n",
                                             ("schedular", "unknown key")),
    "section scalar": recipe("model: 3\n", ("model", "must be a mapping")),
    "scenario as recipe": recipe(SCENARIO, ("--config", "is a simulation scenario", "odyssey simulate --scenario")),
    "empty --config": Bad(["plan", "--config", ""], ("--config", "is empty")),
    "section list": recipe("model: [1, 2]\n", ("model", "must be a mapping")),
    "section null": recipe("model:\n", ("model", "must be a mapping")),
    "unknown section": recipe("modle:\n  num_layers: 4\n", ("modle", "unknown key")),
    "unknown key": recipe("model:\n  num_layer: 4\n", ("model.num_layer", "unknown key")),
    "missing marker": recipe(VALID + "  reroute_restart_s: ???\n", ("odyssey.reroute_restart_s", "???")),
    "missing interpolation": recipe("model:\n  num_layers: ${nope}\n", ("model.num_layers",)),
    "recursive interpolation": recipe("model:\n  num_layers: ${model.num_layers}\n", ("model.num_layers",)),
    "string for int": recipe("model:\n  num_layers: many\n", ("model.num_layers", "expected int")),
    "float for int": recipe("model:\n  num_layers: 3.5\n", ("model.num_layers",)),
    "yaml inf": recipe("odyssey:\n  device_mtbf_hours: .inf\n", ("odyssey.device_mtbf_hours", "finite")),
    "yaml nan value": recipe("odyssey:\n  storage_bandwidth_gb_s: .nan\n", ("odyssey.storage_bandwidth_gb_s", "finite")),
    "scenario missing": Bad(["simulate", "--scenario", "@TMP/none.yaml"], ("--scenario", "no such file")),
    "scenario empty": scenario("", ("--scenario", "holds no settings")),
    "scenario comments": scenario("# a scenario\n", ("--scenario", "holds no settings")),
    "scenario binary": scenario(b"\x89PNG\r\n\x1a\n\0\0", ("--scenario", "binary")),
    "scenario utf-16": scenario(SCENARIO.encode("utf-16"), ("--scenario", "UTF-16")),
    "scenario syntax": scenario("systems: [odyssey\n", ("--scenario", "s.yaml")),
    "scenario duplicate": scenario(SCENARIO + "seed: 1\nseed: 2\n", ("--scenario", "duplicate key seed")),
    "scenario tag": scenario("recipe: !!python/object:pathlib.Path {}\n", ("--scenario", "tags are not")),
    "scenario list": scenario("- odyssey\n", ("--scenario", "not a list")),
    "scenario section scalar": scenario(SCENARIO + "costs: 5\n", ("costs", "must be a mapping")),
    "scenario missing marker": scenario(SCENARIO.replace("duration_hours: 0.5", "duration_hours: ???"),
                                        ("duration_hours", "???")),
    "scenario missing in list": scenario(SCENARIO.replace("[odyssey, checkpoint]", "\n  - odyssey\n  - ???"),
                                         ("systems[1]", "???")),
    "recipe missing": scenario(SCENARIO.replace(TINY, "@TMP/nowhere.yaml"), ("recipe", "no such recipe")),
    "recipe broken": Bad(["simulate", "--scenario", "@TMP/s.yaml"], ("recipe", "r.yaml: line"),
                         {"s.yaml": SCENARIO.replace(TINY, "@TMP/r.yaml"), "r.yaml": "model: [\n1"}),
    "recipe empty": Bad(["simulate", "--scenario", "@TMP/s.yaml"], ("recipe", "holds no settings"),
                        {"s.yaml": SCENARIO.replace(TINY, "@TMP/r.yaml"), "r.yaml": ""}),
    "recipe is a directory": scenario(SCENARIO.replace(TINY, "@TMP"), ("recipe", "is a directory")),
}

TRACE_CASES = {
    "trace missing": sim("failures.process=trace", "failures.trace=@TMP/none.csv", culprit=("failures.trace", "no such file")),
    "trace empty": trace("", ("failures.trace", "lacks time_s")),
    "trace header only": trace(TRACE_HEADER, ("failures.trace", "holds no events")),
    "trace blank rows": trace(TRACE_HEADER + "\n\n", ("failures.trace", "holds no events")),
    "trace missing column": trace("time_s,device\n10,3\n", ("failures.trace", "lacks event")),
    "trace no header": trace("10,3,fail\n", ("failures.trace", "lacks")),
    "trace nan time": trace(TRACE_HEADER + "10,1,fail\nnan,3,fail\n", ("failures.trace", "t.csv:3", "finite")),
    "trace inf time": trace(TRACE_HEADER + "inf,3,fail\n", ("failures.trace", "t.csv:2", "finite")),
    "trace negative time": trace(TRACE_HEADER + "-5,3,fail\n", ("failures.trace", "t.csv:2", ">= 0")),
    "trace text time": trace(TRACE_HEADER + "soon,3,fail\n", ("failures.trace", "t.csv:2", "time_s")),
    "trace empty time": trace(TRACE_HEADER + ",3,fail\n", ("failures.trace", "t.csv:2", "time_s")),
    "trace device range": trace(TRACE_HEADER + "10,8,fail\n", ("failures.trace", "t.csv:2", "0..7")),
    "trace negative device": trace(TRACE_HEADER + "10,-1,fail\n", ("failures.trace", "t.csv:2", "0..7")),
    "trace fractional device": trace(TRACE_HEADER + "10,1.5,fail\n", ("failures.trace", "t.csv:2", "integer")),
    "trace unknown event": trace(TRACE_HEADER + "10,1,explode\n", ("failures.trace", "t.csv:2", "fail or join")),
    "trace event case": trace(TRACE_HEADER + "10,1,FAIL\n", ("failures.trace", "fail or join")),
    "trace short row": trace(TRACE_HEADER + "10,1\n", ("failures.trace", "t.csv:2", "fields")),
    "trace long row": trace(TRACE_HEADER + "10,1,fail,extra\n", ("failures.trace", "t.csv:2", "fields")),
    "trace bad row late": trace(TRACE_HEADER + "".join(f"{t},1,fail\n" for t in range(50)) + "x,1,fail\n",
                                ("failures.trace", "t.csv:52")),
    "trace binary": trace(bytes(range(256)), ("failures.trace", "binary")),
    "trace utf-16": trace((TRACE_HEADER + "10,1,fail\n").encode("utf-16"), ("failures.trace", "UTF-16")),
    "trace latin-1": trace((TRACE_HEADER + "10,1,fail # caf\xe9\n").encode("latin-1"), ("failures.trace", "UTF-8")),
    "trace is a directory": sim("failures.process=trace", "failures.trace=@TMP", culprit=("failures.trace", "directory")),
    "trace without process": sim("failures.trace=@TMP/t.csv", culprit=("failures.trace", "failures.process is trace"),
                                 files={"t.csv": TRACE_HEADER + "10,1,fail\n"}),
    "process trace without file": sim("failures.process=trace", culprit=("failures.trace", "must name a CSV")),
    "trace empty name": sim("failures.process=trace", "failures.trace=", culprit=("failures.trace",)),
}


def _non_finite(key: str, *, command=plan) -> dict[str, Bad]:
    return {f"{key}={value}": command(f"{key}={value}", culprit=(key, "finite"))
            for value in ("inf", "-inf", "nan", "1e999")}


VALUE_CASES = {
    **_non_finite("odyssey.device_mtbf_hours"),
    **_non_finite("odyssey.checkpoint_restart_penalty_s"),
    **_non_finite("odyssey.storage_bandwidth_gb_s"),
    **_non_finite("odyssey.reroute_restart_s"),
    "odyssey.reparallelize_restart_s=inf": plan("odyssey.reparallelize_restart_s=inf",
                                                culprit=("odyssey.reparallelize_restart_s", "finite")),
    "odyssey.memory_budget_gib=inf": plan("odyssey.memory_budget_gib=inf", culprit=("odyssey.memory_budget_gib", "finite")),
    "odyssey.memory_budget_gib=nan": plan("odyssey.memory_budget_gib=nan", culprit=("odyssey.memory_budget_gib", "finite")),
    **_non_finite("odyssey.heartbeat_interval"),
    **_non_finite("odyssey.recovery_timeout"),
    "odyssey.heartbeat_timeout=nan": plan("odyssey.heartbeat_timeout=nan", culprit=("odyssey.heartbeat_timeout", "finite")),
    "odyssey.collective_timeout=inf": plan("odyssey.collective_timeout=inf",
                                           culprit=("odyssey.collective_timeout", "finite")),
    "odyssey.heartbeat_interval=0": plan("odyssey.heartbeat_interval=0", culprit=("odyssey.heartbeat_interval", ">= 0.01")),
    "odyssey.heartbeat_interval=-1": plan("odyssey.heartbeat_interval=-1", culprit="odyssey.heartbeat_interval"),
    "odyssey.heartbeat_timeout=0.1": plan("odyssey.heartbeat_timeout=0.1",
                                          culprit=("odyssey.heartbeat_timeout", "odyssey.heartbeat_interval")),
    "odyssey.heartbeat_timeout=-1": plan("odyssey.heartbeat_timeout=-1", culprit="odyssey.heartbeat_timeout"),
    "odyssey.controller_reattach_s=-1": plan("odyssey.controller_reattach_s=-1",
                                             culprit=("odyssey.controller_reattach_s", ">= 0")),
    "odyssey.collective_timeout=0.5": plan("odyssey.collective_timeout=0.5",
                                           culprit=("odyssey.collective_timeout", "odyssey.heartbeat_timeout")),
    "odyssey.recovery_timeout=30": plan("odyssey.recovery_timeout=30",
                                        culprit=("odyssey.recovery_timeout", "odyssey.collective_timeout")),
    "odyssey.recovery_timeout=1e300": plan("odyssey.recovery_timeout=1e300", culprit=("odyssey.recovery_timeout", "<=")),
    "odyssey.heartbeat_interval=fast": plan("odyssey.heartbeat_interval=fast",
                                            culprit=("odyssey.heartbeat_interval", "expected float")),
    "training.lr=inf": plan("training.lr=inf", culprit=("training.lr", "finite")),
    "training.lr=nan": plan("training.lr=nan", culprit=("training.lr", "finite")),
    "model.num_layers=0": plan("model.num_layers=0", culprit=("model.num_layers", "> 0")),
    "model.hidden_size=-4096": plan("model.hidden_size=-4096", culprit=("model.hidden_size", "> 0")),
    "model.vocab_size=0": plan("model.vocab_size=0", culprit=("model.vocab_size", "> 0")),
    "parallel.data_parallel_size=0": plan("parallel.data_parallel_size=0", culprit=("parallel.data_parallel_size", "> 0")),
    "parallel.tensor_model_parallel_size=-1": plan("parallel.tensor_model_parallel_size=-1",
                                                   culprit="parallel.tensor_model_parallel_size"),
    "training.global_batch_size=0": plan("training.global_batch_size=0", culprit="training.global_batch_size"),
    "training.micro_batch_size=-1": plan("training.micro_batch_size=-1", culprit="training.micro_batch_size"),
    "training.lr=0": plan("training.lr=0", culprit=("training.lr", "> 0")),
    "training.seed=-1": plan("training.seed=-1", culprit=("training.seed", ">= 0")),
    "cluster.devices_per_node=0": plan("cluster.devices_per_node=0", culprit="cluster.devices_per_node"),
    "odyssey.max_layer_splits=0": plan("odyssey.max_layer_splits=0", culprit="odyssey.max_layer_splits"),
    "odyssey.dp_search_radius=-1": plan("odyssey.dp_search_radius=-1", culprit=("odyssey.dp_search_radius", ">= 0")),
    "odyssey.reroute_restart_s=-1": plan("odyssey.reroute_restart_s=-1", culprit="odyssey.reroute_restart_s"),
    "odyssey.prepared_decisions_mib=-1": plan("odyssey.prepared_decisions_mib=-1",
                                              culprit="odyssey.prepared_decisions_mib"),
    "odyssey.memory_budget_gib=-1": plan("odyssey.memory_budget_gib=-1", culprit="odyssey.memory_budget_gib"),
    "odyssey.device_mtbf_hours=1e-9": plan("odyssey.device_mtbf_hours=1e-9", culprit="odyssey.device_mtbf_hours"),
    "odyssey.device_mtbf_hours=1e300": plan("odyssey.device_mtbf_hours=1e300", culprit="odyssey.device_mtbf_hours"),
    "odyssey.storage_bandwidth_gb_s=1e-12": plan("odyssey.storage_bandwidth_gb_s=1e-12",
                                                 culprit="odyssey.storage_bandwidth_gb_s"),
    "model.num_layers=many": plan("model.num_layers=many", culprit=("model.num_layers", "expected int")),
    "model.num_layers=3.5": plan("model.num_layers=3.5", culprit="model.num_layers"),
    "model.num_layers=null": plan("model.num_layers=null", culprit="model.num_layers"),
    "model.num_layers=": plan("model.num_layers=", culprit="model.num_layers"),
    "model.num_layers=[4]": plan("model.num_layers=[4]", culprit="model.num_layers"),
    "odyssey.policy=[auto]": plan("odyssey.policy=[auto]", culprit="odyssey.policy"),
    "odyssey.policy={a: 1}": plan("odyssey.policy={a: 1}", culprit="odyssey.policy"),
    "odyssey.learn_failure_rate=maybe": plan("odyssey.learn_failure_rate=maybe", culprit="odyssey.learn_failure_rate"),
    "odyssey.policy=sometimes": plan("odyssey.policy=sometimes", culprit=("odyssey.policy", "auto, reroute")),
    "odyssey.policy=": plan("odyssey.policy=", culprit="odyssey.policy"),
    "odyssey.length_sweep=often": plan("odyssey.length_sweep=often", culprit="odyssey.length_sweep"),
    "odyssey.batch_on_failure=halve": plan("odyssey.batch_on_failure=halve",
                                           culprit=("odyssey.batch_on_failure", "keep, shrink")),
    "model.params_dtype=fp8": plan("model.params_dtype=fp8", culprit="model.params_dtype"),
    "cluster.device=tpu": plan("cluster.device=tpu", culprit="cluster.device"),
    "model.spec=gpt5": plan("model.spec=gpt5", culprit="model.spec"),
    "model.spec=-1": plan("model.spec=-1", culprit=("model.spec", "got -1")),
    "model.spec=[1]": plan("model.spec=[1]", culprit=("model.spec", "got [1]")),
    "model.spec= (empty)": plan("model.spec=", culprit=("model.spec", "has no value after '='")),
    "space before =": plan("odyssey.policy =x", culprit=("odyssey.policy =x", "no space before '='")),
    "model.hidden_size=4001": plan("model.hidden_size=4001", culprit=("model.hidden_size", "divisible")),
    "model.num_query_groups=5": plan("model.num_query_groups=5", culprit="model.num_query_groups"),
    "training.micro_batch_size=3": plan("training.micro_batch_size=3", culprit="training.global_batch_size"),
    "parallel.data_parallel_size=3": plan("parallel.data_parallel_size=3", culprit="training.global_batch_size"),
    "parallel.pipeline_model_parallel_size=33": plan("parallel.pipeline_model_parallel_size=33",
                                                     culprit="parallel.pipeline_model_parallel_size"),
    "parallel.tensor_model_parallel_size=3": plan("parallel.tensor_model_parallel_size=3",
                                                  culprit="parallel.tensor_model_parallel_size"),
    "parallel.world_size=31": plan("parallel.world_size=31", culprit="parallel.world_size"),
    "model.num_layers=10**23": plan("model.num_layers=100000000000000000000000", culprit=("model.num_layers", "64-bit")),
    "training.train_iters=2**64": plan("training.train_iters=18446744073709551616", culprit="training.train_iters"),
    "model.num_layers=100000": plan("model.num_layers=100000", culprit=("model.num_layers", "1,024")),
    "model.hidden_size=2**21": plan("model.hidden_size=2097152", culprit=("model.hidden_size", "<=")),
    "model.seq_length=10**9": plan("model.seq_length=1000000000", culprit="model.seq_length"),
    "parallel.data_parallel_size=100000": plan("parallel.data_parallel_size=100000", "training.global_batch_size=100000",
                                               culprit="parallel.data_parallel_size"),
    "40,000 workers": plan("parallel.data_parallel_size=10000", "training.global_batch_size=10000",
                           culprit=("parallel", "16,384")),
    "training.global_batch_size=10**9": plan("training.global_batch_size=1000000000",
                                             culprit=("training.global_batch_size", "65,536")),
    "2,048 micro-batches per pipeline": plan("training.global_batch_size=16384",
                                             culprit=("training.global_batch_size", "per pipeline")),
    "cluster.devices_per_node=10**6": plan("cluster.devices_per_node=1000000", culprit="cluster.devices_per_node"),
    "odyssey.max_layer_splits=10**9": plan("odyssey.max_layer_splits=1000000000", culprit="odyssey.max_layer_splits"),
    "odyssey.dp_search_radius=10**6": plan("odyssey.dp_search_radius=1000000", culprit="odyssey.dp_search_radius"),
    "odyssey.pp_search_radius=10**6": plan("odyssey.pp_search_radius=1000000", culprit="odyssey.pp_search_radius"),
    "odyssey.checkpoint_restart_penalty_s=1e300": plan("odyssey.checkpoint_restart_penalty_s=1e300",
                                                       culprit="odyssey.checkpoint_restart_penalty_s"),
    "odyssey.memory_budget_gib=1": plan("odyssey.memory_budget_gib=1", culprit=("parallel", "memory budget")),
    "override ???": plan("odyssey.policy=???", culprit=("odyssey.policy", "???")),
    "override section": plan("model=3", culprit=("model", "must be a mapping")),
    "override no key": plan("=3", culprit=("=3", "section.key=value")),
    "override empty segment": plan("model..num_layers=3", culprit="model..num_layers=3"),
    "override trailing dot": plan("model.=3", culprit="model.=3"),
    "override without =": plan("nonsense", culprit=("nonsense", "section.key=value")),
    "override unknown key": plan("odyssey.polcy=auto", culprit=("odyssey.polcy", "unknown key")),
    "override unknown section": plan("colour.red=1", culprit=("colour", "unknown key")),
    "override twice": plan("odyssey.policy=auto", "odyssey.policy=reroute", culprit=("odyssey.policy", "twice")),
    "override interpolation": plan("model.num_layers=${nope}", culprit="model.num_layers"),
    "override bad grammar": plan("odyssey.policy=${oc.decode:'[1'}", culprit="odyssey.policy"),
    "unrecoverable": plan("--failed", ",".join(map(str, range(1, 32))), culprit="unrecoverable", code=3),
    **_non_finite("training.clip_grad"),
    "training.clip_grad=-1": plan("training.clip_grad=-1", culprit=("training.clip_grad", ">= 0")),
    "training.weight_decay=-1": plan("training.weight_decay=-1", culprit=("training.weight_decay", ">= 0")),
    "training.adam_beta2=1": plan("training.adam_beta2=1", culprit=("training.adam_beta2", "[0, 1)")),
    "training.adam_eps=0": plan("training.adam_eps=0", culprit=("training.adam_eps", "> 0")),
    "cluster.num_nodes=0": plan("cluster.num_nodes=0", culprit=("cluster.num_nodes", "> 0")),
    "cluster.num_nodes=3": plan("cluster.num_nodes=3", culprit=("cluster.num_nodes", "world size of 24")),
    "cluster.num_nodes=10**6": plan("cluster.num_nodes=1000000", culprit=("cluster.num_nodes", "16,384")),
    "cluster.num_nodes=two": plan("cluster.num_nodes=two", culprit=("cluster.num_nodes", "expected")),
    "parallel.world_size=0": plan("parallel.data_parallel_size=null", "parallel.world_size=0",
                                  culprit=("parallel.world_size", "> 0")),
    "parallel.world_size=30": plan("parallel.data_parallel_size=null", "parallel.world_size=30",
                                   culprit=("parallel.world_size", "divisible by", "= 4")),
    "WORLD_SIZE bogus": plan("parallel.data_parallel_size=null", env={"WORLD_SIZE": "lots"},
                             culprit=("WORLD_SIZE", "positive integer")),
    "WORLD_SIZE not divisible": plan("parallel.data_parallel_size=null", env={"WORLD_SIZE": "30"},
                                     culprit=("WORLD_SIZE", "divisible")),
    "logger.wandb_project=a/b": plan("logger.wandb_project=a/b", culprit=("logger.wandb_project", "characters")),
    "logger.wandb_project=[1]": plan("logger.wandb_project=[1]", culprit="logger.wandb_project"),
    "logger.wandb_entity blank": plan("logger.wandb_entity=' '", culprit=("logger.wandb_entity", "empty")),
    "logger.wandb_colour": plan("logger.wandb_colour=red", culprit=("logger.wandb_colour", "unknown key")),
    "odyssey.policy=[auto] lists the values": plan("odyssey.policy=[auto]", culprit=("odyssey.policy", "reparallelize")),
    "odyssey.length_sweep=null": plan("odyssey.length_sweep=null", culprit=("odyssey.length_sweep", "joins")),
    "bridge train.micro_batch_size=0": bridge("train.micro_batch_size=0", culprit=("train.micro_batch_size", "> 0")),
    "bridge train.micro_batch_size=3": bridge("train.micro_batch_size=3",
                                              culprit=("train.global_batch_size", "train.micro_batch_size (3)")),
    "bridge optimizer.lr=nan": bridge("optimizer.lr=nan", culprit=("optimizer.lr", "finite")),
    "bridge rng.seed=-1": bridge("rng.seed=-1", culprit=("rng.seed", ">= 0")),
    "bridge model.num_layers=many": bridge("model.num_layers=many", culprit=("model.num_layers", "expected int")),
    "bridge model.rotary_base=0": bridge("model.rotary_base=0", culprit=("model.rotary_base", "> 0")),
    "bridge model.params_dtype=fp8": bridge("model.params_dtype=fp8", culprit=("model.params_dtype", "bf16, fp16")),
    "bridge model.bf16=maybe": bridge("model.bf16=maybe", culprit=("model.bf16", "true or false")),
    "bridge model.context_parallel_size=2": bridge("model.context_parallel_size=2",
                                                   culprit=("model.context_parallel_size", "must be 1")),
    "bridge model.sequence_parallel=true": bridge("model.sequence_parallel=true", culprit="model.sequence_parallel"),
    "bridge tokenizer_type": bridge("tokenizer.tokenizer_type=TikTokenizer", culprit="tokenizer.tokenizer_type"),
    "bridge dataset.data_path missing": bridge("dataset.data_path=@TMP/none.txt",
                                               culprit=("dataset.data_path", "local file")),
    "bridge seq lengths disagree": bridge("dataset.seq_length=128", culprit=("dataset.seq_length", "model.seq_length")),
    "bridge unknown key": bridge("train.micro_batch_sise=2", culprit=("train.micro_batch_sise", "unknown key")),
    "bridge our key in Bridge's section": bridge("model.tie_embeddings=true",
                                                 culprit=("model.tie_embeddings", "unknown key")),
    "bridge unknown section": bridge("schedular.x=1", culprit=("schedular", "unknown key")),
    "bridge section scalar": bridge("train=3", culprit=("train", "must be a mapping")),
    "bridge odyssey-layout override": bridge("parallel.data_parallel_size=2", culprit=("parallel", "Megatron-Bridge")),
    "bridge ???": bridge("model.num_layers=???", culprit=("model.num_layers", "???")),
    "bridge odyssey.policy=x": bridge("odyssey.policy=x", culprit=("odyssey.policy", "auto, reroute")),
    "bridge world not divisible": bridge("model.pipeline_model_parallel_size=3",
                                         culprit=("cluster.num_nodes", "divisible")),
    "bridge WORLD_SIZE bogus": bridge("cluster.num_nodes=null", env={"WORLD_SIZE": "-8"},
                                      culprit=("WORLD_SIZE", "positive integer")),
    "fault phase": plan("odyssey.faults=[{rank: 5, step: 2, phase: backwards, action: kill}]",
                        culprit=("odyssey.faults[0].phase", "forward, backward, grad_sync")),
    "fault action": plan("odyssey.faults=[{rank: 5, step: 2, phase: backward, action: 9}]",
                         culprit=("odyssey.faults[0].action", "kill, stop, raise, slow")),
    "fault rank and node": plan("odyssey.faults=[{rank: 5, node: 1, step: 2, phase: backward, action: kill}]",
                                culprit=("odyssey.faults[0]", "exactly one of rank and node")),
    "fault rank out of range": plan("odyssey.faults=[{rank: 32, step: 2, phase: forward, action: stop}]",
                                    culprit=("odyssey.faults[0].rank", "0..31")),
    "fault node 0": plan("odyssey.faults=[{node: 0, step: 2, phase: forward, action: kill}]",
                         culprit=("odyssey.faults[0].node", "1..3", "node 0 hosts the controller")),
    "fault step out of range": plan("odyssey.faults=[{rank: 1, step: 5000, phase: optimizer, action: raise}]",
                                    culprit=("odyssey.faults[0].step", "0..4999")),
    "fault not a mapping": recipe(VALID + "  faults: [5]\n", ("odyssey.faults[0]", "must be a mapping")),
    "fault without step": recipe(VALID + "  faults:\n    - {rank: 1, phase: forward, action: kill}\n",
                                 ("odyssey.faults[0].step", "must be given")),
    "join fault with a step": recipe(VALID + "  faults:\n    - {rank: 1, step: 2, join: true, phase: transfer, action: kill}\n",
                                     ("odyssey.faults[0].step", "must be left out with join")),
    "join fault in training": recipe(VALID + "  faults:\n    - {rank: 1, join: true, phase: forward, action: kill}\n",
                                     ("odyssey.faults[0].phase", "recovery, transfer, mid_transfer, group_setup, mid_group_setup")),
    "negative restarts": recipe(VALID + "  restart_workers: -1\n", ("odyssey.restart_workers", ">= 0")),
    "bridge fault rank": bridge("odyssey.faults=[{rank: 99, step: 0, phase: forward, action: kill}]",
                                culprit="odyssey.faults[0].rank"),
}

SCENARIO_CASES = {
    **_non_finite("duration_hours", command=sim),
    **_non_finite("sample_interval_s", command=sim),
    **_non_finite("failures.rate_per_device_hour", command=sim),
    **_non_finite("costs.restart_s", command=sim),
    "repairs.mean_hours=inf": sim("repairs.mean_hours=inf", culprit=("repairs.mean_hours", "finite")),
    "failures.weibull_shape=nan": sim("failures.weibull_shape=nan", culprit="failures.weibull_shape"),
    "duration_hours=0": sim("duration_hours=0", culprit=("duration_hours", "> 0")),
    "duration_hours=-1": sim("duration_hours=-1", culprit="duration_hours"),
    "duration_hours=1e9": sim("duration_hours=1e9", culprit=("duration_hours", "a year")),
    "duration_hours=abc": sim("duration_hours=abc", culprit="duration_hours"),
    "sample_interval_s=0": sim("sample_interval_s=0", culprit="sample_interval_s"),
    "sample_interval_s=1e-9": sim("sample_interval_s=1e-9", culprit=("sample_interval_s", "100,000")),
    "sample_interval_s=0.01": sim("sample_interval_s=0.01", culprit=("sample_interval_s", "samples")),
    "failures.rate_per_device_hour=0": sim("failures.rate_per_device_hour=0", culprit="failures.rate_per_device_hour"),
    "failures.rate_per_device_hour=-1": sim("failures.rate_per_device_hour=-1", culprit="failures.rate_per_device_hour"),
    "failures.rate_per_device_hour=1e300": sim("failures.rate_per_device_hour=1e300",
                                               culprit="failures.rate_per_device_hour"),
    "failures.weibull_shape=1e-9": sim("failures.process=weibull", "failures.weibull_shape=1e-9",
                                       culprit=("failures.weibull_shape", "0.1..20")),
    "failures.weibull_shape=1000": sim("failures.weibull_shape=1000", culprit="failures.weibull_shape"),
    "failures.weibull_shape=0": sim("failures.weibull_shape=0", culprit="failures.weibull_shape"),
    "failures.process=poisson": sim("failures.process=poisson", culprit="failures.process"),
    "failures.unit=rack": sim("failures.unit=rack", culprit="failures.unit"),
    "repairs.mean_hours=0": sim("repairs.mean_hours=0", culprit="repairs.mean_hours"),
    "repairs.mean_hours=-2": sim("repairs.mean_hours=-2", culprit="repairs.mean_hours"),
    "repairs.enabled=sometimes": sim("repairs.enabled=sometimes", culprit="repairs.enabled"),
    "costs.detection_s=-1": sim("costs.detection_s=-1", culprit="costs.detection_s"),
    "costs.restart_s=1e12": sim("costs.restart_s=1e12", culprit=("costs.restart_s", "a year")),
    "costs.checkpoint_interval_min=0": sim("costs.checkpoint_interval_min=0", culprit="costs.checkpoint_interval_min"),
    "costs.checkpoint_save_s=9999": sim("costs.checkpoint_save_s=9999", culprit="costs.checkpoint_save_s"),
    "costs.checkpoint_load_s=nan": sim("costs.checkpoint_load_s=nan", culprit="costs.checkpoint_load_s"),
    "costs.decision_s=-inf": sim("costs.decision_s=-inf", culprit="costs.decision_s"),
    "systems=[]": sim("systems=[]", culprit=("systems", "at least one")),
    "systems=[bamboo]": sim("systems=[odyssey,bamboo]", culprit=("systems", "bamboo")),
    "systems twice": sim("systems=[odyssey,odyssey]", culprit=("systems", "more than once")),
    "systems={a: 1}": sim("systems={a: 1}", culprit=("systems", "must be a list")),
    "systems=odyssey": sim("systems=odyssey", culprit="systems"),
    "systems=[???]": sim("systems=[???]", culprit=("systems", "not valid YAML")),
    "systems=[odyssey,???]": sim("systems=[odyssey,'???']", culprit=("systems[1]", "???")),
    "override bad yaml": plan("odyssey.policy=[auto", culprit=("odyssey.policy", "not valid YAML")),
    "seed=-1": sim("seed=-1", culprit=("seed", ">= 0")),
    "seed=2**70": sim("seed=1180591620717411303424", culprit=("seed", "64-bit")),
    "seed=1.5": sim("seed=1.5", culprit="seed"),
    "oobleck_tolerated_failures=-1": sim("oobleck_tolerated_failures=-1", culprit="oobleck_tolerated_failures"),
    "odyssey_learns_failure_rate=maybe": sim("odyssey_learns_failure_rate=maybe",
                                             culprit="odyssey_learns_failure_rate"),
    "oobleck cannot start": sim("systems=[odyssey,checkpoint,oobleck]", "oobleck_tolerated_failures=100",
                                culprit=("oobleck_tolerated_failures", "oobleck cannot run")),
    "wandb_mode=maybe": sim("wandb_mode=maybe", culprit="wandb_mode"),
    "wandb_project=a/b": sim("wandb_project=a/b", culprit=("wandb_project", "characters")),
    "wandb_project empty": sim("wandb_project=", culprit="wandb_project"),
    "wandb_project long": sim("wandb_project=" + "p" * 200, culprit="wandb_project"),
    "recipe empty name": sim("recipe=", culprit="recipe"),
    "recipe_overrides bad value": sim("recipe_overrides=[model.num_layers=-1]", culprit="model.num_layers"),
    "recipe_overrides malformed": sim("recipe_overrides=[nonsense]", culprit="nonsense"),
    "recipe_overrides not a list": sim("recipe_overrides=5", culprit="recipe_overrides"),
    "recipe_overrides twice": sim("recipe_overrides=[training.lr=1,training.lr=2]", culprit=("training.lr", "twice")),
    "unknown key": sim("colour=red", culprit=("colour", "unknown key")),
    "unknown nested key": sim("failures.rate=1", culprit=("failures.rate", "unknown key")),
    "too many events": sim("failures.rate_per_device_hour=1e6", "repairs.enabled=true", "repairs.mean_hours=1e-6",
                           culprit=("failures", "20,000")),
    "too many trace events": trace(TRACE_HEADER + "".join(f"{t},{t % 8},fail\n" for t in range(20_001)),
                                   ("failures.trace", "20,000")),
}

FLAG_CASES = {
    "no command": Bad([], ("command", "required")),
    "unknown command": Bad(["plna"], ("plna", "plan")),
    "plan without config": Bad(["plan"], ("--config", "required")),
    "config without value": Bad(["plan", "--config"], ("--config", "expected one argument")),
    "config twice": plan("--config", RECIPE, culprit=("--config", "twice")),
    "json twice": plan("--json", "--json", culprit=("--json", "twice")),
    "print-config twice": plan("--print-config", "--print-config", culprit=("--print-config", "twice")),
    "print-config of a bad recipe": plan("--print-config", "model.num_layers=0", culprit="model.num_layers"),
    "simulate print-config twice": sim("--print-config", "--print-config", culprit=("--print-config", "twice")),
    "unknown flag": plan("--bogus", culprit="--bogus"),
    "abbreviated flag": Bad(["plan", "--conf", RECIPE], ("--config",)),
    "failed comma": plan("--failed", ",", culprit=("--failed", "at least one")),
    "failed empty": plan("--failed", "", culprit=("--failed", "at least one")),
    "failed blank": plan("--failed", "  ", culprit=("--failed", "at least one")),
    "failed empty item": plan("--failed", "3,,4", culprit=("--failed", "empty item")),
    "failed trailing comma": plan("--failed", "3,", culprit=("--failed", "empty item")),
    "failed word": plan("--failed", "three", culprit=("--failed", "integers")),
    "failed float": plan("--failed", "1.5", culprit="--failed"),
    "failed range syntax": plan("--failed", "1-3", culprit="--failed"),
    "failed out of range": plan("--failed", "32", culprit=("--failed", "0..31")),
    "failed negative": plan("--failed", "-1", culprit=("--failed", "0..31")),
    "failed huge": plan("--failed", str(10**30), culprit=("--failed", "0..31")),
    "failed repeated out of range": plan("--failed", "1", "--failed", "40", culprit=("--failed", "[40]")),
    "failed without value": plan("--failed", culprit="--failed"),
    "failed nodes out of range": plan("--failed-nodes", "4", culprit=("--failed-nodes", "0..3")),
    "failed nodes comma": plan("--failed-nodes", ",", culprit=("--failed-nodes", "at least one")),
    "failed nodes repeated out of range": plan("--failed-nodes", "0", "--failed-nodes", "9", culprit="--failed-nodes"),
    "simulate without scenario": Bad(["simulate"], ("--scenario", "required")),
    "scenario twice": sim("--scenario", "@TMP/s.yaml", culprit=("--scenario", "twice")),
    "seed negative": sim("--seed", "-1", culprit=("--seed", "0..")),
    "seed word": sim("--seed", "abc", culprit=("--seed", "integer")),
    "seed float": sim("--seed", "1.5", culprit="--seed"),
    "seed too big": sim("--seed", str(2**64), culprit="--seed"),
    "seed twice": sim("--seed", "1", "--seed", "2", culprit=("--seed", "twice")),
    "seed and seed=": sim("--seed", "1", "seed=2", culprit=("seed", "once")),
    "out twice": sim("--out", "@TMP/a", "--out", "@TMP/b", culprit=("--out", "twice")),
    "force without out": sim("--force", culprit=("--force", "--out")),
    "force twice": sim("--out", "@TMP/a", "--force", "--force", culprit=("--force", "twice")),
    "plan flag on simulate": sim("--failed", "1", culprit="--failed"),
}

OUTPUT_CASES = {
    "out is a file": sim("--out", "@TMP/s.yaml", culprit=("--out", "not a directory")),
    "out under a file": sim("--out", "@TMP/s.yaml/run", culprit=("--out", "not a directory")),
    "out is dot": sim("--out", ".", culprit=("--out", "directory of its own")),
    "out is parent": sim("--out", "..", culprit="--out"),
    "out is root": sim("--out", "/", culprit="--out"),
    "out taken": sim("--out", "@TMP/run", culprit=("--out", "--force"),
                     files={"run/summary.json": "{}", "run/series.json": "[]"}),
    "out holds other files": sim("--out", "@TMP/run", "--force", culprit=("--out", "no earlier run"),
                                 files={"run/notes.txt": "keep me"}),
    "out cannot be created": sim("--out", "/proc/odyssey-run", culprit=("--out", "cannot write")),
    "out is a symlink": sim("--out", "@TMP/link", culprit=("--out", "not a directory"), files={"link": "@SYMLINK"}),
}

def _valid_profile() -> dict:
    from odyssey_megatron.config import load_config
    from odyssey_megatron.profile_file import profile_json, recipe_measured_for, recipe_profile

    config = load_config(TINY)
    return profile_json(recipe_profile(config), measured_for=recipe_measured_for(config), source={})


PROFILE = _valid_profile()


def profile(change, culprit, *extra: str) -> Bad:
    """``odyssey plan`` on the tiny recipe with ``odyssey.profile`` naming a file made from a
    valid profile by ``change`` (a function of its JSON object, or the file's text)."""
    if callable(change):
        data = json.loads(json.dumps(PROFILE))
        change(data)
        change = json.dumps(data)
    return Bad(["plan", "--config", TINY, "odyssey.profile=@TMP/p.json", *extra], _culprit(culprit), {"p.json": change})


def _set(path: str, value):
    def change(data):
        *parents, leaf = path.split("/")
        for key in parents:
            data = data[int(key) if key.isdigit() else key]
        if value is _DELETE:
            del data[leaf]
        else:
            data[leaf] = value
    return change


_DELETE = object()


def profiling(*args: str, culprit, files=None) -> Bad:
    return Bad(["profile", "--config", TINY, *args], _culprit(culprit), files or {})


PROFILE_CASES = {
    "profile missing": plan("odyssey.profile=@TMP/none.json", culprit=("odyssey.profile", "no such file")),
    "profile empty name": plan("odyssey.profile=''", culprit=("odyssey.profile", "must name")),
    "profile is a directory": plan("odyssey.profile=@TMP", culprit=("odyssey.profile", "directory")),
    "profile empty": profile("", ("odyssey.profile", "p.json: line 1")),
    "profile yaml": profile("profile: {}\n", ("odyssey.profile", "p.json: line 1")),
    "profile truncated": profile(json.dumps(PROFILE)[:200], ("odyssey.profile", "p.json: line 1")),
    "profile binary": profile(bytes(range(256)), ("odyssey.profile", "binary")),
    "profile utf-16": profile(json.dumps(PROFILE).encode("utf-16"), ("odyssey.profile", "UTF-16")),
    "profile list": profile("[1, 2]", ("odyssey.profile", "top level")),
    "profile NaN": profile(json.dumps(PROFILE).replace('"p2p_bytes": ', '"p2p_bytes": NaN, "x": '),
                           ("odyssey.profile", "NaN")),
    "profile duplicate key": profile(json.dumps(PROFILE).replace('"version": 2', '"version": 2, "version": 2'),
                                     ("odyssey.profile", "twice")),
    "profile deep nesting": profile("[" * 100_000 + "]" * 100_000, ("odyssey.profile", "nested")),
    "profile other format": profile(_set("format", "plan"), ("odyssey.profile", "format")),
    "profile newer version": profile(_set("version", 3), ("odyssey.profile", "version", "3", "reads versions 1, 2")),
    "profile version 1 with a newer field": profile(_set("version", 1),
                                                    ("odyssey.profile", "profile.", "not a field of a version 1")),
    "profile unknown top key": profile(_set("extra", 1), ("odyssey.profile", "extra")),
    "profile no measured_for": profile(_set("measured_for", _DELETE), ("odyssey.profile", "measured_for")),
    "profile measured_for lacks a key": profile(_set("measured_for/model.vocab_size", _DELETE),
                                                ("odyssey.profile", "model.vocab_size")),
    "profile measured_for list": profile(_set("measured_for/model.vocab_size", [512]),
                                         ("odyssey.profile", "measured_for.model.vocab_size")),
    "profile missing field": profile(_set("profile/p2p_bytes", _DELETE), ("odyssey.profile", "profile.p2p_bytes",
                                                                          "missing")),
    "profile unknown field": profile(_set("profile/layers/2/flops", 1), ("odyssey.profile", "profile.layers[2].flops")),
    "profile negative time": profile(_set("profile/layers/3/forward_s", -1e-3),
                                     ("odyssey.profile", "profile.layers[3].forward_s", ">= 0")),
    "profile text time": profile(_set("profile/output/backward_s", "fast"), ("odyssey.profile", "output.backward_s")),
    "profile bool bytes": profile(_set("profile/embedding/param_bytes", True),
                                  ("odyssey.profile", "embedding.param_bytes", "integer")),
    "profile float bytes": profile(_set("profile/p2p_bytes", 1.5), ("odyssey.profile", "p2p_bytes", "integer")),
    "profile huge bytes": profile(_set("profile/p2p_bytes", 10**30), ("odyssey.profile", "p2p_bytes", "64-bit")),
    "profile zero bandwidth": profile(_set("profile/intra_node_bandwidth", 0),
                                      ("odyssey.profile", "intra_node_bandwidth", "> 0")),
    "profile null bandwidth": profile(_set("profile/inter_node_bandwidth", None),
                                      ("odyssey.profile", "inter_node_bandwidth")),
    "profile layers not a list": profile(_set("profile/layers", {}), ("odyssey.profile", "profile.layers")),
    "profile too few layers": profile(lambda d: d["profile"]["layers"].pop(), ("odyssey.profile", "lists 7 layers")),
    "profile weight grads exceed backward": profile(_set("profile/layers/0/weight_grad_s", 1.0),
                                                    ("odyssey.profile", "layers[0].weight_grad_s", "cannot exceed")),
    "profile of another model": profile(lambda d: None, ("odyssey.profile", "model.hidden_size=64", "128"),
                                        "model.hidden_size=128"),
    "profile of another micro-batch": profile(lambda d: None, ("odyssey.profile", "training.micro_batch_size"),
                                              "training.micro_batch_size=1"),
    "profile in a scenario": Bad(["simulate", "--scenario", "@TMP/s.yaml", "recipe_overrides=[odyssey.profile=@TMP/p.json]"],
                                 ("odyssey.profile", "p.json: line 1"), {"p.json": "{"}),
    "emulate_device empty": plan("cluster.emulate_device=' '", culprit=("cluster.emulate_device", "empty")),
    "profile command without config": Bad(["profile"], ("--config", "required")),
    "profile command repeats 0": profiling("--repeats", "0", culprit=("--repeats", "1..")),
    "profile command repeats word": profiling("--repeats", "many", culprit=("--repeats", "integer")),
    "profile command repeats twice": profiling("--repeats", "2", "--repeats", "3", culprit=("--repeats", "twice")),
    "profile command force without out": profiling("--force", culprit=("--force", "--out")),
    "profile command out is a directory": profiling("--out", "@TMP", culprit=("--out", "directory")),
    "profile command out under nothing": profiling("--out", "@TMP/no/p.json", culprit=("--out", "not a directory")),
    "profile command out exists": profiling("--out", "@TMP/s.yaml", culprit=("--out", "--force")),
    "profile command out not a profile": profiling("--out", "@TMP/s.yaml", "--force",
                                                   culprit=("--out", "not a profile file")),
    "profile command bad override": profiling("model.num_layers=0", culprit="model.num_layers"),
    "profile command tensor parallel": profiling("parallel.tensor_model_parallel_size=2",
                                                 culprit=("parallel.tensor_model_parallel_size", "TP=1")),
}

ENV_CASES = {
    "env var in recipe unset": recipe("model:\n  num_layers: ${oc.env:ODYSSEY_TEST_UNSET}\n", ("model.num_layers",)),
    "env var override unset": plan("model.num_layers=${oc.env:ODYSSEY_TEST_UNSET}", culprit="model.num_layers"),
    "env var with bad value": plan("model.num_layers=${oc.env:ODYSSEY_TEST_LAYERS}", culprit="model.num_layers",
                                   env={"ODYSSEY_TEST_LAYERS": "lots"}),
    "WANDB_MODE bogus": sim("wandb_mode=offline", culprit=("wandb_mode", "WANDB_"), env={"WANDB_MODE": "bogus"}),
    "WANDB_PROJECT invalid": sim("wandb_mode=offline", culprit=("wandb_mode", "project"),
                                 env={"WANDB_PROJECT": "a/b", "WANDB_SILENT": "true"}),
    "W&B online without a key": sim("wandb_mode=online", culprit=("wandb_mode", "online"),
                                    env={"WANDB_API_KEY": "", "WANDB_SILENT": "true", "HOME": "@TMP/home"}),
}

CASES = {**FILE_CASES, **TRACE_CASES, **VALUE_CASES, **SCENARIO_CASES, **FLAG_CASES, **OUTPUT_CASES, **PROFILE_CASES,
         **ENV_CASES}


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every file and directory under ``root`` with its size, mtime and content hash."""
    seen = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            info = path.lstat()
            digest = hashlib.sha1(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else ""
            seen[str(path.relative_to(root))] = (info.st_mode, info.st_size, info.st_mtime_ns, digest)
    return seen


def _prepare(case: Bad, tmp_path: Path, monkeypatch) -> list[str]:
    subst = lambda text: text.replace("@TMP", str(tmp_path))  # noqa: E731
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "home").mkdir()
    for name, content in case.files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == "@SYMLINK":
            (tmp_path / "target").mkdir()
            path.symlink_to(tmp_path / "target")
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(subst(content))
    for key, value in case.env.items():
        monkeypatch.setenv(key, subst(value))
    if any(key.startswith("WANDB_") for key in case.env):
        _fresh_wandb_session()  # a session started by an earlier test would ignore the new environment
    monkeypatch.chdir(tmp_path)
    return [subst(arg) for arg in case.argv]


def _fresh_wandb_session() -> None:
    import wandb

    wandb.teardown()


def test_there_are_at_least_150_bad_inputs():
    assert len(CASES) >= 150


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_input_gives_one_line_and_writes_nothing(case: Bad, tmp_path, monkeypatch, capsys):
    argv = _prepare(case, tmp_path, monkeypatch)
    before = _snapshot(tmp_path)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == case.code, err
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("odyssey: unrecoverable:" if case.code == 3 else "odyssey: error:"), err
    for part in case.culprit:
        assert part.replace("@TMP", str(tmp_path)) in err, err
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["deep flow nesting", "utf-16 bom", "out is a file"])
def test_no_traceback_reaches_stderr_of_a_real_process(name, tmp_path, monkeypatch):
    """As a process (libyaml's crash on deep nesting would kill it), with the console entry."""
    argv = _prepare(CASES[name], tmp_path, monkeypatch)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "odyssey_megatron.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("odyssey: error:")


def test_a_bad_mplbackend_is_one_line_before_anything_is_simulated(tmp_path, monkeypatch):
    """A process of its own: matplotlib reads MPLBACKEND once, when first imported."""
    argv = _prepare(Bad(["simulate", "--scenario", "@TMP/s.yaml"], ()), tmp_path, monkeypatch)
    before = _snapshot(tmp_path)
    done = subprocess.run([sys.executable, "-m", "odyssey_megatron.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "bogus"})
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("odyssey: error: MPLBACKEND: 'bogus' is not a "
                                                                   "valid value for backend"), done.stderr
    assert _snapshot(tmp_path) == before


def test_an_interrupted_simulation_leaves_no_files(tmp_path, monkeypatch, capsys):
    """Ctrl-C halfway: one line, exit 130, and neither the run folder nor its staging copy."""
    import odyssey_megatron.simulator.run as run_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    argv = _prepare(Bad(["simulate", "--scenario", "@TMP/s.yaml", "--json"], ()), tmp_path, monkeypatch)
    before = _snapshot(tmp_path)
    monkeypatch.setattr(run_module, "run_system", interrupted)
    assert main(argv) == 130
    out, err = capsys.readouterr()
    assert out == "" and err == "odyssey: interrupted\n"
    assert _snapshot(tmp_path) == before
