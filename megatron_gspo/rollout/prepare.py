"""From a step's RolloutRecord to the training batch: ``BatchPreparer(record) -> TrainBatch``.

    1. advantages over the step's rewards of every row (record.global_rewards, by global row id)
    2. truncation flags (overlong filtering)                                                    algorithms.overlong
    3. micro-batches of rows of similar length, the same shapes where ranks must agree           plan_micro_batches
    4. the rows' behaviour routes (routing.RoutingPolicy.batch_routes: the record's, or the old-log-prob pass's),
       old log-probs (recomputed, or the sampling ones per train.old_logprobs), reference log-probs (KL)
Both rollout sources (colocated.py, remote.py) return a RolloutRecord; the trainer prepares either alike.
``rollout_metrics`` reduces the rollout's own metrics over DP.

Token grid. A record holds right-padded rows ``tokens [B, T]`` (prompt from column 0, then the response,
then pad). Training forwards ``tokens[:, :-1]`` and scores ``tokens[:, 1:]``, so every per-token tensor
used by the losses lives on the shifted ``[B, T-1]`` grid: ``mask = loss_mask[:, 1:]`` (the response; a
multi-turn row's sampled turns, never its prompt or observations: rollout/multiturn.py). The last
token of a row is never an input, which is also why routing recorded during generation (R3) needs no
route for it. Advantages are computed over the rewards of all rows of the step, so the minibatches and
hence every update are the same under any DP / TP / EP layout, whichever rank holds a row.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.model import fp8_alignment
from megatron_gspo.algorithms.overlong import truncated
from megatron_gspo.runtime.metrics import Metric, MetricAccumulator
from megatron_gspo.model.gpt import aux_loss_needs_one_plan_over_dp, forward_logprobs, input_padding_mask, unwrap
from megatron_gspo.model.oom import explain_oom
from megatron_gspo.rollout.record import COUNTS, RolloutRecord
from megatron_gspo.rollout.rows import local_rows, pad_columns

log = logging.getLogger("megatron_gspo")


@dataclass
class TrainBatch:
    """One rank's share of a step's rollouts on the shifted [B, T-1] grid (see module doc)."""

    tokens: torch.Tensor  # [B, T] long
    mask: torch.Tensor  # [B, T-1] bool: response tokens among the targets tokens[:, 1:]
    seq_lengths: torch.Tensor  # [B] long: prompt + response tokens (the rest of the row is padding)
    row_ids: torch.Tensor  # [B] long: global row index (prompt x G + sample) of each local row
    rewards: torch.Tensor  # [B] fp32
    advantages: torch.Tensor  # [B] fp32
    sample_logprobs: torch.Tensor  # [B, T-1] fp32, from the generator
    old_logprobs: Optional[torch.Tensor] = None  # [B, T-1] fp32, the old policy's (config.old_logprob_source)
    ref_logprobs: Optional[torch.Tensor] = None  # [B, T-1] fp32, reference policy (KL)
    # [B] bool: the response hit generation.max_new_tokens without a stop token (overlong.truncated)
    truncated: Optional[torch.Tensor] = None
    sample_ids: list = field(default_factory=list)  # "<prompt id>#<sample>" per row, for error reports
    response_texts: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    # Step-level rollout statistics that need no reduction (dynamic sampling: rounds, dropped groups)
    stats: dict = field(default_factory=dict)
    # The micro-batch plan both passes use (plan_micro_batches): row slices, the flat micro-batch
    # indices of each minibatch, and each micro-batch's token-grid width (its longest row's length).
    micro: list = field(default_factory=list)
    minibatches: list = field(default_factory=list)
    widths: list = field(default_factory=list)
    # [B] long: the policy versions that sampled each row (record.version_start / version_end: async staleness)
    version_start: Optional[torch.Tensor] = None
    version_end: Optional[torch.Tensor] = None
    # [B, T-1, L, k] compact ids: per row, the behaviour policy's top-k experts of every local MoE layer at each
    # input position (the rollout's, or the old-log-prob pass's: routing.RoutingPolicy): R2 / R3 replay them,
    # the routing change is measured against them. Sliced with the rows.
    routes: Optional[torch.Tensor] = None
    # multi-turn rows (env.name): each row's conversation (record.trajectories), in the batch's row order
    trajectories: list = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def input_padding_mask(self) -> torch.Tensor:
        """[B, T-1] bool: True where the forward's input ``tokens[:, :-1]`` holds no real token."""
        return input_padding_mask(self.seq_lengths, self.tokens.shape[1] - 1)

    def rows(self, idx, width: Optional[int] = None) -> "TrainBatch":
        """The rows ``idx`` (a slice or an index tensor), cut to a token-grid width of ``width`` columns
        (every row of them must fit: the columns cut are padding)."""
        w = self.tokens.shape[1] if width is None else width
        pick = lambda t: None if t is None else t[idx, : w - 1]  # noqa: E731
        ids = self.sample_ids[idx] if isinstance(idx, slice) else [self.sample_ids[i] for i in idx.tolist()]
        return TrainBatch(
            tokens=self.tokens[idx, :w], mask=pick(self.mask), seq_lengths=self.seq_lengths[idx],
            row_ids=self.row_ids[idx], rewards=self.rewards[idx], advantages=self.advantages[idx],
            sample_logprobs=pick(self.sample_logprobs), old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs), sample_ids=ids,
            truncated=None if self.truncated is None else self.truncated[idx], routes=pick(self.routes),
        )

    def micro_batch(self, i: int) -> "TrainBatch":
        """Flat micro-batch ``i`` of the plan, at its own width."""
        return self.rows(self.micro[i], self.widths[i])


