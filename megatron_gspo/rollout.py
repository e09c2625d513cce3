"""From prompts to a training batch: the first half of an RL step (``Rollouts.collect``).

    1. draw the step's P prompts, the same on every rank                      data.PromptSampler
    2. keep this rank's rows: its share of every minibatch                    local_rows
    3. sample G responses per prompt on the training model (KV cache)        generation.generate
    4. score them; advantages over every rank's rewards                       rewards, global_advantages
    5. pad to a width every rank shares; old (and reference) log-probs       compute_logprobs
The routing policy is told at 3 (R3 records routes) and 5 (reference routes, R2 records, R3
replays); ``Rollouts.metrics`` reduces the rollout's own metrics over DP.

Global rows. A step's rollout is P prompts x G samples = R rows in prompt-major order (global row
g = prompt g // G, sample g % G), split into ``num_minibatches`` consecutive minibatches of R / M rows
(one optimizer step each). Data parallelism never changes which rows a minibatch holds: DP rank r
holds the r-th contiguous share of every minibatch (``local_rows``). Sampling noise is keyed by the
global row (sampling.py) and advantages are computed over the gathered rewards of all rows, so the
rollout, the minibatches and hence every update are the same under any DP / TP / EP layout.

Token grid. Generation returns right-padded rows ``tokens [B, T]`` (prompt from column 0, then
the response, then pad) with ``response_mask [B, T]``. Training forwards ``tokens[:, :-1]`` and
scores ``tokens[:, 1:]``, so every per-token tensor used by the losses lives on the shifted
``[B, T-1]`` grid: ``mask = response_mask[:, 1:]``. The last token of a row is never an input,
which is also why routing recorded during generation (R3) needs no route for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_gspo import comm
from megatron_gspo.generation import generate
from megatron_gspo.logprobs import vocab_parallel_logprobs
from megatron_gspo.metrics import Metric, MetricAccumulator
from megatron_gspo.model import forward_logits, input_padding_mask
from megatron_gspo.rewards import compute_rewards

# Called around each micro-batch forward with its index: routing replay/monitor hooks use it.
MicroBatchHook = Optional[Callable[[int], "object"]]


@dataclass
class RolloutBatch:
    """One rank's share of a step's rollouts on the shifted [B, T-1] grid (see module doc)."""

    tokens: torch.Tensor  # [B, T] long
    mask: torch.Tensor  # [B, T-1] bool: response tokens among the targets tokens[:, 1:]
    seq_lengths: torch.Tensor  # [B] long: prompt + response tokens (the rest of the row is padding)
    row_ids: torch.Tensor  # [B] long: global row index (prompt x G + sample) of each local row
    rewards: torch.Tensor  # [B] fp32
    advantages: torch.Tensor  # [B] fp32
    sample_logprobs: torch.Tensor  # [B, T-1] fp32, from the generator
    old_logprobs: Optional[torch.Tensor] = None  # [B, T-1] fp32, recomputed by the training model
    ref_logprobs: Optional[torch.Tensor] = None  # [B, T-1] fp32, reference policy (KL)
    sample_ids: list = field(default_factory=list)  # "<prompt id>#<sample>" per row, for error reports
    response_texts: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def input_padding_mask(self) -> torch.Tensor:
        """[B, T-1] bool: True where the forward's input ``tokens[:, :-1]`` holds no real token."""
        return input_padding_mask(self.seq_lengths, self.tokens.shape[1] - 1)

    def rows(self, idx: slice) -> "RolloutBatch":
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return RolloutBatch(
            tokens=self.tokens[idx], mask=self.mask[idx], seq_lengths=self.seq_lengths[idx],
            row_ids=self.row_ids[idx], rewards=self.rewards[idx],
            advantages=self.advantages[idx], sample_logprobs=self.sample_logprobs[idx],
            old_logprobs=pick(self.old_logprobs), ref_logprobs=pick(self.ref_logprobs),
            sample_ids=self.sample_ids[idx],
        )


def common_length(length: int, multiple_of: int, device: torch.device, group=None) -> int:
    """A token-grid width T shared by every rank of ``group`` with (T - 1) % multiple_of == 0.

    With the allgather MoE dispatcher every forward is a collective over the TP x EP ranks and
    needs the same [b, s] on each; under sequence parallel the forward's input ``tokens[:, :-1]``
    is split over TP, so its length must divide by TP.
    """
    T = comm.max_int(length, device, group, what="common token-grid width")
    return 1 + math.ceil((T - 1) / multiple_of) * multiple_of


