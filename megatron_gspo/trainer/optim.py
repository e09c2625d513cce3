"""Optimizer and learning-rate schedule: megatron-core's optimizer and OptimizerParamScheduler.

Whether the optimizer is megatron's DistributedOptimizer (Adam states sharded over data-parallel
ranks, gradients reduce-scattered by DDP) is decided once, by ``ParallelState.use_distributed_optimizer``,
and read from there by DDP (model.wrap_ddp) and by every optimizer built here (RL and SFT): the
two must agree or replicas drift apart. On a CPU machine megatron's hard-coded CUDA tensors are
redirected by compat.optimizer_context(), which is what lets both layouts run there too.
"""

from __future__ import annotations

import torch

from megatron_gspo.runtime import compat
from megatron_gspo.config import OptimizerConfig


def build_optimizer(cfg: OptimizerConfig, ddp_model, state, bf16: bool):
    """megatron's optimizer for ``ddp_model``, laid out as ``state.use_distributed_optimizer`` says
    (the same decision ``model.wrap_ddp`` made for the gradient reduction)."""
    from megatron.core.optimizer import OptimizerConfig as MOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    mcfg = MOptimizerConfig(
        optimizer=cfg.optimizer, lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=state.use_distributed_optimizer,
    )
    if ddp_model.ddp_config.use_distributed_optimizer != state.use_distributed_optimizer:
        raise RuntimeError("the DDP wrapper and the optimizer disagree on use_distributed_optimizer; wrap the "
                           "model with model.wrap_ddp(model, state), which reads the same ParallelState field")
    with compat.optimizer_context(state.device):
        return get_megatron_optimizer(mcfg, [ddp_model], use_gloo_process_groups=False, pg_collection=state.pg)


def optimizer_step(optimizer, device: torch.device) -> tuple[bool, float]:
    """One step (grad clipping included) of a job on ``device``. Returns (update applied, global grad norm)."""
    with compat.optimizer_context(device):
        ok, grad_norm, _ = optimizer.step()
    return bool(ok), float(grad_norm if grad_norm is not None else 0.0)


def build_scheduler(cfg: OptimizerConfig, optimizer, total_steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = cfg.lr_decay_steps if cfg.lr_decay_steps is not None else max(1, total_steps)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_steps > 0 else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=max(decay, cfg.lr_warmup_steps + 1),
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=max(1, total_steps), wd_incr_style="constant",
    )