def forward_width_multiple(model, state) -> int:
    """The forward input width (token-grid width - 1) of every micro-batch is a multiple of this: the
    sequence-parallel size (megatron splits the input over TP) times the model's FP8 token alignment
    (fp8_alignment.py; 1 without FP8), so rows x width / TP suits TE's FP8 GEMMs for any rows."""
    sp = state.tp if state.sequence_parallel else 1
    return fp8_alignment.width_multiple(sp, fp8_alignment.token_alignment(unwrap(model).config))


def global_advantages(rewards: torch.Tensor, row_ids: torch.Tensor, num_rows: int, group_size: int,
                      estimator, dp_size: int, num_minibatches: int, dp_group) -> torch.Tensor:
    """Advantages of this rank's rows [B] computed over every rank's rewards, for a record without
    ``global_rewards`` whose rank holds its ``local_rows`` share (the asynchronous source).

    rewards, row_ids: [B] on the compute device (this rank's rows). The rewards of all R rows are
    gathered over the DP group (a group of G samples may be spread over ranks) and the estimator
    runs on [R] in global row order, so every rank computes the same numbers."""
    parts = comm.all_gather(rewards.float(), dp_group, what="advantages: rewards of every data-parallel rank")
    full = torch.empty(num_rows, dtype=torch.float32, device=rewards.device)
    for r, part in enumerate(parts):
        ids = torch.tensor(local_rows(num_rows, num_minibatches, dp_size, r), device=rewards.device)
        full[ids] = part
    return estimator(full, group_size)[row_ids]


