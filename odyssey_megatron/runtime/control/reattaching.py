"""A restarted controller taking back the survivors of the lost one (``odyssey train
--resume`` on the controller's node, within ``odyssey.controller_reattach_s``).

The lost start is read from the run directory: the last ``controller_started`` before this
one, with no ``run_end`` after it, and the last plan it published (``plan-<g>.json``). The
survivors of that plan outside this node (this node's workers died with its process)
announce themselves (``RankReattached``); the restarted controller waits until all of
them did, or until the window the survivors wait in is over, judges them together
(``reattach.judge_reattachments``) and answers each (``ReattachVerdict``). Taken back,
they train on from memory; refused, they exit, their blocks saved, and the run resumes
from the disk checkpoint. One who announces itself after the judgement is refused; a
stop signal while the controller waits refuses them all, and that start ends untrained.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from odyssey_megatron.cluster import ClusterState
from odyssey_megatron.config import ModelConfig, RecipeConfig
from odyssey_megatron.decision_center import DecisionCenter
from odyssey_megatron.plan import ExecutionPlan
from odyssey_megatron.run_dir import read_jsonl
from odyssey_megatron.runtime.checkpoint_index import latest_checkpoint
from odyssey_megatron.runtime.control.console import CONSOLE
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.detector import Cause, Failure
from odyssey_megatron.runtime.control.reattach import Reattachment, judge_reattachments
from odyssey_megatron.runtime.protocol.messages import ReattachVerdict
from odyssey_megatron.schedules.program import read_published

__all__ = ["Continuation", "LostStart", "continuation", "lost_start", "refuse_all", "resumed_at", "take_back"]

log = logging.getLogger(__name__)
console = logging.getLogger(CONSOLE)


@dataclass(frozen=True)
class Continuation:
    """What a restarted controller trains on from: the lost controller's last plan, which
    the survivors it took back hold, and the failure of that plan's ranks that did not
    come back, if any (the first generation recovers from it)."""

    plan: ExecutionPlan
    lost: Optional[Failure]
    saved: bool = False
    """A complete checkpoint of the step taken back is on disk (the survivors saved what
    they held before they waited): a rollback to the run's start reads it."""


@dataclass(frozen=True)
class LostStart:
    """The controller start before this one, lost while its run trained."""

    epoch: int
    plan: ExecutionPlan
    """The last plan it published: what its survivors ran."""
    last_record_at: float
    """Wall time of its last record: about when it was lost."""


def lost_start(run_dir: Path, *, epoch: int) -> Optional[LostStart]:
    """The start before ``epoch`` (this controller's) where it was lost: it published a
    plan, and ended neither by finishing nor by failing (``run_end``); else None."""
    path = run_dir / "events.jsonl"
    if epoch == 0 or not path.is_file():
        return None
    events = read_jsonl(path, key="--resume")
    starts = [i for i, e in enumerate(events) if e.get("event") == "controller_started"]
    previous = [i for i in starts if events[i].get("epoch") == epoch - 1]
    if not previous:
        return None
    later = [i for i in starts if i > previous[-1]]
    segment = events[previous[-1]:later[0] if later else len(events)]
    plans = [e["generation"] for e in segment if e.get("event") == "plan"]
    if not plans or any(e.get("event") == "run_end" for e in segment):
        return None
    plan_path = run_dir / f"plan-{plans[-1]}.json"
    if not plan_path.is_file():  # lost before it wrote its last plan down: the survivors ran one not on disk
        return None
    plan, _ = read_published(json.loads(plan_path.read_text()))
    return LostStart(epoch - 1, plan, segment[-1]["time"])


