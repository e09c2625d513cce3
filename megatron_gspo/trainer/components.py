"""The trainer's components, one builder each: ``Trainer._build`` is a list of assignments of these.

Each builder takes what it needs explicitly (the config, the parallel state, the components built before
it) and returns its component; none keeps state of its own. The order is the trainer's: the process
groups, the data, the checkpoint decision, the models, the routing policy, the evaluator.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from megatron_gspo.runtime import parallel
from megatron_gspo.algorithms.rollout_correction import inactive_reason
from megatron_gspo.checkpoint import CheckpointManager
from megatron_gspo.config import JobConfig, to_dict
from megatron_gspo.errors import ConfigError
from megatron_gspo.runtime.writable import check_writable
from megatron_gspo.data.job_data import build_job_data
from megatron_gspo.runtime.stop import Cancelled
from megatron_gspo.trainer.evaluation import Evaluator
from megatron_gspo.trainer.stopping import start_up_cut_short
from megatron_gspo.model.gpt import (build_model, impl_reason, job_precision, model_summary, release_ddp, resolve_impl,
                                     wrap_ddp)
from megatron_gspo.model.oom import check_model_fits, explain_oom, model_shapes
from megatron_gspo.routing import RoutingPolicy
from megatron_gspo.data.tokenizer import build_tokenizer, check_vocab_fits

log = logging.getLogger("megatron_gspo")


def resolve_precision(cfg: JobConfig, st) -> JobConfig:
    """The config with the numerics this device runs fast (model.precision=auto), decided once: everything
    built after it reads it."""
    precision, why = job_precision(cfg.model, st.device)
    if precision != cfg.model.precision:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, precision=precision))
    log.info("numerics: %s on %s (%s); %s spec (%s)", precision, st.device, why,
             resolve_impl(cfg.model, st.device), impl_reason(cfg.model, st.device))
    return cfg


def open_bridge(side, device) -> None:
    """An async job's bridge to the rollout ranks (collective with them); nothing for a colocated job."""
    if side is not None:
        side.open_bridge(device)


def build_data(cfg: JobConfig, st, stop):
    """(tokenizer, training prompt sampler, the evaluation's prompts or None), checked (data/job_data.py). A stop
    signal while examples are made ends start-up at once: StoppedFor, exit 79 (trainer/stopping.py)."""
    tokenizer = build_tokenizer(cfg.tokenizer)
    check_vocab_fits(tokenizer, cfg.model.vocab_size)
    try:
        data = build_job_data(cfg, tokenizer, should_stop=lambda: stop.set, write_cache=st.local_rank == 0,
                              main=st.is_main)
    except Cancelled as e:
        raise start_up_cut_short(stop, e) from None
    return tokenizer, data.sampler, data.held


def check_outputs(cfg: JobConfig, st) -> None:
    """Every place the job writes, writable now (runtime/writable.py), before anything is built: checkpoint.save
    on every rank (each writes its own files), train.output_dir (metrics.jsonl, tensorboard/) and
    train.wandb_save_dir on the rank that logs. ConfigError naming the key and the cause."""
    ck, out = cfg.checkpoint.save, cfg.train.output_dir
    if ck:
        check_writable(ck, f"checkpoint.save={ck}", error=ConfigError)
    if st.is_main:
        check_writable(out, f"train.output_dir={out}", error=ConfigError)
        check_writable(os.path.join(out, "metrics.jsonl"), f"train.output_dir={out}", directory=False, error=ConfigError)
        if "tensorboard" in cfg.train.trackers:
            check_writable(os.path.join(out, "tensorboard"), f"train.output_dir={out}", error=ConfigError)
        if "wandb" in cfg.train.trackers and cfg.train.wandb_save_dir:
            check_writable(cfg.train.wandb_save_dir, f"train.wandb_save_dir={cfg.train.wandb_save_dir}",
                           error=ConfigError)


def build_checkpoints(cfg: JobConfig, st) -> CheckpointManager:
    """The resume decision and checkpoint.save's lock (checkpoint/lock.py; given back by release_process_state)."""
    checkpoints = CheckpointManager(cfg.checkpoint, st, num_steps=cfg.train.num_steps)
    try:
        checkpoints.check_config(to_dict(cfg))  # a resume refuses a trajectory-changing config change
    except BaseException:
        checkpoints.close()
        raise
    return checkpoints


