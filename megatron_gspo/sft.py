"""Supervised warm start: a few cross-entropy steps on (prompt, reference answer) pairs.

Real RL starts from a supervised model; the built-in task's tiny random model has no policy worth
reinforcing, so the demo job first teaches it the output format and a rough skill, then GSPO
does the rest. The loss covers answer tokens (and the closing EOS) only, not the prompt.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from megatron_gspo.logprobs import vocab_parallel_logprobs
from megatron_gspo.model import finalize_grads, forward_logits
from megatron_gspo.optim import build_optimizer, optimizer_step
from megatron_gspo.rollout import common_length, pad_columns

log = logging.getLogger("megatron_gspo")


def build_sft_batch(prompts, tokenizer, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens [B, T] (prompt + answer + eos, right-padded), loss mask [B, T-1] on the targets."""
    seqs, starts = [], []
    for p in prompts:
        if p.answer is None:
            raise ValueError(f"prompt {p.id}: supervised warm start needs a reference answer")
        ans = tokenizer.encode(str(p.answer)) + [tokenizer.eos_id]
        seqs.append(list(p.ids) + ans)
        starts.append(len(p.ids))
    T = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1, dtype=torch.bool)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        tokens[i, : len(s)] = torch.tensor(s)
        mask[i, st - 1: len(s) - 1] = True  # targets tokens[st:] are the answer
    return tokens, mask


def sft_warm_start(trainer) -> None:
    cfg, st = trainer.cfg, trainer.state
    t = cfg.train
    opt_cfg = dataclasses.replace(cfg.optimizer, lr=t.sft_lr, min_lr=0.0, lr_warmup_steps=0,
                                  lr_decay_style="constant", weight_decay=0.0)
    optimizer = build_optimizer(opt_cfg, trainer.ddp, st, cfg.model.precision == "bf16", False)
    # draw from the sampler's own dataset with a separate stream so the RL data order is untouched
    from megatron_gspo.data import PromptSampler

    sampler = PromptSampler(trainer.sampler.dataset, trainer.tokenizer,
                            dataclasses.replace(cfg.data, seed=cfg.data.seed + 7919), t.sft_batch_size)
    pad = trainer.gen_cfg.pad_id
    for step in range(t.sft_steps):
        prompts = sampler.next_batch()
        per = len(prompts) // st.dp
        tokens, mask = build_sft_batch(prompts[st.dp_rank * per:(st.dp_rank + 1) * per], trainer.tokenizer, pad)
        # one width on every rank (MoE dispatch is a collective) and (T - 1) % TP == 0 under SP
        T = common_length(tokens.shape[1], st.tp if st.sequence_parallel else 1, group=torch.distributed.group.WORLD)
        tokens, mask = pad_columns(tokens, T, pad), pad_columns(mask, T - 1, False)
        n = torch.tensor([float(mask.sum())])
        if st.dp > 1:
            torch.distributed.all_reduce(n, group=st.dp_group)
        trainer.ddp.zero_grad_buffer()
        optimizer.zero_grad()
        logits = forward_logits(trainer.ddp, tokens[:, :-1])
        lp, _ = vocab_parallel_logprobs(logits, tokens[:, 1:], cfg.model.vocab_size, st.tp_group, with_entropy=False)
        loss = -(lp * mask).sum() / n[0]
        loss.backward()
        finalize_grads(trainer.ddp, st)
        optimizer_step(optimizer)
        if (step + 1) % max(1, t.sft_steps // 10) == 0 or step == t.sft_steps - 1:
            nll = loss.detach().reshape(1)  # this rank's share of the global mean
            if st.dp > 1:
                torch.distributed.all_reduce(nll, group=st.dp_group)
            log.info("sft step %d/%d | nll %.4f", step + 1, t.sft_steps, nll.item())
