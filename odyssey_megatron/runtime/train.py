"""``odyssey train`` on one node: node 0 hosts the controller and the run's owner beside
its launcher; every other node runs its launcher alone. This is where the two sides of
the runtime meet: the control side's launcher starts the rank side's worker.

Node 0 first locks the run directory (``run_lock``: one controller per run), then
prepares the data (tokenized, indexed and cached once, before any worker starts, in a
process apart: ``runtime.data_preparation``), writes the resolved recipe to the run
directory and publishes the ``RunSpec`` every worker reads. The launcher runs in the main
thread (it starts the workers, whose parent-death signal follows that thread); the
controller's polling and the run's owner (``TrainingRun``: commits, decisions, plans) run
in threads beside it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from odyssey_megatron.config import RecipeConfig, config_yaml
from odyssey_megatron.data import sample_ids
from odyssey_megatron.decision_center import DecisionCenter, checkpoint_interval
from odyssey_megatron.planner import UnrecoverableFailure
from odyssey_megatron.run_dir import append_jsonl, private_directory, read_jsonl, write_json, write_text
from odyssey_megatron.run_lock import RunDirLock
from odyssey_megatron.runtime.checkpoint_index import latest_checkpoint
from odyssey_megatron.runtime.control.console import CONSOLE, log_node_to
from odyssey_megatron.runtime.control.fork_server import WORKER_PRELOAD
from odyssey_megatron.runtime.control.controller import Controller
from odyssey_megatron.runtime.control.launch_config import LaunchConfig
from odyssey_megatron.runtime.control.launcher import NodeLauncher
from odyssey_megatron.runtime.control.stop_signals import StopAtOnce, StopSignals
from odyssey_megatron.runtime.control.reattaching import resumed_at
from odyssey_megatron.runtime.control.training_run import (
    SAMPLES,
    RunFailed,
    RunStopped,
    TrainingRun,
    forget_steps_from,
)
from odyssey_megatron.runtime.control.wandb_trace import WandbTrace
from odyssey_megatron.runtime.data_preparation import prepare_apart
from odyssey_megatron.runtime.protocol.auth import launcher_secret
from odyssey_megatron.runtime.protocol.keys import RUN_DONE, RUN_SPEC
from odyssey_megatron.runtime.protocol.messages import RunSpec
from odyssey_megatron.runtime.rank.entry import train_worker
from odyssey_megatron.timeouts import Timeouts

__all__ = ["TrainOutcome", "as_trained", "train_node"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainOutcome:
    status: int
    """0: trained to the end; 1: the run failed (its committed steps saved first, as on a
    stop); 3: no plan could go on; 130 or 143: stopped by SIGINT or SIGTERM."""
    message: str
    wandb_dir: Optional[Path] = None
    """Node 0: the W&B run's local directory."""
    wandb_error: Optional[str] = None
    """Node 0: why W&B logging stopped, if it did (the run's records are complete anyway)."""
    resume: Optional[str] = None
    """The command that continues the run, where a checkpoint holds its committed steps."""


def train_node(config: RecipeConfig, launch: LaunchConfig, *, run_dir: Path,
               resume: Optional[tuple[int, Path]] = None) -> TrainOutcome:
    """Run this node's part of the training run; on node 0, the whole run's outcome.
    ``resume``: (committed steps, checkpoint directory) to continue from."""
    if launch.node_rank != 0:
        timeouts = config.odyssey.timeouts
        # As long as the launcher would wait for node 0's store: node 0 makes the secret first.
        secret = launcher_secret(run_dir, os.environ, wait_s=timeouts.recovery_timeout)
        launcher = NodeLauncher(launch, timeouts=timeouts, target=train_worker, preload=WORKER_PRELOAD,
                                secret=secret, restart_workers=config.odyssey.restart_workers,
                                on_run_spec=lambda spec: _log_to_run_dir_of(spec, launch.node_rank))
        signals = StopSignals(lambda name, status: launcher.request_stop(name))
        signals.install()
        try:
            status = launcher.run()
        except StopAtOnce as stop:
            return TrainOutcome(stop.status, f"node {launch.node_rank}: {stop}")
        finally:
            signals.restore()
        return TrainOutcome(status, f"node {launch.node_rank}: launcher exited with status {status}")
    private_directory(run_dir)
    with RunDirLock.take(run_dir):  # before anything is written there: one controller per run
        return _control_run(config, launch, run_dir=run_dir, resume=resume)


