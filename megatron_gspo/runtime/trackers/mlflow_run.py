"""train.loggers: mlflow, an MLflow run (imported only when named)."""

from __future__ import annotations

import re
import time
from urllib.parse import urlparse
from typing import Mapping, Optional

import torch

from megatron_gspo.runtime.trackers.base import Tracker

# MLflow's limits of one log_batch call and of a parameter's value (mlflow.utils.validation)
MAX_PARAMS_PER_BATCH, MAX_METRICS_PER_BATCH, MAX_PARAM_VALUE = 100, 1000, 6000


def metric_name(key: str, file_store: bool = False) -> str:
    """``key`` as MLflow accepts it: letters, digits, _ - . / and space (on every OS); any other character
    becomes "_" (eval/pass@4 -> eval/pass_4). ``file_store``: MLflow's file store (a file: URI or a path) keeps
    each metric in a file of that path, so a key cannot also be another's folder (routing/aux_loss beside
    routing/aux_loss/layer_0): there "/" becomes "." (routing.aux_loss, routing.aux_loss.layer_0)."""
    name = re.sub(r"[^\w./\- ]", "_", key)
    return name.replace("/", ".") if file_store else name


def is_file_store(tracking_uri: str) -> bool:
    """The tracking URI (resolved) names MLflow's file store."""
    return urlparse(tracking_uri).scheme in ("", "file")


class MlflowTracker(Tracker):
    """``train.mlflow_*``: the tracking URI (None: MLflow's default, $MLFLOW_TRACKING_URI), the experiment
    (created when missing) and the run's name. ``config``: the job, flattened, logged as the run's parameters
    when it is created (MLflow's parameters cannot change; a resumed run keeps them). ``resume``: the run the
    checkpoint names ({"run_id": ...}), continued."""

    name = "mlflow"

    def __init__(self, tracking_uri: Optional[str], experiment: str, run_name: Optional[str], config: dict,
                 resume: Optional[dict] = None) -> None:
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.config, self.resume = config, resume
        self.client = self.run_id = None
        self.file_store = False

    def start(self, first_step: int) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # the client, not mlflow's fluent API: no process-wide active run (a host program may have one)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.file_store = is_file_store(self.client.tracking_uri)
        if self.resume:
            self.run_id = self.resume["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        exp = self.client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id
        params = [Param(k, str(v)[:MAX_PARAM_VALUE]) for k, v in self.config.items()]
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_PER_BATCH])

    def log(self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, torch.Tensor]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_name(k, self.file_store), x, now, step) for k, x in scalars.items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])

    def run(self) -> Optional[dict]:
        return {"run_id": self.run_id}

    def close(self) -> None:
        if self.run_id is not None:
            run_id, self.run_id = self.run_id, None
            self.client.set_terminated(run_id)