def plan_micro_batches(seq_lengths: list[int], num_minibatches: int, micro_batch_size: int,
                       max_tokens: Optional[int], multiple_of: int) -> tuple[list[int], list[list[slice]], list[int]]:
    """Group each minibatch's rows by length into micro-batches no wider than their longest row.

    seq_lengths: real tokens per local row. Rows are sorted (longest first) within each minibatch,
    which never moves a row to another minibatch; then cut into micro-batches of
    ``micro_batch_size`` rows, or, with a ``max_tokens`` budget, of as many rows as keep
    rows x width <= max_tokens. Returns (perm: the new order of the rows, per minibatch its
    micro-batches as slices of the permuted rows, each micro-batch's width: its longest row,
    rounded up so that (width - 1) % multiple_of == 0: forward_width_multiple, the sequence-parallel
    split of the input times FP8's token alignment)."""
    n = len(seq_lengths)
    per = n // num_minibatches
    round_up = lambda w: 1 + math.ceil((max(w, 2) - 1) / multiple_of) * multiple_of  # noqa: E731
    perm, plan, widths = [], [], []
    for k in range(num_minibatches):
        rows = sorted(range(k * per, (k + 1) * per), key=lambda r: -seq_lengths[r])  # stable: ties keep order
        perm += rows
        mini, lo = [], k * per
        while lo < (k + 1) * per:
            width = round_up(seq_lengths[perm[lo]])  # the longest row of the micro-batch comes first
            take = micro_batch_size if max_tokens is None else max(1, max_tokens // width)
            hi = min(lo + take, (k + 1) * per)
            mini.append(slice(lo, hi))
            widths.append(width)
            lo = hi
        plan.append(mini)
    return perm, plan, widths


def agreed_length_profile(seq_lengths: list[int], num_minibatches: int, device: torch.device, group=None) -> list[int]:
    """The micro-batch plan's lengths of a group of ranks that must run one plan (``BatchPreparer.plan_group``:
    a lockstep group, ``ParallelState.lockstep_group``, or the DP group), the same on its ranks.

    Every MoE forward is a collective over the expert-TP x EP ranks and needs the same [rows, width] on each
    (megatron's aux statistics need as many micro-batches on every DP rank), but a token budget cuts each
    rank's rows by their own lengths. Each rank sorts every minibatch's
    rows longest first (as plan_micro_batches does); the profile is, at each position of that order,
    the longest length any rank has there (one MAX all-reduce). Planned on the profile, every rank
    gets the same micro-batches of the same widths, its own row at each position fits (it is no
    longer than the profile's), and rows x width stays within the budget."""
    per = len(seq_lengths) // num_minibatches
    local = [x for k in range(num_minibatches) for x in sorted(seq_lengths[k * per:(k + 1) * per], reverse=True)]
    t = torch.tensor(local, dtype=torch.long, device=device)
    return comm.all_reduce(t, "max", group, what="micro-batch plan: sorted lengths (plan group)").tolist()




class BatchPreparer:
    """RolloutRecord -> TrainBatch on this rank (module doc); built once by the trainer.

    cfg: the JobConfig; gen_cfg: the generation section with the tokenizer's stop and pad ids filled in;
    model / ref_model: the policy (DDP-wrapped) and the frozen KL reference (or None); advantage_fn: the
    advantage estimator; routing: the RoutingPolicy; timer: where the sections' wall times go;
    recompute_old_logprobs: config.old_logprob_source's decision."""

    def __init__(self, cfg, state, model, ref_model, advantage_fn, gen_cfg, routing, timer, *,
                 recompute_old_logprobs: bool) -> None:
        self.cfg, self.state, self.model, self.ref_model = cfg, state, model, ref_model
        self.advantage_fn, self.gen_cfg, self.routing, self.timer = advantage_fn, gen_cfg, routing, timer
        self.recompute_old_logprobs = recompute_old_logprobs
        # log-probs are taken at the sampling temperature (greedy rollouts: the raw policy)
        self.temperature = gen_cfg.temperature or 1.0

    def __call__(self, record: RolloutRecord) -> TrainBatch:
        st, dev, t = self.state, self.state.device, self.cfg.train
        G = self.gen_cfg.n_samples_per_prompt
        R = t.prompts_per_step * G
        rows = record.row_ids.tolist()
        row_ids = torch.tensor(rows, dtype=torch.long, device=dev)
        rewards = record.rewards
        if record.global_rewards is not None:  # the source knows every row's reward (the global batch)
            advantages = self.advantage_fn(record.global_rewards.to(dev, torch.float32), G)[row_ids]
        else:
            advantages = global_advantages(rewards, row_ids, R, G, self.advantage_fn, st.dp, t.num_minibatches,
                                           st.dp_group)
        cut = truncated(record.stopped.to(dev), record.response_lengths.to(dev), self.gen_cfg.max_new_tokens)
        # rows of similar length share a micro-batch as wide as its longest row; where data-parallel ranks
        # step together (EP, expert-TP, megatron's aux statistics) the shapes are agreed over them (plan_group)
        seq_lengths = record.seq_lengths
        perm, plan, widths = self._plan(seq_lengths.tolist())
        T = max(max(widths), record.tokens.shape[1])
        order = torch.tensor(perm, dtype=torch.long, device=dev)
        tokens = pad_columns(record.tokens, T, self.gen_cfg.pad_id)[order]
        mask = pad_columns(record.loss_mask, T, False)[order]
        sample_lp = pad_columns(record.sample_logprobs, T, 0.0)[order]
        sample_ids = record.sample_ids(G)
        batch = TrainBatch(tokens=tokens, mask=mask[:, 1:], seq_lengths=seq_lengths[order], row_ids=row_ids[order],
                           rewards=rewards[order], advantages=advantages[order], truncated=cut[order],
                           sample_logprobs=sample_lp[:, 1:], response_texts=[record.texts[i] for i in perm],
                           sample_ids=[sample_ids[i] for i in perm],
                           micro=[sl for mini in plan for sl in mini], widths=widths,
                           version_start=record.version_start[order], version_end=record.version_end[order],
                           routes=self.routing.batch_routes(record.routes, order, T - 1, dev),
                           trajectories=[record.trajectories[i] for i in perm] if record.trajectories else [])
        batch.minibatches, n = [], 0
        for mini in plan:
            batch.minibatches.append(list(range(n, n + len(mini))))
            n += len(mini)
        pads = [batch.micro_batch(i).input_padding_mask() for i in range(len(batch.micro))]
        with self.timer("old_logprob"):
            if self.recompute_old_logprobs:
                batch.old_logprobs = self.logprobs(self.model, batch, pads, routing=self.routing)
            else:  # the sampling log-probs stand for the old policy's (config.old_logprob_source); a copy,
                # so that nothing written to one can change the other
                batch.old_logprobs = batch.sample_logprobs.clone()
            if self.ref_model is not None:
                batch.ref_logprobs = self.logprobs(self.ref_model, batch, pads)
        batch.stats = dict(record.stats)
        batch.timings = {"gen_s": record.gen_s, **{k: getattr(record, k) for k in COUNTS}}
        return batch

    def _plan(self, seq_lengths: list[int]) -> tuple[list[int], list[list[slice]], list[int]]:
        """plan_micro_batches on this rank's lengths; the shapes agreed by every rank of ``plan_group`` where
        ranks with rows of their own must run the same micro-batches."""
        st, t = self.state, self.cfg.train
        # widths: the sequence-parallel split of the input, and FP8's token alignment (fp8_alignment.py)
        multiple = forward_width_multiple(self.model, st)
        perm, plan, widths = plan_micro_batches(seq_lengths, t.num_minibatches, t.micro_batch_size,
                                                t.max_tokens_per_micro_batch, multiple)
        group = self.plan_group()
        if group is None:
            return perm, plan, widths
        if t.max_tokens_per_micro_batch is not None:
            # a token budget cuts each rank's rows its own way: plan once, on the longest length at
            # each position of the sorted order over the group's ranks, so they all run the same shapes
            profile = agreed_length_profile(seq_lengths, t.num_minibatches, st.device, group)
            _, plan, widths = plan_micro_batches(profile, t.num_minibatches, t.micro_batch_size,
                                                 t.max_tokens_per_micro_batch, multiple)
        else:
            agreed = torch.tensor(widths, dtype=torch.long, device=st.device)
            widths = comm.all_reduce(agreed, "max", group, what="micro-batch widths (plan group)").tolist()
        return perm, plan, widths

    def plan_group(self):
        """The ranks whose micro-batch plans must be one (the same micro-batches, rows and widths), or None.

        * the data-parallel group, where the load-balancing statistic needs every DP rank to run as many
          micro-batches (megatron's aux_loss / global_aux_loss: gpt.aux_loss_needs_one_plan_over_dp). It
          holds every lockstep group's rows too: a lockstep group's ranks are DP ranks (EP, expert-TP) or TP
          ranks, which hold the same rows as their DP peers of another TP rank, so the plan agreed over each
          DP group is the same on every rank of the world (within a pipeline stage);
        * else the lockstep group where it joins data-parallel ranks (``ParallelState.lockstep_over_dp``:
          every MoE forward is a collective over them);
        * else None: each rank plans its own rows (plain DP with seq_aux_loss: one all-reduce per step)."""
        st, m = self.state, self.cfg.model
        if st.dp > 1 and aux_loss_needs_one_plan_over_dp(m.moe_router_load_balancing_type, m.moe_aux_loss_coeff):
            return st.dp_group
        return st.lockstep_group if st.lockstep_over_dp else None

    @torch.no_grad()
    def logprobs(self, model, batch: TrainBatch, pads: list[torch.Tensor], routing=None) -> torch.Tensor:
        """Forward-only log-probs of the batch's targets [B, T-1], micro-batch by micro-batch at each one's
        own width (0 past it). routing: the RoutingPolicy, for the old-log-prob pass (R3 replays the rows'
        routes; R2 and the routing reference record this pass's into ``batch.routes``)."""
        out = torch.zeros_like(batch.sample_logprobs)
        for i, sl in enumerate(batch.micro):
            w = batch.widths[i]
            ctx = routing.old_pass(batch.micro_batch(i)) if routing is not None else contextlib.nullcontext()
            shapes = f"micro-batch of {sl.stop - sl.start} rows x {w - 1} tokens"
            with ctx as recorded, explain_oom("old_logprobs", self.cfg, self.state, shapes):
                out[sl, : w - 1], _ = forward_logprobs(model, batch.tokens[sl, : w - 1], batch.tokens[sl, 1:w],
                                                       self.cfg.model.vocab_size, temperature=self.temperature,
                                                       with_entropy=False, padding_mask=pads[i])
            if recorded is not None and recorded.routes is not None:
                batch.routes[sl, : w - 1] = recorded.routes
        return out


def rollout_metrics(batch: TrainBatch, state) -> dict:
    """rollout/* (rewards, lengths) and perf/gen_tokens, perf/decode_row_steps, perf/prefill_tokens (prompt tokens
    prefilled: each distinct prompt of a generate call once), perf/decode_batch_fill (the decode batches' rows still
    generating over their rows, summed over the decode steps), reduced over DP; the batch's source statistics as
    they are."""
    m = batch.mask
    dev = state.device
    acc = MetricAccumulator()
    acc.add({
        "rollout/reward_mean": Metric.mean(batch.rewards),
        "rollout/reward_std": Metric.std(batch.rewards),
        "rollout/response_length_mean": Metric.mean(m.sum(-1).float()),
        "rollout/response_length_max": Metric.max(m.sum(-1).float()),
        "rollout/truncated_frac": Metric.mean(batch.truncated.double()),
        # rows of a group whose rewards are all equal: advantages.py makes those exactly 0
        "rollout/zero_advantage_frac": Metric.mean((batch.advantages == 0).double()),
        "perf/gen_tokens": Metric.sum(torch.tensor([float(batch.timings["gen_tokens"])], device=dev)),
        "perf/decode_row_steps": Metric.sum(torch.tensor([float(batch.timings["decode_row_steps"])], device=dev)),
        "perf/prefill_tokens": Metric.sum(torch.tensor([float(batch.timings["prefill_tokens"])], device=dev)),
        "perf/decode_batch_fill": Metric.from_sum_count(
            torch.tensor(float(batch.timings["decode_live_row_steps"]), device=dev),
            torch.tensor(float(batch.timings["decode_row_steps"]), device=dev)),
    })
    if batch.trajectories:
        acc.add(trajectory_metrics(batch.trajectories, dev))
    return {**acc.reduce(state.dp_group), **batch.stats}


def trajectory_metrics(trajectories: list, device) -> dict:
    """rollout/* of multi-turn rows (rollout/multiturn.py's summaries), as Metrics that reduce over DP: assistant
    turns, tool calls and observation tokens per row (every token appended between turns: the environment's text
    and the template's tokens around it), failed tool calls (a count), the share of rows that
    reached env.max_turns still talking, and the share that ended on an environment's own error."""
    col = lambda key: torch.tensor([float(t[key]) for t in trajectories], dtype=torch.float64, device=device)  # noqa: E731
    calls = torch.tensor([float(len(t["tool_calls"])) for t in trajectories], dtype=torch.float64, device=device)
    env_errors = torch.tensor([float(t["env_error"] is not None) for t in trajectories], dtype=torch.float64,
                              device=device)
    return {"rollout/turns_mean": Metric.mean(col("num_turns")), "rollout/tool_calls_mean": Metric.mean(calls),
            "rollout/tool_errors": Metric.sum(col("tool_errors")),
            "rollout/observation_tokens_mean": Metric.mean(col("observation_tokens")),
            "rollout/max_turns_reached_frac": Metric.mean(col("max_turns_reached")),
            "rollout/env_error_frac": Metric.mean(env_errors)}
