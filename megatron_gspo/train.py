"""GSPO / GRPO training entry point: ``python -m megatron_gspo.train [config.yaml] [section.key=value ...]``.

One RL step, top to bottom:
  1. sample P prompts (every DP rank draws the same P and keeps its slice), G responses each,
     on the training model itself (KV cache);
  2. rewards -> group-relative advantages (groups never straddle ranks);
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
import sys
import time
from typing import Optional

import psutil
import torch
import torch.distributed as dist

from megatron_gspo import parallel
from megatron_gspo.advantages import get_advantage_estimator
from megatron_gspo.checkpoint import latest_complete, load_checkpoint, load_model, save_checkpoint
from megatron_gspo.config import JobConfig, load_job_config, to_dict
from megatron_gspo.data import build_prompt_sampler
from megatron_gspo.faults import EXIT_PREEMPTED, EXIT_TOO_MANY_SKIPS, Faults, PreemptionFlag
from megatron_gspo.generation import generate
from megatron_gspo.logger import MetricsLogger, progress_line, setup_logging
from megatron_gspo.logprobs import vocab_parallel_logprobs
from megatron_gspo.losses import batch_normalizer, compute_policy_loss
from megatron_gspo.metrics import Metric, MetricAccumulator
from megatron_gspo.model import build_model, finalize_grads, forward_logits, model_summary, wrap_ddp
from megatron_gspo.optim import build_optimizer, build_scheduler, optimizer_step
from megatron_gspo.rewards import build_reward_fn, compute_rewards
from megatron_gspo.rollout import RolloutBatch, Timer, compute_logprobs, pad_to_common_length
from megatron_gspo.routing import RolloutRecorder, RoutingMonitor, RoutingReplay
from megatron_gspo.sft import sft_warm_start
from megatron_gspo.tokenizer import build_tokenizer, check_vocab_fits

log = logging.getLogger("megatron_gspo")


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank (a collective decision)."""
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


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
        if t.prompts_per_step % st.dp:
            raise ValueError(f"train.prompts_per_step={t.prompts_per_step} is not divisible by the "
                             f"data-parallel size {st.dp}")
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        check_vocab_fits(self.tokenizer, cfg.model.vocab_size)
        self.sampler = build_prompt_sampler(cfg.data, self.tokenizer, t.prompts_per_step)
        self.reward_fn = build_reward_fn(cfg.reward)
        self.advantage_fn = get_advantage_estimator(t.advantage_estimator)
        stops = cfg.generation.stop_token_ids or list(self.tokenizer.eos_ids)
        self.gen_cfg = dataclasses.replace(cfg.generation, stop_token_ids=stops,
                                           pad_token_id=cfg.generation.pad_token_id if cfg.generation.pad_token_id is not None else self.tokenizer.pad_id)
        # log-probs are taken at the sampling temperature (greedy rollouts: the raw policy)
        self.temperature = cfg.generation.temperature or 1.0

        # The reference model (KL) is built first: build_model resets megatron's RouterReplay
        # registry, which must end up holding the policy's routers.
        self.ref_model = None
        if cfg.loss.kl_coef > 0:
            self.ref_model = build_model(cfg.model, cfg.parallel, st).eval()
        self.model = build_model(cfg.model, cfg.parallel, st, routing_replay=t.routing_replay != "off")
        if cfg.checkpoint.load and not cfg.checkpoint.resume:
            load_model(self.model, cfg.checkpoint.load)
        self.ddp = wrap_ddp(self.model, st, cfg.parallel.use_distributed_optimizer)
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
        log.info("layout: world %d = TP %d x PP %d x DP %d (EP %d, ETP %d, SP %s)", st.world_size, st.tp, st.pp,
                 st.dp, st.ep, st.etp, st.sequence_parallel)

    # ------------------------------------------------------------------------------------------
    def setup_optimizer(self) -> None:
        cfg = self.cfg
        bf16 = cfg.model.precision == "bf16"
        self.optimizer = build_optimizer(cfg.optimizer, self.ddp, self.state, bf16, cfg.parallel.use_distributed_optimizer)
        total = cfg.train.num_steps * cfg.train.num_minibatches
        self.scheduler = build_scheduler(cfg.optimizer, self.optimizer, total)
        ck = cfg.checkpoint
        if ck.resume:
            root = ck.save or ck.load
            if root and latest_complete(root) is not None:
                info = load_checkpoint(root, self.ddp, self.optimizer, self.scheduler)
                self.step = info["step"]
                self.sampler.load_state_dict(info["extra"]["data"])
                log.info("resumed from %s at step %d", info["path"], self.step)
            elif ck.load:
                load_model(self.model, ck.load)

    # ------------------------------------------------------------------------------------------
    def rollout(self) -> RolloutBatch:
        cfg, st = self.cfg, self.state
        prompts = self.sampler.next_batch()
        per = len(prompts) // st.dp
        mine = prompts[st.dp_rank * per:(st.dp_rank + 1) * per]
        G = self.gen_cfg.n_samples_per_prompt
        with self.timer("generate"), (self.recorder.recording() if self.recorder else contextlib.nullcontext()):
            out = generate(self.ddp, [p.ids for p in mine], self.gen_cfg, vocab_size=cfg.model.vocab_size,
                           state=st, seed=cfg.train.seed * 1000 + self.step,
                           on_forward=self.recorder.on_forward if self.recorder else None)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
        with self.timer("reward"):
            rewards = compute_rewards(self.reward_fn, [mine[i // G].text for i in range(len(texts))], texts,
                                      [mine[i // G].answer for i in range(len(texts))])
        advantages = self.advantage_fn(rewards, G)
        tokens, mask, sample_lp = pad_to_common_length(out.tokens, out.response_mask, out.logprobs,
                                                       self.gen_cfg.pad_id, group=None if st.world_size == 1 else dist.group.WORLD)
        batch = RolloutBatch(tokens=tokens, mask=mask[:, 1:], rewards=rewards, advantages=advantages,
                             sample_logprobs=sample_lp[:, 1:], response_texts=texts,
                             sample_ids=[f"{mine[i // G].id}#{i % G}" for i in range(len(texts))])
        mbs = cfg.train.micro_batch_size
        if self.recorder is not None:
            # R3: the rollout's routes, in the micro-batch partition both passes use
            routes = self.recorder.finish(out)
            for i, lo in enumerate(range(0, tokens.shape[0], mbs)):
                rows = list(range(lo, min(lo + mbs, tokens.shape[0])))
                self.replay.load(i, routes.routes_for(rows, seq_len=tokens.shape[1] - 1))
        with self.timer("old_logprob"):
            batch.old_logprobs = compute_logprobs(
                self.ddp, tokens, mbs, cfg.model.vocab_size, st.tp_group, self.temperature,
                on_micro_batch=self._old_pass_context)
            if self.replay.mode == "R3":
                self.replay.finish_pass()  # the training pass replays the same routes once more
            if self.ref_model is not None:
                batch.ref_logprobs = compute_logprobs(self.ref_model, tokens, mbs, cfg.model.vocab_size,
                                                      st.tp_group, self.temperature)
        batch.timings = {"gen_tokens": out.num_generated_tokens, "gen_s": out.elapsed_s}
        return batch

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
        mbs, n_mb = cfg.train.micro_batch_size, cfg.train.num_minibatches
        rows_per_minibatch = batch.num_rows // n_mb
        acc = MetricAccumulator()
        grad_norms, skipped = [], 0
        inject_nan = self.faults.active("nan_logprob", self.step + 1)
        for k in range(n_mb):
            lo = k * rows_per_minibatch
            mini = batch.rows(slice(lo, lo + rows_per_minibatch))
            # The loss divides by the unit count of the whole minibatch over every DP rank, and DDP
            # sums gradients (calculate_per_token_loss): any DP/EP layout gives the DP=1 gradient.
            norm = _all_reduce_sum(batch_normalizer(cfg.loss, mini.mask).reshape(1), st.dp_group)
            n_micro = math.ceil(mini.num_rows / mbs)
            self._set_aux_loss_scale(1.0 / (st.dp * n_micro))
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            bad_rows: list[str] = []
            for j in range(n_micro):
                mb_index = (lo // mbs) + j  # the micro-batch id the old-log-prob pass used
                micro = mini.rows(slice(j * mbs, (j + 1) * mbs))
                with self._train_pass_context(mb_index):
                    logits = forward_logits(self.ddp, micro.tokens[:, :-1])
                    logp, ent = vocab_parallel_logprobs(logits, micro.tokens[:, 1:], cfg.model.vocab_size,
                                                        st.tp_group, temperature=self.temperature)
                    if inject_nan and j == 0:  # test hook (MEGATRON_GSPO_FAULTS)
                        logp = logp + torch.where(micro.mask, float("nan"), 0.0)
                    finite = torch.where(micro.mask, logp.detach(), 0.0).isfinite().all(dim=-1)
                    bad_rows += [micro.sample_ids[r] for r in torch.nonzero(~finite).flatten().tolist()]
                    loss, metrics = compute_policy_loss(
                        cfg.loss, logp, micro.old_logprobs, micro.advantages, micro.mask,
                        ref_logp=micro.ref_logprobs, entropy=ent, global_batch_normalizer=norm[0])
                    with self.replay.backward_replay():
                        loss.backward()
                acc.add(metrics)
            finalize_grads(self.ddp, st)
            # NaN/Inf guard: decided collectively so every rank skips the same update
            local_bad = bool(bad_rows) or not all(
                torch.isfinite(p.main_grad).all() for p in self.ddp.parameters() if getattr(p, "main_grad", None) is not None)
            if _any_rank(local_bad):
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

    def _set_aux_loss_scale(self, scale: float) -> None:
        # megatron injects the MoE aux-loss gradient with this scale on every forward; gradients
        # are summed over DP ranks and micro-batches here, so scale by their count.
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))

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
            "perf/gen_tokens": Metric.sum(torch.tensor([float(batch.timings["gen_tokens"])])),
        }
        acc = MetricAccumulator()
        acc.add(local)
        out = acc.reduce(self.state.dp_group)
        # routing: expert load, aux loss and the share of (token, k) choices that changed between
        # the old-log-prob pass and the training forward (0 under replay), reduced over all ranks
        n_mb = math.ceil(batch.num_rows / self.cfg.train.micro_batch_size)
        stats = None
        for i in range(n_mb):
            s = self.monitor.stats(("train", i), pop=True)
            stats = s if stats is None else stats + s
            self.monitor.drop(("old", i))
        out.update(stats.all_reduce().summary(prefix="routing/"))
        return out

    # ------------------------------------------------------------------------------------------
    def save(self) -> None:
        ck = self.cfg.checkpoint
        if not ck.save:
            return
        save_checkpoint(ck.save, self.step, self.ddp, self.optimizer, self.scheduler,
                        extra={"data": self.sampler.state_dict(), "config": to_dict(self.cfg)},
                        is_main=self.state.is_main, keep_last=ck.keep_last,
                        fault_hook=self.faults.save_hook(self.step))

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        if t.sft_steps > 0 and self.step == 0 and not cfg.checkpoint.resume:
            sft_warm_start(self)
        self.setup_optimizer()
        history = []
        while self.step < t.num_steps:
            if _any_rank(self.preempt.set):
                self.save()
                saved = f"checkpoint saved to {self.cfg.checkpoint.save}" if self.cfg.checkpoint.save else \
                    "NO checkpoint written (checkpoint.save is not set)"
                raise TrainingStopped(f"preempted by signal {self.preempt.received or '(on another rank)'} before "
                                      f"step {self.step + 1}: {saved}; exiting with {EXIT_PREEMPTED} "
                                      "(resume with checkpoint.resume=true)", EXIT_PREEMPTED)
            self.faults.at_step_start(self.step + 1)
            t0 = time.perf_counter()
            # every random draw of a step is a function of (seed, step): resume is exact
            parallel.set_seed(t.seed + self.step, self.state)
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


def summarize(history: list[dict]) -> str:
    r = [h["rollout/reward_mean"] for h in history]
    k = min(10, max(1, len(r) // 2))
    first, last = sum(r[:k]) / k, sum(r[-k:]) / k
    return (f"mean reward of the first {k} GSPO steps {first:.3f} -> last {k} steps {last:.3f} "
            f"(+{last - first:.3f})")


DEMO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo_gspo.yaml")


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    path = argv.pop(0) if argv and not argv[0].startswith("-") and "=" not in argv[0] else None
    if path is None:
        # no YAML: the built-in demo job (tiny MoE, arithmetic task), overrides still apply
        path = DEMO_CONFIG
    cfg = load_job_config(path, argv)
    trainer = Trainer(cfg)
    log.info("config: %s %s", path, " ".join(argv))
    try:
        result = trainer.run()
        if trainer.state.is_main and result["history"]:
            log.info(summarize(result["history"]))
    except TrainingStopped as e:
        log.error("%s", e)
        return e.exit_code
    finally:
        trainer.logger.close()
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
