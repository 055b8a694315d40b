"""The training worker: one process per device, started by its node's launcher, that
trains plan generation after plan generation until the run is done.

For each plan the controller publishes, the worker works out its ``Role`` in it once:
idle (the plan leaves it out, or it joins the run and no generation has admitted it yet),
send-only (it enters the generation to send blocks but trains nothing) or train. It
enters the generation and plays that part (``runtime.rank.generation``,
``runtime.rank.training_loop``), then leaves it and waits for the next plan. What the
process holds for its whole life, and the blocks it carries from one generation to the
next, are ``runtime.rank.worker_process``'s.

When a peer fails, the survivors' collectives end: gloo reports a closed connection as
soon as a dead peer's sockets close, and where nothing closes (a frozen node, a dropped
link) the controller names the failure from missed heartbeats and aborts the generation,
which the worker's heartbeat thread hears of (its launcher relays the controller's
heartbeat) and turns into an abort of every wait
on the generation's groups (``hooks.collective_guard``). Either way the wait raises
``PeerLost`` where the collective was called. The worker then leaves the generation: it
keeps its blocks, lets go of its process groups (held until their operations have surely
ended) and waits for the controller's next plan. A collective that waits past the
collective timeout with no abort is reported to the controller, which ends the generation.
An error of its own (an injected fault, a bug) is reported to the controller and ends the
process. A ``StopOrder``, or the controller's loss, ends the loop between generations
(``runtime.rank.stopping``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Optional

import torch.distributed as dist

from odyssey_megatron.hooks.collective_guard import PeerLost
from odyssey_megatron.runtime.protocol.keys import RUN_DONE, RUN_STOP
from odyssey_megatron.runtime.protocol.launch import EXIT_CONTROLLER_LOST, WorkerLaunch
from odyssey_megatron.runtime.protocol.liveness import missed_beat
from odyssey_megatron.runtime.protocol.messages import StopOrder
from odyssey_megatron.runtime.protocol.plan_frame import PlanPublished
from odyssey_megatron.runtime.rank.controller_link import ControllerLink
from odyssey_megatron.runtime.rank.entering import enter
from odyssey_megatron.runtime.rank.generation import Generation, GenerationEnded
from odyssey_megatron.runtime.rank.role import Role
from odyssey_megatron.runtime.rank.snapshots import SnapshotAbandoned
from odyssey_megatron.runtime.rank.stopping import carry_out, save_held
from odyssey_megatron.runtime.rank.training_loop import TrainingLoop
from odyssey_megatron.runtime.rank.worker_process import WorkerProcess

__all__ = ["train_worker"]

log = logging.getLogger(__name__)


_GENERATION_LEFT = (GenerationEnded, PeerLost, dist.DistError, SnapshotAbandoned)
"""What ends a generation without being this worker's own error: the controller ended it,
a collective lost a peer (raised where it was called), or the store rendezvous failed."""


def train_worker(launch: WorkerLaunch) -> None:
    """The launcher's target: run the worker; an error of its own is reported, then the
    process ends with status 1; a worker that lost the controller ends with
    ``EXIT_CONTROLLER_LOST`` once it saved what it holds."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {launch.rank} %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its dataset index chatter, once per rank
    for stop in (signal.SIGINT, signal.SIGTERM):  # the launcher and the controller stop the run
        signal.signal(stop, signal.SIG_IGN)
    link = ControllerLink(launch)
    link.start()
    try:
        status = Worker(launch, link).run()
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(status)  # at once: interpreter teardown (torch, gloo) can outlast a heartbeat timeout
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the controller must know
        log.exception("rank %d: failed", launch.rank)
        link.report_failure(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)


