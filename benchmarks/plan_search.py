"""Decision latency at cluster scale: ``DecisionCenter.on_failure`` after one rank, one
node or two ranks at once fail, cold and prepared in advance, 32 to 16,384 ranks.

The shipped recipes scaled by DP, with their real micro-batches per pipeline: Llama-2 7B
on Ascend 910B (TP1 x PP4, 8 micro-batches per pipeline, recipes/llama2_7b/ascend_910b_32.yaml)
and Llama-2 70B on H100 (TP8 x PP8, 64 per pipeline, configs/llama2_70b_h100_1024.yaml),
8 devices per node. Each cell is the median of --repeats wall times, each on a fresh
decision center. "cold" prices every candidate inside on_failure; "prepared" first runs
``prepare`` for the failure it times (the controller's background work after a plan
change, which covers every worker and node up to ``prepare_cap``, or on a symmetric plan
the representatives that stand for them; its time for this one case is printed apart)
and then times on_failure, a lookup. Targets (issue 20): cold under 1 s at 4,096 ranks
and 5 s at 16,384; prepared under 50 ms at 16,384.
``--memory`` reports, at --max-ranks, the decision center's tracemalloc peak from its
build through two prepared cases, a prepared and a cold decision, and what one prepared
decision keeps (``prepare_cap`` of them are kept).
``--renamed`` times, at 4,096 ranks and up, what covers every single-worker and node
failure of the symmetric starting plan: ``prepare`` of its representatives (one per
stage and node shape, ``planner.symmetry``), then on_failure for the rank and node
failures above, neither a representative: the representative's drafts renamed and
weighed by Eq. 8. It then does the same on the plan rerouted after a first rank failure
(``time_cascade``; ``--cascade-only`` skips the first table).
``--give-way`` times how long the controller's background ``prepare``, stopped 2, 4.5 or
6.5 s after it started at 4,096 ranks, keeps a failure waiting (the controller joins it
before deciding): 17 / 12 / 0 ms for 7B and 68 / 14 / 0 ms for 70B (2026-11-26; 0 ms:
it had finished), where stopping between cases only waited 2.06 / 1.23 / 1.43 s and
5.24 / 2.49 / 0.50 s, and the pure-Python replay 7 / 26 / 22 ms and 405 / 532 / 832 ms.
Run: PYTHONPATH=. .venv/bin/python benchmarks/plan_search.py [--max-ranks 1024] [--memory] [--batch-on-failure shrink]
     [--renamed [--cascade-only]] [--give-way]

Renamed lookups (--renamed --repeats 3, median, 2026-11-26, same machine; "prepare" is
all representatives once):

| ranks | model | prepare (cases) | renamed rank / node |
|---|---|---|---|
| 4,096 | 7B | 5.07 s (8) | 3 / 4 ms |
| 16,384 | 7B | 17.1 s (8) | 11 / 11 ms |
| 4,096 | 70B | 6.06 s (8) | 3 / 3 ms |
| 16,384 | 70B | 14.3 s (8) | 4 / 4 ms |

70B's node is one worker (TP8 on 8-device nodes), so its node failure is a rank failure
of another stage. What is left of a 7B lookup at 16,384 ranks is the scan of every
pipeline of each of the four drafts for a renamed worker (about 1.5 ms each) and the
cluster's live-device count for Eq. 8.

After a first failure (--renamed --cascade-only --repeats 3, 2026-11-26, same machine):
the first rank failure of ``failures`` decided cold, its reroute's plan prepared for its
representatives (``planner.symmetry``: the groups of pipelines the reroute left alone,
"eligible" counts their pipelines), then a next rank and a next node failure in the last
eligible group, cold once (on a copy taken before preparing) and renamed (median):

| ranks | model | first (cold) | eligible pipelines | prepare (cases) | next rank cold / renamed | next node cold / renamed |
|---|---|---|---|---|---|---|
| 4,096 | 7B | 402 ms | 1,008 of 1,024 | 4.20 s (8) | 467 / 4 ms | 629 / 4 ms |
| 16,384 | 7B | 1.78 s | 4,080 of 4,096 | 16.1 s (8) | 2.10 s / 12 ms | 2.27 s / 13 ms |
| 4,096 | 70B | 792 ms | 0 of 64 | - | - | - |
| 16,384 | 70B | 1.44 s | 191 of 256 | 21.1 s (8) | 2.13 s / 2 ms | 2.78 s / 2 ms |

70B at 4,096 ranks has 64 pipelines and its reroute spreads the failed stage's 64
micro-batches over all 63 peers, so no pipeline is left alone and the next failure is
decided cold (or from its own prepared case, within ``prepare_cap``).

One run on the shared 2-core development machine (--repeats 1 --memory, 2026-11-26);
"before" is the code before the compiled replay (commit 4611895) with --no-prepared,
run right after it:

| ranks | model | cold rank / node / two | before | prepared rank / node / two |
|---|---|---|---|---|
| 32 | 7B | 33 / 13 / 41 ms | 69 / 20 / 87 ms | <1 / <1 / <1 ms |
| 1,024 | 7B | 116 / 249 / 199 ms | 163 / 485 / 224 ms | <1 / <1 / <1 ms |
| 4,096 | 7B | 468 / 600 / 520 ms | 449 / 786 / 535 ms | <1 / <1 / <1 ms |
| 16,384 | 7B | 1.80 / 1.94 / 2.27 s | 1.77 / 2.08 / 2.04 s | 1 / 1 / 1 ms |
| 1,024 | 70B | 493 / 598 / 531 ms | 2.28 / 2.31 / 3.85 s | <1 / <1 / <1 ms |
| 4,096 | 70B | 832 / 814 ms / 1.49 s | 8.07 / 7.79 / 14.91 s | <1 / <1 / <1 ms |
| 16,384 | 70B | 1.59 / 1.62 / 3.55 s | 8.53 / 8.67 / 18.55 s | <1 / <1 / <1 ms |

Every cell chose the same plan. Both cold targets hold for single-rank and node
failures; two ranks at once of 70B at 4,096 ranks take 1.49 s (two normalizations of 8
candidates each, every one a replay of all 64 pipelines). A 70B decision at 4,096 ranks
replays 24 op graphs of about 100,000 ops (8 normalization candidates, 2-4 variants
each: split list scheduling over 2 steps, staggered periods of its op lists); the
compiled loop (``estimator.wakeup_loop``) takes 0.31 s of it, building op graphs 0.15 s.
7B at 16,384 ranks is about 7 % slower on two ranks: numba's 44k module objects make
each full pass of the cyclic garbage collector longer (``gc.freeze()`` after the import
gave it back in a probe).

Memory at 16,384 ranks: 7B peak 77.8 MiB, one prepared decision 17.7 MiB (1,134 B per
rank), at most 8 kept; 70B peak 259.7 MiB (the cold two-rank decision's replays, their
op graphs now numpy arrays), one prepared decision 4.38 MiB (280 B per rank), at most 8
kept.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import threading
import time
import tracemalloc

from odyssey_megatron.config import load_config
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.planner import Decision

MODELS = {  # name: (spec, device, TP, PP, micro-batches per pipeline)
    "7B": ("llama2-7b", "ascend-910b", 1, 4, 8),
    "70B": ("llama2-70b", "h100-80gb", 8, 8, 64),
}
RANKS = (32, 1024, 4096, 16384)
DEVICES_PER_NODE = 8


def recipe(model: str, ranks: int, *, micro_batches: int | None = None, batch_on_failure: str = "keep"):
    """``model``'s recipe widened to ``ranks``, with ``micro_batches`` per pipeline (default:
    MODELS') and ``odyssey.batch_on_failure``."""
    spec, device, tp, pp, per_pipeline = MODELS[model]
    per_pipeline = micro_batches or per_pipeline
    dp = ranks // (tp * pp)
    return load_config(None, [
        f"model.spec={spec}", f"cluster.device={device}", f"cluster.devices_per_node={DEVICES_PER_NODE}",
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        f"parallel.data_parallel_size={dp}", "training.micro_batch_size=1",
        f"training.global_batch_size={per_pipeline * dp}", f"odyssey.batch_on_failure={batch_on_failure}",
    ])


