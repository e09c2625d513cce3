"""Optimizer and learning-rate schedule: megatron-core's optimizer and OptimizerParamScheduler.

Whether the optimizer is megatron's DistributedOptimizer (Adam states sharded over data-parallel
ranks, gradients reduce-scattered by DDP) is decided once, by ``ParallelState.use_distributed_optimizer``,
and read from there by DDP (model.wrap_ddp) and by every optimizer built here (RL and SFT): the
two must agree or replicas drift apart. On a CPU machine megatron's hard-coded CUDA tensors are
redirected by compat.optimizer_context(), which is what lets both layouts run there too.
"""

from __future__ import annotations

import logging
import os

import torch

from megatron_gspo.runtime import compat
from megatron_gspo.config import JobConfig, OptimizerConfig
from megatron_gspo.model.oom import explain_oom, model_shapes

log = logging.getLogger("megatron_gspo")


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


def nonfinite_grads(ddp) -> torch.Tensor:
    """A 0-dim bool on the gradients' device: some gradient is NaN or Inf. One min/max reduction per
    DDP gradient buffer (the main grads are views into them; NaN propagates through min and max), so
    no per-parameter host sync and no temporary the size of the gradients."""
    bufs = [b.grad_data for b in getattr(ddp, "buffers", []) + getattr(ddp, "expert_parallel_buffers", [])]
    if not bufs:
        bufs = [p.main_grad for p in ddp.parameters() if getattr(p, "main_grad", None) is not None]
    if not bufs:
        return torch.zeros((), dtype=torch.bool, device=next(ddp.parameters()).device)
    return torch.stack([torch.stack(torch.aminmax(g)) for g in bufs]).isfinite().all().logical_not()


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


def extra_checkpoint_models(ref_model) -> dict:
    """The models a training checkpoint holds beside the policy, by the name it saves and restores them under."""
    return {"ref_model": ref_model} if ref_model is not None else {}


def setup_optimizer(cfg: JobConfig, state, ddp, checkpoints, sampler, ref_model, step: int, during_save=None,
                    skips=None):
    """The RL optimizer and LR schedule of ``ddp``, built after the SFT warm start; when ``checkpoints`` is
    resuming a training checkpoint, restored with everything it holds (weights, Adam states, schedule, the
    KL reference ``ref_model`` if any, the ``sampler``'s data position, the count of skipped updates
    ``skips``: trainer.skips.SkipCount, or None); then the same state is handed to
    ``checkpoints`` for every later save (CheckpointManager.track; ``during_save(tmp_dir)`` runs inside
    each), so what a checkpoint restores and what it saves are named in one place. Returns (optimizer,
    scheduler, the step to continue after: ``step`` unless restored)."""
    with explain_oom("model", cfg, state, model_shapes(cfg)):  # bf16: the fp32 master copy
        optimizer = build_optimizer(cfg.optimizer, ddp, state, cfg.model.precision == "bf16")
    scheduler = build_scheduler(cfg.optimizer, optimizer, cfg.train.num_steps * cfg.train.num_minibatches)
    if checkpoints.resuming:
        with explain_oom("model", cfg, state, model_shapes(cfg) + ", restored from a checkpoint"):
            info = checkpoints.restore(ddp, optimizer, scheduler,
                                       extra_models=extra_checkpoint_models(ref_model))
        step = info["step"]
        sampler.load_state_dict(info["extra"]["data"], accept=checkpoints.change_allowed)
        if skips is not None:
            skips.load_state_dict(info["extra"].get("skips"))
        skipped = "; ".join(os.path.basename(p) for p, _ in checkpoints.skipped)
        log.info("resumed from %s at step %d%s", info["path"], step,
                 f" (newer, damaged: {skipped}; the steps after {step} are trained again)" if skipped else "")
    checkpoints.track(ddp, optimizer, scheduler, job=cfg, data=sampler, extra_models=extra_checkpoint_models(ref_model),
                      during_save=during_save, skips=skips)
    return optimizer, scheduler, step
