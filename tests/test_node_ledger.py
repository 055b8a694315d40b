"""Ranks commit a step per node (``runtime.rank.node_ledger``): the same decisions as the
step ledger's per rank, with a node's requests on the controller's store instead of each
rank's, and a node that loses its carrier still learns the step's fate from the
controller. Threads over a thread-safe dict store stand in for the ranks and the stores.
A wait for the decision that runs out is reported as a stall, and every rank then takes
the decision the controller makes, ordered here by the stall report itself."""

from __future__ import annotations

import datetime
import threading
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from odyssey_megatron.runtime.protocol.keys import node_applied_key, step_report_key
from odyssey_megatron.runtime.rank.live_step import AfterStall, commit_step
from odyssey_megatron.runtime.rank.node_ledger import NodeLedger
from odyssey_megatron.runtime.rank.op_timers import OpTimers
from odyssey_megatron.runtime.step_ledger import Outcome, StepLedger

TIMEOUT = datetime.timedelta(seconds=10)
GENERATION, STEP = 2, 5


class ThreadStore:
    """A store's calls over a dict, safe across threads; ``requests`` counts them by kind."""

    def __init__(self):
        self.values: dict[str, object] = {}
        self.requests: Counter[str] = Counter()
        self._changed = threading.Condition()

    def _note(self, kind: str) -> None:
        self.requests[kind] += 1

    def add(self, key, amount):
        with self._changed:
            self._note("add")
            self.values[key] = self.values.get(key, 0) + amount
            self._changed.notify_all()
            return self.values[key]

    def set(self, key, value):
        with self._changed:
            self._note("set")
            self.values[key] = value if isinstance(value, bytes) else value.encode()
            self._changed.notify_all()

    def append(self, key, value):
        with self._changed:
            self._note("append")
            self.values[key] = self.values.get(key, b"") + (value if isinstance(value, bytes) else value.encode())
            self._changed.notify_all()

    def get(self, key):
        with self._changed:
            self._note("get")
            return self.values[key]

    def check(self, keys):
        with self._changed:
            self._note("check")
            return all(k in self.values for k in keys)

    def wait(self, keys, timeout):
        with self._changed:
            self._note("wait")
            if not self._changed.wait_for(lambda: all(k in self.values for k in keys), timeout.total_seconds()):
                raise dist.DistStoreError(f"wait for {keys}: timeout")


def _commit(main, node, *, world: int, node_ranks: int, rank: int, results: dict) -> None:
    ledger = NodeLedger(StepLedger(main, generation=GENERATION, training_ranks=world), lambda: node,
                        node_ranks=node_ranks, check_s=0.05)
    outcome = ledger.count_in(STEP, f'{{"rank": {rank}}}\n', timeout=TIMEOUT)
    results[rank] = outcome if outcome is not None else ledger.wait_decided(STEP, timeout=TIMEOUT)


def _run(nodes: int, per_node: int, *, absent: tuple[int, ...] = (), freeze_after: float | None = None):
    """Every rank but ``absent`` commits, node by node; the controller freezes the step
    after ``freeze_after`` seconds if given. (main store, its decision per rank)"""
    main, results = ThreadStore(), {}
    world = nodes * per_node
    threads = []
    for n in range(nodes):
        node = ThreadStore()
        for rank in range(n * per_node, (n + 1) * per_node):
            if rank not in absent:
                threads.append(threading.Thread(target=_commit, args=(main, node), kwargs=dict(
                    world=world, node_ranks=per_node, rank=rank, results=results)))
    for t in threads:
        t.start()
    if freeze_after is not None:
        time.sleep(freeze_after)
        StepLedger(main, generation=GENERATION, training_ranks=world).freeze(STEP, STEP)
    for t in threads:
        t.join(timeout=30)
    return main, results


@pytest.mark.parametrize("nodes,per_node", [(1, 1), (2, 3), (3, 4)])
def test_every_rank_commits_with_its_report_carried_and_one_count_per_node(nodes, per_node):
    main, results = _run(nodes, per_node)
    assert results == dict.fromkeys(range(nodes * per_node), Outcome.COMMITTED)
    reports = main.values[step_report_key(GENERATION, STEP)].decode().splitlines()
    assert sorted(reports) == sorted(f'{{"rank": {r}}}' for r in range(nodes * per_node))
    assert main.requests["append"] == nodes and main.requests["add"] == nodes  # a node's, not a rank's


def test_the_controllers_store_sees_as_many_requests_for_four_ranks_a_node_as_for_one():
    few, _ = _run(3, 1)
    many, _ = _run(3, 4)
    assert sum(many.requests.values()) == sum(few.requests.values())


def test_a_rank_that_never_counts_in_leaves_the_step_to_the_controllers_freeze_on_every_node():
    """Rank 4 (node 1) died before counting in: node 0's carrier waits on the controller's
    decision; node 1 has no carrier, and its ranks learn the freeze from the controller."""
    main, results = _run(2, 3, absent=(4,), freeze_after=0.3)
    assert results == dict.fromkeys((0, 1, 2, 3, 5), Outcome.FROZEN)
    assert node_applied_key(GENERATION, STEP) not in main.values  # a node's count stays in the node's store


