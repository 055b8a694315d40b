"""What issue 18's checks must still let through, and a property over random mutations.

Controls: unicode paths with spaces, a UTF-8 byte-order mark, CRLF line ends, megabytes of
comments, repeated --failed flags, unsorted traces, a 16,384-rank cluster; run
directories never overwritten (a fresh name, or --force over an earlier run).
The property: a valid recipe (in either layout) or scenario with a few keys set to random
values, sane or hostile, ends within a time and memory bound, with exit 0 and strictly valid, finite JSON,
or exit 2/3 and one line on stderr.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import resource
import shutil
import signal
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odyssey_megatron.cli import main
from odyssey_megatron.config import load_config

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes/llama2_7b/ascend_910b_32.yaml"
TINY = REPO / "recipes/llama2_7b/tiny_cpu.yaml"
BRIDGE = REPO / "recipes/llama2_7b/bridge_tiny.yaml"
SCENARIO = f"""recipe: {TINY}
duration_hours: 0.25
failures: {{rate_per_device_hour: 1.0}}
systems: [odyssey, checkpoint]
wandb_mode: disabled
"""


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def strict_json(text: str):
    """Parse JSON, refusing NaN and Infinity, and check every number is finite."""
    def refuse(constant):
        raise ValueError(f"{constant} in JSON output")

    value = json.loads(text, parse_constant=refuse)
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float):
            assert math.isfinite(item)
    return value


def plan_json(argv: list[str]) -> dict:
    """The chosen plan and its step time (transition times include the measured search)."""
    code, out, err = run(["plan", *argv, "--json"])
    assert code == 0, err
    plan = strict_json(out)
    return {key: plan[key] for key in ("policy", "pipelines", "reroutes", "transfers", "sync_units", "est_step_time_s")}


# Valid controls ------------------------------------------------------------------------


def test_unicode_path_with_spaces_bom_crlf_and_megabytes_of_comments_plan_as_the_original(tmp_path):
    expected = plan_json(["--config", RECIPE, "--failed", "5"])
    text = RECIPE.read_text()
    folder = tmp_path / "récipes ünïcode ✓"
    folder.mkdir()
    variants = {
        "with spaces ☃.yaml": text,
        "bom.yaml": "\ufeff" + text,
        "crlf.yaml": text.replace("\n", "\r\n"),
        "bom crlf.yaml": "\ufeff" + text.replace("\n", "\r\n"),
        "comments.yaml": "# " + "a long comment line about nothing " * 2 + "\n" * 1 + text
        + ("# padding: the recipe above is all there is\n" * 120_000),
    }
    for name, content in variants.items():
        path = folder / name
        path.write_bytes(content.encode())
        assert plan_json(["--config", path, "--failed", "5"]) == expected, name
    assert (folder / "comments.yaml").stat().st_size > 5_000_000


def test_repeated_failed_flags_accumulate(capsys):
    both = plan_json(["--config", RECIPE, "--failed", "1", "--failed", "2"])
    assert both == plan_json(["--config", RECIPE, "--failed", "1,2"])
    assert both == plan_json(["--config", RECIPE, "--failed", "2,1", "--failed", "1"])
    live = {s["worker"] for p in both["pipelines"] for s in p["stages"]}  # TP 1: worker ids are ranks
    assert not live & {1, 2}
    code, out, _ = run(["plan", "odyssey.policy=reroute", "--config", RECIPE, "--failed", "1", "--failed", "2"])
    assert code == 0 and out.startswith("after failure of ranks [1, 2]: reroute")


def test_a_16384_rank_cluster_passes_the_guards_and_plans():
    """Llama-2 70B, TP 8 x PP 8 x DP 256; and 16,384 workers of 7B pass validation (their
    plan takes about two minutes: benchmarks/plan_search.py)."""
    big = ["model.spec=llama2-70b", "cluster.device=h100-80gb", "parallel.tensor_model_parallel_size=8",
           "parallel.pipeline_model_parallel_size=8", "parallel.data_parallel_size=256",
           "training.global_batch_size=2048"]
    plan = plan_json(["--config", RECIPE, "--failed", "8193", *big])
    assert sum(len(p["micro_batches"]) for p in plan["pipelines"]) == 2048
    config = load_config(RECIPE, ["parallel.data_parallel_size=4096", "training.global_batch_size=32768"])
    assert config.parallel.num_ranks == 16_384


def test_trace_rows_in_any_order_with_bom_and_crlf(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_bytes("\ufefftime_s,device,event\r\n900,2,join\r\n300,2,fail\r\n300,5,fail\r\n".encode())
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO)
    code, out, err = run(["simulate", "--scenario", scenario, "--json", "--out", tmp_path / "run",
                          "failures.process=trace", f"failures.trace={trace}"])
    assert code == 0, err
    assert strict_json(out)["scenario"]["failures"] == 1 and strict_json(out)["scenario"]["repairs"] == 1


def test_run_directories_are_never_overwritten_silently(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(SCENARIO)
    args = ["simulate", "--scenario", "s.yaml", "--json", "systems=[checkpoint]"]
    assert run(args)[0] == 0
    first = tmp_path / "runs/simulate/s-seed0"
    summary = (first / "summary.json").read_bytes()
    assert first.stat().st_mode & 0o777 == (tmp_path / "runs").stat().st_mode & 0o777  # not private like a temp dir
    assert run(args + ["--seed", "0", "failures.rate_per_device_hour=2"])[0] == 0
    assert (first / "summary.json").read_bytes() == summary
    assert (tmp_path / "runs/simulate/s-seed0-2/summary.json").is_file()
    (first / "stale.txt").write_text("from before")
    code, _, err = run(args + ["--out", first, "--force", "failures.rate_per_device_hour=2"])
    assert code == 0, err
    assert (first / "summary.json").read_bytes() != summary and not (first / "stale.txt").exists()
    assert sorted(p.name for p in (tmp_path / "runs/simulate").iterdir()) == ["s-seed0", "s-seed0-2"]


def test_json_holds_null_not_infinity_when_a_system_trains_nothing(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,device,event\n" + "".join(f"1,{d},fail\n" for d in range(8)))
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO)
    code, out, err = run(["simulate", "--scenario", scenario, "--json", "--out", tmp_path / "run",
                          "failures.process=trace", f"failures.trace={trace}"])
    assert code == 0, err
    summary = strict_json(out)
    assert summary["ratios"] == {"checkpoint": None}
    assert strict_json((tmp_path / "run/summary.json").read_text()) == summary


def test_yaml_limits_ignore_the_environment(monkeypatch):
    monkeypatch.setenv("OMEGACONF_MAX_YAML_EXPANDED_NODES", "not a number")
    assert load_config(RECIPE).parallel.num_ranks == 32


# The property ---------------------------------------------------------------------------

HOSTILE = ["0", "-1", "1", "2", "3", "8", "64", "0.5", "1e-9", "1e9", "1e300", "inf", "-inf", "nan", "1e999",
           str(2**63), str(2**70), "abc", "", "null", "'???'", "[1]", "{a: 1}", "true", "${nope}",
           "${oc.env:ODYSSEY_TEST_UNSET}"]
RECIPE_KEYS = {
    "model.num_layers": [], "model.hidden_size": ["128"], "model.ffn_hidden_size": [], "model.num_attention_heads": [],
    "model.num_query_groups": [], "model.vocab_size": [], "model.seq_length": ["128"],
    "model.params_dtype": ["bf16", "fp8"], "model.spec": ["llama2-7b", "gpt5"], "model.tie_embeddings": [],
    "parallel.tensor_model_parallel_size": [], "parallel.pipeline_model_parallel_size": [],
    "parallel.data_parallel_size": [], "parallel.world_size": ["16"], "training.global_batch_size": ["32"],
    "training.micro_batch_size": [], "training.clip_grad": [], "training.weight_decay": [],
    "training.adam_beta1": [], "training.adam_beta2": ["0.95"], "training.adam_eps": ["1e-5"], "cluster.device": ["a100-80gb", "tpu"],
    "cluster.devices_per_node": [], "cluster.num_nodes": [], "logger.wandb_project": ["p"],
    "odyssey.policy": ["reroute", "reparallelize"], "odyssey.device_mtbf_hours": [],
    "odyssey.learn_failure_rate": ["false"], "odyssey.dp_search_radius": [], "odyssey.pp_search_radius": [],
    "odyssey.length_sweep": ["always", "never"], "odyssey.decoupled_weight_grads": ["false"],
    "odyssey.staggered_optimizer": ["false"], "odyssey.distributed_optimizer": ["true"], "odyssey.max_layer_splits": [], "odyssey.memory_budget_gib": [],
    "odyssey.reroute_restart_s": [], "odyssey.reparallelize_restart_s": [], "odyssey.storage_bandwidth_gb_s": [],
    "odyssey.checkpoint_restart_penalty_s": [], "odyssey.heartbeat_interval": ["0.05", "0.01"],
    "odyssey.heartbeat_timeout": ["0.2", "5"], "odyssey.collective_timeout": ["10"], "odyssey.recovery_timeout": ["600"],
}
BRIDGE_KEYS = {
    "model.tensor_model_parallel_size": [], "model.pipeline_model_parallel_size": [], "model.num_layers": [],
    "model.num_query_groups": [], "model.seq_length": ["128"], "dataset.seq_length": ["128"],
    "model.params_dtype": ["torch.bfloat16", "bfloat16", "fp8"], "model.bf16": [], "model.fp16": [],
    "model.context_parallel_size": [], "model.share_embeddings_and_output_weights": [],
    "train.global_batch_size": ["32"], "train.micro_batch_size": [], "optimizer.lr": [], "optimizer.clip_grad": [],
    "optimizer.weight_decay": ["0.1"], "optimizer.adam_beta2": ["0.95"],
    "rng.seed": [], "tokenizer.tokenizer_type": ["HuggingFaceTokenizer"], "cluster.num_nodes": ["2"],
    "ddp.overlap_grad_reduce": [], "mixed_precision": ["bf16_mixed"], "odyssey.policy": ["reroute"],
}
SCENARIO_KEYS = {
    "duration_hours": [], "seed": [], "sample_interval_s": ["600"], "failures.process": ["weibull", "trace"],
    "failures.rate_per_device_hour": [], "failures.weibull_shape": [], "failures.unit": ["node"],
    "repairs.enabled": [], "repairs.mean_hours": [], "costs.detection_s": [], "costs.restart_s": [],
    "costs.checkpoint_interval_min": [], "costs.checkpoint_save_s": [], "costs.checkpoint_load_s": [],
    "costs.decision_s": [], "systems": ["[recycle,oracle]", "[oobleck]", "[recycle_1f1b]"],
    "oobleck_tolerated_failures": [], "odyssey_learns_failure_rate": ["true"],
}
SECONDS_PER_RUN = 60
MEMORY_PER_RUN = 2 * 2**30


def mutations(keys: dict[str, list[str]]):
    pairs = st.sampled_from(sorted(keys)).flatmap(
        lambda key: st.tuples(st.just(key), st.sampled_from(keys[key] + HOSTILE)))
    return st.lists(pairs, min_size=1, max_size=3, unique_by=lambda pair: pair[0])


class Overran(Exception):
    pass


def run_bounded(argv: list[str]) -> tuple[int, str, str]:
    """``run`` under a wall-clock alarm, checking the peak memory it added."""
    def alarm(signum, frame):
        raise Overran(f"{argv} ran past {SECONDS_PER_RUN} s")

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(SECONDS_PER_RUN)
    try:
        result = run(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < MEMORY_PER_RUN, f"{argv} grew the peak memory by {grown / 2**30:.1f} GiB"
    return result


def check_outcome(code: int, out: str, err: str, *, allowed: tuple[int, ...]) -> None:
    assert code in allowed, err
    if code == 0:
        strict_json(out)
    else:
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith("odyssey: error:" if code == 2 else "odyssey: unrecoverable:"), err


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=mutations(RECIPE_KEYS), failed=st.lists(st.integers(0, 7), max_size=3))
def test_mutated_recipes_plan_or_fail_in_one_line(changes, failed):
    argv = ["plan", "--config", TINY, "--json", *[f"{k}={v}" for k, v in changes]]
    argv += ["--failed", ",".join(map(str, failed))] if failed else []
    code, out, err = run_bounded(argv)
    check_outcome(code, out, err, allowed=(0, 2, 3))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=mutations(BRIDGE_KEYS), failed=st.lists(st.integers(0, 7), max_size=2))
def test_mutated_bridge_recipes_plan_or_fail_in_one_line(changes, failed):
    argv = ["plan", "--config", BRIDGE, "--json", *[f"{k}={v}" for k, v in changes]]
    argv += ["--failed", ",".join(map(str, failed))] if failed else []
    code, out, err = run_bounded(argv)
    check_outcome(code, out, err, allowed=(0, 2, 3))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=mutations(SCENARIO_KEYS), recipe_change=st.none() | mutations(RECIPE_KEYS))
def test_mutated_scenarios_simulate_or_fail_in_one_line(changes, recipe_change):
    folder = Path(tempfile.mkdtemp())
    try:
        (folder / "s.yaml").write_text(SCENARIO)
        (folder / "trace.csv").write_text("time_s,device,event\n60,3,fail\n")
        argv = ["simulate", "--scenario", folder / "s.yaml", "--json", "--out", folder / "run",
                *[f"{k}={v}" for k, v in changes]]
        if any(k == "failures.process" and v == "trace" for k, v in changes):
            argv.append(f"failures.trace={folder / 'trace.csv'}")
        if recipe_change:
            argv.append(f"recipe_overrides=[{','.join(f'{k}={v}' for k, v in recipe_change)}]")
        code, out, err = run_bounded(argv)
        check_outcome(code, out, err, allowed=(0, 2))
        assert (folder / "run").exists() == (code == 0)
    finally:
        shutil.rmtree(folder)
