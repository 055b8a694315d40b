"""A training run's trace in Weights & Biases, written by node 0 from the run directory's
records once the run has ended: per committed step its loss, plan generation and wall
time since the start; per recovery its times, policy, alternatives and bytes moved (a
table, and the summary). Offline unless ``logger.wandb_project`` is given; the W&B
directory goes into the run directory unless ``logger.wandb_save_dir`` names another."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from odyssey_megatron.config import RecipeConfig
from odyssey_megatron.runtime.control.run_summary import read_jsonl

__all__ = ["RECOVERY_COLUMNS", "log_run_to_wandb"]

RECOVERY_COLUMNS = ("generation", "failed_ranks", "cause", "policy", "start_step", "detection_s", "to_plan_s",
                    "to_first_step_s", "transfer_bytes", "mapping_bytes", "naive_mapping_bytes", "restarts")


def log_run_to_wandb(run_dir: Path, config: RecipeConfig) -> Path:
    """Log the run in ``run_dir`` to a W&B run; returns the W&B run's directory."""
    import wandb

    logger = config.logger
    save_dir = Path(logger.wandb_save_dir) if logger.wandb_save_dir else Path(run_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=logger.wandb_project or "odyssey-megatron", entity=logger.wandb_entity,
                     name=logger.wandb_exp_name or Path(run_dir).name, dir=str(save_dir),
                     mode="online" if logger.wandb_project else "offline", job_type="train",
                     config=OmegaConf.to_container(OmegaConf.structured(config), resolve=True),
                     reinit="finish_previous")
    events = read_jsonl(Path(run_dir) / "events.jsonl")
    started = events[0]["time"] if events else 0.0
    committed_at = {e["step"]: e["time"] for e in events if e["event"] == "step"}
    for row in read_jsonl(Path(run_dir) / "samples.jsonl"):
        run.log({"loss": row["loss"], "generation": row["generation"],
                 "time_s": committed_at.get(row["step"], started) - started}, step=row["step"])
    recoveries = [e for e in events if e["event"] == "recovery"]
    table = wandb.Table(columns=list(RECOVERY_COLUMNS))
    for r in recoveries:
        table.add_data(*[str(r[c]) if isinstance(r[c], list) else r[c] for c in RECOVERY_COLUMNS])
    run.log({"recoveries": table})
    run.summary["recoveries"] = len(recoveries)
    for i, r in enumerate(recoveries):
        for key in ("detection_s", "to_plan_s", "to_first_step_s", "policy"):
            run.summary[f"recovery{i}/{key}"] = r[key]
    directory = Path(run.dir).parent
    run.finish()
    return directory
