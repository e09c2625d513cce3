"""From prompts to a training batch: the first half of an RL step (``Rollouts.collect``).

    1. draw the step's P prompts, the same on every rank                      data.PromptSampler
    2. keep this rank's rows: its share of every minibatch                    local_rows
    3. sample G responses per prompt on the training model (KV cache)        generation.generate
    4. score them; advantages over every rank's rewards                       rewards, global_advantages
    5. micro-batches of rows of similar length; old (and reference) log-probs  plan_micro_batches
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
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_gspo import comm, fp8_alignment
from megatron_gspo.faults import StepAbandoned
from megatron_gspo.generation import Generator
from megatron_gspo.metrics import Metric, MetricAccumulator
from megatron_gspo.oom import explain_oom
from megatron_gspo.model import forward_logprobs, input_padding_mask, unwrap
from megatron_gspo.algorithms.dynamic_sampling import informative_groups, prune_groups
from megatron_gspo.algorithms.overlong import overlong_penalty, truncated
from megatron_gspo.rewards import compute_rewards

log = logging.getLogger("megatron_gspo")

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

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def input_padding_mask(self) -> torch.Tensor:
        """[B, T-1] bool: True where the forward's input ``tokens[:, :-1]`` holds no real token."""
        return input_padding_mask(self.seq_lengths, self.tokens.shape[1] - 1)

    def rows(self, idx, width: Optional[int] = None) -> "RolloutBatch":
        """The rows ``idx`` (a slice or an index tensor), cut to a token-grid width of ``width`` columns
        (every row of them must fit: the columns cut are padding)."""
        w = self.tokens.shape[1] if width is None else width
        pick = lambda t: None if t is None else t[idx, : w - 1]  # noqa: E731
        ids = self.sample_ids[idx] if isinstance(idx, slice) else [self.sample_ids[i] for i in idx.tolist()]
        return RolloutBatch(
            tokens=self.tokens[idx, :w], mask=pick(self.mask), seq_lengths=self.seq_lengths[idx],
            row_ids=self.row_ids[idx], rewards=self.rewards[idx], advantages=self.advantages[idx],
            sample_logprobs=pick(self.sample_logprobs), old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs), sample_ids=ids,
            truncated=None if self.truncated is None else self.truncated[idx],
        )

    def micro_batch(self, i: int) -> "RolloutBatch":
        """Flat micro-batch ``i`` of the plan, at its own width."""
        return self.rows(self.micro[i], self.widths[i])


def common_length(length: int, multiple_of: int, device: torch.device, group=None) -> int:
    """A token-grid width T shared by every rank of ``group`` with (T - 1) % multiple_of == 0.

    With the allgather MoE dispatcher every forward is a collective over the TP x EP ranks and
    needs the same [b, s] on each; under sequence parallel the forward's input ``tokens[:, :-1]``
    is split over TP, so its length must divide by TP.
    """
    T = comm.max_int(length, device, group, what="common token-grid width")
    return 1 + math.ceil((T - 1) / multiple_of) * multiple_of


def forward_width_multiple(model, state) -> int:
    """The forward input width (token-grid width - 1) of every micro-batch is a multiple of this: the
    sequence-parallel size (megatron splits the input over TP) times the model's FP8 token alignment
    (fp8_alignment.py; 1 without FP8), so rows x width / TP suits TE's FP8 GEMMs for any rows."""
    sp = state.tp if state.sequence_parallel else 1
    return fp8_alignment.width_multiple(sp, fp8_alignment.token_alignment(unwrap(model).config))


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
    """The micro-batch plan's lengths under expert parallelism, the same on every rank.

    Every MoE forward is a collective over the TP x EP ranks and needs the same [rows, width] on each,
    but a token budget cuts each rank's rows by their own lengths. Each rank sorts every minibatch's
    rows longest first (as plan_micro_batches does); the profile is, at each position of that order,
    the longest length any rank has there (one MAX all-reduce). Planned on the profile, every rank
    gets the same micro-batches of the same widths, its own row at each position fits (it is no
    longer than the profile's), and rows x width stays within the budget."""
    per = len(seq_lengths) // num_minibatches
    local = [x for k in range(num_minibatches) for x in sorted(seq_lengths[k * per:(k + 1) * per], reverse=True)]
    t = torch.tensor(local, dtype=torch.long, device=device)
    return comm.all_reduce(t, "max", group, what="micro-batch plan: sorted lengths (EP lockstep)").tolist()