def build_models(cfg: JobConfig, st, checkpoints: CheckpointManager):
    """(model, ref_model or None, ddp): the policy (checkpoint.load applied), the KL reference, DDP's wrap."""
    t = cfg.train
    # a model that cannot fit this rank's memory is refused now, not after minutes of building (on
    # the CPU a memory cgroup would SIGKILL it, with nothing said); what does not fit later, each
    # phase names (oom.explain_oom)
    check_model_fits(cfg, st)
    with explain_oom("model", cfg, st, model_shapes(cfg)):
        model = build_model(cfg.model, cfg.parallel, st, routing_replay=t.routing_replay != "off",
                            deterministic=t.deterministic)
        # The KL reference is the initial policy: a frozen copy taken after checkpoint.load and the
        # SFT warm start (in run()), saved in every checkpoint so a resumed run keeps it.
        ref_model = None
        if cfg.loss.kl_coef > 0:
            ref_model = build_model(cfg.model, cfg.parallel, st, deterministic=t.deterministic).eval().requires_grad_(False)
        checkpoints.prepare(model)  # refuse a wrong-shape resume, or load checkpoint.load
        ddp = wrap_ddp(model, st)
    return model, ref_model, ddp


def build_routing(cfg: JobConfig, st, ddp, recompute: bool) -> RoutingPolicy:
    routing = RoutingPolicy(cfg.train.routing_replay, ddp, st, old_pass=recompute)
    if (inactive := inactive_reason(cfg.rollout_correction.mode, recompute)) and st.is_main:
        log.warning("%s", inactive)  # legal (a no-op, bit for bit) but not what a run asking for correction expects
    return routing


def generation_config(cfg: JobConfig, tokenizer):
    """The generation section with the tokenizer's stop and pad ids filled in."""
    g = cfg.generation
    return dataclasses.replace(g, stop_token_ids=g.stop_token_ids or list(tokenizer.eos_ids),
                               pad_token_id=g.pad_token_id if g.pad_token_id is not None else tokenizer.pad_id)


def build_evaluator(cfg: JobConfig, st, ddp, tokenizer, reward_fn, gen_cfg, held, source):
    """The evaluation every eval.interval steps on ``held`` (build_data's prompts), or None. It shares the
    rollout ``source``'s generator and multi-turn rollout where the source generates on this model (colocated:
    one KV cache, one set of CUDA graphs, one environment worker pool for the job); the remote source has none."""
    e = cfg.eval
    if e.interval <= 0 or held is None:
        return None
    evaluator = Evaluator(cfg, st, ddp, tokenizer, reward_fn, gen_cfg, held.prompts,
                          length_policy=(held.num_dropped, held.num_truncated),
                          generator=getattr(source, "generator", None), multiturn=getattr(source, "multiturn", None))
    log.info("evaluation: %s every %d steps", held.describe(), e.interval)
    return evaluator


def log_setup(cfg: JobConfig, st, recompute: bool, why: str) -> None:
    """The start-up lines: model, layout, optimizer, the old log-probs' source."""
    log.info("model: %s", model_summary(cfg.model, st.device))
    log.info("layout: world %d = TP %d x PP %d x DP %d (EP %d, ETP %d, SP %s) on %s", st.world_size, st.tp, st.pp,
             st.dp, st.ep, st.etp, st.sequence_parallel, st.device)
    log.info("optimizer: %s", st.optimizer_layout())
    log.info("old log-probs: %s (%s)%s", "recomputed by the training model" if recompute else "the rollout's",
             why, "; deterministic mode on" if cfg.train.deterministic else "")


def release_process_state(trainer) -> None:
    """Give back what ``trainer`` set process-wide: checkpoint.save's lock, the rollout ranks of an async job
    follow it out, DDP's gradient hooks are removed (model.release_ddp: else the model and its process groups'
    threads outlive the job), megatron's per-model globals are reset, deterministic mode is undone. Each once (a second
    call is a no-op for the lock, the side and determinism)."""
    if getattr(trainer, "checkpoints", None) is not None:  # checkpoint.save's lock, on every way out
        trainer.checkpoints.close()
    if trainer.side is not None:  # the rollout ranks follow the trainer out
        trainer.side.close(stop="the trainer ended")
        trainer.side = None
    if getattr(trainer, "ddp", None) is not None:  # the model and its process groups freed with the trainer
        release_ddp(trainer.ddp)
    parallel.reset_megatron_globals()
    if trainer._restore_determinism is not None:
        trainer._restore_determinism()
        trainer._restore_determinism = None