class Worker:
    """The generation loop of one worker process."""

    process: WorkerProcess
    generation: int
    """The generation the worker runs, or the last it ran: the next plan follows it."""

    def __init__(self, launch: WorkerLaunch, link: ControllerLink):
        self.process = WorkerProcess(launch, link)
        self.generation = -1

    def run(self) -> int:
        """Train generation after generation; returns the process's exit status."""
        process, launch, link = self.process, self.process.launch, self.process.link
        if launch.joining:
            self.generation = max(-1, link.published_at_start - 1)  # watch from the running one
        while True:
            if process.controller_lost is not None:
                save_held(process)
                ended = self._reattach()
                if ended is not None:
                    return ended
                continue
            try:
                published = self._next_plan()
            except dist.DistError:
                if not self._wait_controller_lost():
                    raise
                continue
            if isinstance(published, StopOrder):
                carry_out(process, published)
                return 0
            if published is None:
                log.info("rank %d: the run is done", launch.rank)
                return 0
            self.generation = published.plan.generation
            link.watching = self.generation
            current = Generation(process, published)
            try:
                self._run_generation(current)
                ended = False
            except _GENERATION_LEFT as exc:
                if isinstance(exc, PeerLost) and exc.timed_out:
                    link.report_stall(self.generation, str(exc))
                log.warning("rank %d: generation %d ended in %s of step %d: %s", launch.rank, self.generation,
                            current.phase, current.step, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                ended = True
            if not ended and process.store.check([RUN_DONE]):
                log.info("rank %d: the run is done", launch.rank)
                return 0  # the process ends now: nothing to tear down for
            # Outside the except block: its frame holds references that keep gloo's sockets open.
            current.leave(abandoned=ended)

    @staticmethod
    def _run_generation(current: Generation) -> None:
        """Enter the generation as the rank's role asks, then play the role's part."""
        role = current.begin()
        if role is Role.idle:
            current.sit_out()
        else:
            enter(current, role)
            if role is Role.send_only:
                current.send_blocks()
            else:
                TrainingLoop(current).run()

    def _next_plan(self) -> PlanPublished | StopOrder | None:
        """The next generation's plan, the order to stop, or None once the run is done;
        waits (on the successor key, without polling) up to the recovery timeout."""
        try:
            following = self.process.link.next_after(self.generation)
        except dist.DistError as exc:  # missed_beat alone tells a late answer from a lost store
            if not missed_beat(exc):
                raise
            raise TimeoutError(f"no plan generation {self.generation + 1} within the recovery timeout "
                               f"({self.process.timeouts.recovery_timeout} s)") from None
        if following == RUN_STOP:
            return StopOrder.from_json(self.process.store.get(RUN_STOP))
        if following == RUN_DONE:
            return None
        return following

    def _reattach(self) -> Optional[int]:
        """With the controller lost and the held blocks saved: reattach to a restarted
        controller within the window (``Timeouts.controller_reattach_s``), announcing the
        last generation the worker ran and the committed step its blocks hold (none: idle
        in it). None where it took the worker back (it trains on from memory, or waits to
        join where it was idle, under the restarted controller's start), else the exit
        status: 0 where it refused the worker (the run resumes from disk, the worker's part
        of it saved), ``EXIT_CONTROLLER_LOST`` where none came back. Blocks at different
        steps cannot go on from memory: the worker exits after its save."""
        process = self.process
        steps = {process.state.blocks[block].step for block in process.state.held()} if process.state else set()
        if process.timeouts.controller_reattach_s == 0 or len(steps) > 1 or self.generation < 0:
            return EXIT_CONTROLLER_LOST
        verdict = process.link.reattach(epoch=process.spec.epoch, generation=self.generation,
                                        committed_step=steps.pop() if steps else None)
        if verdict is None:
            return EXIT_CONTROLLER_LOST
        if not verdict.accepted:
            log.warning("rank %d: the restarted controller refused it (%s); its blocks are saved, exiting",
                        process.launch.rank, verdict.why)
            return 0
        process.reconnected(epoch=verdict.epoch, step=verdict.step)
        return None

    def _wait_controller_lost(self) -> bool:
        """After a store error: whether the heartbeat thread finds the controller gone."""
        process = self.process
        deadline = time.monotonic() + 2 * process.timeouts.heartbeat_timeout
        while process.controller_lost is None and time.monotonic() < deadline:
            time.sleep(process.timeouts.poll_interval)
        return process.controller_lost is not None