def local_rows(num_rows: int, num_minibatches: int, dp_size: int, dp_rank: int) -> list[int]:
    """Global row indices held by DP rank ``dp_rank``: its contiguous share of every minibatch.

    Minibatch k is rows [k R/M, (k+1) R/M) whatever the DP size, so an update never depends on how
    many ranks share it."""
    per_mini, share = num_rows // num_minibatches, num_rows // (num_minibatches * dp_size)
    if share * num_minibatches * dp_size != num_rows:
        raise ValueError(f"{num_rows} rollout rows cannot be split into {num_minibatches} minibatches x "
                         f"{dp_size} data-parallel ranks")
    return [k * per_mini + dp_rank * share + i for k in range(num_minibatches) for i in range(share)]


def global_advantages(rewards: torch.Tensor, row_ids: torch.Tensor, num_rows: int, group_size: int,
                      estimator, dp_size: int, num_minibatches: int, dp_group) -> torch.Tensor:
    """Advantages of this rank's rows [B] computed over every rank's rewards.

    rewards, row_ids: [B] on the compute device (this rank's rows). The rewards of all R rows are
    gathered over the DP group (a group of G samples may be spread over ranks) and the estimator
    runs on [R] in global row order, so every rank computes the same numbers."""
    parts = comm.all_gather(rewards.float(), dp_group, what="advantages: rewards of every data-parallel rank")
    full = torch.empty(num_rows, dtype=torch.float32, device=rewards.device)
    for r, part in enumerate(parts):
        ids = torch.tensor(local_rows(num_rows, num_minibatches, dp_size, r), device=rewards.device)
        full[ids] = part
    return estimator(full, group_size)[row_ids]


