"""train.loggers: wandb, a Weights & Biases run (imported only when named)."""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch

from megatron_gspo.runtime.trackers.base import Tracker


class WandbTracker(Tracker):
    """``train.wandb_*``: the project, the run's display name, the directory of wandb's files and the entity.
    ``config``: the job, flattened, recorded when the run is created (a resumed run keeps its own). ``resume``:
    the run the checkpoint names ({"id": ...}); that run is continued (wandb's resume="allow")."""

    name = "wandb"

    def __init__(self, project: str, exp_name: Optional[str], save_dir: str, entity: Optional[str], config: dict,
                 resume: Optional[dict] = None) -> None:
        self.project, self.exp_name, self.save_dir, self.entity = project, exp_name, save_dir, entity
        self.config, self.resume = config, resume
        self.wandb_run = None

    def start(self, first_step: int) -> None:
        import wandb

        os.makedirs(self.save_dir, exist_ok=True)
        run_id = (self.resume or {}).get("id")
        # reinit="create_new": a run of its own, never wandb's global one (a host program may hold that);
        # console="off": the job's log goes to the launcher's stdout already, and wandb's capture would wrap
        # the host program's sys.stdout / sys.stderr
        self.wandb_run = wandb.init(
            project=self.project, entity=self.entity, name=self.exp_name, dir=self.save_dir, id=run_id,
            resume="allow" if run_id else None, config=None if run_id else self.config, reinit="create_new",
            settings=wandb.Settings(console="off"))

    def log(self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, torch.Tensor]) -> None:
        self.wandb_run.log(dict(scalars), step=step)

    def run(self) -> Optional[dict]:
        return {"id": self.wandb_run.id, "project": self.wandb_run.project}

    def close(self) -> None:
        if self.wandb_run is not None:
            run, self.wandb_run = self.wandb_run, None
            run.finish()
