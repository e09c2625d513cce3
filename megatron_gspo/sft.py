"""Supervised warm start: a few cross-entropy steps on (prompt, reference answer) pairs.

Real RL starts from a supervised model; the built-in task's tiny random model has no policy worth
reinforcing, so the demo job first teaches it the output format and a rough skill, then GSPO
does the rest. The loss covers answer tokens (and the closing EOS) only, not the prompt.

Like the RL update, an SFT step's gradient does not depend on the layout or the micro-batch size:
the loss is normalized by the target tokens of the whole batch over every DP rank, DDP sums, the
batch is micro-batched with ``train.micro_batch_size`` and the MoE aux loss gets the same weights
(model.aux_loss_scales). Its optimizer is laid out as the parallel state says, like the RL one.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from megatron_gspo import comm
from megatron_gspo.data import PromptSampler
from megatron_gspo.errors import DataError
from megatron_gspo.hooks import TrainerHook
from megatron_gspo.model import (
    aux_loss_scales,
    finalize_grads,
    forward_logprobs,
    input_padding_mask,
    set_aux_loss_scale,
)
from megatron_gspo.oom import explain_oom
from megatron_gspo.optim import build_optimizer, optimizer_step
from megatron_gspo.rollout import common_length, forward_width_multiple, micro_batch_slices, pad_columns

log = logging.getLogger("megatron_gspo")


def build_sft_batch(prompts, tokenizer, pad_id: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> tokens [B, T] (prompt + answer + eos, right-padded), loss mask [B, T-1] on the targets,
    lengths [B] (real tokens per row); all on ``device``."""
    seqs, starts = [], []
    for p in prompts:
        if p.answer is None:
            raise DataError(f"prompt {p.id}: the supervised warm start (train.sft_steps > 0) needs a reference "
                            "answer (data.answer_key)")
        ans = tokenizer.encode(str(p.answer)) + [tokenizer.eos_id]
        seqs.append(list(p.ids) + ans)
        starts.append(len(p.ids))
    T = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1, dtype=torch.bool)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        tokens[i, : len(s)] = torch.tensor(s)
        mask[i, st - 1: len(s) - 1] = True  # targets tokens[st:] are the answer
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    return tokens.to(device), mask.to(device), lengths.to(device)


class SFTWarmStart(TrainerHook):
    """The warm start as a hook: before the RL optimizer exists (bf16 master weights copy the
    parameters when it is built), unless the run resumes (the checkpoint holds the warmed-up policy)."""

    def before_training(self, trainer) -> None:
        if trainer.cfg.train.sft_steps > 0 and not trainer.resumed:
            sft_warm_start(trainer.ddp, trainer.state, trainer.cfg, trainer.sampler.dataset, trainer.tokenizer,
                           trainer.rollouts.gen_cfg.pad_id)


def sft_warm_start(model, state, cfg, dataset, tokenizer, pad: int) -> None:
    """``train.sft_steps`` supervised steps on ``dataset``'s (prompt, answer) pairs. model: the DDP-wrapped
    policy; cfg: the JobConfig (train.sft_*, optimizer, model, data); pad: the padding token id."""
    st, t = state, cfg.train
    opt_cfg = dataclasses.replace(cfg.optimizer, lr=t.sft_lr, min_lr=0.0, lr_warmup_steps=0,
                                  lr_decay_style="constant", weight_decay=0.0)
    optimizer = build_optimizer(opt_cfg, model, st, cfg.model.precision == "bf16")
    # draw from the same dataset with a separate stream so the RL data order is untouched
    sampler = PromptSampler(dataset, tokenizer, dataclasses.replace(cfg.data, seed=cfg.data.seed + 7919),
                            t.sft_batch_size)
    for step in range(t.sft_steps):
        prompts = sampler.next_batch()
        per = len(prompts) // st.dp
        tokens, mask, lengths = build_sft_batch(prompts[st.dp_rank * per:(st.dp_rank + 1) * per], tokenizer, pad,
                                                st.device)
        # one width on every rank (MoE dispatch is a collective); (T - 1) % TP == 0 under SP, and a
        # multiple of FP8's token alignment under FP8 (rollout.forward_width_multiple)
        T = common_length(tokens.shape[1], forward_width_multiple(model, st), st.device, group=dist.group.WORLD)
        tokens, mask = pad_columns(tokens, T, pad), pad_columns(mask, T - 1, False)
        n = comm.all_reduce(mask.sum().to(torch.float32).reshape(1), "sum", st.dp_group, what="SFT: target tokens over DP")
        micro = micro_batch_slices(per, 1, t.micro_batch_size)[0]
        pad_masks = [input_padding_mask(lengths[sl], T - 1) for sl in micro]
        scales = aux_loss_scales(pad_masks, st, cfg.model.moe_router_load_balancing_type, cfg.model.moe_aux_loss_coeff)
        model.zero_grad_buffer()
        optimizer.zero_grad()
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
        optimizer_step(optimizer, st.device)
        if (step + 1) % max(1, t.sft_steps // 10) == 0 or step == t.sft_steps - 1:
            comm.all_reduce(nll, "sum", st.dp_group, what="SFT: loss over DP")
            log.info("sft step %d/%d | nll %.4f", step + 1, t.sft_steps, nll.item())