def micro_batch_slices(num_rows: int, num_minibatches: int, micro_batch_size: int) -> list[list[slice]]:
    """Rows of each minibatch, split into micro-batches of at most ``micro_batch_size``.

    The old-log-prob pass and the training pass use this one partition: routing replay and the
    routing monitor key their records by the flat index of a micro-batch in it.
    """
    per = num_rows // num_minibatches
    return [[slice(lo, min(lo + micro_batch_size, hi)) for lo in range(k * per, hi, micro_batch_size)]
            for k, hi in ((k, (k + 1) * per) for k in range(num_minibatches))]


class Rollouts:
    """Prompts -> RolloutBatch on this rank, every step (see the module docstring).

    cfg: the JobConfig; gen_cfg: the generation section with the tokenizer's stop and pad ids filled
    in; model / ref_model: the policy (DDP-wrapped) and the frozen KL reference (or None); routing:
    the RoutingPolicy; timer: where the sections' wall times go. ``should_stop``: the trainer's stop
    flag (a signal came); generation stops early and every rank leaves the step (StepAbandoned)."""

    should_stop: Callable[[], bool] = staticmethod(lambda: False)

    def __init__(self, cfg, state, model, ref_model, sampler, tokenizer, reward_fn, advantage_fn, gen_cfg,
                 routing, timer, *, recompute_old_logprobs: bool) -> None:
        self.cfg, self.state, self.model, self.ref_model = cfg, state, model, ref_model
        # config.old_logprob_source decided it (the trainer passes the decision)
        self.recompute_old_logprobs = recompute_old_logprobs
        self.sampler, self.tokenizer, self.reward_fn, self.advantage_fn = sampler, tokenizer, reward_fn, advantage_fn
        self.routing, self.timer = routing, timer
        self.gen_cfg = gen_cfg
        # generate() gets one row per sample: a sample's noise is keyed by its global row
        self.row_gen_cfg = dataclasses.replace(gen_cfg, n_samples_per_prompt=1)
        # log-probs are taken at the sampling temperature (greedy rollouts: the raw policy)
        self.temperature = gen_cfg.temperature or 1.0
        # one decoder for every rollout of the job (its KV cache and CUDA graphs sized for the longest prompt)
        self.generator = Generator(model, vocab_size=cfg.model.vocab_size, state=state,
                                   slots=cfg.data.max_prompt_length + gen_cfg.max_new_tokens - 1)

    def sampling_seed(self, step: int) -> int:
        """(generation.seed, step) in one 64-bit key; sampling.py keys every draw by row and position too."""
        return (self.gen_cfg.seed << 32) + step

    def _generate_round(self, step: int, rnd: int, rows: list[int], R: int):
        """Draw P prompts, sample this rank's rows of them and score them (steps 1-4 without advantages).

        Round ``rnd`` > 0 (dynamic sampling) keys its noise by rows rnd * R + g: every row of every
        round of a step draws distinct noise, and round 0 is exactly the rollout without dynamic
        sampling. Returns (this rank's prompts per row, GenerationOutput, texts, rewards [B])."""
        cfg, st, dev = self.cfg, self.state, self.state.device
        prompts = self.sampler.next_batch()  # 1. the same P prompts on every rank
        G = self.gen_cfg.n_samples_per_prompt
        mine = [prompts[g // G] for g in rows]
        shapes = (f"{len(mine)} rows, prompts up to {max(len(p.ids) for p in mine)} tokens + "
                  f"{self.gen_cfg.max_new_tokens} new")
        with self.timer("generate"), self.routing.generating(), explain_oom("generation", cfg, st, shapes):  # 3.
            out = self.generator.generate([p.ids for p in mine], self.row_gen_cfg, seed=self.sampling_seed(step),
                                          row_keys=[rnd * R + g for g in rows],
                                          on_forward=self.routing.on_generation_forward, should_stop=self.should_stop)
        # A stop signal on any rank: all leave the step here, together (one all-reduce per round; the
        # decode loop itself stopped at once, agreed within its lockstep group at no extra cost)
        if comm.any_rank(out.abandoned or self.should_stop(), dev, what="stop vote after generation"):
            raise StepAbandoned(step + 1, f"in generation round {rnd + 1}" + (", decoding cut short" if out.abandoned else ""))
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
        with self.timer("reward"):  # 4.
            rewards = compute_rewards(self.reward_fn, [p.text for p in mine], texts, [p.answer for p in mine],
                                      device=dev)
            r = cfg.reward
            if r.overlong_buffer_len > 0:  # DAPO's soft overlong punishment, part of the reward
                rewards = rewards + overlong_penalty(out.response_lengths.to(dev), self.gen_cfg.max_new_tokens,
                                                     r.overlong_buffer_len, r.overlong_penalty_factor)
        return mine, out, texts, rewards

    def _dynamic_rounds(self, step: int, rows: list[int], R: int, G: int):
        """Dynamic sampling (dynamic_sampling.py; data-parallel size 1, so ``rows`` is every row): rounds
        of P prompts until P informative groups, or train.dynamic_sampling_max_rounds extra rounds (each
        one logged). Between rounds only the groups that can still be picked are kept (prune_groups: at
        most P, their rows copied out of the round's output), so memory does not grow with the rounds.
        Returns the kept rows merged like one round's output, and the step's statistics."""
        t = self.cfg.train
        P = t.prompts_per_step
        kept: list[_Group] = []  # informative first, each part in (round, group) order
        rounds = groups = dropped = gen_tokens = 0
        reward_sum, times = 0.0, dict(elapsed_s=0.0, prefill_s=0.0, num_forwards=0, decode_row_steps=0)
        while True:
            mine, out, texts, rewards = self._generate_round(step, rounds, rows, R)
            flags = informative_groups(rewards, G).tolist()
            groups, dropped = groups + len(flags), dropped + flags.count(False)
            reward_sum, gen_tokens = reward_sum + float(rewards.double().sum()), gen_tokens + out.num_generated_tokens
            times = {k: v + getattr(out, k) for k, v in times.items()}
            new = [_Group(ok, mine[g * G:(g + 1) * G], texts[g * G:(g + 1) * G], rewards[g * G:(g + 1) * G].clone(),
                          _merge_rows([out], [(0, g * G + j) for j in range(G)], self.gen_cfg.pad_id))
                   for g, ok in enumerate(flags)]
            kept = prune_groups(kept + new, P, informative=lambda grp: grp.informative)
            rounds += 1
            found = sum(grp.informative for grp in kept)
            if found == P or rounds > t.dynamic_sampling_max_rounds:
                break
            log.info("step %d: dynamic sampling: %d of %d informative groups after %d generation round(s); round %d "
                     "of at most %d (train.dynamic_sampling_max_rounds=%d extra)", step + 1, found, P, rounds,
                     rounds + 1, t.dynamic_sampling_max_rounds + 1, t.dynamic_sampling_max_rounds)
        filled = P - found
        if filled:
            log.warning("step %d: dynamic sampling found %d of %d informative groups in %d generation rounds "
                        "(train.dynamic_sampling_max_rounds=%d); %d constant groups (zero advantage) fill the step",
                        step + 1, found, P, rounds, t.dynamic_sampling_max_rounds, filled)
        stats = {"dynamic_sampling/rounds": float(rounds),
                 "dynamic_sampling/dropped_group_frac": dropped / groups,
                 "dynamic_sampling/filled_groups": float(filled),
                 "dynamic_sampling/generated_reward_mean": reward_sum / (groups * G),
                 "_gen_tokens": gen_tokens}  # every round's, kept or not
        # the kept groups' rows, in pick order; the timings are those of every round
        out = _merge_rows([grp.out for grp in kept], [(k, j) for k in range(len(kept)) for j in range(G)],
                          self.gen_cfg.pad_id)
        out = dataclasses.replace(out, **times)
        mine = [p for grp in kept for p in grp.prompts]
        texts = [x for grp in kept for x in grp.texts]
        return mine, out, texts, torch.cat([grp.rewards for grp in kept]), stats

    def collect(self, step: int) -> RolloutBatch:
        st, t = self.state, self.cfg.train
        G = self.gen_cfg.n_samples_per_prompt
        R = t.prompts_per_step * G
        rows = local_rows(R, t.num_minibatches, st.dp, st.dp_rank)  # 2.
        if t.dynamic_sampling:
            mine, out, texts, rewards, stats = self._dynamic_rounds(step, rows, R, G)
        else:
            (mine, out, texts, rewards), stats = self._generate_round(step, 0, rows, R), {}
        return self.assemble(rows, [p.id for p in mine], out, texts, rewards, stats)

    def assemble(self, rows: list[int], prompt_ids: list[str], out, texts: list[str], rewards: torch.Tensor,
                 stats: dict) -> RolloutBatch:
        """Steps 4-5 for this rank's sampled rows ``rows`` (global row ids; ``out`` their GenerationOutput,
        ``rewards`` [B]): advantages, the micro-batch plan, old and reference log-probs. The asynchronous
        trainer (async_rollout/source.py) calls it with rows the rollout ranks generated."""
        st, dev, t = self.state, self.state.device, self.cfg.train
        G = self.gen_cfg.n_samples_per_prompt
        R = t.prompts_per_step * G
        row_ids = torch.tensor(rows, dtype=torch.long, device=dev)
        advantages = global_advantages(rewards, row_ids, R, G, self.advantage_fn, st.dp, t.num_minibatches,
                                       st.dp_group)
        cut = truncated(out.stopped.to(dev), out.response_lengths.to(dev), self.gen_cfg.max_new_tokens)
        # 5. rows of similar length share a micro-batch as wide as its longest row; under expert
        # parallelism every MoE forward is a collective: the widths are agreed over all ranks
        seq_lengths = out.prompt_lengths + out.response_lengths
        # widths: the sequence-parallel split of the input, and FP8's token alignment (fp8_alignment.py)
        multiple = forward_width_multiple(self.model, st)
        perm, plan, widths = plan_micro_batches(seq_lengths.tolist(), t.num_minibatches, t.micro_batch_size,
                                                t.max_tokens_per_micro_batch, multiple)
        if st.ep > 1 and t.max_tokens_per_micro_batch is not None:
            # a token budget cuts each rank's rows its own way: plan once, on the longest length at
            # each rank of the sorted order over every rank, so all ranks run the same shapes
            _, plan, widths = plan_micro_batches(agreed_length_profile(seq_lengths.tolist(), t.num_minibatches, dev),
                                                 t.num_minibatches, t.micro_batch_size,
                                                 t.max_tokens_per_micro_batch, multiple)
        elif st.ep > 1:
            agreed = torch.tensor(widths, dtype=torch.long, device=dev)
            widths = comm.all_reduce(agreed, "max", None, what="micro-batch widths (EP lockstep)").tolist()
        T = max(max(widths), out.tokens.shape[1])
        order = torch.tensor(perm, dtype=torch.long, device=dev)
        tokens = pad_columns(out.tokens, T, self.gen_cfg.pad_id)[order]
        mask = pad_columns(out.response_mask, T, False)[order]
        sample_lp = pad_columns(out.logprobs, T, 0.0)[order]
        batch = RolloutBatch(tokens=tokens, mask=mask[:, 1:], seq_lengths=seq_lengths[order], row_ids=row_ids[order],
                             rewards=rewards[order], advantages=advantages[order], truncated=cut[order],
                             sample_logprobs=sample_lp[:, 1:], response_texts=[texts[i] for i in perm],
                             sample_ids=[f"{prompt_ids[i]}#{rows[i] % G}" for i in perm],
                             micro=[sl for mini in plan for sl in mini], widths=widths)
        batch.minibatches, n = [], 0
        for mini in plan:
            batch.minibatches.append(list(range(n, n + len(mini))))
            n += len(mini)
        pads = [batch.micro_batch(i).input_padding_mask() for i in range(len(batch.micro))]
        self.routing.after_generation(out, [order[sl] for sl in batch.micro], widths, pads)
        with self.timer("old_logprob"):
            if self.recompute_old_logprobs:
                batch.old_logprobs = self.logprobs(self.model, batch, pads, on_micro_batch=self.routing.old_pass)
                self.routing.after_old_pass()
            else:  # the sampling log-probs stand for the old policy's (config.old_logprob_source); a copy,
                # so that nothing written to one can change the other
                batch.old_logprobs = batch.sample_logprobs.clone()
            if self.ref_model is not None:
                batch.ref_logprobs = self.logprobs(self.ref_model, batch, pads)
        gen_tokens = stats.pop("_gen_tokens", out.num_generated_tokens)
        batch.stats = stats
        batch.timings = {"gen_tokens": gen_tokens, "gen_s": out.elapsed_s,
                         "decode_row_steps": out.decode_row_steps}
        return batch

    @torch.no_grad()
    def logprobs(self, model, batch: RolloutBatch, pads: list[torch.Tensor], on_micro_batch=None) -> torch.Tensor:
        """Forward-only log-probs of the batch's targets [B, T-1], micro-batch by micro-batch at each one's
        own width (0 past it)."""
        out = torch.zeros_like(batch.sample_logprobs)
        for i, sl in enumerate(batch.micro):
            w = batch.widths[i]
            ctx = on_micro_batch(i) if on_micro_batch is not None else contextlib.nullcontext()
            shapes = f"micro-batch of {sl.stop - sl.start} rows x {w - 1} tokens"
            with ctx, explain_oom("old_logprobs", self.cfg, self.state, shapes):
                out[sl, : w - 1], _ = forward_logprobs(model, batch.tokens[sl, : w - 1], batch.tokens[sl, 1:w],
                                                       self.cfg.model.vocab_size, temperature=self.temperature,
                                                       with_entropy=False, padding_mask=pads[i])
        return out

    def metrics(self, batch: RolloutBatch) -> dict:
        """rollout/* (rewards, lengths) and perf/gen_tokens, reduced over DP."""
        m = batch.mask
        dev = self.state.device
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
        })
        return {**acc.reduce(self.state.dp_group), **batch.stats}