def pad_columns(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad [B, T] to [B, width]."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def micro_batch_slices(num_rows: int, num_minibatches: int, micro_batch_size: int) -> list[list[slice]]:
    """Rows of each minibatch, split into micro-batches of at most ``micro_batch_size``.

    The old-log-prob pass and the training pass use this one partition: routing replay and the
    routing monitor key their records by the flat index of a micro-batch in it.
    """
    per = num_rows // num_minibatches
    return [[slice(lo, min(lo + micro_batch_size, hi)) for lo in range(k * per, hi, micro_batch_size)]
            for k, hi in ((k, (k + 1) * per) for k in range(num_minibatches))]


@torch.no_grad()
def compute_logprobs(model, tokens: torch.Tensor, micro_batches: list[slice], vocab_size: int, tp_group,
                     temperature: float = 1.0, on_micro_batch: MicroBatchHook = None,
                     padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Forward-only per-token log-probs of tokens[:, 1:], one forward per row slice in
    ``micro_batches`` (which cover the rows in order): [B, T-1] fp32. padding_mask [B, T-1]: see
    model.forward_logits.

    ``on_micro_batch(i)`` may return a context manager entered around micro-batch i's forward
    (routing record / monitor capture)."""
    out = []
    for i, rows in enumerate(micro_batches):
        mb = tokens[rows]
        ctx = on_micro_batch(i) if on_micro_batch is not None else contextlib.nullcontext()
        with ctx:
            logits = forward_logits(model, mb[:, :-1], padding_mask=None if padding_mask is None else padding_mask[rows])
        lp, _ = vocab_parallel_logprobs(logits, mb[:, 1:], vocab_size, tp_group, temperature=temperature,
                                        with_entropy=False)
        out.append(lp)
    return torch.cat(out, dim=0)


class Rollouts:
    """Prompts -> RolloutBatch on this rank, every step (see the module docstring).

    cfg: the JobConfig; gen_cfg: the generation section with the tokenizer's stop and pad ids filled
    in; model / ref_model: the policy (DDP-wrapped) and the frozen KL reference (or None); routing:
    the RoutingPolicy; timer: where the sections' wall times go."""

    def __init__(self, cfg, state, model, ref_model, sampler, tokenizer, reward_fn, advantage_fn, gen_cfg,
                 routing, timer) -> None:
        self.cfg, self.state, self.model, self.ref_model = cfg, state, model, ref_model
        self.sampler, self.tokenizer, self.reward_fn, self.advantage_fn = sampler, tokenizer, reward_fn, advantage_fn
        self.routing, self.timer = routing, timer
        self.gen_cfg = gen_cfg
        # generate() gets one row per sample: a sample's noise is keyed by its global row
        self.row_gen_cfg = dataclasses.replace(gen_cfg, n_samples_per_prompt=1)
        # log-probs are taken at the sampling temperature (greedy rollouts: the raw policy)
        self.temperature = gen_cfg.temperature or 1.0

    def micro_batches(self, num_rows: int) -> list[slice]:
        """This rank's micro-batches, minibatch after minibatch: the one partition both passes use."""
        t = self.cfg.train
        return [s for mini in micro_batch_slices(num_rows, t.num_minibatches, t.micro_batch_size) for s in mini]

    def sampling_seed(self, step: int) -> int:
        """(generation.seed, step) in one 64-bit key; sampling.py keys every draw by row and position too."""
        return (self.gen_cfg.seed << 32) + step

    def collect(self, step: int) -> RolloutBatch:
        cfg, st, dev = self.cfg, self.state, self.state.device
        vocab = cfg.model.vocab_size
        prompts = self.sampler.next_batch()  # 1. the same P prompts on every rank
        G = self.gen_cfg.n_samples_per_prompt
        R = len(prompts) * G
        rows = local_rows(R, cfg.train.num_minibatches, st.dp, st.dp_rank)  # 2.
        mine = [prompts[g // G] for g in rows]
        with self.timer("generate"), self.routing.generating():  # 3.
            out = generate(self.model, [p.ids for p in mine], self.row_gen_cfg, vocab_size=vocab, state=st,
                           seed=self.sampling_seed(step), row_keys=rows,
                           on_forward=self.routing.on_generation_forward)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
        with self.timer("reward"):  # 4.
            rewards = compute_rewards(self.reward_fn, [p.text for p in mine], texts, [p.answer for p in mine],
                                      device=dev)
        row_ids = torch.tensor(rows, dtype=torch.long, device=dev)
        advantages = global_advantages(rewards, row_ids, R, G, self.advantage_fn, st.dp, cfg.train.num_minibatches,
                                       st.dp_group)
        # 5. one width on every rank (MoE dispatch is a collective), (T - 1) % TP == 0 under SP
        T = common_length(out.tokens.shape[1], st.tp if st.sequence_parallel else 1, dev, group=dist.group.WORLD)
        tokens = pad_columns(out.tokens, T, self.gen_cfg.pad_id)
        mask, sample_lp = pad_columns(out.response_mask, T, False), pad_columns(out.logprobs, T, 0.0)
        batch = RolloutBatch(tokens=tokens, mask=mask[:, 1:], seq_lengths=out.prompt_lengths + out.response_lengths,
                             row_ids=row_ids, rewards=rewards, advantages=advantages,
                             sample_logprobs=sample_lp[:, 1:], response_texts=texts,
                             sample_ids=[f"{p.id}#{g % G}" for p, g in zip(mine, rows)])
        micro = self.micro_batches(batch.num_rows)
        self.routing.after_generation(out, micro, seq_len=T - 1)
        pad_mask = batch.input_padding_mask()
        with self.timer("old_logprob"):
            batch.old_logprobs = compute_logprobs(self.model, tokens, micro, vocab, st.tp_group, self.temperature,
                                                  on_micro_batch=self.routing.old_pass, padding_mask=pad_mask)
            self.routing.after_old_pass()
            if self.ref_model is not None:
                batch.ref_logprobs = compute_logprobs(self.ref_model, tokens, micro, vocab, st.tp_group,
                                                      self.temperature, padding_mask=pad_mask)
        batch.timings = {"gen_tokens": out.num_generated_tokens, "gen_s": out.elapsed_s}
        return batch

    def metrics(self, batch: RolloutBatch) -> dict:
        """rollout/* (rewards, lengths, sampling vs recomputed log-probs) and perf/gen_tokens, over DP."""
        m = batch.mask
        diff = (batch.old_logprobs - batch.sample_logprobs).abs()
        acc = MetricAccumulator()
        acc.add({
            "rollout/reward_mean": Metric.mean(batch.rewards),
            "rollout/reward_std": Metric.std(batch.rewards),
            "rollout/response_length_mean": Metric.mean(m.sum(-1).float()),
            "rollout/response_length_max": Metric.max(m.sum(-1).float()),
            # generation ran on the training model itself: this is numerical noise only
            "rollout/logprob_diff_mean": Metric.mean(diff, m),
            "rollout/logprob_diff_max": Metric.max(diff, m),
            "perf/gen_tokens": Metric.sum(torch.tensor([float(batch.timings["gen_tokens"])], device=self.state.device)),
        })
        return acc.reduce(self.state.dp_group)
