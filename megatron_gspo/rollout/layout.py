"""Which rank does what in an asynchronous job, and whether the config fits the world size.

One torchrun world of N ranks is split in two: global ranks 0 .. N-R-1 train (their layout is
``parallel.*``), the last R = ``rollout.world_size`` generate (their layout is ``rollout.*``). Each
side is a torch.distributed world of its own (rollout.side): megatron-core's parallel groups,
dist_checkpointing and every collective of the package run over one side's ranks, exactly as in a
colocated job of that size, and the two sides talk over a separate bridge (see side.py).

``check_world`` is the one function that validates a config against a world size for the split (the
trainer and the rollout worker call it before anything is built; a launcher's dry run can too).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from megatron_gspo.config import ConfigError, JobConfig, ParallelConfig

TRAINER, ROLLOUT = "trainer", "rollout"


@dataclass(frozen=True)
class RankSplit:
    """The split of a world of ``world_size`` ranks (global torchrun ranks)."""

    world_size: int
    trainer_size: int
    rollout_size: int
    trainer_dp: int
    rollout_dp: int
    rollout_tp: int

    def role(self, rank: int) -> str:
        return TRAINER if rank < self.trainer_size else ROLLOUT

    def side_rank(self, rank: int) -> int:
        """A global rank's rank in its side's world."""
        return rank if rank < self.trainer_size else rank - self.trainer_size

    @property
    def rollout_leaders(self) -> list[int]:
        """Rollout-world ranks that send rows to the trainer: TP rank 0 of each rollout DP rank (megatron
        orders ranks TP-innermost), in rollout DP-rank order."""
        return [d * self.rollout_tp for d in range(self.rollout_dp)]


def rollout_parallel_config(cfg: JobConfig) -> ParallelConfig:
    """The rollout ranks' ParallelConfig: the job's, with the rollout section's TP / EP / expert TP."""
    r = cfg.rollout
    return dataclasses.replace(cfg.parallel, tensor_model_parallel_size=r.tensor_model_parallel_size,
                               expert_model_parallel_size=r.expert_model_parallel_size,
                               expert_tensor_parallel_size=r.expert_tensor_parallel_size,
                               sequence_parallel=None, use_distributed_optimizer=False)


def check_world(cfg: JobConfig, world_size: int) -> RankSplit:
    """Refuse an async job that cannot run on ``world_size`` ranks (messages name the keys); returns the split.

    Both sides' layouts are validated as a job of their own size would be (parallel.validate_layout),
    and the rollout rows must split evenly over the rollout ranks' data-parallel groups."""
    from megatron_gspo.runtime.parallel import validate_layout

    r = cfg.rollout
    if not r.is_async:
        raise ValueError("check_world: rollout.mode is not async")
    if world_size <= r.world_size:
        raise ConfigError(f"rollout.mode=async with rollout.world_size={r.world_size} needs more ranks than that "
                          f"(the trainer gets the rest), but the job has {world_size} (WORLD_SIZE); launch "
                          f"rollout.world_size + the trainer's ranks with torchrun")
    trainer = world_size - r.world_size
    try:
        trainer_dp = validate_layout(cfg.model, cfg.parallel, trainer)
    except ConfigError as e:
        raise ConfigError(f"{e} (the trainer's ranks: WORLD_SIZE {world_size} - rollout.world_size {r.world_size} "
                          f"= {trainer})") from None
    try:
        rollout_dp = validate_layout(cfg.model, rollout_parallel_config(cfg), r.world_size)
    except ConfigError as e:
        msg = str(e).replace("tensor_model_parallel_size", "rollout.tensor_model_parallel_size").replace(
            "expert_model_parallel_size", "rollout.expert_model_parallel_size").replace(
            "expert_tensor_parallel_size", "rollout.expert_tensor_parallel_size")
        raise ConfigError(f"{msg} (the rollout ranks: rollout.world_size={r.world_size})") from None
    rows = cfg.train.prompts_per_step * cfg.generation.n_samples_per_prompt
    if rows % rollout_dp:
        raise ConfigError(f"train.prompts_per_step x generation.n_samples_per_prompt = {rows} rollout rows are not "
                          f"divisible by the rollout ranks' data-parallel size {rollout_dp} (rollout.world_size="
                          f"{r.world_size} / rollout.tensor_model_parallel_size={r.tensor_model_parallel_size})")
    return RankSplit(world_size=world_size, trainer_size=trainer, rollout_size=r.world_size, trainer_dp=trainer_dp,
                     rollout_dp=rollout_dp, rollout_tp=r.tensor_model_parallel_size)


def role_of(cfg: JobConfig) -> str:
    """This process's role from torchrun's RANK / WORLD_SIZE (no communication): "trainer" or "rollout"."""
    if not cfg.rollout.is_async:
        return TRAINER
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return check_world(cfg, world).role(rank)
