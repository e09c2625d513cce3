"""The GSPO / GRPO trainer: components assembled once, and the RL loop.

A step, top to bottom (``Trainer.run``):
  1. rollout: this rank's share of P prompts x G responses, sampled and scored  (source.collect: a
     rollout.RolloutSource), then group advantages over every rank's rewards, micro-batches, old
     log-probs                                                           (prepare: rollout.BatchPreparer)
  2. num_minibatches optimizer steps over it, each the one-rank, one-micro-batch gradient whatever
     the layout and micro-batch size; per micro-batch forward -> objective -> backward
                                                          (Trainer.train_on, algorithms.objective)
  3. metrics reduced over ranks, logged; a checkpoint every N steps     (logger, checkpoint)

The components, each behind a narrow interface:

    state        parallel.ParallelState      layout, compute device, the optimizer-layout decision
    model / ddp  model.build_model, wrap_ddp the policy; ref_model: the frozen KL reference (or None)
    checkpoints  checkpoint.CheckpointManager the resume decision (verified once) and the saves
    routing      routing.RoutingPolicy        off / R2 / R3 routing replay and routing metrics
    source       rollout.build_source         prompts -> RolloutRecord (colocated, or the async rollout ranks)
    prepare      rollout.BatchPreparer        RolloutRecord -> TrainBatch
    hooks        hooks.Hooks                  SFT warm start, experiments' probes, the tests' fault injection
    stopping     stopping.StopControl         the stop votes, what a stop saves, the stop line
    evaluator    evaluation.Evaluator         held-out greedy accuracy / pass@k every eval.interval steps
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import Iterable

import torch

from megatron_gspo.runtime import comm, determinism, parallel
from megatron_gspo.trainer import components as components
from megatron_gspo.algorithms.advantages import get_advantage_estimator
from megatron_gspo.algorithms.objective import (ObjectiveConfig, bad_sample_ids, loss_units, nonfinite_rows, objective,
                                                warn_off_policy)
from megatron_gspo.algorithms.overlong import empty_minibatch
from megatron_gspo.config import JobConfig, old_logprob_source, to_dict
from megatron_gspo.runtime.exit_status import StoppedFor
from megatron_gspo.runtime.stop import Cancelled, PreemptionFlag
from megatron_gspo.trainer.stopping import StopControl
from megatron_gspo.runtime.hooks import Hooks, TrainerHook
from megatron_gspo.runtime.logger import MetricsLogger, Timer, data_metrics, perf_metrics, progress_line
from megatron_gspo.runtime.trackers import build_trackers, check_installed
from megatron_gspo.runtime.metrics import MetricAccumulator
from megatron_gspo.model.oom import explain_oom, model_shapes
from megatron_gspo.model.gpt import aux_loss_scales, clear_aux_losses_tracker, finalize_grads, forward_logprobs, set_aux_loss_scale
from megatron_gspo.trainer.optim import nonfinite_grads, optimizer_step, setup_optimizer
from megatron_gspo.data.rewards import build_reward
from megatron_gspo.rollout.prepare import BatchPreparer, TrainBatch, rollout_metrics
from megatron_gspo.rollout.dump import RolloutDump
from megatron_gspo.rollout.multiturn import check_env_error_frac
from megatron_gspo.rollout.source import build_source, join_side
from megatron_gspo.trainer.sft import SFTWarmStart
from megatron_gspo.trainer.skips import SkipCount, StepStart

log = logging.getLogger("megatron_gspo")


class Trainer:
    """Construction validates and builds everything (collective); ``run()`` is the loop.

    hooks: extra TrainerHooks, called after the built-in ones (the SFT warm start, the source's); the
    entry point adds the tests' fault injection here (testing/faults.py).
    stop: the process's stop flag (train.main passes the one it installed first thing); None: the
    process's flag, installed now for SIGTERM / SIGUSR1 (a Trainer built by another program)."""

    def __init__(self, cfg: JobConfig, hooks: Iterable[TrainerHook] = (), stop: PreemptionFlag | None = None):
        self.cfg = cfg
        self.preempt = stop
        # process-wide numerics settings first: NCCL and cuBLAS read them when they start
        self._restore_determinism = determinism.enable() if cfg.train.deterministic else None
        self.side = None  # rollout.mode=async: this rank's side of the job (rollout.side)
        try:
            self._build(cfg, hooks)
        except BaseException:
            components.release_process_state(self)  # a refused config leaves the process as it found it
            raise

    def _build(self, cfg: JobConfig, hooks: Iterable[TrainerHook]) -> None:
        """The components (trainer/components.py), in dependency order; collective."""
        check_installed(cfg.train.trackers)  # a tracker named and not installed: exit 2 before anything starts
        self.side = join_side(cfg)  # rollout.mode=async: the trainer's ranks are a world of their own
        self.state = st = parallel.initialize(cfg.model, cfg.parallel, side=self.side)
        components.check_outputs(cfg, st)  # every place the job writes, before anything is built
        self.cfg = cfg = components.resolve_precision(cfg, st)
        components.open_bridge(self.side, st.device)
        cfg.check_data_parallel(st.dp)  # the same checks as launch/pretrain_gspo.sh --dry-run
        self.checkpoints = components.build_checkpoints(cfg, st)  # before the data: a root in use is refused first
        self.reward = reward_fn = build_reward(cfg.reward)  # its settings refused by key before anything is built
        # long steps stop early on it (runtime.stop.Cancelled); so does the making of the data
        self.preempt = self.preempt if self.preempt is not None else PreemptionFlag.install()
        self.tokenizer, self.sampler, held_out = components.build_data(cfg, st, self.preempt)
        self.model, self.ref_model, self.ddp = components.build_models(cfg, st, self.checkpoints)
        recompute, why = old_logprob_source(cfg, st.device)
        self.routing = components.build_routing(cfg, st, self.ddp, recompute)
        self.timer = Timer(st.device)
        self.objective_cfg = ObjectiveConfig.of(cfg)  # what algorithms.objective reads of the job
        gen_cfg = components.generation_config(cfg, self.tokenizer)
        self.source = build_source(cfg, st, self.ddp, self.sampler, self.tokenizer, reward_fn, gen_cfg, self.routing,
                                   self.timer, side=self.side, stop=self.preempt)
        self.prepare = BatchPreparer(cfg, st, self.ddp, self.ref_model, get_advantage_estimator(cfg.train.advantage_estimator),
                                     gen_cfg, self.routing, self.timer, recompute_old_logprobs=recompute)
        self.evaluator = components.build_evaluator(cfg, st, self.ddp, self.tokenizer, reward_fn, gen_cfg, held_out,
                                                    self.source)
        dump = [RolloutDump()] if cfg.train.dump_rollouts else []  # {output_dir}/rollouts/step_XXXXXX.jsonl
        self.hooks = Hooks([SFTWarmStart(), *self.source.hooks(), *dump, *hooks])
        # the stop story: votes, what a stop saves, the stop line (trainer/stopping.py)
        self.stopping = StopControl(cfg, st, self.preempt, self.source, self.checkpoints, self.ddp, self.sampler,
                                    during_save=functools.partial(self.hooks.during_save, self))
        # a run continuing a checkpoint continues its log; any other keeps an earlier run's logs aside
        # (rank 0) the trackers continue the runs the resumed checkpoint names, which every save then keeps
        trackers = build_trackers(cfg.train, cfg.train.output_dir, to_dict(cfg),
                                  self.checkpoints.saved_runs()) if st.is_main else []
        self.logger = MetricsLogger(cfg.train.output_dir, enabled=st.is_main, trackers=trackers,
                                    resumed=self.checkpoints.resume_dir is not None)
        self.checkpoints.keep_runs(self.logger.runs)
        self.skips = SkipCount()  # the NaN guard's count: part of the training state (trainer/skips.py)
        self.step_start = StepStart(self.ddp, self.sampler, self.skips)  # what a stop for too many skips goes back to
        self.warned_empty = False  # overlong filtering emptied a minibatch (said once)
        self.step = 0
        self._warned_off_policy = False
        components.log_setup(cfg, st, recompute, why)

    @property
    def resumed(self) -> bool:
        """A training checkpoint is continued (not: a fresh start, or a checkpoint of the SFT warm start)."""
        return self.checkpoints.resuming

    # ------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """The warm start, then the RL steps. A stop signal is acted on within a fraction of the phase it
        lands in: at every step boundary, in the decode loop, scoring and the dynamic-sampling rounds, between the
        rollout and the update, between two SFT steps, in an evaluation (the work cut short raises Cancelled,
        which StopControl handles); an update and a checkpoint save run to their end first (trainer/stopping.py)."""
        t = self.cfg.train
        self.stopping.check(self.step)  # a signal during start-up: stop before the SFT warm start and the restore
        self.hooks.before_training(self)  # the SFT warm start, unless resuming a training checkpoint
        if self.ref_model is not None and not self.checkpoints.resuming:
            self.ref_model.load_state_dict(self.model.state_dict())
        # the RL optimizer (restored with the rest of the checkpoint when resuming); the training state is
        # then handed to self.checkpoints, which every later save writes
        self.optimizer, self.scheduler, self.step = setup_optimizer(
            self.cfg, self.state, self.ddp, self.checkpoints, self.sampler, self.ref_model, self.step,
            during_save=functools.partial(self.hooks.during_save, self), skips=self.skips)
        self.stopping.first_step = self.step  # the RL loop starts: a stop before a step completes saves no new one
        # the skip stop can come after some of a step's updates only when a step has more minibatches than the
        # skips it takes (trainer/skips.py)
        may_stop_inside = t.num_minibatches > t.max_consecutive_skips
        history = []
        while self.step < t.num_steps:
            self.stopping.check(self.step)  # a collective vote; saves and raises StoppedFor on a stop signal
            self.hooks.at_step_start(self)
            t0 = time.perf_counter()
            parallel.set_seed(t.seed + self.step, self.state)  # every draw of a step depends on (seed, step)
            clear_aux_losses_tracker()  # megatron's per-step aux-loss log (nobody reads it; it must not grow)
            data_before, data_state = self.sampler.counters(), self.sampler.state_dict()
            self.step_start.begin(data_state, may_stop_inside and self.stopping.writes_state(self.step), self.optimizer,
                                  self.scheduler)
            batch = self._rollout(t0, data_state)
            self.hooks.after_rollout(self, batch)
            check_env_error_frac(batch.trajectories, self.cfg.env, self.state, self.step + 1)  # after the dump
            with self.timer("train"):
                metrics = self.train_on(batch)
            metrics.update(rollout_metrics(batch, self.state))
            metrics.update(self.routing.step_metrics())
            self.step += 1
            metrics.update(perf_metrics(self.timer, metrics["perf/gen_tokens"], time.perf_counter() - t0))
            metrics.update(data_metrics(data_before, self.sampler.counters(), self.step, self.cfg.data, self.state.is_main))
            if (self.evaluator is not None and self.evaluator.due(self.step)
                    and not self.stopping.requested("preemption vote before evaluation")):
                metrics.update(self._evaluate())
            self.hooks.after_step(self, metrics)
            self.logger.log(self.step, metrics)
            history.append({k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor) or v.numel() == 1})
            if self.step % t.log_interval == 0:
                log.info(progress_line(self.step, t.num_steps, metrics))
            self.checkpoints.save_if_due(self.step)
        self.checkpoints.save_final(self.step)  # a no-op without checkpoint.save
        self.stopping.finished(self.step)  # says so when a stop signal came too late to cut anything short
        self.logger.close()
        return {"history": history}

    def _rollout(self, t0: float, data_state: dict):
        """This step's batch; a stop signal before its update, or lost rollout ranks, stop the run here (the
        stopping calls raise), with the step's prompts drawn again after a resume."""
        try:
            batch = self.prepare(self.source.collect(self.step))
            # a signal during the rollout's scoring or its old / reference log-prob passes: leave the step
            # before the update, which once begun runs to its end (a half-applied step cannot be saved)
            if self.stopping.requested("preemption vote before the update"):
                raise Cancelled("before its update (rollout done)", self.step + 1)
            return batch
        except StoppedFor as e:  # rollout.mode=async, rollout ranks lost (RemoteSource): checkpoint and stop, never hang
            self.stopping.without_rollouts(self.step, e)
        except Cancelled as e:  # a stop signal during the rollout: nothing of this step was applied
            e.elapsed_s = time.perf_counter() - t0
            self.sampler.load_state_dict(data_state)  # its prompts are drawn again after a resume
            self.stopping.check(self.step, abandoned=e)

    def _evaluate(self) -> dict:
        """The evaluation after step ``self.step``: eval/* and perf/eval_s, or nothing when a stop signal cut
        it short (the step stands; the next boundary saves it and stops)."""
        t_eval = time.perf_counter()
        try:
            out = self.evaluator.run(self.step, should_stop=lambda: self.preempt.set)
        except Cancelled as e:
            e.elapsed_s = time.perf_counter() - t_eval
            self.stopping.evaluation_cut_short(self.step, e)
            return {}
        except StoppedFor as e:  # the rollout engine failed (rollout.engine=vllm): the step stands, saved
            self.stopping.without_rollouts(self.step, e)
        out["perf/eval_s"] = time.perf_counter() - t_eval
        return out

    # ------------------------------------------------------------------------------------------
    def train_on(self, batch: TrainBatch) -> dict:
        """num_minibatches optimizer steps over the rollout; returns reduced metrics."""
        st = self.state
        acc = MetricAccumulator()
        grad_norms, skipped, empty = [], 0, 0
        for k, mini in enumerate(batch.minibatches):
            # the first minibatch runs on the sampling weights: its log-probs measure the rollout's gap
            bad_rows = self.accumulate_gradients(batch, mini, acc, measure_rollout_gap=k == 0)
            # overlong filtering masked every response of the minibatch out on every DP rank: nothing to
            # learn from, no update (not even the aux loss's)
            if self.cfg.train.overlong_filtering and empty_minibatch(batch, mini, st.device):
                empty += 1
                continue
            # NaN/Inf guard: decided collectively so every rank skips the same update. The local
            # flag stays on the device (one reduction per gradient buffer); the vote is the only
            # host sync of the guard, and sequence ids are looked up only when it fails.
            local_bad = torch.stack([nonfinite_grads(self.ddp)] + [m.any() for _, m in bad_rows]).any()
            if comm.any_true(local_bad, what="non-finite gradient vote"):
                self._skip_update(bad_sample_ids(bad_rows))
                skipped += 1
                continue
            self.step_start.before_update()
            with explain_oom("optimizer", self.cfg, st, model_shapes(self.cfg)):  # Adam's states, at the first step
                ok, gnorm = optimizer_step(self.optimizer, st.device)
            if not ok or not math.isfinite(gnorm):  # megatron's own overflow check (bf16/fp16)
                self._skip_update([])
                skipped += 1
                continue
            self.skips.applied()
            self.scheduler.step(increment=1)
            grad_norms.append(gnorm)
            self.hooks.after_update(self, k)
        self.routing.finish_step()  # asserts every replayed backward recompute ran
        out = {(k if k.startswith(("rollout/", "rollout_correction/")) else f"loss/{k}"): v
               for k, v in acc.reduce(st.dp_group).items()}
        out["loss/clip_frac"] = out["loss/clip_frac_low"] + out["loss/clip_frac_high"]
        out["loss/onpolicy/clip_frac"] = out["loss/onpolicy/clip_frac_low"] + out["loss/onpolicy/clip_frac_high"]
        # said once: the first minibatch, trained on the sampling weights, was not at ratio 1
        self._warned_off_policy = self._warned_off_policy or warn_off_policy(
            out["loss/onpolicy/seq_ratio_dev_max"], self.step + 1, self.prepare.recompute_old_logprobs)
        out["train/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        out["train/skipped_updates"] = skipped
        if self.cfg.train.overlong_filtering:
            out = self._empty_step_metrics(out, empty, len(batch.minibatches))
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def accumulate_gradients(self, batch: TrainBatch, mini: list[int], acc: MetricAccumulator,
                             measure_rollout_gap: bool = False) -> list[tuple[list, torch.Tensor]]:
        """Forward + backward of one minibatch (its flat micro-batch indices ``mini`` in the batch's plan),
        gradients reduced over DP (finalize_grads): per micro-batch, forward_logprobs -> the RL objective
        (algorithms.objective: loss mask, rollout correction, the policy loss, its metrics) -> backward.
        The loss divides by the unit count of the whole minibatch over every DP rank and DDP sums
        gradients (calculate_per_token_loss), so the gradient is the DP=1, one-micro-batch gradient
        whatever the split; the MoE aux loss gets the same weight too
        (model.aux_loss_scales). ``measure_rollout_gap``: log rollout/logprob_diff_* from these forwards
        (on the sampling weights: the first minibatch). Returns, per micro-batch, its sample ids and a
        [b] bool device tensor marking the rows whose (current or old) log-probs were not finite
        (``bad_sample_ids`` turns them into ids; kept on the device so that no micro-batch waits)."""
        cfg, st = self.cfg, self.state
        obj = self.objective_cfg
        micros = [batch.micro_batch(i) for i in mini]
        units = sum(loss_units(obj, m) for m in micros).reshape(1)
        norm = comm.all_reduce(units, "sum", st.dp_group, what="loss normalizer (units of the minibatch over DP)")
        # overlong filtering can empty a minibatch: its loss is then 0 / 1, not 0 / 0
        norm = norm.clamp(min=1)
        pad_masks = [m.input_padding_mask() for m in micros]
        scales = aux_loss_scales(pad_masks, st, cfg.model.moe_router_load_balancing_type, cfg.model.moe_aux_loss_coeff)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        bad_rows: list[tuple[list, torch.Tensor]] = []
        for j, micro in enumerate(micros):
            set_aux_loss_scale(scales[j], st.device)  # megatron reads it in this micro-batch's backward only
            shape = f"micro-batch of {micro.tokens.shape[0]} rows x {micro.tokens.shape[1] - 1} tokens"
            with explain_oom("training", cfg, st, shape), self.routing.train_pass(micro):
                # log-probs from the final hidden states, output layer fused in: no [b, s, V] logits
                logp, ent = forward_logprobs(self.ddp, micro.tokens[:, :-1], micro.tokens[:, 1:], cfg.model.vocab_size,
                                             temperature=self.prepare.temperature, padding_mask=pad_masks[j])
                bad_rows.append((micro.sample_ids, nonfinite_rows(micro, logp)))
                loss, metrics = objective(obj, micro, logp, ent, norm[0], on_sampling_weights=measure_rollout_gap)
            with explain_oom("training", cfg, st, "backward of the " + shape), self.routing.backward():
                loss.backward()
            acc.add(metrics)
        finalize_grads(self.ddp, st)
        return bad_rows

    def _empty_step_metrics(self, out: dict, empty: int, minibatches: int) -> dict:
        """``out`` with train/empty_minibatches (a warning the first time), and for a step that trained on
        nothing its loss, 0 (no update), in place of the NaNs of means over no response."""
        if empty and not self.warned_empty and self.state.is_main:
            self.warned_empty = True
            log.warning("step %d: overlong filtering (train.overlong_filtering=true) left %d of %d minibatch(es) "
                        "without a response to train on: every one was cut at generation.max_new_tokens=%d without "
                        "a stop token; no update was made for them (counted in train/empty_minibatches, said once)",
                        self.step + 1, empty, minibatches, self.cfg.generation.max_new_tokens)
        out = {**out, "train/empty_minibatches": empty}
        if empty == minibatches:
            out = {k: v for k, v in out.items() if isinstance(v, torch.Tensor) or math.isfinite(v)}
            out.update({"loss/loss": 0.0, "loss/pg_loss": 0.0})
        return out

    def _skip_update(self, bad_rows: list[str]) -> None:
        """Every rank together: count a skipped update; too many in a row stop the run, saving the last completed
        step (never the state inside this one: trainer/skips.py, StopControl.too_many_skips)."""
        self.skips.skipped()
        log.warning("step %d: non-finite loss/gradients, update skipped on every rank (%d in a row, %d total)%s",
                    self.step + 1, self.skips.consecutive, self.skips.total,
                    f"; sequences with non-finite log-probs on rank {self.state.rank}: {bad_rows[:8]}" if bad_rows else "")
        if self.skips.consecutive >= self.cfg.train.max_consecutive_skips:
            why = (f"stopping: {self.skips.consecutive} consecutive updates had non-finite loss or gradients "
                   f"(train.max_consecutive_skips={self.cfg.train.max_consecutive_skips}) at step {self.step + 1}")
            self.step_start.rewind()
            self.stopping.too_many_skips(self.step, why)

    # ------------------------------------------------------------------------------------------
    def stop_requested(self, what: str) -> bool:
        """Whether any rank got a stop signal (a collective vote: every rank calls it at the same point)."""
        return self.stopping.requested(what)

    def stop_if_preempted(self, abandoned: Cancelled | None = None, agreed: bool = False) -> None:
        """If any rank got a stop signal: save what this run completed and raise StoppedFor
        (trainer/stopping.py). At a step boundary (a vote), or with ``abandoned`` / ``agreed`` when every
        rank already agreed (a step left in flight, the warm start's own vote)."""
        self.stopping.check(self.step, abandoned=abandoned, agreed=agreed)

    def save(self) -> None:
        """Every rank: the state after ``self.step``, now (a stop, a skipped update)."""
        self.checkpoints.save_step(self.step)

    def close(self) -> None:
        """Close the hooks and the logger and give back what the job set process-wide (megatron's
        per-model globals, deterministic mode). The process groups stay up: train.run_trainer (or the
        caller running several jobs) tears them down with parallel.destroy()."""
        self.hooks.close(self)
        self.source.close()
        if self.evaluator is not None:
            self.evaluator.close()
        self.reward.close()  # its worker processes, if any
        self.logger.close()
        components.release_process_state(self)