def as_trained(config: RecipeConfig) -> RecipeConfig:
    """``config`` as the live run trains and prices it, each change said in one log line:
    the optimizer steps after its step commits (a staggered rank would step before its
    step commits; the live run commits every step first, and its decisions price that), and
    every rank keeps a full copy of its optimizer state (snapshots, checkpoints and recovery
    read whole blocks, so the live worker does not shard it yet: nothing is lost)."""
    odyssey = config.odyssey
    if odyssey.staggered_optimizer:
        log.info("odyssey train: the optimizer steps after each step commits (odyssey.staggered_optimizer "
                 "is for odyssey plan and simulate)")
        odyssey = replace(odyssey, staggered_optimizer=False)
    if odyssey.distributed_optimizer:
        log.warning("odyssey train: every rank keeps a full copy of its optimizer state "
                    "(odyssey.distributed_optimizer, which a Bridge recipe's use_distributed_optimizer sets, is "
                    "priced by odyssey plan and simulate; the live run does not shard it yet)")
        odyssey = replace(odyssey, distributed_optimizer=False)
    return replace(config, odyssey=odyssey)


def _control_run(config: RecipeConfig, launch: LaunchConfig, *, run_dir: Path,
                 resume: Optional[tuple[int, Path]]) -> TrainOutcome:
    """Node 0's part, the run directory locked: the controller, the run's owner and the
    node's launcher, to the run's outcome."""
    timeouts = config.odyssey.timeouts
    log_node_to(run_dir, 0)
    config = as_trained(config)
    if resume is None:
        write_text(run_dir / "config.yaml", config_yaml(config))
    # The store opens, and the controller beats, before the data is prepared (minutes for a
    # real corpus): the other nodes' launchers connect and wait for the run's spec meanwhile.
    controller = Controller(host=launch.master_addr, port=launch.master_port, timeouts=timeouts, run_dir=run_dir)
    if launch.master_port == 0:
        launch = replace(launch, master_port=controller.port)
    trace = WandbTrace(run_dir, config)
    controller.record.subscribe(trace)
    trace.start()
    controller.start()
    # From here a stop signal is the run's, also while the data is prepared or a restarted
    # controller waits for the lost one's survivors: this start then ends before it trains.
    signals = StopSignals(lambda name, status: controller.request_stop(f"{name} on node 0", status=status))
    signals.install()
    try:
        outcome = _owned_to_the_end(config, launch, controller, run_dir=run_dir, resume=resume)
    except StopAtOnce as stop:  # this node's workers are killed; the others go with the controller
        checkpoint = latest_checkpoint(run_dir)
        outcome = TrainOutcome(stop.status, f"{stop}: nothing saved past {_resume_hint(run_dir, checkpoint)}")
    except BaseException:
        controller.stop()
        raise
    finally:
        signals.restore()
    controller.record.event("run_end", status=outcome.status, message=outcome.message)
    controller.stop()
    write_json(run_dir / "outcome.json", {"status": outcome.status, "message": outcome.message,
                                          "resume": outcome.resume})
    try:
        return replace(outcome, wandb_dir=trace.finish())
    except RuntimeError as exc:
        return replace(outcome, wandb_error=str(exc))


