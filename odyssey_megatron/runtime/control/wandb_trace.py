"""The run's trace in Weights & Biases, logged live from node 0's ``odyssey train`` process,
which hosts the controller and outlives every worker: a rank's death never cuts the W&B
run short. Every record the controller appends to ``events.jsonl`` (the source of truth)
is handed to this trace too, and a background thread logs it, so a slow or unreachable
W&B never holds up a recovery.

Two x-axes (``define_metric``): ``step`` for the training metrics (loss, learning rate,
measured and estimated step time, tokens/s, training ranks, plan generation) and ``time_s``, wall-clock
seconds since the run started, for failures and recoveries (the time of each phase, bytes
moved by the Kuhn-Munkres and by a naive mapping) and for the online profile's factors
(``profile/*``, measured over the starting profile's op times; the estimated step time
follows them). Every recovery is also a row of an
incremental ``recoveries`` table with its policy and the alternatives' estimates, every
join (workers taken back, or kept out by Eq. 8) a row of a ``joins`` table with its
decision and the bytes it moved, and every published plan an artifact. Offline unless ``logger.wandb_project`` is given; the W&B
files go into the run directory unless ``logger.wandb_save_dir`` names another. The run id
is kept in ``RUN_DIR/wandb-run-id``, so ``odyssey train --resume`` continues the same run.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import uuid
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from odyssey_megatron.config import RecipeConfig

__all__ = ["JOIN_COLUMNS", "RECOVERY_COLUMNS", "RUN_ID_FILE", "WandbTrace"]

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb-run-id"
RECOVERY_COLUMNS = ("generation", "failed_ranks", "cause", "policy", "decision_source", "start_step", "detection_s",
                    "to_plan_s", "to_first_step_s", "transfer_bytes", "mapping_bytes", "naive_mapping_bytes",
                    "restarts", "snapshot_step", "replayed_steps", "replay_s", "rebuilt_shards", "alternatives")
JOIN_COLUMNS = ("generation", "workers", "grew", "policy", "decision_source", "start_step", "training_ranks",
                "handover_s", "to_first_step_s", "transfers", "transfer_bytes", "mapping_bytes", "naive_mapping_bytes",
                "alternatives")
_JOIN_METRICS = ("transfer_bytes", "handover_s", "to_first_step_s", "training_ranks")
_RECOVERY_METRICS = ("detection_s", "to_plan_s", "to_first_step_s", "transfer_bytes", "mapping_bytes",
                     "naive_mapping_bytes", "replayed_steps", "replay_s")
_STRAGGLER_METRICS = ("rank", "slowdown", "removed", "kept_step_s", "kept_samples_per_s", "removed_step_s",
                      "removed_samples_per_s", "transition_s", "horizon_s", "priced_slowdown")
"""A ``straggler`` event's fields W&B gets: with ``odyssey.straggler=remove``, whether it was
removed and both prices (``planner.straggler``), and for a kept one priced again the slowdown
it was kept at; a report-only event has the first three."""
_END = object()


class WandbTrace:
    """A listener for ``RunRecord`` (``subscribe``) that logs each record to one W&B run."""

    def __init__(self, run_dir: Path, config: RecipeConfig):
        self.run_dir, self.config = Path(run_dir), config
        self.directory: Optional[Path] = None
        """The W&B run's local directory, once the run has finished."""
        self.error: Optional[str] = None
        """Why W&B logging stopped, if it did (training goes on regardless)."""
        self._records: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._log_all, name="odyssey-wandb", daemon=True)
        self._started: Optional[float] = None
        self._estimated_s: dict[int, float] = {}
        """Estimated step time per plan generation."""
        self._ranks: dict[int, int] = {}
        """Training ranks per plan generation."""
        self._last_commit: Optional[tuple[int, float]] = None
        """(generation, time) of the last committed step."""
        self._failures = self._recoveries = self._joins = 0

    def start(self) -> None:
        self._thread.start()

    def __call__(self, record: dict) -> None:
        self._records.put(record)

    def finish(self) -> Path:
        """Log what is queued and close the run; its directory. RuntimeError if W&B failed."""
        self._records.put(_END)
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.directory

    # -- the logging thread ---------------------------------------------------------------

    def _log_all(self) -> None:
        run = None
        try:
            run, tables = self._init()
            while (record := self._records.get()) is not _END:
                self._log(run, tables, record)
            self.directory = Path(run.dir).parent
            run.finish()
        except Exception as exc:  # noqa: BLE001 - W&B must never stop the training run
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("W&B logging stopped: %s", self.error)
            while self._records.get() is not _END:  # drain, so finish() returns
                pass

    def _init(self):
        import wandb

        logger = self.config.logger
        save_dir = Path(logger.wandb_save_dir) if logger.wandb_save_dir else self.run_dir
        save_dir.mkdir(parents=True, exist_ok=True)
        id_file = self.run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:16]
        def start(run_id: str):
            return wandb.init(project=logger.wandb_project or "odyssey-megatron", entity=logger.wandb_entity,
                              name=logger.wandb_exp_name or self.run_dir.name, dir=str(save_dir), id=run_id,
                              resume="allow", mode="online" if logger.wandb_project else "offline", job_type="train",
                              config=OmegaConf.to_container(OmegaConf.structured(self.config), resolve=True),
                              settings=wandb.Settings(silent=True))  # the run's directory is printed at the end

        try:
            run = start(run_id)
        except Exception as exc:  # noqa: BLE001 - W&B's own error types vary by version
            if "in use" not in str(exc):
                raise
            # The process that logged it died without closing it (a killed controller):
            # its W&B service may still hold the id. The trace goes on in a new run.
            log.warning("W&B run %s is still held by a process that died; continuing in a new W&B run", run_id)
            run_id = uuid.uuid4().hex[:16]
            run = start(run_id)
        id_file.write_text(run_id + "\n")
        run.define_metric("step")
        run.define_metric("train/*", step_metric="step")
        run.define_metric("time_s")
        run.define_metric("recovery/*", step_metric="time_s")
        run.define_metric("profile/*", step_metric="time_s")
        run.define_metric("join/*", step_metric="time_s")
        return run, {"recoveries": wandb.Table(columns=list(RECOVERY_COLUMNS), log_mode="INCREMENTAL"),
                     "joins": wandb.Table(columns=list(JOIN_COLUMNS), log_mode="INCREMENTAL")}

    def _log(self, run, tables: dict, record: dict) -> None:
        import wandb

        event, at = record["event"], record["time"]
        if self._started is None:
            self._started = at
        time_s = at - self._started
        if event == "plan":
            generation = record["generation"]
            self._ranks[generation] = len(record["workers"]) * self.config.parallel.tensor_model_parallel_size
            if record.get("estimated_step_s") is not None:
                self._estimated_s[generation] = record["estimated_step_s"]
            plan_file = self.run_dir / f"plan-{generation}.json"
            if plan_file.is_file():
                artifact = wandb.Artifact(f"plan-{generation}", type="plan",
                                          metadata={"policy": record["policy"], "start_step": record["start_step"]})
                artifact.add_file(str(plan_file))
                run.log_artifact(artifact)
        elif event == "step":
            self._log_step(run, record, at, time_s)
        elif event == "profile":
            self._estimated_s[record["generation"]] = record["estimated_step_s"]
            run.log({**{f"profile/{kind}_scale": record[kind] for kind in ("forward", "backward", "optimizer")},
                     "time_s": time_s})
        elif event == "snapshot":
            run.log({"snapshot/step": record["step"], "time_s": time_s})
        elif event == "failure":
            self._failures += 1
            run.log({"recovery/failures": self._failures, "time_s": time_s})
        elif event == "straggler":
            run.log({**{f"straggler/{key}": record[key] for key in _STRAGGLER_METRICS
                        if record.get(key) is not None}, "time_s": time_s})
        elif event == "recovery":
            run.log({**{f"recovery/{key}": record[key] for key in _RECOVERY_METRICS},
                     "recovery/generation": record["generation"], "time_s": time_s})
            _add_row(tables["recoveries"], record, RECOVERY_COLUMNS)
            run.log({"recoveries": tables["recoveries"]})
            self._recoveries += 1
            run.summary["recoveries"] = self._recoveries
        elif event == "join":
            if record["grew"]:
                run.log({**{f"join/{key}": record[key] for key in _JOIN_METRICS}, "time_s": time_s})
                self._joins += 1
                run.summary["joins"] = self._joins
            _add_row(tables["joins"], record, JOIN_COLUMNS)
            run.log({"joins": tables["joins"]})
        elif event == "run_end":
            run.summary["status"], run.summary["message"] = record["status"], record["message"]

    def _log_step(self, run, record: dict, at: float, time_s: float) -> None:
        generation, training = record["generation"], self.config.training
        metrics: dict[str, Any] = {"train/loss": record["loss"], "train/lr": record["lr"],
                                   "train/generation": generation, "train/training_ranks": self._ranks.get(generation),
                                   "step": record["step"], "time_s": time_s}
        if generation in self._estimated_s:
            metrics["train/estimated_step_time_s"] = self._estimated_s[generation]
        if self._last_commit is not None and self._last_commit[0] == generation:
            measured = at - self._last_commit[1]
            metrics["train/step_time_s"] = measured
            metrics["train/tokens_per_s"] = training.global_batch_size * self.config.model.seq_length / measured
        self._last_commit = generation, at
        run.log(metrics)


def _add_row(table, record: dict, columns: tuple[str, ...]) -> None:
    """``record`` as a row of ``table``: lists as text, the alternatives as JSON, a field
    the record lacks (a join Eq. 8 declined has no timings) as None."""
    row = {**record, "alternatives": json.dumps(record.get("alternatives", []))}
    table.add_data(*[str(row[c]) if isinstance(row.get(c), list) else row.get(c) for c in columns])
