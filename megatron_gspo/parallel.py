"""Distributed setup: torch.distributed from torchrun's environment, megatron-core's parallel
groups for TP / PP / EP / expert-TP / DP, layout validation and seeding.

megatron-core keeps its process groups in module globals; we initialize them once here and hand
the rest of the package an explicit ``ParallelState`` (sizes, ranks and the
``ProcessGroupCollection``) so no other module reaches into ``parallel_state`` itself.

The parallel state also owns the two decisions every other module must agree on:

* ``device``: where every tensor that meets the model or a collective is created (the local CUDA
  device with NCCL, the CPU with gloo). See comm.py for the check at every collective.
* ``use_distributed_optimizer``: whether DDP reduce-scatters gradients and the optimizer shards its
  state over data-parallel ranks. DDP, the RL optimizer and the SFT optimizer all read this one field:
  a DDP told "distributed" (reduce-scatter: each rank holds correct gradients for its shard only)
  next to a replicated optimizer (which steps every parameter with those gradients) trains replicas
  that drift apart.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo import cpu_compat
from megatron_gspo.config import ConfigError, ModelConfig, ParallelConfig


def validate_layout(model: ModelConfig, par: ParallelConfig, world_size: int) -> int:
    """Refuse an impossible layout before anything is built. Returns the data-parallel size."""
    tp, pp, ep, etp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                       par.expert_model_parallel_size, par.etp)

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(f"invalid parallel layout: {msg}")

    need(world_size % (tp * pp) == 0,
         f"world size {world_size} is not a multiple of tensor_model_parallel_size x "
         f"pipeline_model_parallel_size = {tp} x {pp} = {tp * pp}")
    need(world_size % (etp * ep * pp) == 0,
         f"world size {world_size} is not a multiple of expert_tensor_parallel_size x "
         f"expert_model_parallel_size x pipeline_model_parallel_size = {etp} x {ep} x {pp} = {etp * ep * pp}")
    need(model.num_attention_heads % tp == 0,
         f"num_attention_heads={model.num_attention_heads} is not divisible by tensor_model_parallel_size={tp}")
    need(model.num_query_groups % tp == 0,
         f"num_query_groups={model.num_query_groups} (KV heads) is not divisible by tensor_model_parallel_size={tp}")
    need(model.num_moe_experts % ep == 0,
         f"num_moe_experts={model.num_moe_experts} is not divisible by expert_model_parallel_size={ep}")
    need(model.moe_ffn_hidden_size % etp == 0,
         f"moe_ffn_hidden_size={model.moe_ffn_hidden_size} is not divisible by expert_tensor_parallel_size={etp}")
    need(model.padded_vocab_size % tp == 0,
         f"padded vocab size {model.padded_vocab_size} (vocab_size={model.vocab_size} rounded up to "
         f"make_vocab_size_divisible_by={model.make_vocab_size_divisible_by}) is not divisible by "
         f"tensor_model_parallel_size={tp}")
    need(model.num_layers % pp == 0,
         f"num_layers={model.num_layers} is not divisible by pipeline_model_parallel_size={pp}")
    if tp > 1:
        # megatron-core's MoE layer with TP needs the token stream split along the sequence.
        need(par.sp, f"MoE with tensor_model_parallel_size={tp} requires sequence_parallel=true")
    if par.sequence_parallel and tp == 1:
        raise ConfigError("invalid parallel layout: sequence_parallel=true needs tensor_model_parallel_size > 1")
    return world_size // (tp * pp)


@dataclass
class ParallelState:
    """Explicit handle to the parallel layout of this process."""

    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    sequence_parallel: bool
    pg: "object"  # megatron.core.process_groups_config.ProcessGroupCollection
    device: torch.device
    use_distributed_optimizer: bool = False

    @property
    def tp_group(self):
        return self.pg.tp

    @property
    def dp_group(self):
        return self.pg.dp

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.pg.tp)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.pg.dp)

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.pg.ep)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pg.pp)

    @property
    def expt_dp_group(self):
        """Data-parallel group of the expert parameters (replicas of the same experts)."""
        return self.pg.expt_dp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def optimizer_layout(self) -> str:
        """One line for the log: how gradients and optimizer state are laid out over DP."""
        if self.use_distributed_optimizer:
            return (f"distributed optimizer: gradients reduce-scattered and Adam states sharded over "
                    f"DP={self.dp} ranks (megatron DistributedOptimizer)")
        why = distributed_optimizer_support()
        return (f"replicated optimizer: gradients all-reduced over DP={self.dp} ranks, full Adam states on every "
                f"rank" + (f" (distributed optimizer unavailable: {why})" if why else ""))


def distributed_optimizer_support() -> Optional[str]:
    """None if megatron's DistributedOptimizer can train *and checkpoint* here, else why not.

    It trains anywhere (on the CPU through cpu_compat.optimizer_context()), but megatron-core 0.16
    reloads its state only from a fused Adam (Transformer Engine's or apex's): with torch's AdamW
    (what megatron falls back to without them) the per-parameter "step" state breaks every load
    (KeyError 'step' in DistributedOptimizer._set_main_param_and_optimizer_states), so a run could
    save checkpoints it can never resume."""
    if not torch.cuda.is_available():
        return "no CUDA device (megatron's fused Adam, which its distributed-optimizer checkpoints need, is CUDA-only)"
    from megatron.core.optimizer import distrib_optimizer

    if not distrib_optimizer.HAVE_APEX_OR_TE:
        return "neither Transformer Engine nor apex is installed (megatron then uses torch's AdamW, whose state its distributed-optimizer checkpoints cannot reload)"
    return None


def resolve_distributed_optimizer(par: ParallelConfig) -> bool:
    """The one optimizer-layout decision: ``parallel.use_distributed_optimizer`` (None = where supported)."""
    why_not = distributed_optimizer_support()
    if par.use_distributed_optimizer and why_not:
        raise ConfigError(f"parallel.use_distributed_optimizer=true is not possible here: {why_not}; set it to "
                          "false or leave it unset (the replicated optimizer is used then)")
    return why_not is None if par.use_distributed_optimizer is None else bool(par.use_distributed_optimizer)


def init_distributed(timeout_minutes: float = 10.0, backend: Optional[str] = None) -> None:
    """Initialize torch.distributed from torchrun's env vars (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Without torchrun a single-process group is created, since megatron-core needs one even for
    one rank. nccl with CUDA, gloo without.
    """
    if dist.is_initialized():
        return
    cpu_compat.apply()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" not in os.environ:
        # One process, no torchrun: an in-process store and no TCP port at all. os.environ stays
        # untouched: exported RANK/MASTER_PORT would be inherited by child processes (a test's
        # subprocess trainer then tried to bind this process's store port: EADDRINUSE in CI).
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend, timeout=timeout)


def initialize(model: ModelConfig, par: ParallelConfig) -> ParallelState:
    """Set up torch.distributed and megatron-core's parallel groups for this layout."""
    from megatron.core import parallel_state as mps
    from megatron.core.process_groups_config import ProcessGroupCollection

    # Validate against the environment first: a bad layout must fail before any collective.
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    validate_layout(model, par, world)
    resolve_distributed_optimizer(par)
    init_distributed(par.distributed_timeout_minutes)
    world = dist.get_world_size()
    dp = validate_layout(model, par, world)
    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    mps.initialize_model_parallel(
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        expert_model_parallel_size=par.expert_model_parallel_size,
        expert_tensor_parallel_size=par.etp,
        distributed_timeout_minutes=int(max(1, par.distributed_timeout_minutes)),
        create_gloo_process_groups=torch.cuda.is_available(),
    )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    state = ParallelState(
        world_size=world, rank=dist.get_rank(), local_rank=local_rank,
        tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
        ep=par.expert_model_parallel_size, etp=par.etp, dp=dp, sequence_parallel=par.sp,
        pg=ProcessGroupCollection.use_mpu_process_groups(), device=device,
        use_distributed_optimizer=resolve_distributed_optimizer(par),
    )
    set_seed(par.seed, state)
    return state


def set_seed(seed: int, state: Optional[ParallelState] = None) -> None:
    """Seed Python, numpy and torch. Pipeline stages get distinct seeds (as in Megatron-LM);
    on GPU megatron's tracker adds the TP / EP model-parallel RNG streams."""
    s = seed + (100 * state.pp_rank if state is not None else 0)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    if torch.cuda.is_available() and state is not None:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(s)


def destroy() -> None:
    """Tear down megatron's groups and torch.distributed (tests and re-initialization)."""
    from megatron.core import parallel_state as mps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
