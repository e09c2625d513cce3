"""Distributed setup: torch.distributed from torchrun's environment, megatron-core's parallel
groups for TP / PP / EP / expert-TP / DP, layout validation and seeding.

megatron-core keeps its process groups in module globals; we initialize them once here and hand
the rest of the package an explicit ``ParallelState`` (sizes, ranks and the
``ProcessGroupCollection``) so no other module reaches into ``parallel_state`` itself.

The parallel state also owns the three decisions every other module must agree on:

* ``device``: where every tensor that meets the model or a collective is created (the local CUDA
  device with NCCL, the CPU with gloo). See comm.py for the check at every collective.
* ``use_distributed_optimizer``: whether DDP reduce-scatters gradients and the optimizer shards its
  state over data-parallel ranks. DDP, the RL optimizer and the SFT optimizer all read this one field:
  a DDP told "distributed" (reduce-scatter: each rank holds correct gradients for its shard only)
  next to a replicated optimizer (which steps every parameter with those gradients) trains replicas
  that drift apart.
* ``lockstep_group``: the ranks that must run every model forward together, with the same shapes
  (``lockstep_group_of`` below). Generation, the multi-turn loop, evaluation and the micro-batch
  plan all read this one field.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.runtime import compat
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


def lockstep_group_of(tp: int, n_expert: int, pg):
    """The group whose ranks must run every forward together, or None (no collective in a forward).

    Two kinds of collectives run inside a forward of a sharded model: the dense tensor-parallel
    group's (``pg.tp``: TP ranks holding the same rows) and the MoE layers' token dispatch over the
    expert group (``pg.tp_ep``: expert-TP x EP = ``n_expert`` ranks, megatron's token dispatchers'
    domain), whose ranks hold *different* rows under EP or expert-TP (they are data-parallel ranks
    of the dense layers). A collective needs every rank of its group at the same call with the same
    shapes, so the ranks connected through either kind of group must run the same forwards on
    batches of one shape: the smallest set of ranks closed under both. megatron lays both groups out
    as aligned blocks of consecutive ranks (tensor-parallel ranks fastest, in the dense and in the
    expert rank order), so that set is the TP group when the expert group's size divides TP, the
    expert group when TP divides its size, and otherwise (sizes that do not divide: a layout megatron
    allows but nobody runs) the whole world, which is always a superset. The choice depends on the
    sizes only, so every rank makes the same one; each rank checks its own groups against it. Under
    expert-TP alone (TP 1, EP 1, expert-TP 2) the expert group is two data-parallel ranks: they step
    together although no EP is set."""
    if n_expert == 1:
        return pg.tp if tp > 1 else None
    if n_expert % tp == 0:
        group, inner = pg.tp_ep, pg.tp
    elif tp % n_expert == 0:
        group, inner = pg.tp, pg.tp_ep
    else:
        return dist.group.WORLD
    ranks = lambda g: dist.get_process_group_ranks(g)  # noqa: E731
    if not set(ranks(inner)) <= set(ranks(group)):
        raise RuntimeError(f"parallel: this rank's groups are not nested as megatron lays them out (TP ranks "
                           f"{ranks(pg.tp)}, expert-TP x EP ranks {ranks(pg.tp_ep)}); the ranks that must "
                           f"run every forward together cannot be chosen")
    return group


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
    # answers of one-off collective probes of megatron's behaviour, keyed per group (model.py); they
    # live and die with this state's groups
    probes: dict = field(default_factory=dict)
    # the ranks that run every forward together (lockstep_group_of; None: no collective in a forward)
    lockstep_group: Optional[object] = None

    @property
    def lockstep_over_dp(self) -> bool:
        """Whether the lockstep group holds ranks with rows of their own (data-parallel ranks joined by the
        expert group: EP or expert-TP), not only TP ranks holding the same rows. Such ranks agree on every
        shape they run (micro-batch plans, generation batches) and a rank without rows still steps."""
        return self.lockstep_group is not None and dist.get_world_size(self.lockstep_group) > self.tp

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
        why = distributed_optimizer_support(self.device)
        return (f"replicated optimizer: gradients all-reduced over DP={self.dp} ranks, full Adam states on every "
                f"rank" + (f" (distributed optimizer unavailable: {why})" if why else ""))


def distributed_optimizer_support(device: torch.device) -> Optional[str]:
    """None if megatron's DistributedOptimizer can train *and checkpoint* a job on ``device``, else why not.

    It trains anywhere (on the CPU through compat.optimizer_context()), but megatron-core 0.16
    reloads its state only from a fused Adam (Transformer Engine's or apex's): with torch's AdamW
    (what megatron falls back to without them) the per-parameter "step" state breaks every load
    (KeyError 'step' in DistributedOptimizer._set_main_param_and_optimizer_states), so a run could
    save checkpoints it can never resume."""
    if torch.device(device).type != "cuda":
        return "the job runs on the CPU (megatron's fused Adam, which its distributed-optimizer checkpoints need, is CUDA-only)"
    from megatron.core.optimizer import distrib_optimizer

    if not distrib_optimizer.HAVE_APEX_OR_TE:
        return "neither Transformer Engine nor apex is installed (megatron then uses torch's AdamW, whose state its distributed-optimizer checkpoints cannot reload)"
    return None


def resolve_distributed_optimizer(par: ParallelConfig, device: torch.device) -> bool:
    """The one optimizer-layout decision: ``parallel.use_distributed_optimizer`` (None = where supported)."""
    why_not = distributed_optimizer_support(device)
    if par.use_distributed_optimizer and why_not:
        raise ConfigError(f"parallel.use_distributed_optimizer=true is not possible here: {why_not}; set it to "
                          "false or leave it unset (the replicated optimizer is used then)")
    return why_not is None if par.use_distributed_optimizer is None else bool(par.use_distributed_optimizer)


def resolve_device(par: ParallelConfig, local_rank: Optional[int] = None) -> torch.device:
    """The one device decision of a job: ``parallel.device`` on this machine, for this local rank.

    "auto": cuda:LOCAL_RANK when CUDA is available (a rank without a GPU of its own is refused),
    else the CPU. Every other module reads the result from ``ParallelState.device``."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    if par.device == "cpu" or (par.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("parallel.device=cuda but CUDA is not available on this machine "
                          f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use auto or cpu")
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise ConfigError(f"local rank {local_rank} has no GPU: this node has {n} visible GPU(s) "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most "
                          f"{n} processes per node, or run on the CPU with parallel.device=cpu")
    return torch.device("cuda", local_rank)