def failures(ranks: int, tp: int) -> dict[str, dict]:
    """on_failure arguments per failure kind: a rank mid-cluster, the node after it, and
    two ranks at once in other stages and pipelines (a quarter and three quarters in)."""
    middle = ranks // 2 + tp  # the first rank of a worker in the middle of the cluster
    return {
        "rank": {"ranks": [middle]},
        "node": {"nodes": [middle // DEVICES_PER_NODE + 1]},
        "two": {"ranks": [ranks // 4 + 3 * tp, 3 * ranks // 4 + 5 * tp]},
    }


def failed_workers(center: DecisionCenter, failed: dict) -> frozenset[int]:
    """The workers ``on_failure(**failed)`` will mark failed: the case to prepare."""
    cluster = center.cluster
    return cluster.fail_ranks(failed.get("ranks", ())).fail_nodes(failed.get("nodes", ())).failed_workers \
        - cluster.failed_workers


def time_failure(config, failed: dict, *, prepared: bool, repeats: int) -> tuple[float, float, str]:
    """(median on_failure seconds, median seconds to prepare its case, what the last one chose)."""
    times, prepare_times, chosen = [], [], ""
    for _ in range(repeats):
        center = DecisionCenter.from_recipe(config)
        if prepared:
            started = time.perf_counter()
            assert center.prepare([failed_workers(center, failed)]) == 1
            prepare_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        decision = center.on_failure(**failed)
        times.append(time.perf_counter() - started)
        c = decision.chosen
        chosen = f"{c.policy} {c.layout} step {c.estimate.step_time_s:.3f} s"
    return statistics.median(times), statistics.median(prepare_times) if prepare_times else 0.0, chosen


def time_lookup(center: DecisionCenter, failed: dict, *, repeats: int) -> tuple[float, Decision]:
    """Median seconds of ``on_failure(**failed)`` on copies of ``center`` (each shares its
    prepared decisions; on_failure replaces a copy's plan and cluster), and the decision."""
    runs = []
    for _ in range(repeats):
        fresh = copy.copy(center)
        started = time.perf_counter()
        decision = fresh.on_failure(**failed)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs), decision


def time_renamed(config, *, repeats: int) -> tuple[float, int, dict[str, float], str]:
    """Prepare a symmetric plan's representatives once (``likely_failures``), then time
    on_failure for the rank and node failures of ``failures``, neither a representative:
    a lookup of the representative's drafts, renamed. Returns (seconds to prepare, cases
    prepared, median on_failure seconds per kind, what the node failure chose)."""
    center = DecisionCenter.from_recipe(config)
    started = time.perf_counter()
    prepared = center.prepare()
    prepare_s = time.perf_counter() - started
    representatives = set(center.likely_failures())
    tp = config.parallel.tensor_model_parallel_size
    times, chosen = {}, ""
    for kind, failed in failures(config.parallel.num_ranks, tp).items():
        if kind == "two":
            continue
        assert failed_workers(center, failed) not in representatives
        times[kind], decision = time_lookup(center, failed, repeats=repeats)
        c = decision.chosen
        chosen = f"{c.policy} {c.layout} step {c.estimate.step_time_s:.3f} s"
    return prepare_s, prepared, times, chosen


def time_cascade(config, *, repeats: int) -> dict:
    """After a first rank failure (``failures``' "rank", decided cold), prepare the
    rerouted plan's representatives (``planner.symmetry``: the groups of pipelines the
    reroute left alone), then time on_failure for a next rank and a next node failure in
    the last eligible group, neither a representative: cold once (on a copy taken before
    preparing) and renamed (median of ``repeats``). Returns the figures, or only the first
    failure's where no group is eligible."""
    center = DecisionCenter.from_recipe(config)
    tp = config.parallel.tensor_model_parallel_size
    started = time.perf_counter()
    first = center.on_failure(**failures(config.parallel.num_ranks, tp)["rank"])
    out = {"first_s": time.perf_counter() - started, "first": first.chosen.policy}
    sym = center.symmetry()
    if sym is None:
        return out
    out["eligible"] = len(sym.eligible) * sym.group
    last, stage = sym.eligible[-1], sym.stages // 2
    nexts = {"rank": {"ranks": [center.cluster.worker_ranks(sym.worker(stage, last + sym.group - 1))[0]]}}
    node = center.cluster.node_of_worker(sym.worker(stage - 1 if stage else stage, last))
    nexts["node"] = {"nodes": [node]}
    cold = copy.copy(center)  # before prepare: its next failure finds nothing prepared
    representatives = sym.representatives()
    started = time.perf_counter()
    out["prepared"] = center.prepare(representatives)
    out["prepare_s"] = time.perf_counter() - started
    before = center.cluster.failed_workers
    for kind, failed in nexts.items():
        if failed_workers(center, failed) in representatives:
            continue  # one eligible group: its nodes are the representatives
        started = time.perf_counter()
        assert copy.copy(cold).on_failure(**failed).source == "cold"
        out[f"{kind}_cold_s"] = time.perf_counter() - started
        out[f"{kind}_renamed_s"], decision = time_lookup(center, failed, repeats=repeats)
        assert decision.source == "renamed" and not before & set(decision.chosen.plan.workers)
    return out


def time_give_way(config, *, into_s: float) -> tuple[float, int]:
    """How long the controller's background ``prepare`` keeps a failure waiting: stop it
    ``into_s`` seconds after it started and time the thread's join (the controller joins
    it before deciding). Returns (seconds waited, cases it kept)."""
    center = DecisionCenter.from_recipe(config)
    stop, kept = threading.Event(), []
    thread = threading.Thread(target=lambda: kept.append(center.prepare(stop=stop.is_set)))
    thread.start()
    time.sleep(into_s)
    started = time.perf_counter()
    stop.set()
    thread.join()
    return time.perf_counter() - started, kept[0]


def seconds(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def memory_peak(model: str, ranks: int) -> None:
    """tracemalloc peak of a decision center from its build through two prepared cases
    (the rank failure timed above and one in another pipeline), the prepared decision
    and a cold two-rank one; and the memory one prepared decision keeps."""
    config = recipe(model, ranks)
    tp = MODELS[model][2]
    tracemalloc.start()
    center = DecisionCenter.from_recipe(config)
    cap = center.prepare_cap()
    rank = failures(ranks, tp)["rank"]
    cases = [failed_workers(center, rank), failed_workers(center, {"ranks": [ranks // 4]})]
    center.prepare(cases[:1])  # also fills the caches every case shares
    before, _ = tracemalloc.get_traced_memory()
    assert center.prepare(cases[1:]) == 1
    per_case = tracemalloc.get_traced_memory()[0] - before
    center.on_failure(**rank)
    center.on_failure(**failures(ranks, tp)["two"])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"memory: {model} at {ranks} ranks: tracemalloc peak {peak / 2**20:.1f} MiB (build, prepare 2 cases, "
          f"prepared rank failure, cold two-rank failure); one prepared decision keeps {per_case / 2**20:.2f} MiB "
          f"({per_case / ranks:.0f} B per rank), at most {cap} kept",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-ranks", type=int, default=RANKS[-1])
    parser.add_argument("--no-prepared", action="store_true", help="time cold decisions only")
    parser.add_argument("--memory", action="store_true", help="also the tracemalloc peak at --max-ranks (7B, 70B)")
    parser.add_argument("--renamed", action="store_true",
                        help="only the renamed lookups of a symmetric plan, at 4,096 ranks and up (time_renamed), "
                             "and of the plan rerouted after a first failure (time_cascade)")
    parser.add_argument("--cascade-only", action="store_true", help="with --renamed: skip time_renamed")
    parser.add_argument("--give-way", action="store_true",
                        help="only how long a stopped prepare keeps a failure waiting, at 4,096 ranks (time_give_way)")
    parser.add_argument("--batch-on-failure", choices=("keep", "shrink"), default="keep",
                        help="the table's decisions with odyssey.batch_on_failure (shrink: smaller batches drafted too)")
    parser.add_argument("--smoke", action="store_true",
                        help="CI's check that it runs: the table at its smallest size (32 ranks, one repeat)")
    args = parser.parse_args()
    if args.smoke:
        args.max_ranks, args.repeats = RANKS[0], 1
    if args.give_way:
        for model in MODELS:
            for into_s in (2.0, 4.5, 6.5):
                waited, kept = time_give_way(recipe(model, 4096), into_s=into_s)
                print(f"{model} 4096 ranks: prepare stopped {into_s} s in gave way after {seconds(waited)} "
                      f"({kept} cases kept)", flush=True)
        return
    if args.renamed:
        print(f"{'model':<5} {'ranks':>6} {'prepare':>9} {'cases':>5} {'rank':>9} {'node':>9}  node chose")
        for model in MODELS:
            for ranks in RANKS:
                if 4096 <= ranks <= args.max_ranks and not args.cascade_only:
                    prep, cases, times, chosen = time_renamed(recipe(model, ranks), repeats=args.repeats)
                    print(f"{model:<5} {ranks:>6} {seconds(prep):>9} {cases:>5} {seconds(times['rank']):>9} "
                          f"{seconds(times['node']):>9}  {chosen}", flush=True)
        print("after a first rank failure (cold), on the rerouted plan:")
        print(f"{'model':<5} {'ranks':>6} {'first':>9} {'eligible':>8} {'prepare':>9} {'cases':>5} "
              f"{'rank cold':>9} {'renamed':>9} {'node cold':>9} {'renamed':>9}")
        for model in MODELS:
            for ranks in RANKS:
                if 4096 <= ranks <= args.max_ranks:
                    out = time_cascade(recipe(model, ranks), repeats=args.repeats)
                    cells = [seconds(out[k]) if k in out else "-" for k in
                             ("prepare_s", "rank_cold_s", "rank_renamed_s", "node_cold_s", "node_renamed_s")]
                    print(f"{model:<5} {ranks:>6} {seconds(out['first_s']):>9} {out.get('eligible', 0):>8} "
                          f"{cells[0]:>9} {out.get('prepared', 0):>5} {cells[1]:>9} {cells[2]:>9} {cells[3]:>9} "
                          f"{cells[4]:>9}  (first: {out['first']})", flush=True)
        return
    print(f"{'model':<5} {'ranks':>6} {'TPxPPxDP':>10} {'failure':>7} {'cold':>9} {'prepared':>9} {'prepare':>9}"
          "  chosen")
    for model, (_, _, tp, pp, _) in MODELS.items():
        for ranks in RANKS:
            if ranks > args.max_ranks or ranks < tp * pp:
                continue
            config = recipe(model, ranks, batch_on_failure=args.batch_on_failure)
            for kind, failed in failures(ranks, tp).items():
                repeats = args.repeats
                cold, _, chosen = time_failure(config, failed, prepared=False, repeats=repeats)
                if args.no_prepared:
                    warm = prep = float("nan")
                else:
                    warm, prep, _ = time_failure(config, failed, prepared=True, repeats=repeats)
                cells = [seconds(s) if s == s else "-" for s in (cold, warm, prep)]
                print(f"{model:<5} {ranks:>6} {f'{tp}x{pp}x{ranks // (tp * pp)}':>10} {kind:>7} "
                      f"{cells[0]:>9} {cells[1]:>9} {cells[2]:>9}  {chosen}", flush=True)
    if args.memory:
        for model in MODELS:
            memory_peak(model, args.max_ranks)


if __name__ == "__main__":
    main()
