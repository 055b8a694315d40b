"""What authenticating the store's values costs (``runtime.protocol.auth``): HMAC-SHA256
signing on the writer's side plus checking on the reader's, per value.

Figures, each the median of ``--repeats`` timed loops over the package's ``Signer``:
- ``small_message_us``: a heartbeat as a worker writes it (``Heartbeat.to_json``, about
  150 bytes; a step decision, an abort or a kill order is shorter), signed and opened;
- ``frame_us`` and ``frame_bytes``: the plan frame every worker reads
  (``PlanPublished.frame``) of the recipe's first plan at ``--ranks`` (7B at 16,384 by
  default, as ``plan_search.py`` widens it), signed once by the controller and opened by
  a worker;
- ``publication_ms``: signing every op list and the frame, the controller's extra work
  per plan published; ``own_ops_us``: opening the largest op list, a worker's.
For scale: a store request costs 20-120 us on this machine, a Python relay in front of
the store 277-964 us.

Measured 2026 (shared 2-core CPU, other sessions' tests beside it, 16,384 ranks, 3 repeats):
a 138-byte heartbeat signed and checked in 4.2 us; the plan frame (1,090 B compressed) in
5 us; signing the whole publication (16,384 op lists, 1.5 MB, and the frame) 27.6 ms; a
worker's largest op list checked in 3.6 us. The smoke run prints the same line at 64 ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.runtime.protocol.auth import Signer
from odyssey_megatron.runtime.protocol.keys import plan_key, rank_heartbeat_key
from odyssey_megatron.runtime.protocol.messages import Heartbeat
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished
from plan_search import recipe

SECRET = bytes(range(32))


def per_call_s(call, *, loops: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds per call in ``loops`` calls."""
    rounds = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(loops):
            call()
        rounds.append((time.perf_counter() - started) / loops)
    return statistics.median(rounds)


def round_trip(signer: Signer, key: str, value: bytes):
    def call():
        assert signer.open(key, signer.sign(key, value)) == value

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=16384, help="the plan's ranks (7B, widened)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CI's check that it runs: 64 ranks, short loops")
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.repeats = 64, 1
    signer = Signer(SECRET)
    small_loops = 2_000 if args.smoke else 50_000
    beat = Heartbeat(12345, time.time(), 3, 3, 4242, 17, 96).to_json().encode()
    small_s = per_call_s(round_trip(signer, rank_heartbeat_key(4095), beat), loops=small_loops, repeats=args.repeats)

    started = time.perf_counter()
    center = DecisionCenter.from_recipe(recipe("7B", args.ranks))
    published = PlanPublished(center.plan, center.program, time.time())
    frame, op_lists = published.frame(), published.op_lists()
    built_s = time.perf_counter() - started
    key = plan_key(published.plan.generation)
    frame_s = per_call_s(round_trip(signer, key, frame), loops=20, repeats=args.repeats)
    own_key, own = max(op_lists.items(), key=lambda item: len(item[1]))
    own_s = per_call_s(lambda: signer.open(own_key, signer.sign(own_key, own)), loops=200, repeats=args.repeats)

    def publication():
        for k, v in op_lists.items():
            signer.sign(k, v)
        signer.sign(key, frame)

    publication_s = per_call_s(publication, loops=1, repeats=args.repeats)
    print(f"small message ({len(beat)} B): {small_s * 1e6:.2f} us signed and opened")
    print(f"{args.ranks:,} ranks (plan built in {built_s:.1f} s): frame {len(frame):,} B {frame_s * 1e6:.0f} us; "
          f"{len(op_lists):,} op lists {sum(map(len, op_lists.values())):,} B; publication signed in "
          f"{publication_s * 1e3:.1f} ms; largest op list ({len(own):,} B) {own_s * 1e6:.1f} us")
    print(json.dumps({"store_auth": {"small_message_us": round(small_s * 1e6, 3), "small_message_bytes": len(beat),
                                     "ranks": args.ranks, "frame_bytes": len(frame), "frame_us": round(frame_s * 1e6, 1),
                                     "op_lists": len(op_lists), "publication_ms": round(publication_s * 1e3, 2),
                                     "own_ops_us": round(own_s * 1e6, 2)}}))


if __name__ == "__main__":
    main()