def _owned_to_the_end(config: RecipeConfig, launch: LaunchConfig, controller: Controller, *, run_dir: Path,
                      resume: Optional[tuple[int, Path]]) -> TrainOutcome:
    """Node 0 from its started controller to the run's outcome: the data prepared, where a
    resume goes on from, the run's owner in its thread and this node's launcher."""
    timeouts = config.odyssey.timeouts
    prepared = prepare_apart(config, run_dir=run_dir, stopped=lambda: controller.stop_request is not None,
                             poll_s=timeouts.poll_interval)
    center = DecisionCenter.from_recipe(config, settles_at_once=False)
    start_step, continuing = 0, None
    if resume is not None:
        start_step, resume, continuing = resumed_at(controller, center, config, run_dir, checkpoint=resume,
                                                    node=launch.node_rank, here=launch.ranks)
    if controller.stop_request is not None:  # asked before anything trained: nothing new to save
        reason, status = controller.stop_request
        checkpoint = latest_checkpoint(run_dir)
        return TrainOutcome(status, f"stopped ({reason}) before this start trained; "
                                    f"{_resume_hint(run_dir, checkpoint)}",
                            resume=_resume_command(run_dir) if checkpoint else None)
    if resume is not None:
        forget_steps_from(run_dir / SAMPLES, start_step)
        _record_steps_the_controller_missed(run_dir / SAMPLES, start_step, prepared, config)
    config = _with_checkpoint_interval(config, center, controller)
    controller.store.set(RUN_SPEC, RunSpec(config_yaml(config), prepared.to_json(), str(run_dir.resolve()),
                                           None if resume is None else str(resume[1]),
                                           epoch=controller.epoch).to_json())
    run = TrainingRun(config=config, controller=controller, center=center, run_dir=run_dir, start_step=start_step,
                      continuing=continuing)
    outcome: list[TrainOutcome] = []
    owner = threading.Thread(target=_own_run, args=(run, outcome), name="odyssey-run", daemon=True)
    owner.start()
    if continuing is not None:  # this node's workers join the survivors' run, once it is under way
        _wait_published(controller, continuing.plan.generation + 1, owner)
    # A dedicated controller's node has no workers: it only owns the run.
    status = NodeLauncher(launch, timeouts=timeouts, target=train_worker, preload=WORKER_PRELOAD,
                          secret=controller.secret, restart_workers=config.odyssey.restart_workers,
                          joining=continuing is not None).run() if launch.ranks else 0
    while owner.is_alive():  # node 0's workers may all be gone while other nodes train on
        owner.join(timeout=timeouts.heartbeat_interval)
    if not outcome:
        outcome.append(TrainOutcome(1, f"the workers ended (launcher status {status}) before the run did"))
    _wait_other_nodes(controller, timeouts)
    return outcome[0]


def _wait_published(controller: Controller, generation: int, owner: threading.Thread) -> None:
    """Until ``generation`` is published (or the owner ended first)."""
    while controller.published_generation < generation and owner.is_alive():
        time.sleep(controller.timeouts.poll_interval)


def _with_checkpoint_interval(config: RecipeConfig, center: DecisionCenter, controller: Controller) -> RecipeConfig:
    """``config`` with ``odyssey.checkpoint_interval`` resolved (Young's by default), said
    in the console and recorded, as every worker then reads it (``RunSpec``)."""
    steps, how = checkpoint_interval(config, center)
    logging.getLogger(CONSOLE).info("disk checkpoints: %s", how)
    controller.record.event("checkpoint_interval", steps=steps, chosen=how)
    return replace(config, odyssey=replace(config.odyssey, checkpoint_interval=steps))


