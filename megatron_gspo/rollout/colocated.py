"""The colocated rollout source: the training model samples its own rollouts (``rollout.mode=colocated``).

    1. draw the step's P prompts, the same on every rank                      data.PromptSampler
    2. generate this rank's rows: its share of every minibatch                rows.local_rows
    3. sample G responses per prompt on the training model (KV cache)        generation.Generator
    4. score them (+ DAPO's overlong penalty); every rank's scores gathered   rewards, exchange.gather_scores
    5. dynamic sampling: more rounds until P informative groups              algorithms.dynamic_sampling
    6. the kept rows as one global batch, dealt to the DP ranks by tokens     rows.deal_rows, exchange.exchange
-> a RolloutRecord of the rows this rank trains (record.py); rollout/prepare.py turns it into the training batch.
Sampling noise is keyed by the global row (sampling.py), so the rows are the same under any DP / TP / EP
layout; which groups dynamic sampling keeps and which rank trains a row are decided on the gathered
scores, the same on every rank. The routing policy is told while generating: the routes it records (R3,
or the routing reference without an old-log-prob pass) travel with their rows, in the record.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from megatron_gspo.algorithms.dynamic_sampling import informative_groups, prune_groups
from megatron_gspo.algorithms.overlong import overlong_penalty
from megatron_gspo.runtime.stop import Cancelled, raise_together
from megatron_gspo.config.rules import row_token_budget
from megatron_gspo.generation.generator import Generator
from megatron_gspo.model.oom import explain_oom
from megatron_gspo.data.rewards import compute_rewards
from megatron_gspo.rollout.exchange import RouteSpec, Scores, exchange, gather_scores, row_bytes
from megatron_gspo.rollout.multiturn import build_multiturn, multiturn_rewards
from megatron_gspo.rollout.record import COUNTS, RolloutRecord
from megatron_gspo.rollout.rows import deal_rows, generating_rank, local_rows, token_imbalance

log = logging.getLogger("megatron_gspo")


class ColocatedSource:
    """A RolloutSource (rollout/source.py) generating on the training model, every step (module doc).

    cfg: the JobConfig; gen_cfg: the generation section with the tokenizer's stop and pad ids filled
    in; model: the policy (DDP-wrapped); routing: the RoutingPolicy; timer: where the sections' wall
    times go. ``stop``: the job's stop flag (anything with ``.set``): generation stops early and every
    rank leaves the step (runtime.stop.Cancelled)."""

    def __init__(self, cfg, state, model, sampler, tokenizer, reward_fn, gen_cfg, routing, timer, *, stop) -> None:
        self.cfg, self.state, self.model = cfg, state, model
        self.sampler, self.tokenizer, self.reward_fn = sampler, tokenizer, reward_fn
        self.routing, self.timer, self.stop = routing, timer, stop
        self.gen_cfg = gen_cfg
        # generate() gets one row per sample: a sample's noise is keyed by its global row
        self.row_gen_cfg = dataclasses.replace(gen_cfg, n_samples_per_prompt=1)
        # rollout.engine=vllm: a vLLM engine samples the rollouts (rollout/vllm_engine.py)
        self.engine = _vllm_engine(cfg, state, model, gen_cfg) if cfg.rollout.engine == "vllm" else None
        # one decoder for every rollout of the job (its KV cache and CUDA graphs sized for the longest row: a
        # prompt and its response, or a whole conversation);
        # with vLLM the engine behind the same interface, which the multi-turn rollout and the evaluation use too
        self.generator = Generator(model, vocab_size=cfg.model.vocab_size, state=state,
                                   slots=row_token_budget(cfg) - 1) \
            if self.engine is None else _engine_generator(self.engine)
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
        if self.engine is not None:
            self.engine.close()

    def sampling_seed(self, step: int) -> int:
        """(generation.seed, step) in one 64-bit key; sampling.py keys every draw by row and position too."""
        return (self.gen_cfg.seed << 32) + step

    def _generate_round(self, step: int, rnd: int, rows: list[int], R: int):
        """Draw P prompts, sample this rank's rows of them and score them (steps 1-4 without advantages).

        Round ``rnd`` > 0 (dynamic sampling) keys its noise by rows rnd * R + g: every row of every
        round of a step draws distinct noise, and round 0 is exactly the rollout without dynamic
        sampling. Returns (this rank's prompts per row, GenerationOutput, texts, rewards [B], the routes it
        was generated with: routing.RolloutRoutes, or None when the routing policy records none, the round's
        P prompts)."""
        cfg, st, dev = self.cfg, self.state, self.state.device
        prompts = self.sampler.next_batch()  # 1. the same P prompts on every rank
        G = self.gen_cfg.n_samples_per_prompt
        mine = [prompts[g // G] for g in rows]
        shapes = (f"{len(mine)} rows, prompts up to {max(len(p.ids) for p in mine)} tokens + "
                  f"{self.gen_cfg.max_new_tokens} new")
        if self.multiturn is not None:
            return (mine, *self._talk(step, rnd, rows, R, mine, shapes), prompts)
        # 3. (on vLLM the engine's routes are filed to the recorder under R3: rollout/vllm_routes.py)
        with self.timer("generate"), self.routing.generating(), explain_oom("generation", cfg, st, shapes):
            out = self.generator.generate([p.ids for p in mine], self.row_gen_cfg, seed=self.sampling_seed(step),
                                          row_keys=[rnd * R + g for g in rows],
                                          on_forward=self.routing.on_generation_forward,
                                          should_stop=self.should_stop)
        # A stop signal on any rank: all leave the step here, together (one all-reduce per round; the
        # decode loop itself stopped at once, agreed within its lockstep group at no extra cost)
        raise_together(out.abandoned or self.should_stop(), dev,
                       f"in generation round {rnd + 1}" + (", decoding cut short" if out.abandoned else ""), step + 1,
                       what="stop vote after generation")
        routes = self.routing.rollout_routes(out)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
        with self.timer("reward"):  # 4. (a stop signal cuts scoring short: one vote, every rank leaves the step)
            try:
                rewards = compute_rewards(self.reward_fn, [p.text for p in mine], texts, [p.answer for p in mine],
                                          device=dev, should_stop=self.should_stop)
            except Cancelled:
                rewards = None
            raise_together(rewards is None, dev, f"while scoring round {rnd + 1}", step + 1, what="stop vote after scoring")
            r = cfg.reward
            if r.overlong_buffer_len > 0:  # DAPO's soft overlong punishment, part of the reward
                rewards = rewards + overlong_penalty(out.response_lengths.to(dev), self.gen_cfg.max_new_tokens,
                                                     r.overlong_buffer_len, r.overlong_penalty_factor)
        return mine, out, texts, rewards, routes, prompts

    def _talk(self, step: int, rnd: int, rows: list[int], R: int, mine: list, shapes: str):
        """Steps 3-4 of a multi-turn job: every row talks with its environment (rollout/multiturn.py), then is
        scored: the environment's reward, or reward.name on its last response. (output, texts, rewards, routes)"""
        cfg, st = self.cfg, self.state
        with self.timer("generate"), explain_oom("generation", cfg, st, shapes + ", over turns"):
            out = self.multiturn.run(mine, [rnd * R + g for g in rows], self.sampling_seed(step), self.routing,
                                     self.should_stop)
        # perf/env_s: the part of perf/generate_s spent in environment steps (tool calls), every round's
        self.timer.record("env", self.timer.times.get("env", 0.0) + out.stats["rollout/env_s"])
        raise_together(out.abandoned or self.should_stop(), st.device,
                       f"in generation round {rnd + 1}, over turns" + (", cut short" if out.abandoned else ""), step + 1,
                       what="stop vote after generation")
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
        with self.timer("reward"):
            try:
                rewards = multiturn_rewards(out, mine, self.reward_fn, cfg, st.device, should_stop=self.should_stop)
            except Cancelled:
                rewards = None
            raise_together(rewards is None, st.device, f"while scoring round {rnd + 1}", step + 1,
                           what="stop vote after scoring")
        return out, texts, rewards, out.routes

    def _round(self, step: int, rnd: int, rows: list[int], R: int):
        """One generation round: this rank's rows as a record (row_ids: the generation keys rnd * R + g, unique
        within the step), every rank's scores by row of the round (one all-gather), the round's prompts."""
        st, t = self.state, self.cfg.train
        mine, out, texts, rewards, routes, prompts = self._generate_round(step, rnd, rows, R)
        scores = gather_scores(rewards, out, R, t.num_minibatches, st.dp, st.dp_group, st.device,
                               conversations=out.trajectories if self.multiturn is not None else None)
        record = RolloutRecord.from_generation(step, out, [rnd * R + g for g in rows], [p.id for p in mine], texts,
                                               rewards, routes=routes)
        return record, scores, prompts

    def _dynamic_rounds(self, step: int, rows: list[int], R: int, G: int):
        """Dynamic sampling over the whole batch: rounds of P prompts until P informative groups (decided on
        every rank's gathered rewards), or train.dynamic_sampling_max_rounds extra rounds (each one logged).
        Between rounds only the groups that can still be picked are kept (prune_groups: at most P, this
        rank's rows of them copied out of the round's output), so memory does not grow with the rounds.
        Returns (the picked groups in pick order, this rank's rows of them, the step's statistics)."""
        t = self.cfg.train
        P = t.prompts_per_step
        kept: list[_Pick] = []  # informative first, each part in (round, group) order
        pool, rounds, dropped, reward_sum, totals = None, 0, 0, 0.0, dict(gen_s=0.0, **dict.fromkeys(COUNTS, 0))
        while True:
            record, scores, prompts = self._round(step, rounds, rows, R)
            flags = informative_groups(scores.rewards, G).tolist()
            dropped, reward_sum = dropped + flags.count(False), reward_sum + float(scores.rewards.double().sum())
            totals = {k: v + getattr(record, k) for k, v in totals.items()}
            kept = prune_groups(kept + [_Pick(rounds, g, ok, prompts[g], scores.rows(g * G, (g + 1) * G))
                                        for g, ok in enumerate(flags)], P, informative=lambda p: p.informative)
            pool = _keep(record if pool is None else RolloutRecord.cat([pool, record], self.gen_cfg.pad_id),
                         {p.round * R + p.group * G + j for p in kept for j in range(G)})
            rounds += 1
            found = sum(p.informative for p in kept)
            if found == P or rounds > t.dynamic_sampling_max_rounds:
                break
            log.info("step %d: dynamic sampling: %d of %d informative groups after %d generation round(s); round %d "
                     "of at most %d (train.dynamic_sampling_max_rounds=%d extra)", step + 1, found, P, rounds,
                     rounds + 1, t.dynamic_sampling_max_rounds + 1, t.dynamic_sampling_max_rounds)
        if P - found and self.state.is_main:
            log.warning("step %d: dynamic sampling found %d of %d informative groups in %d generation rounds "
                        "(train.dynamic_sampling_max_rounds=%d); %d constant groups (zero advantage) fill the step",
                        step + 1, found, P, rounds, t.dynamic_sampling_max_rounds, P - found)
        stats = {"dynamic_sampling/rounds": float(rounds),
                 "dynamic_sampling/dropped_group_frac": dropped / (rounds * P),
                 "dynamic_sampling/filled_groups": float(P - found),
                 "dynamic_sampling/generated_reward_mean": reward_sum / (rounds * P * G)}
        # the timings and generated tokens are every round's, kept or not
        return kept, dataclasses.replace(pool, **totals), stats

    def collect(self, step: int) -> RolloutRecord:
        st, t = self.state, self.cfg.train
        G = self.gen_cfg.n_samples_per_prompt
        R = t.prompts_per_step * G
        rows = local_rows(R, t.num_minibatches, st.dp, st.dp_rank)  # 2.
        sync = None
        if self.engine is not None:  # the weights of every update since the last step (or the warm start, a resume)
            with self.timer("weight_sync"):
                sync = self.generator.sync()
            self.engine.take_prefix_cache_stats()  # the step's hit rate: its own generations only
        if t.dynamic_sampling:
            picks, pool, stats = self._dynamic_rounds(step, rows, R, G)
        else:
            pool, scores, prompts = self._round(step, 0, rows, R)
            picks, stats = [_Pick(0, g, True, prompts[g], scores.rows(g * G, (g + 1) * G)) for g in range(len(prompts))], {}
        if sync is not None:
            stats = {**stats, **_engine_stats(self.engine, sync)}
            self.generator.stale = True  # the step's updates follow: an evaluation after them syncs first
            self.engine.rest()  # (rollout.vllm.sleep_level) the step's training gets the engine's GPU memory
        return self._global_batch(picks, pool, stats, R, G)

    def _global_batch(self, picks: list, pool: RolloutRecord, stats: dict, R: int, G: int) -> RolloutRecord:
        """The picked groups as the step's global batch (slot i * G + j: sample j of the i-th picked group), dealt
        to the DP ranks by token count (rows.deal_rows) and moved there (exchange.exchange; nothing moves
        when the deal leaves every row where it was generated): this rank's rows as a record, with every
        slot's reward (the advantages' input) and, at DP > 1, how balanced the deal is."""
        st, t = self.state, self.cfg.train
        keys = [p.round * R + p.group * G + j for p in picks for j in range(G)]  # slot -> generation key
        scores = Scores.cat([p.scores for p in picks])
        lengths = scores.seq_lengths.tolist()
        deal = deal_rows(lengths, t.num_minibatches, st.dp, balance=t.balance_batch)
        holder = [generating_rank(k % R, R, t.num_minibatches, st.dp) for k in keys]
        at = {key: i for i, key in enumerate(pool.row_ids.tolist())}
        where = {s: at[k] for s, k in enumerate(keys) if k in at}  # slot -> its row in the pool, held here
        moves = [s for r, dealt in enumerate(deal) for s in dealt if holder[s] != r]
        prompt_ids = [p.prompt.id for p in picks for _ in range(G)]
        if moves:
            local = exchange(pool, where, deal, holder, scores, prompt_ids, rank=st.dp_rank, group=st.dp_group,
                             device=st.device, pad_id=self.gen_cfg.pad_id,
                             decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        else:
            idx = [where[s] for s in deal[st.dp_rank]]
            local = pool if idx == list(range(pool.num_rows)) else pool.select(
                torch.tensor(idx, dtype=torch.long, device=pool.tokens.device), width=pool.tokens.shape[1])
            local = dataclasses.replace(local, row_ids=torch.tensor(deal[st.dp_rank], dtype=torch.long,
                                                                    device=local.row_ids.device))
        if st.dp > 1:
            spec, plen = RouteSpec.of(pool.routes), scores.prompt_lengths.tolist()
            conv = [None] * len(lengths) if scores.conversation_bytes is None else scores.conversation_bytes.tolist()
            stats = {**stats, "rollout/dp_token_imbalance": token_imbalance(lengths, deal, t.num_minibatches),
                     "rollout/dp_token_imbalance_unbalanced": token_imbalance(
                         lengths, deal_rows(lengths, t.num_minibatches, st.dp, balance=False), t.num_minibatches),
                     "rollout/dp_moved_rows_frac": len(moves) / R,
                     "rollout/dp_exchange_bytes": float(sum(row_bytes(plen[s], lengths[s] - plen[s], spec, conv[s])
                                                            for s in moves))}
        return dataclasses.replace(local, step=pool.step, gen_s=pool.gen_s, **{k: getattr(pool, k) for k in COUNTS},
                                   stats=stats, prompt_ids=[
                                       prompt_ids[s] for s in local.row_ids.tolist()],
                                   global_rewards=scores.rewards)


def _vllm_engine(cfg, state, model, gen_cfg):
    """The job's vLLM engine (rollout.engine=vllm; colocated, or a rollout rank's of an async job), sized for the
    longest prompt and response (a multi-turn row's: its whole conversation), with the rollout.vllm.* settings:
    this rank's shard of its TP group's engine (vllm_engine.engine_layout_args); each DP replica generates its
    own rows (local_rows)."""
    from megatron_gspo.config.rules import env_response_budget
    from megatron_gspo.rollout.vllm_engine import VllmEngine, engine_args_of

    response = env_response_budget(cfg) if cfg.env.enabled else gen_cfg.max_new_tokens
    args = engine_args_of(cfg.rollout.vllm)
    if cfg.rollout.is_async:  # a rollout rank's engine (rollout/worker.py) takes weights between two engine steps:
        args["async_scheduling"] = False  # no step may still be running then (vLLM's async scheduling runs ahead)
    return VllmEngine(model, state, cfg.model, seed=gen_cfg.seed, bucket_mb=int(cfg.rollout.weight_sync_bucket_mb),
                      max_model_len=cfg.data.max_prompt_length + response, engine_args=args,
                      return_routes=cfg.train.routing_replay == "R3", sleep_level=_sleep_level(cfg, state))


def _sleep_level(cfg, state) -> int:
    """rollout.vllm.sleep_level, null resolved: 2 for a colocated engine on a GPU (its memory goes back to
    training between generations, and each generation starts with a weight sync), else 0 (no sleep mode on a
    CPU; an async rollout rank does not train)."""
    level = cfg.rollout.vllm.sleep_level
    if level is None:
        level = 2 if state.device.type == "cuda" and not cfg.rollout.is_async else 0
    return level


def _engine_generator(engine):
    from megatron_gspo.rollout.vllm_engine import EngineGenerator

    return EngineGenerator(engine)


def engine_metrics(sync_bytes: float, queries: int, hits: int) -> dict:
    """A step's vLLM engine metrics (colocated, and an async job's from its rollout ranks: rollout/remote.py): the
    bytes its weight syncs moved, and the share of its requests' prompt tokens (``queries``: a row's prompt, or a
    conversation so far) that the engine's prefix cache served (``hits``: the prompt's KV computed once for its G
    samples, a conversation's reused by its next turn)."""
    return {"rollout/weight_sync_bytes": float(sync_bytes),
            "rollout/prefix_cache_hit_rate": hits / queries if queries else 0.0}


def _engine_stats(engine, sync) -> dict:
    return engine_metrics(sync.bytes, *engine.take_prefix_cache_stats())


@dataclass
class _Pick:
    """A generated group that dynamic sampling may still pick (every rank knows all of them): its round,
    its index in the round, whether it carries signal, its prompt and its G rows' scores."""

    round: int
    group: int
    informative: bool
    prompt: object
    scores: Scores


def _keep(record: RolloutRecord, keys: set) -> RolloutRecord:
    """The rows of ``record`` whose generation key (row_ids) is in ``keys``, copied out (the grid keeps its width)."""
    idx = [i for i, k in enumerate(record.row_ids.tolist()) if k in keys]
    return record.select(torch.tensor(idx, dtype=torch.long, device=record.row_ids.device), width=record.tokens.shape[1])
