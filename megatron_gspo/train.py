"""GSPO / GRPO training entry point: ``python -m megatron_gspo.train [config.yaml] [section.key=value ...]``.

One RL step, top to bottom:
  1. sample P prompts (every DP rank draws the same P), G responses each = R global rows; each DP
     rank generates its share of every minibatch (rollout.local_rows) on the training model itself
     (KV cache), with sampling noise keyed by the global row, so the rollout is layout independent;
  2. rewards -> group-relative advantages over the gathered rewards of all R rows;
  3. old log-probs recomputed by the training model (and, for GRPO + R2, the routing recorded);
  4. the rollout split into minibatches, one optimizer step each (later minibatches are off-policy);
  5. metrics reduced over DP, logged; checkpoint every N steps.
Launch with torchrun for several ranks (launch/pretrain_gspo.sh).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import time
from typing import Callable, Optional

import psutil
import torch
import torch.distributed as dist

from megatron_gspo import comm, exit_status, parallel
from megatron_gspo.advantages import get_advantage_estimator
from megatron_gspo.checkpoint import (
    MANIFEST,
    check_compatible,
    iter_dir,
    latest_complete,
    load_checkpoint,
    load_model,
    resolve,
    save_checkpoint,
)
from megatron_gspo.config import ConfigError, JobConfig, load_job_config, to_dict
from megatron_gspo.data import build_prompt_sampler
from megatron_gspo.faults import EXIT_PREEMPTED, EXIT_TOO_MANY_SKIPS, Faults, PreemptionFlag
from megatron_gspo.generation import generate
from megatron_gspo.logger import MetricsLogger, progress_line, setup_logging
from megatron_gspo.logprobs import vocab_parallel_logprobs
from megatron_gspo.losses import batch_normalizer, compute_policy_loss
from megatron_gspo.metrics import Metric, MetricAccumulator
from megatron_gspo.model import (
    aux_loss_scales,
    build_model,
    finalize_grads,
    forward_logits,
    model_summary,
    set_aux_loss_scale,
    wrap_ddp,
)
from megatron_gspo.optim import build_optimizer, build_scheduler, optimizer_step
from megatron_gspo.rewards import build_reward_fn, compute_rewards
from megatron_gspo.rollout import (
    RolloutBatch,
    Timer,
    common_length,
    compute_logprobs,
    global_advantages,
    local_rows,
    micro_batch_slices,
    pad_columns,
)
from megatron_gspo.routing import RolloutRecorder, RoutingMonitor, RoutingReplay
from megatron_gspo.sft import sft_warm_start
from megatron_gspo.tokenizer import build_tokenizer, check_vocab_fits

log = logging.getLogger("megatron_gspo")


class TrainingStopped(Exception):
    """The run stops on purpose (preemption, too many non-finite steps): checkpoint written."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Trainer:
    """Holds what a run needs; ``run()`` is the loop. Construction validates and builds everything."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.state = parallel.initialize(cfg.model, cfg.parallel)
        setup_logging(self.state.rank)
        st, t = self.state, cfg.train
        rows = t.prompts_per_step * cfg.generation.n_samples_per_prompt
        if rows % (t.num_minibatches * st.dp):
            raise ConfigError(f"train.prompts_per_step x generation.n_samples_per_prompt = {rows} rollout rows are "
                              f"not divisible by train.num_minibatches x the data-parallel size = "
                              f"{t.num_minibatches} x {st.dp}: every DP rank holds an equal share of every minibatch")
        if t.sft_steps > 0 and t.sft_batch_size % st.dp:
            raise ConfigError(f"train.sft_batch_size={t.sft_batch_size} is not divisible by the data-parallel size {st.dp}")
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        check_vocab_fits(self.tokenizer, cfg.model.vocab_size)
        self.sampler = build_prompt_sampler(cfg.data, self.tokenizer, t.prompts_per_step)
        self.reward_fn = build_reward_fn(cfg.reward)
        self.advantage_fn = get_advantage_estimator(t.advantage_estimator)
        stops = cfg.generation.stop_token_ids or list(self.tokenizer.eos_ids)
        self.gen_cfg = dataclasses.replace(cfg.generation, stop_token_ids=stops,
                                           pad_token_id=cfg.generation.pad_token_id if cfg.generation.pad_token_id is not None else self.tokenizer.pad_id)
        # generate() is called with one row per sample (a sample's noise is keyed by its global row)
        self.row_gen_cfg = dataclasses.replace(self.gen_cfg, n_samples_per_prompt=1)
        # log-probs are taken at the sampling temperature (greedy rollouts: the raw policy)
        self.temperature = cfg.generation.temperature or 1.0

        self.model = build_model(cfg.model, cfg.parallel, st, routing_replay=t.routing_replay != "off")
        # The KL reference is the initial policy: a frozen copy taken after checkpoint.load and the
        # SFT warm start (in run()), saved in every checkpoint so a resumed run keeps it.
        self.ref_model = None
        if cfg.loss.kl_coef > 0:
            self.ref_model = build_model(cfg.model, cfg.parallel, st).eval().requires_grad_(False)
        # resume = continue the newest complete checkpoint under save (or load); without one, a
        # resume request is a fresh start (initial weights from checkpoint.load, if given)
        ck = cfg.checkpoint
        root = (ck.save or ck.load) if ck.resume else None
        self.resume_root = root if root and latest_complete(root) is not None else None
        if ck.load and self.resume_root is None:
            load_model(self.model, ck.load)
        if self.resume_root is not None:  # refuse a checkpoint of another shape before any work
            check_compatible(self.model, resolve(self.resume_root))
        self.ddp = wrap_ddp(self.model, st)
        # GRPO's routing replay (R2: routes of the old-log-prob pass, R3: of the rollout), and
        # routing metrics (expert load, aux loss, change old -> new policy) for every run.
        self.replay = RoutingReplay.from_model(t.routing_replay, self.ddp, st)
        self.recorder = RolloutRecorder(self.ddp) if t.routing_replay == "R3" else None
        self.monitor = RoutingMonitor(self.ddp)
        self.logger = MetricsLogger(t.output_dir, enabled=st.is_main, tensorboard=t.tensorboard)
        self.timer = Timer()
        self.faults = Faults(rank=st.rank)
        self.preempt = PreemptionFlag()
        self.consecutive_skips = 0
        self.skipped_total = 0
        self.step = 0
        log.info("model: %s", model_summary(cfg.model))
        log.info("layout: world %d = TP %d x PP %d x DP %d (EP %d, ETP %d, SP %s) on %s", st.world_size, st.tp, st.pp,
                 st.dp, st.ep, st.etp, st.sequence_parallel, st.device)
        log.info("optimizer: %s", st.optimizer_layout())

    # ------------------------------------------------------------------------------------------
    def setup_optimizer(self) -> None:
        cfg = self.cfg
        bf16 = cfg.model.precision == "bf16"
        self.optimizer = build_optimizer(cfg.optimizer, self.ddp, self.state, bf16)
        total = cfg.train.num_steps * cfg.train.num_minibatches
        self.scheduler = build_scheduler(cfg.optimizer, self.optimizer, total)
        if self.resume_root is not None:
            info = load_checkpoint(self.resume_root, self.ddp, self.optimizer, self.scheduler,
                                   extra_models=self._extra_models())
            self.step = info["step"]
            self.sampler.load_state_dict(info["extra"]["data"])
            log.info("resumed from %s at step %d", info["path"], self.step)

    # ------------------------------------------------------------------------------------------
    def rollout(self) -> RolloutBatch:
        cfg, st = self.cfg, self.state
        dev = st.device
        prompts = self.sampler.next_batch()  # the same P prompts on every rank
        G = self.gen_cfg.n_samples_per_prompt
        R = len(prompts) * G
        rows = local_rows(R, cfg.train.num_minibatches, st.dp, st.dp_rank)
        mine = [prompts[g // G] for g in rows]
        with self.timer("generate"), (self.recorder.recording() if self.recorder else contextlib.nullcontext()):
            out = generate(self.ddp, [p.ids for p in mine], self.row_gen_cfg, vocab_size=cfg.model.vocab_size,
                           state=st, seed=self.sampling_seed(), row_keys=rows,
                           on_forward=self.recorder.on_forward if self.recorder else None)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
        with self.timer("reward"):
            rewards = compute_rewards(self.reward_fn, [p.text for p in mine], texts, [p.answer for p in mine],
                                      device=dev)
        row_ids = torch.tensor(rows, dtype=torch.long, device=dev)
        advantages = global_advantages(rewards, row_ids, R, G, self.advantage_fn, st.dp, cfg.train.num_minibatches,
                                       st.dp_group)
        T = common_length(out.tokens.shape[1], st.tp if st.sequence_parallel else 1, dev, group=dist.group.WORLD)
        tokens = pad_columns(out.tokens, T, self.gen_cfg.pad_id)
        mask, sample_lp = pad_columns(out.response_mask, T, False), pad_columns(out.logprobs, T, 0.0)
        batch = RolloutBatch(tokens=tokens, mask=mask[:, 1:], seq_lengths=out.prompt_lengths + out.response_lengths,
                             row_ids=row_ids, rewards=rewards, advantages=advantages,
                             sample_logprobs=sample_lp[:, 1:], response_texts=texts,
                             sample_ids=[f"{p.id}#{g % G}" for p, g in zip(mine, rows)])
        micro = self.micro_batches(batch.num_rows)
        if self.recorder is not None:
            # R3: the rollout's routes, in the micro-batch partition both passes use
            routes = self.recorder.finish(out)
            for i, sl in enumerate(micro):
                self.replay.load(i, routes.routes_for(list(range(sl.start, sl.stop)), seq_len=T - 1))
        pad_mask = batch.input_padding_mask()
        with self.timer("old_logprob"):
            batch.old_logprobs = compute_logprobs(
                self.ddp, tokens, micro, cfg.model.vocab_size, st.tp_group, self.temperature,
                on_micro_batch=self._old_pass_context, padding_mask=pad_mask)
            if self.replay.mode == "R3":
                self.replay.finish_pass()  # the training pass replays the same routes once more
            if self.ref_model is not None:
                batch.ref_logprobs = compute_logprobs(self.ref_model, tokens, micro, cfg.model.vocab_size,
                                                      st.tp_group, self.temperature, padding_mask=pad_mask)
        batch.timings = {"gen_tokens": out.num_generated_tokens, "gen_s": out.elapsed_s}
        return batch

    def sampling_seed(self) -> int:
        """Seed of this step's sampling noise: (generation.seed, step) in one 64-bit key (sampling.py
        then keys every draw by global row and position)."""
        return (self.cfg.generation.seed << 32) + self.step

    def micro_batches(self, num_rows: int) -> list[slice]:
        t = self.cfg.train
        return [s for mini in micro_batch_slices(num_rows, t.num_minibatches, t.micro_batch_size) for s in mini]

    def _old_pass_context(self, mb: int):
        stack = contextlib.ExitStack()
        stack.enter_context(self.monitor.capture(("old", mb)))
        if self.replay.mode == "R2":
            stack.enter_context(self.replay.recording(mb))
        elif self.replay.mode == "R3":
            stack.enter_context(self.replay.replaying(mb))
        return stack

    # ------------------------------------------------------------------------------------------
    def train_on(self, batch: RolloutBatch) -> dict:
        """num_minibatches optimizer steps over the rollout; returns reduced metrics."""
        cfg, st = self.cfg, self.state
        t = cfg.train
        acc = MetricAccumulator()
        grad_norms, skipped = [], 0
        inject_nan = self.faults.active("nan_logprob", self.step + 1)
        mb_index = 0  # flat micro-batch id: the key of the old-log-prob pass's routing records
        for mini in micro_batch_slices(batch.num_rows, t.num_minibatches, t.micro_batch_size):
            bad_rows = self.accumulate_gradients(batch, mini, mb_index, acc, inject_nan)
            mb_index += len(mini)
            # NaN/Inf guard: decided collectively so every rank skips the same update
            local_bad = bool(bad_rows) or not all(
                torch.isfinite(p.main_grad).all() for p in self.ddp.parameters() if getattr(p, "main_grad", None) is not None)
            if comm.any_rank(local_bad, st.device, what="non-finite gradient vote"):
                self._skip_update(bad_rows)
                skipped += 1
                continue
            ok, gnorm = optimizer_step(self.optimizer)
            if not ok or not math.isfinite(gnorm):  # megatron's own overflow check (bf16/fp16)
                self._skip_update([])
                skipped += 1
                continue
            self.consecutive_skips = 0
            self.scheduler.step(increment=1)
            grad_norms.append(gnorm)
        self.replay.finish_step()  # asserts every recorded route was replayed exactly once
        out = {f"loss/{k}": v for k, v in acc.reduce(st.dp_group).items()}
        out["loss/clip_frac"] = out["loss/clip_frac_low"] + out["loss/clip_frac_high"]
        out["train/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        out["train/skipped_updates"] = skipped
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    def accumulate_gradients(self, batch: RolloutBatch, mini: list[slice], mb_index: int,
                             acc: MetricAccumulator, inject_nan: bool = False) -> list[str]:
        """Forward + backward of one minibatch (its micro-batches ``mini``), gradients reduced over DP
        (finalize_grads). The loss divides by the unit count of the whole minibatch over every DP rank
        and DDP sums gradients (calculate_per_token_loss), so the gradient is the DP=1, one-micro-batch
        gradient whatever the split; the MoE aux loss gets the same weight too (model.aux_loss_scales).
        Returns the sample ids whose log-probs were not finite."""
        cfg, st = self.cfg, self.state
        rows = slice(mini[0].start, mini[-1].stop)
        norm = comm.all_reduce(batch_normalizer(cfg.loss, batch.mask[rows]).reshape(1), "sum", st.dp_group,
                               what="loss normalizer (units of the minibatch over DP)")
        pad_masks = [batch.rows(sl).input_padding_mask() for sl in mini]
        scales = aux_loss_scales(pad_masks, st, cfg.model.moe_router_load_balancing_type, cfg.model.moe_aux_loss_coeff)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        bad_rows: list[str] = []
        for j, sl in enumerate(mini):
            micro = batch.rows(sl)
            with self._train_pass_context(mb_index + j):
                logits = forward_logits(self.ddp, micro.tokens[:, :-1], padding_mask=pad_masks[j])
                logp, ent = vocab_parallel_logprobs(logits, micro.tokens[:, 1:], cfg.model.vocab_size,
                                                    st.tp_group, temperature=self.temperature)
                if inject_nan and j == 0:  # test hook (MEGATRON_GSPO_FAULTS)
                    logp = logp + torch.where(micro.mask, float("nan"), 0.0)
                finite = torch.where(micro.mask, logp.detach(), 0.0).isfinite().all(dim=-1)
                bad_rows += [micro.sample_ids[r] for r in torch.nonzero(~finite).flatten().tolist()]
                loss, metrics = compute_policy_loss(
                    cfg.loss, logp, micro.old_logprobs, micro.advantages, micro.mask,
                    ref_logp=micro.ref_logprobs, entropy=ent, global_batch_normalizer=norm[0])
            set_aux_loss_scale(scales[j], st.device)
            # backward outside the routing monitor's capture: activation recompute re-runs the
            # routers, which must replay (backward_replay) but not count as a second forward
            with self.replay.backward_replay():
                loss.backward()
            acc.add(metrics)
        finalize_grads(self.ddp, st)
        return bad_rows

    def _skip_update(self, bad_rows: list[str]) -> None:
        self.consecutive_skips += 1
        self.skipped_total += 1
        log.warning("step %d: non-finite loss/gradients, update skipped on every rank (%d in a row, %d total)%s",
                    self.step + 1, self.consecutive_skips, self.skipped_total,
                    f"; sequences with non-finite log-probs on rank {self.state.rank}: {bad_rows[:8]}" if bad_rows else "")
        if self.consecutive_skips >= self.cfg.train.max_consecutive_skips:
            self.save()  # nothing was applied since the last good update: this is the last good state
            raise TrainingStopped(
                f"stopping: {self.consecutive_skips} consecutive updates had non-finite loss or gradients "
                f"(train.max_consecutive_skips={self.cfg.train.max_consecutive_skips}) at step {self.step + 1}; "
                f"the last good state was saved to {self.cfg.checkpoint.save or '(checkpoint.save not set)'}",
                EXIT_TOO_MANY_SKIPS)

    def _train_pass_context(self, mb: int):
        stack = contextlib.ExitStack()
        stack.enter_context(self.monitor.capture(("train", mb), compare_to=("old", mb)))
        if self.replay.mode != "off":
            stack.enter_context(self.replay.replaying(mb))
        return stack

    # ------------------------------------------------------------------------------------------
    def rollout_metrics(self, batch: RolloutBatch) -> dict:
        m = batch.mask
        diff = (batch.old_logprobs - batch.sample_logprobs).abs()
        local = {
            "rollout/reward_mean": Metric.mean(batch.rewards),
            "rollout/reward_std": Metric.std(batch.rewards),
            "rollout/response_length_mean": Metric.mean(m.sum(-1).float()),
            "rollout/response_length_max": Metric.max(m.sum(-1).float()),
            # generation ran on the training model itself: this is numerical noise only
            "rollout/logprob_diff_mean": Metric.mean(diff, m),
            "rollout/logprob_diff_max": Metric.max(diff, m),
            "perf/gen_tokens": Metric.sum(torch.tensor([float(batch.timings["gen_tokens"])], device=self.state.device)),
        }
        acc = MetricAccumulator()
        acc.add(local)
        out = acc.reduce(self.state.dp_group)
        # routing: expert load, aux loss and the share of (token, k) choices that changed between
        # the old-log-prob pass and the training forward (0 under replay), reduced over all ranks
        stats = None
        for i in range(len(self.micro_batches(batch.num_rows))):
            s = self.monitor.stats(("train", i), pop=True)
            stats = s if stats is None else stats + s
            self.monitor.drop(("old", i))
        out.update(stats.all_reduce().summary(prefix="routing/"))
        return out

    # ------------------------------------------------------------------------------------------
    def _extra_models(self) -> dict:
        return {"ref_model": self.ref_model} if self.ref_model is not None else {}

    def save(self) -> None:
        ck = self.cfg.checkpoint
        if not ck.save:
            return
        save_checkpoint(ck.save, self.step, self.ddp, self.optimizer, self.scheduler,
                        extra_models=self._extra_models(),
                        extra={"data": self.sampler.state_dict(), "config": to_dict(self.cfg)},
                        is_main=self.state.is_main, keep_last=ck.keep_last,
                        fault_hook=self.faults.save_hook(self.step))

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        if t.sft_steps > 0 and self.resume_root is None:
            sft_warm_start(self)  # before the RL optimizer exists: bf16 master weights copy params
        if self.ref_model is not None and self.resume_root is None:
            self.ref_model.load_state_dict(self.model.state_dict())
        self.setup_optimizer()
        history = []
        while self.step < t.num_steps:
            if comm.any_rank(self.preempt.set, self.state.device, what="preemption vote"):
                ck = cfg.checkpoint
                # The periodic save at the end of the step just run already holds this state
                # (its directory exists only once complete): writing it again would spend the
                # scheduler's lead time on a copy.
                just_saved = bool(ck.save and ck.save_interval and self.step and self.step % ck.save_interval == 0
                                  and os.path.isfile(os.path.join(iter_dir(ck.save, self.step), MANIFEST)))
                if not comm.all_ranks(just_saved, self.state.device, what="preemption: step already saved"):
                    self.save()
                saved = f"checkpoint saved to {self.cfg.checkpoint.save}" if self.cfg.checkpoint.save else \
                    "NO checkpoint written (checkpoint.save is not set)"
                sig = signal.Signals(self.preempt.received).name if self.preempt.received else "(on another rank)"
                raise TrainingStopped(f"preempted by signal {sig} before "
                                      f"step {self.step + 1}: {saved}; exiting with {EXIT_PREEMPTED} "
                                      "(resume with checkpoint.resume=true)", EXIT_PREEMPTED)
            self.faults.at_step_start(self.step + 1)
            t0 = time.perf_counter()
            # every random draw of a step is a function of (seed, step): resume is exact
            parallel.set_seed(t.seed + self.step, self.state)
            data_before = self.sampler.counters()
            batch = self.rollout()
            with self.timer("train"):
                metrics = self.train_on(batch)
            metrics.update(self.rollout_metrics(batch))
            self.step += 1
            times = self.timer.pop()
            step_time = time.perf_counter() - t0
            metrics.update({f"perf/{k}_s": v for k, v in times.items()})
            metrics["perf/step_time_s"] = step_time
            metrics["perf/rss_mb"] = psutil.Process().memory_info().rss / 2**20
            metrics["perf/gen_tokens_per_s"] = metrics["perf/gen_tokens"] / max(times.get("generate", 0.0), 1e-9)
            metrics.update(_data_metrics(data_before, self.sampler.counters(), self.step, cfg.data, self.state.is_main))
            self.logger.log(self.step, metrics)
            history.append({k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor) or v.numel() == 1})
            if self.step % t.log_interval == 0:
                log.info(progress_line(self.step, t.num_steps, metrics))
            if cfg.checkpoint.save_interval and self.step % cfg.checkpoint.save_interval == 0:
                self.save()
        if cfg.checkpoint.save and (not cfg.checkpoint.save_interval or self.step % cfg.checkpoint.save_interval):
            self.save()
        self.logger.close()
        return {"history": history}


def _data_metrics(before: dict, after: dict, step: int, data_cfg, log_it: bool) -> dict:
    """Prompts that data.overlong_prompt_policy dropped or cut this step, and since the start of the
    run (the sampler's counters survive a resume); said once per step when any, never silently.
    Every DP rank draws the same prompts, so the counts need no reduction."""
    out = {"data/dropped_prompts": after["num_dropped"] - before["num_dropped"],
           "data/truncated_prompts": after["num_truncated"] - before["num_truncated"],
           "data/dropped_prompts_total": after["num_dropped"], "data/truncated_prompts_total": after["num_truncated"]}
    if log_it and (out["data/dropped_prompts"] or out["data/truncated_prompts"]):
        log.warning("step %d: %d prompt(s) dropped and %d left-truncated for exceeding data.max_prompt_length=%d "
                    "tokens (data.overlong_prompt_policy=%s; %d dropped, %d truncated since the start)",
                    step, out["data/dropped_prompts"], out["data/truncated_prompts"], data_cfg.max_prompt_length,
                    data_cfg.overlong_prompt_policy, after["num_dropped"], after["num_truncated"])
    return out


def summarize(history: list[dict], loss_name: str) -> str:
    r = [h["rollout/reward_mean"] for h in history]
    k = min(10, max(1, len(r) // 2))
    first, last = sum(r[:k]) / k, sum(r[-k:]) / k
    return (f"mean reward of the first {k} {loss_name.upper()} steps {first:.3f} -> last {k} steps {last:.3f} "
            f"({last - first:+.3f})")


def _user_errors() -> tuple:
    from megatron_gspo.checkpoint import CheckpointError
    from megatron_gspo.config import ConfigError
    from megatron_gspo.data import DataError
    from megatron_gspo.rewards import RewardError
    from megatron_gspo.tokenizer import TokenizerError

    return (ConfigError, CheckpointError, DataError, RewardError, TokenizerError, FileNotFoundError)


USER_ERRORS = _user_errors()
DEMO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo_gspo.yaml")


def main(argv: Optional[list[str]] = None) -> int:
    exit_status.rank_started()  # the launcher waits for this rank and reads its exit code
    argv = list(sys.argv[1:] if argv is None else argv)
    path = argv.pop(0) if argv and not argv[0].startswith("-") and "=" not in argv[0] else None
    if path is None:
        # no YAML: the built-in demo job (tiny MoE, arithmetic task), overrides still apply
        path = DEMO_CONFIG
    try:
        cfg = load_job_config(path, argv)
        trainer = Trainer(cfg)
    except USER_ERRORS as e:
        # a wrong config, layout, file or checkpoint: the message names it; no traceback
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        log.error("error: %s", e)
        exit_status.record(exit_status.EXIT_USER_ERROR, str(e))
        parallel.destroy()
        return exit_status.EXIT_USER_ERROR
    log.info("config: %s %s", path, " ".join(argv))
    return run_trainer(trainer)


def run_trainer(trainer: Trainer, on_exit: Optional[Callable[[], None]] = None) -> int:
    """Run the loop and return the process exit code: 0, a TrainingStopped code (preemption, too
    many skipped updates) or 2 for a user error, recorded for the launcher (exit_status). ``on_exit``,
    the logger and the process groups are closed whatever happens."""
    try:
        result = trainer.run()
        if trainer.state.is_main and result["history"]:
            log.info(summarize(result["history"], trainer.cfg.loss.name))
    except TrainingStopped as e:
        log.error("%s", e)
        exit_status.record(e.exit_code, str(e))
        return e.exit_code
    except USER_ERRORS as e:
        log.error("error: %s", e)
        exit_status.record(exit_status.EXIT_USER_ERROR, str(e))
        return exit_status.EXIT_USER_ERROR
    finally:
        if on_exit is not None:
            on_exit()
        trainer.logger.close()
        parallel.destroy()
    exit_status.record(0, "finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