def _own_run(run: TrainingRun, outcome: list[TrainOutcome]) -> None:
    """The owner thread: run to the end, then release the workers. If it fails, it first
    ends the running generation, so no worker trains on unrecorded, and has the workers
    save the last committed step (``_saved_after_failure``)."""
    try:
        final = run.run()
        outcome.append(TrainOutcome(0, f"trained {run.committed} steps; final model in {final}"))
        run.controller.end_run(RUN_DONE, "1")
        return
    except RunStopped as stop:
        checkpoint = latest_checkpoint(run.run_dir)
        what = (f"saved as checkpoint/step-{stop.step}" if stop.saved else
                "nothing to save: no step committed since the start" if run.fresh else
                "the save missed blocks (see the log)")
        outcome.append(TrainOutcome(stop.status, f"stopped ({stop.reason}) after {stop.step} committed steps, {what}; "
                                                 f"{_resume_hint(run.run_dir, checkpoint)}",
                                    resume=_resume_command(run.run_dir) if checkpoint else None))
        run.controller.end_run(RUN_DONE, "1")
        return
    except UnrecoverableFailure as exc:
        checkpoint = latest_checkpoint(run.run_dir)
        outcome.append(TrainOutcome(3, f"unrecoverable: {exc}; {_resume_hint(run.run_dir, checkpoint)}",
                                    resume=_resume_command(run.run_dir) if checkpoint else None))
    except RunFailed as exc:
        outcome.append(_saved_after_failure(run, str(exc)))
    except Exception as exc:  # noqa: BLE001 - the launcher must still be released
        log.exception("run: failed")
        outcome.append(_saved_after_failure(run, f"{type(exc).__name__}: {exc}"))
    try:
        if run.plan is not None:
            run.end_generation()
    finally:
        run.controller.end_run(RUN_DONE, "1")


def _saved_after_failure(run: TrainingRun, why: str) -> TrainOutcome:
    """A failed owner ends the run as a stop does: the workers write the last committed
    step (``StopWriter.save_committed``), so what committed is on disk to resume from."""
    try:
        saved = run.stop.save_committed(f"the run failed: {why}")
    except Exception:  # noqa: BLE001 - the failure is reported whatever the save did
        log.exception("run: the save after the failure failed")
        saved = False
    checkpoint = latest_checkpoint(run.run_dir)
    what = (f"saved as checkpoint/step-{run.committed}" if saved else
            "nothing to save: no step committed since the start" if run.fresh else "the save missed blocks")
    return TrainOutcome(1, f"{why}; after {run.committed} committed steps, {what}; "
                           f"{_resume_hint(run.run_dir, checkpoint)}",
                        resume=_resume_command(run.run_dir) if checkpoint else None)


def _resume_command(run_dir: Path) -> str:
    return f"odyssey train --resume {run_dir}"


def _resume_hint(run_dir: Path, checkpoint: Optional[tuple[int, Path]]) -> str:
    if checkpoint is None:
        return "no checkpoint to resume from (odyssey.checkpoint_interval is 0 or none was due)"
    return f"resume from the checkpoint of step {checkpoint[0]} with: {_resume_command(run_dir)}"


def _record_steps_the_controller_missed(samples: Path, upto: int, prepared, config: RecipeConfig) -> None:
    """Steps before ``upto`` that ``samples.jsonl`` lacks: the ranks committed them (the
    resumed checkpoint holds them; a rank applies committed steps only) after the controller
    last recorded one, when it died. Their samples follow from the step; their loss was
    never reported (null)."""
    recorded = {record["step"] for record in read_jsonl(samples, key="--resume")} if samples.is_file() else set()
    train = config.training
    for step in (step for step in range(upto) if step not in recorded):
        ids = [i for m in range(train.num_micro_batches)
               for i in sample_ids(prepared, step, m, micro_batch_size=train.micro_batch_size,
                                   num_micro_batches=train.num_micro_batches)]
        append_jsonl(samples, {"step": step, "generation": None, "samples": ids, "loss": None, "recovered": True})


def _wait_other_nodes(controller: Controller, timeouts: Timeouts) -> None:
    """Keep the store up until every other node's launcher has left (or was lost)."""
    deadline = time.monotonic() + timeouts.recovery_timeout
    while time.monotonic() < deadline:
        states = [node.state.value for n, node in list(controller.detector.nodes.items()) if n != 0]
        if all(state in ("left", "failed") for state in states):
            return
        time.sleep(timeouts.poll_interval)


def _log_to_run_dir_of(spec: bytes, node: int) -> None:
    """A node other than 0 logs to ``logs/node-<n>.log`` in the run directory node 0's
    ``RunSpec`` names (its own ``--run-dir`` may differ, and writing there before node 0
    has made it would make node 0 refuse it); until node 0 published it, to the terminal only."""
    log_node_to(Path(RunSpec.from_json(spec).run_dir), node)