@dataclass
class _Group:
    """One generated group that dynamic sampling may still pick: its G rows, copied out of their round."""

    informative: bool
    prompts: list
    texts: list
    rewards: torch.Tensor  # [G]
    out: object  # GenerationOutput of the G rows


def _merge_rows(outs: list, take: list[tuple[int, int]], pad_id: int):
    """One GenerationOutput of the rows ``take`` = [(output index, row)] of several outputs, the token
    grid padded to the widest; timings and generated-token counts are those of every output (all of
    them were generated)."""
    width = max(o.tokens.shape[1] for o in outs)

    def gather(name: str, pad=None) -> torch.Tensor:
        parts = [getattr(outs[k], name)[i] for k, i in take]
        if pad is not None:
            parts = [torch.nn.functional.pad(x, (0, width - x.shape[0]), value=pad) for x in parts]
        return torch.stack(parts)

    merged = dataclasses.replace(
        outs[0], tokens=gather("tokens", pad_id), prompt_lengths=gather("prompt_lengths"),
        response_lengths=gather("response_lengths"), response_mask=gather("response_mask", False),
        logprobs=gather("logprobs", 0.0), stopped=gather("stopped"), prompt_index=gather("prompt_index"),
        elapsed_s=sum(o.elapsed_s for o in outs), prefill_s=sum(o.prefill_s for o in outs),
        num_forwards=sum(o.num_forwards for o in outs), decode_row_steps=sum(o.decode_row_steps for o in outs))
    return merged
