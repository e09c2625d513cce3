"""The colocated rollout source: the training model samples its own rollouts (``rollout.mode=colocated``).

    1. draw the step's P prompts, the same on every rank                      data.PromptSampler
    2. keep this rank's rows: its share of every minibatch                    rows.local_rows
    3. sample G responses per prompt on the training model (KV cache)        generation.Generator
    4. score them (+ DAPO's overlong penalty)                                 rewards
    5. dynamic sampling: more rounds until P informative groups              algorithms.dynamic_sampling
-> a RolloutRecord of this rank's rows (record.py); rollout/prepare.py turns it into the training batch.
Sampling noise is keyed by the global row (sampling.py), so the rows are the same under any DP / TP / EP
layout. The routing policy is told while generating: the routes it records (R3, or the routing reference
without an old-log-prob pass) travel with their rows, in the record.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.algorithms.dynamic_sampling import informative_groups, prune_groups
from megatron_gspo.algorithms.overlong import overlong_penalty
from megatron_gspo.runtime.stop import StepAbandoned
from megatron_gspo.generation.generator import Generator
from megatron_gspo.model.oom import explain_oom
from megatron_gspo.data.rewards import ScoringStopped, compute_rewards
from megatron_gspo.rollout.multiturn import build_multiturn, multiturn_rewards
from megatron_gspo.rollout.record import RolloutRecord
from megatron_gspo.rollout.rows import local_rows
from megatron_gspo.routing.rollout_routes import RolloutRoutes

log = logging.getLogger("megatron_gspo")


class ColocatedSource:
    """A RolloutSource (rollout/source.py) generating on the training model, every step (module doc).

    cfg: the JobConfig; gen_cfg: the generation section with the tokenizer's stop and pad ids filled
    in; model: the policy (DDP-wrapped); routing: the RoutingPolicy; timer: where the sections' wall
    times go. ``stop``: the job's stop flag (anything with ``.set``): generation stops early and every
    rank leaves the step (StepAbandoned)."""

    def __init__(self, cfg, state, model, sampler, tokenizer, reward_fn, gen_cfg, routing, timer, *, stop) -> None:
        self.cfg, self.state, self.model = cfg, state, model
        self.sampler, self.tokenizer, self.reward_fn = sampler, tokenizer, reward_fn
        self.routing, self.timer, self.stop = routing, timer, stop
        self.gen_cfg = gen_cfg
        # generate() gets one row per sample: a sample's noise is keyed by its global row
        self.row_gen_cfg = dataclasses.replace(gen_cfg, n_samples_per_prompt=1)
        # one decoder for every rollout of the job (its KV cache and CUDA graphs sized for the longest prompt)
        self.generator = Generator(model, vocab_size=cfg.model.vocab_size, state=state,
                                   slots=cfg.data.max_prompt_length + gen_cfg.max_new_tokens - 1)
        # env.name: every row talks with an environment over turns (rollout/multiturn.py)
        self.multiturn = build_multiturn(cfg, state, self.generator, tokenizer, gen_cfg)

    def should_stop(self) -> bool:
        return self.stop.set

    def hooks(self) -> list:
        return []

    def peer_stop_request(self):
        """A stop signal another side of the job asked for (none: every rank of a colocated job votes itself)."""
        return None

    def stop_if_ranks_lost(self, signal_name: str) -> None:
        """Nothing to lose: a colocated job generates on the trainer's own ranks."""

    def close(self) -> None:
        if self.multiturn is not None:
            self.multiturn.close()

    def sampling_seed(self, step: int) -> int:
        """(generation.seed, step) in one 64-bit key; sampling.py keys every draw by row and position too."""
        return (self.gen_cfg.seed << 32) + step

    def _generate_round(self, step: int, rnd: int, rows: list[int], R: int):
        """Draw P prompts, sample this rank's rows of them and score them (steps 1-4 without advantages).

        Round ``rnd`` > 0 (dynamic sampling) keys its noise by rows rnd * R + g: every row of every
        round of a step draws distinct noise, and round 0 is exactly the rollout without dynamic
        sampling. Returns (this rank's prompts per row, GenerationOutput, texts, rewards [B], the routes it
        was generated with: routing.RolloutRoutes, or None when the routing policy records none)."""
        cfg, st, dev = self.cfg, self.state, self.state.device
        prompts = self.sampler.next_batch()  # 1. the same P prompts on every rank
        G = self.gen_cfg.n_samples_per_prompt
        mine = [prompts[g // G] for g in rows]
        shapes = (f"{len(mine)} rows, prompts up to {max(len(p.ids) for p in mine)} tokens + "
                  f"{self.gen_cfg.max_new_tokens} new")
        if self.multiturn is not None:
            return (mine, *self._talk(step, rnd, rows, R, mine, shapes))
        with self.timer("generate"), self.routing.generating(), explain_oom("generation", cfg, st, shapes):  # 3.
            out = self.generator.generate([p.ids for p in mine], self.row_gen_cfg, seed=self.sampling_seed(step),
                                          row_keys=[rnd * R + g for g in rows],
                                          on_forward=self.routing.on_generation_forward, should_stop=self.should_stop)
        # A stop signal on any rank: all leave the step here, together (one all-reduce per round; the
        # decode loop itself stopped at once, agreed within its lockstep group at no extra cost)
        if comm.any_rank(out.abandoned or self.should_stop(), dev, what="stop vote after generation"):
            raise StepAbandoned(step + 1, f"in generation round {rnd + 1}" + (", decoding cut short" if out.abandoned else ""))
        routes = self.routing.rollout_routes(out)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
        with self.timer("reward"):  # 4. (a stop signal cuts scoring short: one vote, every rank leaves the step)
            try:
                rewards = compute_rewards(self.reward_fn, [p.text for p in mine], texts, [p.answer for p in mine],
                                          device=dev, should_stop=self.should_stop)
            except ScoringStopped:
                rewards = None
            if comm.any_rank(rewards is None, dev, what="stop vote after scoring"):
                raise StepAbandoned(step + 1, f"while scoring round {rnd + 1}")
            r = cfg.reward
            if r.overlong_buffer_len > 0:  # DAPO's soft overlong punishment, part of the reward
                rewards = rewards + overlong_penalty(out.response_lengths.to(dev), self.gen_cfg.max_new_tokens,
                                                     r.overlong_buffer_len, r.overlong_penalty_factor)
        return mine, out, texts, rewards, routes

    def _talk(self, step: int, rnd: int, rows: list[int], R: int, mine: list, shapes: str):
        """Steps 3-4 of a multi-turn job: every row talks with its environment (rollout/multiturn.py), then is
        scored: the environment's reward, or reward.name on its last response. (output, texts, rewards, routes)"""
        cfg, st = self.cfg, self.state
        with self.timer("generate"), explain_oom("generation", cfg, st, shapes + ", over turns"):
            out = self.multiturn.run(mine, [rnd * R + g for g in rows], self.sampling_seed(step), self.routing,
                                     self.should_stop)
        if comm.any_rank(out.abandoned or self.should_stop(), st.device, what="stop vote after generation"):
            raise StepAbandoned(step + 1, f"in generation round {rnd + 1}, over turns" +
                                (", cut short" if out.abandoned else ""))
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
        with self.timer("reward"):
            try:
                rewards = multiturn_rewards(out, mine, self.reward_fn, cfg, st.device, should_stop=self.should_stop)
            except ScoringStopped:
                rewards = None
            if comm.any_rank(rewards is None, st.device, what="stop vote after scoring"):
                raise StepAbandoned(step + 1, f"while scoring round {rnd + 1}")
        return out, texts, rewards, out.routes

    def _dynamic_rounds(self, step: int, rows: list[int], R: int, G: int):
        """Dynamic sampling (dynamic_sampling.py; data-parallel size 1, so ``rows`` is every row): rounds
        of P prompts until P informative groups, or train.dynamic_sampling_max_rounds extra rounds (each
        one logged). Between rounds only the groups that can still be picked are kept (prune_groups: at
        most P, their rows copied out of the round's output), so memory does not grow with the rounds.
        Returns the kept rows merged like one round's output (prompts, output, texts, rewards, routes), the
        step's statistics and every round's generated-token count."""
        t = self.cfg.train
        P = t.prompts_per_step
        kept: list[_Group] = []  # informative first, each part in (round, group) order
        rounds = groups = dropped = gen_tokens = 0
        reward_sum, times = 0.0, dict(elapsed_s=0.0, prefill_s=0.0, num_forwards=0, decode_row_steps=0)
        while True:
            mine, out, texts, rewards, routes = self._generate_round(step, rounds, rows, R)
            flags = informative_groups(rewards, G).tolist()
            groups, dropped = groups + len(flags), dropped + flags.count(False)
            reward_sum, gen_tokens = reward_sum + float(rewards.double().sum()), gen_tokens + out.num_generated_tokens
            times = {k: v + getattr(out, k) for k, v in times.items()}
            new = [_Group(ok, mine[g * G:(g + 1) * G], texts[g * G:(g + 1) * G], rewards[g * G:(g + 1) * G].clone(),
                          routes.select(range(g * G, (g + 1) * G)) if routes is not None else None,
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
                 "dynamic_sampling/generated_reward_mean": reward_sum / (groups * G)}
        # the kept groups' rows, in pick order; the timings are those of every round
        out = _merge_rows([grp.out for grp in kept], [(k, j) for k in range(len(kept)) for j in range(G)],
                          self.gen_cfg.pad_id)
        out = dataclasses.replace(out, **times)
        mine = [p for grp in kept for p in grp.prompts]
        texts = [x for grp in kept for x in grp.texts]
        # the kept rows' own routes (R3, or the routing reference), whichever round generated them
        routes = RolloutRoutes.cat([grp.routes for grp in kept]) if kept[0].routes is not None else None
        # gen_tokens: every round's, kept or not
        return mine, out, texts, torch.cat([grp.rewards for grp in kept]), routes, stats, gen_tokens

    def collect(self, step: int) -> RolloutRecord:
        st, t = self.state, self.cfg.train
        G = self.gen_cfg.n_samples_per_prompt
        R = t.prompts_per_step * G
        rows = local_rows(R, t.num_minibatches, st.dp, st.dp_rank)  # 2.
        if t.dynamic_sampling:
            mine, out, texts, rewards, routes, stats, gen_tokens = self._dynamic_rounds(step, rows, R, G)
        else:
            (mine, out, texts, rewards, routes), stats, gen_tokens = self._generate_round(step, 0, rows, R), {}, None
        return RolloutRecord.from_generation(step, out, rows, [p.id for p in mine], texts, rewards,
                                             gen_tokens=gen_tokens, stats=stats, routes=routes)


@dataclass
class _Group:
    """One generated group that dynamic sampling may still pick: its G rows, copied out of their round."""

    informative: bool
    prompts: list
    texts: list
    rewards: torch.Tensor  # [G]
    routes: Optional[RolloutRoutes]  # the G rows' routes (routing.RolloutRoutes), when recorded
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
    if getattr(outs[0], "trajectories", None):  # multi-turn rows: their conversations follow them
        merged = dataclasses.replace(merged, trajectories=[outs[k].trajectories[i] for k, i in take])
    return merged