def test_a_node_whose_carrier_died_after_counting_in_learns_the_commit_from_the_controller():
    main, node = ThreadStore(), ThreadStore()
    ledger = NodeLedger(StepLedger(main, generation=GENERATION, training_ranks=2), lambda: node, node_ranks=2,
                        check_s=0.05)
    assert ledger.count_in(STEP, '{"rank": 0}\n', timeout=TIMEOUT) is None
    # Rank 1 carries: its count reaches the node's, it adds the node's ranks to the step, and dies.
    node.append(f"gen{GENERATION}/node/report/{STEP}", '{"rank": 1}\n')
    node.add(node_applied_key(GENERATION, STEP), 1)
    assert StepLedger(main, generation=GENERATION, training_ranks=2).count_in(STEP, amount=2) is Outcome.COMMITTED
    assert ledger.wait_decided(STEP, timeout=TIMEOUT) is Outcome.COMMITTED


def test_no_decision_within_the_timeout_is_a_store_error():
    main, node = ThreadStore(), ThreadStore()
    ledger = NodeLedger(StepLedger(main, generation=GENERATION, training_ranks=2), lambda: node, node_ranks=2,
                        check_s=0.05)
    ledger.count_in(STEP, '{"rank": 0}\n', timeout=TIMEOUT)
    with pytest.raises(dist.DistStoreError, match="no decision within the timeout"):
        ledger.wait_decided(STEP, timeout=datetime.timedelta(seconds=0.2))


def _late_rank_and_waiter(*, same_node: bool):
    """Rank 0 counts into a two-rank step; rank 1 is late to, on rank 0's node or another.
    (main store, rank 0's ledger, the late rank's count-in, run when called)"""
    main, node_0 = ThreadStore(), ThreadStore()
    node_1 = node_0 if same_node else ThreadStore()
    node_ranks = 2 if same_node else 1
    waiter = NodeLedger(StepLedger(main, generation=GENERATION, training_ranks=2), lambda: node_0,
                        node_ranks=node_ranks, check_s=0.05)
    late = NodeLedger(StepLedger(main, generation=GENERATION, training_ranks=2), lambda: node_1,
                      node_ranks=node_ranks, check_s=0.05)
    return main, waiter, lambda: late.count_in(STEP, '{"rank": 1}\n', timeout=TIMEOUT)


def _commit_waiting_out(ledger: NodeLedger, main: ThreadStore, on_stall) -> tuple[Outcome, list[str]]:
    """Rank 0's commit with a short wait for the decision; ``on_stall`` runs as its stall is
    reported, with the position the report carries. (its outcome, the stalls reported)"""
    timers, stalls = OpTimers(torch.device("cpu")), []
    timers.begin_step(STEP)

    def report(detail: str) -> None:
        stalls.append(detail)
        on_stall(timers.position)

    after_stall = AfterStall(report=report, reconnect=lambda: main, timeout=TIMEOUT)
    outcome = commit_step(ledger=ledger, rank=0, step=STEP, losses={0: 1.0}, samples={0: [7]}, lr=1e-3, op_timers=timers,
                          timeout=datetime.timedelta(seconds=0.2), after_stall=after_stall)
    return outcome, stalls


@pytest.mark.parametrize("same_node", [True, False])
def test_a_commit_wait_that_runs_out_is_reported_and_takes_the_step_the_late_rank_commits_after(same_node):
    """On the code before, the wait that ran out left the generation without the step, and
    the late rank's count-in then committed it: rank 0 would have died entering the next
    generation, its blocks a step behind the committed ones."""
    main, waiter, late_count_in = _late_rank_and_waiter(same_node=same_node)
    positions = []
    outcome, stalls = _commit_waiting_out(waiter, main, lambda position: (positions.append(position),
                                                                           late_count_in()))
    assert outcome is Outcome.COMMITTED
    assert StepLedger(main, generation=GENERATION, training_ranks=2).committed(STEP)
    assert len(stalls) == 1 and f"step {STEP} not decided" in stalls[0]
    assert positions == [(STEP, 1)]  # past its (no) ops and counted in: blamed on whoever is not


@pytest.mark.parametrize("same_node", [True, False])
def test_a_step_the_controller_froze_after_the_stall_is_applied_by_neither_the_waiter_nor_the_late_rank(same_node):
    main, waiter, late_count_in = _late_rank_and_waiter(same_node=same_node)
    controller = StepLedger(main, generation=GENERATION, training_ranks=2)
    late = []

    def end_generation(_position) -> None:  # the controller ends the generation the stall blamed on rank 1
        assert controller.freeze(STEP, STEP) == []
        late.append(late_count_in())

    outcome, _ = _commit_waiting_out(waiter, main, end_generation)
    assert outcome is Outcome.FROZEN and late == [Outcome.FROZEN]
    assert not controller.committed(STEP)
