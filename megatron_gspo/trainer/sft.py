"""Supervised warm start: a few cross-entropy steps on (prompt, reference answer) pairs.

Real RL starts from a supervised model; the built-in task's tiny random model has no policy worth
reinforcing, so the demo job first teaches it the output format and a rough skill, then GSPO
does the rest. The loss covers answer tokens (and the closing EOS) only, not the prompt.

Like the RL update, an SFT step's gradient does not depend on the layout or the micro-batch size:
the loss is normalized by the target tokens of the whole batch over every DP rank, DDP sums, the
batch is micro-batched with ``train.micro_batch_size`` and the MoE aux loss gets the same weights
(model.aux_loss_scales). Its optimizer is laid out as the parallel state says, like the RL one.

A stop signal (SLURM's time limit, scancel) ends the warm start between two of its steps, like an RL
step: the trainer saves it as the checkpoint of step 0 (weights, its optimizer and its data position,
``SFTRun.state_dict``) and exits 75; a resume continues it where it stopped, with the result of an
uninterrupted one (tests/test_stop_signals.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_gspo.runtime import comm
from megatron_gspo.data.prompts import PromptDataset, PromptSampler
from megatron_gspo.errors import DataError, EnvError, TokenizerError
from megatron_gspo.runtime.hooks import TrainerHook
from megatron_gspo.model.gpt import (
    aux_loss_scales,
    finalize_grads,
    forward_logprobs,
    input_padding_mask,
    set_aux_loss_scale,
)
from megatron_gspo.model.oom import explain_oom
from megatron_gspo.trainer.optim import build_optimizer, optimizer_step
from megatron_gspo.rollout.prepare import forward_width_multiple
from megatron_gspo.rollout.rows import common_length, micro_batch_slices, pad_columns

log = logging.getLogger("megatron_gspo")


def sft_rows(prompts, tokenizer, max_length: Optional[int] = None) -> tuple[list[list[int]], list[int], int]:
    """(rows: prompt + answer + eos token ids, where each row's answer starts, how many rows were cut). A row
    longer than ``max_length`` (model.max_position_embeddings) keeps its first ``max_length`` tokens: the
    prompt whole (data.max_prompt_length keeps it shorter) and the start of its answer, without the eos
    (the right truncation of TRL's SFTTrainer, verl's SFT ``truncation: right``)."""
    rows, starts, cut = [], [], 0
    for p in prompts:
        if p.answer is None or getattr(p.answer, "missing", False):
            raise DataError(f"prompt {p.id}: the supervised warm start (train.sft_steps > 0) needs a reference "
                            "answer (data.answer_key)")
        row = list(p.ids) + tokenizer.encode(str(p.answer)) + [tokenizer.eos_id]
        if max_length is not None and len(row) > max_length:
            row, cut = row[:max_length], cut + 1
        rows.append(row)
        starts.append(len(p.ids))
    return rows, starts, cut


def build_sft_batch(prompts, tokenizer, pad_id: int, device="cpu",
                    max_length: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> tokens [B, T] (prompt + answer + eos, right-padded; a row over ``max_length`` cut: sft_rows), loss mask
    [B, T-1] on the targets, lengths [B] (real tokens per row); all on ``device``."""
    rows, starts, _ = sft_rows(prompts, tokenizer, max_length)
    return pad_sft_rows(rows, starts, pad_id, device)


def pad_sft_rows(seqs: list[list[int]], starts: list[int], pad_id: int,
                 device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sft_rows' rows as build_sft_batch's (tokens, loss mask, lengths)."""
    T = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1, dtype=torch.bool)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        tokens[i, : len(s)] = torch.tensor(s)
        mask[i, st - 1: len(s) - 1] = True  # targets tokens[st:] are the answer
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    return tokens.to(device), mask.to(device), lengths.to(device)


class DemonstrationSampler(PromptSampler):
    """The warm start's batches of a multi-turn job with env.sft_source: demonstrations ({"messages": [...]}),
    each drawn as (ids, loss mask) by env.chat.conversation_ids, the way the rollout tokenizes a row; the order
    and its resume state are PromptSampler's."""

    def __init__(self, cfg, tokenizer, batch_size: int) -> None:
        from megatron_gspo.env.chat import build_format
        from megatron_gspo.env.tools import load_tools

        dataset = PromptDataset.from_jsonl(cfg.env.sft_source, prompt_key="messages", answer_key=None,
                                           key="env.sft_source")
        super().__init__(dataset, tokenizer, dataclasses.replace(cfg.data, seed=cfg.data.seed + 7919,
                                                                 apply_chat_template=False), batch_size)
        self.fmt = build_format(tokenizer, cfg.data, cfg.env.tool_format)
        self.tools = [t.schema() for t in load_tools(cfg.env.tools).values()] if cfg.env.tools else None
        self.limit = cfg.model.max_position_embeddings

    def encode(self, example):
        from megatron_gspo.env.chat import conversation_ids

        try:
            ids, mask = conversation_ids(self.fmt, example.prompt, self.tools)
        except (EnvError, TokenizerError) as e:
            raise DataError(f"{example.where} (env.sft_source): {e}") from None
        if len(ids) > self.limit:  # a whole conversation or none: a cut one would end inside a turn
            raise DataError(f"{example.where} (env.sft_source): the conversation is {len(ids)} tokens > "
                            f"model.max_position_embeddings={self.limit}; shorten it")
        return ids, mask


def build_demonstration_batch(items, pad_id: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Demonstrations [(ids, loss mask)] -> tokens [B, T], loss mask [B, T-1] on the targets, lengths [B]
    (as build_sft_batch)."""
    T = max(len(ids) for ids, _ in items)
    tokens = torch.full((len(items), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(items), T - 1, dtype=torch.bool)
    for i, (ids, m) in enumerate(items):
        tokens[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids) - 1] = torch.tensor(m[1:], dtype=torch.bool)
    lengths = torch.tensor([len(ids) for ids, _ in items], dtype=torch.long)
    return tokens.to(device), mask.to(device), lengths.to(device)


class SFTRun:
    """The warm start's state: its optimizer, its own prompt stream and the steps done, so that a stop
    signal can cut it short between two steps and a checkpoint of it (StopControl.save_warm_start, in
    trainer/stopping.py) continues exactly where it stopped. model: the DDP-wrapped policy; cfg: the JobConfig (train.sft_*, optimizer,
    model, data); pad: the padding token id. ``optimizer=False``: none is built (a finished warm start
    that only restores its weights)."""

    def __init__(self, model, state, cfg, dataset, tokenizer, pad: int, optimizer: bool = True) -> None:
        self.model, self.state, self.cfg, self.tokenizer, self.pad = model, state, cfg, tokenizer, pad
        t = cfg.train
        self.steps = t.sft_steps
        opt_cfg = dataclasses.replace(cfg.optimizer, lr=t.sft_lr, min_lr=0.0, lr_warmup_steps=0,
                                      lr_decay_style="constant", weight_decay=0.0)
        self.optimizer = build_optimizer(opt_cfg, model, state, cfg.model.precision == "bf16") if optimizer else None
        # draw from the same dataset with a separate stream so the RL data order is untouched; a multi-turn job
        # with demonstrations (env.sft_source) learns those instead
        self.demonstrations = cfg.env.enabled and cfg.env.sft_source is not None
        self.sampler = (DemonstrationSampler(cfg, tokenizer, t.sft_batch_size) if self.demonstrations else
                        PromptSampler(dataset, tokenizer, dataclasses.replace(cfg.data, seed=cfg.data.seed + 7919),
                                      t.sft_batch_size))
        self.done = self.first = 0  # steps done; where this process started (a checkpoint's progress)
        self.rows = self.cut = 0  # rows trained on by this process, and those cut at model.max_position_embeddings

    @property
    def finished(self) -> bool:
        return self.done >= self.steps

    @property
    def progressed(self) -> bool:
        """This process completed a step of the warm start (a stop has something new to save)."""
        return self.done > self.first

    def state_dict(self) -> dict:
        """What a checkpoint of the warm start holds besides the weights and the optimizer."""
        return {"step": min(self.done, self.steps), "steps": self.steps, "data": self.sampler.state_dict()}

    def load_state_dict(self, sd: dict, accept=lambda key: False) -> None:
        self.done = self.first = int(sd["step"])
        self.sampler.load_state_dict(sd["data"], accept=accept)

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Steps until ``steps``; True when the warm start is over, False when ``should_stop()`` (a
        collective vote, read before every step) cut it short."""
        while not self.finished:
            if should_stop():
                return False
            self.step()
        if self.cut and self.state.is_main:
            log.info("SFT warm start: %d of its %d rows were cut at model.max_position_embeddings=%d tokens",
                     self.cut, self.rows, self.cfg.model.max_position_embeddings)
        return True

    def _rows(self, prompts) -> tuple[list[list[int]], list[int]]:
        """This rank's share of the batch ``prompts`` as sft_rows; rows cut for length counted over the whole
        batch (said at the first step that cuts any)."""
        limit = self.cfg.model.max_position_embeddings
        rows, starts, cut = sft_rows(prompts, self.tokenizer, limit)
        per = len(prompts) // self.state.dp
        mine = slice(self.state.dp_rank * per, (self.state.dp_rank + 1) * per)
        if cut and not self.cut and self.state.is_main:
            log.warning("SFT step %d: %d of %d rows (prompt + reference answer + eos) are longer than "
                        "model.max_position_embeddings=%d tokens; each keeps its first %d tokens (its answer cut on "
                        "the right, without its eos; the total is said when the warm start ends)", self.done + 1, cut,
                        len(prompts), limit, limit)
        self.rows, self.cut = self.rows + len(prompts), self.cut + cut
        return rows[mine], starts[mine]

    def step(self) -> None:
        """One supervised step on ``sft_batch_size`` prompts (collective)."""
        model, st, cfg, t, pad = self.model, self.state, self.cfg, self.cfg.train, self.pad
        prompts = self.sampler.next_batch()
        per = len(prompts) // st.dp
        if self.demonstrations:
            mine = prompts[st.dp_rank * per:(st.dp_rank + 1) * per]
            tokens, mask, lengths = build_demonstration_batch(mine, pad, st.device)
        else:
            tokens, mask, lengths = pad_sft_rows(*self._rows(prompts), pad, st.device)
        # one width on every rank (MoE dispatch is a collective); (T - 1) % TP == 0 under SP, and a
        # multiple of FP8's token alignment under FP8 (rollout.forward_width_multiple)
        T = common_length(tokens.shape[1], forward_width_multiple(model, st), st.device, group=dist.group.WORLD)
        tokens, mask = pad_columns(tokens, T, pad), pad_columns(mask, T - 1, False)
        n = comm.all_reduce(mask.sum().to(torch.float32).reshape(1), "sum", st.dp_group, what="SFT: target tokens over DP")
        micro = micro_batch_slices(per, 1, t.micro_batch_size)[0]
        pad_masks = [input_padding_mask(lengths[sl], T - 1) for sl in micro]
        scales = aux_loss_scales(pad_masks, st, cfg.model.moe_router_load_balancing_type, cfg.model.moe_aux_loss_coeff)
        model.zero_grad_buffer()
        self.optimizer.zero_grad()
        nll = torch.zeros(1, device=st.device)
        for j, sl in enumerate(micro):
            with explain_oom("sft", cfg, st, f"micro-batch of {sl.stop - sl.start} rows x {T - 1} tokens"):
                lp, _ = forward_logprobs(model, tokens[sl, :-1], tokens[sl, 1:], cfg.model.vocab_size,
                                         with_entropy=False, padding_mask=pad_masks[j])
                loss = -(lp * mask[sl]).sum() / n[0]
                set_aux_loss_scale(scales[j], st.device)
                loss.backward()
            nll += loss.detach()  # this rank's share of the global mean
        finalize_grads(model, st)
        optimizer_step(self.optimizer, st.device)
        self.done += 1
        step = self.done - 1
        if (step + 1) % max(1, self.steps // 10) == 0 or step == self.steps - 1:
            comm.all_reduce(nll, "sum", st.dp_group, what="SFT: loss over DP")
            log.info("sft step %d/%d | nll %.4f", step + 1, self.steps, nll.item())


class SFTWarmStart(TrainerHook):
    """The warm start as a hook: before the RL optimizer exists (bf16 master weights copy the
    parameters when it is built), on a fresh start, or continuing a checkpoint of a warm start that a
    stop signal cut short (trainer.checkpoints.warm_start); not when a training checkpoint is resumed
    (it holds the warmed-up policy). Every step is preceded by the trainer's stop vote: a stop signal
    ends the warm start between two steps, and the trainer saves it (Trainer.stop_if_preempted)."""

    def before_training(self, trainer) -> None:
        progress = trainer.checkpoints.warm_start
        if trainer.resumed or (trainer.cfg.train.sft_steps <= 0 and progress is None):
            return
        finished = progress is not None and progress["step"] >= trainer.cfg.train.sft_steps
        run = SFTRun(trainer.ddp, trainer.state, trainer.cfg, trainer.sampler.dataset, trainer.tokenizer,
                     trainer.prepare.gen_cfg.pad_id, optimizer=not finished)
        if progress is not None:  # the weights (and, half-way, the optimizer) of the checkpoint
            info = trainer.checkpoints.restore(trainer.ddp, run.optimizer, None)
            run.load_state_dict(progress, accept=trainer.checkpoints.change_allowed)
            log.info("resumed the supervised warm start from %s at SFT step %d of %d", info["path"], run.done,
                     run.steps)
        trainer.stopping.warm_start = run  # what a stop signal from now on saves
        if not run.run(should_stop=lambda: trainer.stop_requested("preemption vote in the SFT warm start")):
            trainer.stop_if_preempted(agreed=True)
        run.optimizer = None  # its memory goes before the RL optimizer is built


def sft_warm_start(model, state, cfg, dataset, tokenizer, pad: int) -> None:
    """``train.sft_steps`` supervised steps on ``dataset``'s (prompt, answer) pairs, without stopping.
    model: the DDP-wrapped policy; cfg: the JobConfig (train.sft_*, optimizer, model, data); pad: the
    padding token id."""
    SFTRun(model, state, cfg, dataset, tokenizer, pad).run()