def take_back(controller: Controller, lost: LostStart, *, cluster: ClusterState, model: ModelConfig,
              window_s: float, gone: Iterable[int]) -> Reattachment:
    """Wait for the survivors of ``lost`` to announce themselves, all but the ranks in
    ``gone`` (this node's, lost with it), up to the end of the window they wait in, then
    judge and answer each. Said in the console and recorded (``reattachment``)."""
    timeouts = controller.timeouts
    gone = set(gone)
    expected = set(cluster.ranks_of(lost.plan.workers)) - gone
    deadline = lost.last_record_at + timeouts.collective_timeout + window_s
    console.info("controller start %d lost at generation %d: waiting up to %.0f s for its %d survivors to reattach",
                 lost.epoch, lost.plan.generation, max(0.0, deadline - time.time()), len(expected))
    while (time.time() < deadline and controller.stop_request is None
           and not expected <= {r.rank for r in controller.survivors.reports()}):
        time.sleep(timeouts.poll_interval)
    reports = controller.survivors.close()
    stopped = controller.stop_request is not None  # a stop signal: this start ends before it trains
    if stopped:
        why = f"the restarted controller was stopped ({controller.stop_request[0]})"
        reattachment = Reattachment(None, (), refused=dict.fromkeys(sorted(r.rank for r in reports), why), why=why)
    else:
        reattachment = judge_reattachments(reports, plan=lost.plan, epoch=lost.epoch, cluster=cluster, model=model)
    for rank in (*reattachment.accepted, *reattachment.joiners):
        controller.survivors.answer(controller.store, ReattachVerdict(rank, controller.epoch, True, "",
                                                                      reattachment.step))
    for rank, why in sorted(reattachment.refused.items()):
        controller.survivors.answer(controller.store, ReattachVerdict(rank, controller.epoch, False, why))
    controller.record.event("reattachment", lost_epoch=lost.epoch, generation=lost.plan.generation,
                            step=reattachment.step, accepted=list(reattachment.accepted),
                            joiners=list(reattachment.joiners),
                            refused={str(r): why for r, why in reattachment.refused.items()}, why=reattachment.why)
    if reattachment.from_memory:
        console.info("took back %d survivors of controller start %d: training goes on from their memory at step %d%s",
                     len(reattachment.accepted), lost.epoch, reattachment.step,
                     f" ({len(reattachment.joiners)} idle ones to join)" if reattachment.joiners else "")
    elif stopped:
        console.warning("took back no survivor of controller start %d: %s", lost.epoch, reattachment.why)
    else:
        console.warning("took back no survivor of controller start %d (%s): resuming from disk", lost.epoch,
                        reattachment.why)
    return reattachment


def refuse_all(controller: Controller, *, why: str) -> list[int]:
    """Take no survivor back (this start resumes from disk, or ends): refuse each that
    announced itself so far, and every later one (``SurvivorInbox.close``). The ranks refused."""
    refused = [report.rank for report in controller.survivors.close()]
    for rank in refused:
        controller.survivors.answer(controller.store, ReattachVerdict(rank, controller.epoch, False, why))
    return refused


def continuation(lost: LostStart, reattachment: Reattachment, center: DecisionCenter, *, node: int,
                 here: Iterable[int], saved: bool = False) -> Continuation:
    """What the run trains on from after ``reattachment`` took survivors back: ``center``
    continues from the lost plan (``DecisionCenter.continue_from``), with every rank outside
    it failed until it returns (the idle survivors taken back too: ``Reattachment.joiners``,
    offered back at once as they are alive); that plan's ranks that did not come back fail
    together, as node ``node``'s loss where they are all ``here`` (its ranks, lost with its
    process).
    ``saved``: the step taken back is in a complete checkpoint (``Continuation.saved``)."""
    cluster, plan, back, here = center.cluster, lost.plan, set(reattachment.accepted), set(here)
    used = set(cluster.ranks_of(plan.workers))
    center.continue_from(plan, away=set(range(cluster.world_size)) - used - back)
    missing = tuple(sorted(used - back))
    if not missing:
        return Continuation(plan, None, saved)
    if set(missing) <= here:
        failure = Failure(Cause.NODE, missing, node, lost.last_record_at, time.time(),
                          "lost with the controller's process", node_ranks=tuple(sorted(here)))
    else:
        failure = Failure(Cause.HEARTBEAT, missing, None, lost.last_record_at, time.time(),
                          "not taken back by the restarted controller")
    return Continuation(plan, failure, saved)


def resumed_at(controller: Controller, center: DecisionCenter, config: RecipeConfig, run_dir: Path, *,
               checkpoint: tuple[int, Path], node: int,
               here: Iterable[int]) -> tuple[int, tuple[int, Path], Optional[Continuation]]:
    """Where ``odyssey train --resume`` on node ``node`` (running ranks ``here``) goes on:
    (the step, the checkpoint its ranks rebuild from, what to train on from). From the
    memory of the lost controller's survivors where it takes them back (the step they
    hold); else from the disk, every survivor refused. The checkpoint is read again after
    the wait: the newest complete one, which the survivors' save may be, else ``checkpoint``."""
    lost = lost_start(run_dir, epoch=controller.epoch)
    window_s = config.odyssey.controller_reattach_s
    if lost is None or window_s == 0:
        refuse_all(controller, why="the run resumes from disk" if lost is None else
                   "odyssey.controller_reattach_s is 0 for this start: the run resumes from disk")
        return checkpoint[0], checkpoint, None
    reattachment = take_back(controller, lost, cluster=center.cluster, model=config.model, window_s=window_s,
                             gone=here)
    checkpoint = latest_checkpoint(run_dir) or checkpoint  # the survivors save before they announce themselves
    if not reattachment.from_memory:
        return checkpoint[0], checkpoint, None
    return reattachment.step, checkpoint, continuation(lost, reattachment, center, node=node, here=here,
                                                       saved=checkpoint[0] == reattachment.step)