def init_distributed(device: torch.device, timeout_minutes: float = 10.0, side=None) -> None:
    """Initialize torch.distributed from torchrun's env vars (RANK, WORLD_SIZE, MASTER_ADDR, ...) with
    the backend ``device`` needs: NCCL for a CUDA device, gloo for the CPU.

    Without torchrun a single-process group is created, since megatron-core needs one even for
    one rank. ``side`` (rollout.side.Side): the default world is that side's ranks only (an
    asynchronous job's trainer or rollout ranks), on torchrun's store under the side's prefix.
    """
    if dist.is_initialized():
        backend = dist.get_backend()
        if (backend == "nccl") != (device.type == "cuda"):
            raise ConfigError(f"torch.distributed is already initialized with {backend}, which cannot serve a job "
                              f"on {device}; set parallel.device to match it")
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if side is not None:
        dist.init_process_group(backend=backend, store=side.world_store(), rank=side.rank, world_size=side.size,
                                timeout=timeout)
        return
    if "RANK" not in os.environ:
        # One process, no torchrun: an in-process store and no TCP port at all. os.environ stays
        # untouched: exported RANK/MASTER_PORT would be inherited by child processes (a test's
        # subprocess trainer then tried to bind this process's store port: EADDRINUSE in CI).
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def initialize(model: ModelConfig, par: ParallelConfig, side=None) -> ParallelState:
    """Set up torch.distributed and megatron-core's parallel groups for this layout. ``side``: one side of
    an asynchronous job (rollout.side.join), whose ranks alone are then the world."""
    from megatron.core import parallel_state as mps
    from megatron.core.process_groups_config import ProcessGroupCollection

    # Validate against the environment first: a bad layout must fail before any collective.
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    if side is not None:
        world = side.size
    validate_layout(model, par, world)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(par, local_rank)
    use_distributed_optimizer = resolve_distributed_optimizer(par, device)
    compat.apply(device)
    init_distributed(device, par.distributed_timeout_minutes, side=side)
    world = dist.get_world_size()
    dp = validate_layout(model, par, world)
    reset_megatron_globals()
    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    mps.initialize_model_parallel(
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        expert_model_parallel_size=par.expert_model_parallel_size,
        expert_tensor_parallel_size=par.etp,
        distributed_timeout_minutes=int(max(1, par.distributed_timeout_minutes)),
        # gloo twins of the NCCL groups (megatron's CPU-side collectives) only where NCCL is the backend
        create_gloo_process_groups=device.type == "cuda",
    )
    state = ParallelState(
        world_size=world, rank=dist.get_rank(), local_rank=local_rank,
        tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
        ep=par.expert_model_parallel_size, etp=par.etp, dp=dp, sequence_parallel=par.sp,
        pg=ProcessGroupCollection.use_mpu_process_groups(), device=device,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    state.lockstep_group = lockstep_group_of(state.tp, state.ep * state.etp, state.pg)
    set_seed(par.seed, state)
    return state


def set_seed(seed: int, state: Optional[ParallelState] = None) -> None:
    """Seed Python, numpy and torch. Pipeline stages get distinct seeds (as in Megatron-LM);
    on a CUDA device megatron's tracker adds the TP / EP model-parallel RNG streams."""
    s = seed + (100 * state.pp_rank if state is not None else 0)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    if state is not None and state.device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(s)


def reset_megatron_globals() -> None:
    """Forget what a previous job left in megatron-core's process-wide state (a process that runs
    several jobs: the preflight, tests, notebooks, experiments):

    * the MoE aux-loss logging tracker: sized by the first model's layer count and kept on its
      device (a deeper model then failed with IndexError in save_to_aux_losses_tracker);
    * RouterReplay's class-level instance list and action (a rebuilt model's routers append to it);
    * MoEAuxLossAutoScaler's loss scale (a tensor on the previous job's device: set_loss_scale copies
      into it);
    * RotaryEmbedding.forward's lru_cache, keyed by the module: it kept the last 32 jobs' rotary modules,
      and with them their context-parallel group and its gloo threads, alive.
    The parallel groups and megatron's global memory buffer go with ``destroy`` / ``initialize``
    (destroy_model_parallel), the RNG tracker with ``compat.apply``."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router_replay import RouterReplay

    compat.reset_moe_metrics_tracker()
    RouterReplay.clear_global_router_replay_instances()
    RouterReplay.clear_global_router_replay_action()
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if hasattr(RotaryEmbedding.forward, "cache_clear"):
        RotaryEmbedding.forward.cache_clear()


def destroy(keep_world: bool = False) -> None:
    """Tear down megatron's groups and torch.distributed, and what a job left in megatron's globals
    (tests and re-initialization). ``keep_world``: torch.distributed's default group stays up for the next
    job of these same ranks (several jobs in one torchrun; its rendezvous cannot be done twice)."""
    from megatron.core import parallel_state as mps

    reset_megatron_globals()
    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    if dist.is_initialized() and not keep_world:
        dist.destroy_process_group()
    compat.restore()  # the CPU workarounds parallel.initialize applied (compat.apply)
