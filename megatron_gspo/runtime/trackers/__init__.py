"""Run trackers: where a step's scalars go besides metrics.jsonl (``train.loggers``), rank 0 only.

    base.py         Tracker (the interface: start, log, run, close) and Trackers (the set; one that fails
                    is said in one line and dropped, training goes on)
    tensorboard.py  {train.output_dir}/tensorboard/
    wandb_run.py    Weights & Biases (``train.wandb_*``)
    mlflow_run.py   MLflow (``train.mlflow_*``)

wandb and mlflow are imported when a run starts, only when named. Each gets the scalars TensorBoard gets, at
the same steps; the job's config, flattened, once, when its run is created; and a resumed job continues the
run its checkpoint names (logger_runs.json in the checkpoint: checkpoint/training.py)."""

from __future__ import annotations

import importlib.util
from typing import Optional

from megatron_gspo.errors import ConfigError
from megatron_gspo.runtime.trackers.base import Tracker, Trackers

# the module each imports, and what to install (mlflow-skinny brings the same module, without the server)
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}

__all__ = ["Tracker", "Trackers", "build_trackers", "check_installed", "flat_config"]


def check_installed(names: list[str]) -> None:
    """Start-up: every tracker named is importable, else ConfigError naming the key and the pip line."""
    for name in names:
        module = PACKAGES.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"train.loggers names {name}, which is not installed here: pip install {module}")


def flat_config(job: dict) -> dict:
    """The job (config.to_dict) as {"section.key": value}: what wandb's config and MLflow's parameters hold."""
    out = {}

    def walk(prefix: str, d: dict) -> None:
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                walk(key, v)
            else:
                out[key] = v

    walk("", job)
    return out


def build_trackers(train, output_dir: str, job: dict, runs: Optional[dict] = None) -> list[Tracker]:
    """The trackers of ``train.trackers`` (TrainConfig), unstarted. ``job``: the config (config.to_dict), recorded
    by a new run; ``runs``: {name: run} of the checkpoint a resumed job continues (those runs go on)."""
    from megatron_gspo.runtime.trackers.mlflow_run import MlflowTracker
    from megatron_gspo.runtime.trackers.tensorboard import TensorBoardTracker
    from megatron_gspo.runtime.trackers.wandb_run import WandbTracker

    runs = runs or {}
    flat = flat_config(job)
    made: list[Tracker] = []
    for name in train.trackers:
        if name == "tensorboard":
            made.append(TensorBoardTracker(output_dir))
        elif name == "wandb":
            made.append(WandbTracker(train.wandb_project, train.wandb_exp_name, train.wandb_save_dir or output_dir,
                                     train.wandb_entity, flat, runs.get("wandb")))
        elif name == "mlflow":
            made.append(MlflowTracker(train.mlflow_tracking_uri, train.mlflow_experiment, train.mlflow_run_name,
                                      flat, runs.get("mlflow")))
        else:  # the config refuses any other name (config/sections.py: TRACKER_NAMES)
            raise ValueError(f"no tracker named {name!r}")
    return made
