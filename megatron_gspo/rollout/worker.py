"""A rollout rank of an asynchronous job: generate step after step with the newest weights it was sent.

The loop (every rollout rank; ``s0`` is the step the trainer starts or resumes at)::

    for step s = s0, s0+1, ...:
        wait until holding policy version >= max(s0, s - rollout.max_staleness)   (serving weight pushes)
        draw step s's P prompts (the data position goes with the batch), sample this rank's rows:
            noise keyed by (generation.seed, s, global row, position), as in a colocated job
            a weight push announced mid-generation is applied between two decode steps: the responses in
            flight finish under the new weights (attending to their prefix's KV cache from the old ones: no
            re-prefill; the log-prob recorded per token is the one of the distribution it was drawn from),
            or (partial_rollouts=drop) the generation starts over
        score them; each data-parallel leader (TP rank 0) sends its rows to the trainer over the bridge
    serve weight pushes until the trainer says stop

Staleness is counted from the version a row *started* with: a row of step s began with weights of
version >= s - max_staleness, and the trainer, which trains step s with version s, checks it.

Never blocking in a collective the trainer did not announce: a rank with permission to generate goes
on generating (a push reaches it between decode steps); ranks in generation lockstep (the rollout side's
ParallelState.lockstep_group: TP, or the expert group under EP / expert-TP) agree on "apply the push now" in the vote generate() already takes on the
finished rows every generation.finished_check_interval tokens (no collective, no host sync of its own);
waits poll the control plane (side.Control) and check the trainer's heartbeat.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

import torch

from megatron_gspo.runtime import comm, parallel
from megatron_gspo.rollout.layout import ROLLOUT, rollout_parallel_config
from megatron_gspo.rollout.record import RolloutRecord, pack
from megatron_gspo.rollout.side import PeerState, Side, is_peer_loss, short_error
from megatron_gspo.rollout.weight_sync import WeightReceiver
from megatron_gspo.config import JobConfig
from megatron_gspo.config.rules import row_token_budget
from megatron_gspo.runtime.stop import Cancelled, PreemptionFlag
from megatron_gspo.generation.generator import Generator
from megatron_gspo.rollout.colocated import _vllm_engine
from megatron_gspo.rollout.vllm_engine import EngineGenerator
from megatron_gspo.algorithms.overlong import overlong_penalty
from megatron_gspo.data.rewards import build_reward, compute_rewards
from megatron_gspo.rollout.multiturn import build_multiturn, multiturn_rewards
from megatron_gspo.rollout.rows import local_rows

log = logging.getLogger("megatron_gspo")

# a rollout rank's counters of the step in the making: seconds idle / in weight syncs, bytes handed to a vLLM engine
_CLOCK = {"idle": 0.0, "sync": 0.0, "engine_bytes": 0.0}


class _Restart(Exception):
    """partial_rollouts=drop: a weight update arrived mid-generation; generate again under it."""


@dataclasses.dataclass
class Generated:
    """One step's rows of this rank: GenerationOutput plus the policy versions behind them."""

    out: object
    version_start: int  # every row began with this version
    version_end: torch.Tensor  # [B] long: the newest version that drew a token of the row
    finished_partial: int  # rows in flight at a mid-generation update, finished under the new weights
    dropped_rows: int  # rows thrown away by partial_rollouts=drop
    updates: int  # weight updates applied while generating (under drop: each one restarted the generation)


def generate_with_updates(model, prompts, gen_cfg, *, vocab_size: int, state, seed: int, row_keys: list[int],
                          version: int, poll, apply, policy: str, generator: Optional[Generator] = None) -> Generated:
    """``generate`` that takes weight updates between decode steps.

    poll(): (update pending, stop pending) on this rank, read at every check of the finished rows (every
    generation.finished_check_interval decode steps; generate() agrees on both over the generation lockstep
    group in that check's vote); apply(): receives the update into ``model`` and returns the new version.
    policy "finish": the rows go on under the new weights; "drop": the generation restarts under them (same
    noise: the samples are those of a generation that began with the new weights). ``generator``: the
    rank's Generator on ``model`` (None: a throwaway one)."""
    if generator is None:
        generator = Generator(model, vocab_size=vocab_size, state=state)
    dropped = applied = 0
    while True:
        v_start = version
        updates: list[tuple[int, int]] = []  # (forward index, version after it) of this attempt

        def on_update(idx: int) -> None:
            nonlocal version, applied
            version = apply()
            applied += 1  # applied while generating, whatever the policy does with the rows in flight
            if policy == "drop":
                raise _Restart()
            updates.append((idx, version))

        try:
            out = generator.generate(prompts, gen_cfg, seed=seed, row_keys=row_keys, poll=poll, on_update=on_update)
        except _Restart:
            dropped += len(row_keys)
            continue
        if out.abandoned:  # the trainer announced the end (or went silent): the rank leaves its loop
            raise Cancelled("while generating")
        break
    # forward idx computed the logits of response token idx: tokens idx+1.. came from the new weights
    lengths = out.response_lengths.to(torch.long)
    v_end = torch.full_like(lengths, v_start)
    partial = torch.zeros_like(lengths, dtype=torch.bool)
    for idx, v in updates:
        touched = lengths > idx + 1
        v_end = torch.where(touched, torch.full_like(v_end, v), v_end)
        partial |= touched
    return Generated(out, v_start, v_end, int(partial.sum()), dropped, applied)


class RolloutWorker:
    """A rollout rank: built from the job's config and its ``Side`` (rollout.side.join). ``faults``: the
    tests' fault injection (testing/faults.py), which the entry point adds when asked; None otherwise."""

    def __init__(self, cfg: JobConfig, side: Side, faults=None) -> None:
        from megatron_gspo.data.prompts import build_prompt_sampler
        from megatron_gspo.model.gpt import build_model, job_precision
        from megatron_gspo.data.tokenizer import build_tokenizer, check_vocab_fits

        assert side.role == ROLLOUT
        self.cfg, self.side = cfg, side
        par = rollout_parallel_config(cfg)
        self.state = st = parallel.initialize(cfg.model, par, side=side)
        # the trainer's numerics on this device (model.precision=auto: trainer.Trainer resolves it the same way)
        precision, _ = job_precision(cfg.model, st.device)
        if precision != cfg.model.precision:
            self.cfg = cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, precision=precision))
        side.open_bridge(st.device)
        self.control = side.control
        # a stop signal here is passed on to the trainer (_poll), which checkpoints and announces the stop
        self.preempt = PreemptionFlag.install()
        r, t, g = cfg.rollout, cfg.train, cfg.generation
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        check_vocab_fits(self.tokenizer, cfg.model.vocab_size)
        e = cfg.eval
        holdout = e.num_prompts if e.interval > 0 and e.source is None else 0  # as the trainer's sampler
        self.sampler = build_prompt_sampler(cfg.data, self.tokenizer, t.prompts_per_step, holdout=holdout)
        self.model = build_model(cfg.model, par, st, deterministic=t.deterministic)
        self.model.requires_grad_(False)
        self.gen_cfg = dataclasses.replace(
            g, stop_token_ids=g.stop_token_ids or list(self.tokenizer.eos_ids),
            pad_token_id=g.pad_token_id if g.pad_token_id is not None else self.tokenizer.pad_id)
        self.row_gen_cfg = dataclasses.replace(self.gen_cfg, n_samples_per_prompt=1)
        # one decoder for every step of this rank (its KV cache and CUDA graphs sized for the longest row: a
        # prompt and its response, or a whole conversation); rollout.engine=vllm: this rank's vLLM engine (its
        # shard of its TP group's engine), built from the model, behind the same interface. The model stays the
        # weight stream's landing place (WeightReceiver); each push is handed on to the engine (_apply_push).
        self.engine = _vllm_engine(cfg, st, self.model, self.gen_cfg) if r.engine == "vllm" else None
        self.generator = Generator(self.model, vocab_size=cfg.model.vocab_size, state=st, slots=row_token_budget(cfg) - 1) \
            if self.engine is None else EngineGenerator(self.engine)
        self.reward_fn = build_reward(cfg.reward)
        # env.name: every row talks with an environment over turns (rollout/multiturn.py), here as colocated
        self.multiturn = build_multiturn(cfg, st, self.generator, self.tokenizer, self.gen_cfg)
        self.receiver = WeightReceiver(self.model, st, side.sync_pg, int(r.weight_sync_bucket_mb * 2**20))
        self.faults = faults
        self.G = g.n_samples_per_prompt
        self.R = t.prompts_per_step * self.G
        self.rows = local_rows(self.R, 1, st.dp, st.dp_rank)
        self.leader = st.tp_rank == 0
        if self.leader and side.split.rollout_leaders[st.dp_rank] != st.rank:
            raise RuntimeError(f"rollout rank {st.rank} is TP rank 0 of data-parallel rank {st.dp_rank}, but the "
                               f"trainer expects that rank's rows from rollout rank {side.split.rollout_leaders[st.dp_rank]}")
        self.version = -1
        self.pending: list[tuple[int, list, tuple]] = []  # (step, send works, buffers kept alive)
        self._last_poll, self._last_pushed = 0.0, -1
        self._stop_why: Optional[str] = None  # why this rank stops: the trainer's stop, or its silence
        self._asked_to_stop = False  # this rank's stop signal was passed on to the trainer (Control.request_stop)
        self._clock = dict(_CLOCK)
        self._since = time.perf_counter()
        self.timeout_s = r.heartbeat_timeout_s

    # ------------------------------------------------------------------------------------------
    def run(self) -> str:
        """The loop (module doc); returns when the trainer stops, with why (recorded as this rank's exit, which
        the trainer's stop line quotes)."""
        cfg, k = self.cfg, self.cfg.rollout.max_staleness
        start = self._idle_until(self.control.start)
        s0 = int(start["step"])
        if start.get("data"):
            self.sampler.load_state_dict(start["data"])
        log.info("rollout ranks: %d (TP %d, EP %d, DP %d), starting at step %d, max staleness %d, partial rollouts: %s",
                 self.state.world_size, self.state.tp, self.state.ep, self.state.dp, s0 + 1, k,
                 cfg.rollout.partial_rollouts)
        try:
            for s in range(s0, cfg.train.num_steps):
                need = max(s0, s - k)
                self._idle_until(lambda: self.version >= need)
                if self.faults is not None:  # tests: die (or raise) as step s+1's generation starts
                    self.faults.step_starts(s + 1)
                self._one_step(s)
            self._idle_until(lambda: False)  # serve pushes until the stop
        except Cancelled as e:  # the trainer announced the end or went silent (_poll), read in generation, scoring or a wait
            why = self._stop_why or "the trainer stopped"  # (a peer of the generation lockstep may have seen it first)
            log.info("%s, %s: rollout rank %d ends", why, e, self.side.global_rank)
            return why
        return "finished"

    def _one_step(self, step: int) -> None:
        st, dev = self.state, self.state.device
        prompts = self.sampler.next_batch()
        data_state = self.sampler.state_dict()
        mine = [prompts[g // self.G] for g in self.rows]
        if self.multiturn is not None:
            return self._talk(step, mine, data_state)
        gen = generate_with_updates(
            self.model, [p.ids for p in mine], self.row_gen_cfg, vocab_size=self.cfg.model.vocab_size, state=st,
            seed=(self.gen_cfg.seed << 32) + step, row_keys=self.rows, version=self.version,
            poll=self._poll, apply=self._apply_push, policy=self.cfg.rollout.partial_rollouts, generator=self.generator)
        out = gen.out
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
        # a stop (the trainer's, read as in generation) cuts scoring short: Cancelled
        rewards = compute_rewards(self.reward_fn, [p.text for p in mine], texts, [p.answer for p in mine],
                                  device=dev, should_stop=lambda: self._poll()[1])
        rc = self.cfg.reward
        if rc.overlong_buffer_len > 0:  # as ColocatedSource._generate_round
            rewards = rewards + overlong_penalty(out.response_lengths.to(dev), self.gen_cfg.max_new_tokens,
                                                 rc.overlong_buffer_len, rc.overlong_penalty_factor)
        if self.leader:
            self._send(step, gen, mine, texts, rewards, data_state)

    def _talk(self, step: int, mine: list, data_state) -> None:
        """``_one_step`` of a multi-turn job: the rows talk with their environments (rollout/multiturn.py, the
        noise keyed as in a colocated job); a weight push announced during a turn is applied between two of its
        decode steps, as in one response (partial_rollouts=drop: the step's conversations start over). Every
        row of a step that took a push counts as finished under it: version_end is the newest version."""
        dev, policy = self.state.device, self.cfg.rollout.partial_rollouts
        dropped = applied = 0

        def on_update(idx: int) -> None:
            nonlocal applied
            self._apply_push()
            applied += 1
            if policy == "drop":
                raise _Restart()

        stop = lambda: self._poll()[1]  # noqa: E731
        while True:
            v_start = self.version
            try:
                out = self.multiturn.run(mine, self.rows, (self.gen_cfg.seed << 32) + step, should_stop=stop,
                                         gen_kw={"poll": self._poll, "on_update": on_update})
            except _Restart:
                dropped += len(self.rows)
                continue
            break
        if out.abandoned:
            raise Cancelled("while talking")
        rewards = multiturn_rewards(out, mine, self.reward_fn, self.cfg, dev, should_stop=stop)
        touched = v_start != self.version
        gen = Generated(out, v_start, torch.full((len(self.rows),), self.version, dtype=torch.long, device=dev),
                        len(self.rows) if touched and policy == "finish" else 0, dropped, applied)
        if self.leader:
            texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out.responses()]
            self._send(step, gen, mine, texts, rewards, data_state)

    # ------------------------------------------------------------------------------------------
    def _send(self, step: int, gen: Generated, mine, texts, rewards, data_state) -> None:
        """This data-parallel rank's rows of ``step`` to trainer rank 0 (bridge rank 0), without waiting."""
        out, dev = gen.out, self.state.device
        n = out.tokens.shape[0]
        now = time.perf_counter()
        wall, self._since = now - self._since, now
        clock, self._clock = self._clock, dict(_CLOCK)
        queries, hits = self.engine.take_prefix_cache_stats() if self.engine is not None else (0, 0)
        record = RolloutRecord(
            step=step, tokens=out.tokens, prompt_lengths=out.prompt_lengths, response_lengths=out.response_lengths,
            stopped=out.stopped, sample_logprobs=out.logprobs, loss_mask=out.response_mask, rewards=rewards,
            row_ids=torch.tensor(self.rows, dtype=torch.long, device=dev),
            version_start=torch.full((n,), gen.version_start, dtype=torch.long, device=dev),
            version_end=gen.version_end, prompt_ids=[p.id for p in mine], texts=texts, gen_s=out.elapsed_s,
            gen_tokens=out.num_generated_tokens, decode_row_steps=out.decode_row_steps,
            decode_live_row_steps=out.decode_live_row_steps, prefill_tokens=out.prefill_tokens, data_state=data_state,
            trajectories=list(getattr(out, "trajectories", [])),
            stats={"idle_s": clock["idle"], "sync_s": clock["sync"], "wall_s": wall,
                   "partial_finished": gen.finished_partial, "dropped": gen.dropped_rows, "updates": gen.updates,
                   "env_s": float(getattr(out, "stats", {}).get("rollout/env_s", 0.0)),  # multi-turn: tool calls
                   "engine_sync_bytes": clock["engine_bytes"], "prefix_queries": queries, "prefix_hits": hits})
        header, ints, floats, metab = pack(record)
        # "ready" first: with NCCL the first send creates the pair's communicator, which waits for the receiver
        self.control.mark_ready(step, self.state.dp_rank)
        works = [comm.bridge_send(x, 0, self.side.data_pg, what=f"rollout rows of step {step + 1}")
                 for x in (header, ints, floats, metab)]
        self.pending.append((step, works, (header, ints, floats, metab)))

    def _release_sent(self) -> None:
        """Sends of batches the trainer has consumed (it pushes version v after training step v-1)."""
        keep = []
        for step, works, bufs in self.pending:
            if step < self.version:
                for w in works:
                    w.wait()
            else:
                keep.append((step, works, bufs))
        self.pending = keep

    # ------------------------------------------------------------------------------------------
    def _poll(self) -> tuple[bool, bool]:
        """(a push is announced, the trainer stopped or went silent), from the control plane, at most every 10 ms."""
        now = time.monotonic()
        if now - self._last_poll >= 0.01:
            self._last_poll = now
            self._last_pushed = self.control.pushed_version()
            if self.preempt.set and not self._asked_to_stop:
                # a stop signal to this rank: the trainer decides (it checkpoints, then announces the stop);
                # this rank goes on serving until then, the trainer may be pushing to it
                self._asked_to_stop = True
                self.control.request_stop(self.preempt.name)
            if self._stop_why is None:
                info = self.control.stopped()
                gone = None if info is not None else self._trainer_gone()
                if info is not None:
                    self._stop_why = f"the trainer stopped ({info['reason']})"
                elif gone is not None:  # its heartbeat timed out, or it recorded its exit
                    self._stop_why = f"declared the trainer dead: {gone}"
        return self._last_pushed > self.version, self._stop_why is not None

    def _apply_push(self) -> int:
        t0 = time.perf_counter()
        stats = self.receiver.receive()
        if self.engine is not None:  # between two engine steps (generate_with_updates), or while idle
            self._clock["engine_bytes"] += self.generator.sync().bytes
        self._clock["sync"] += time.perf_counter() - t0
        if stats.version <= self.version:
            raise RuntimeError(f"weight sync: received version {stats.version} after {self.version}")
        self.version = stats.version
        self._release_sent()
        return self.version

    def _trainer_gone(self) -> Optional[str]:
        state, why = self.control.check_peers([0], self.timeout_s, "trainer")
        return None if state is PeerState.ALIVE else why

    def _idle_until(self, ready):
        """Wait (serving pushes, watching for the stop and the trainer's heartbeat) until ``ready()`` is truthy;
        returns its value."""
        t0 = time.perf_counter()
        try:
            while True:
                value = ready()
                if value:
                    return value
                update, stop = self._poll()
                if stop:
                    raise Cancelled("while waiting")
                if update:
                    t1 = time.perf_counter()
                    self._apply_push()
                    t0 += time.perf_counter() - t1  # the sync is counted as sync, not idle
                    continue
                time.sleep(0.005)
        finally:
            self._clock["idle"] += time.perf_counter() - t0

    def close(self, message: str, error: bool) -> None:
        self.reward_fn.close()  # its worker processes, if any
        if self.multiturn is not None:
            self.multiturn.close()
        if self.engine is not None:
            self.engine.close()
        self.control.record_exit(message, error)
        self.side.close()


def run_rollout_rank(cfg: JobConfig, faults=None) -> int:
    """A rollout rank's whole life (train.main calls it); returns the process exit code. Why it ended goes
    to the control plane, where the trainer reads it (a failure here stops the trainer with this message).
    ``faults``: the tests' fault injection (train.injected_faults), or None."""
    from megatron_gspo.runtime import exit_status
    from megatron_gspo.rollout.side import join
    from megatron_gspo.errors import USER_ERRORS

    side = join(cfg, ROLLOUT)
    worker = None
    try:
        worker = RolloutWorker(cfg, side, faults=faults)
        why = worker.run()
    except BaseException as e:
        msg = f"{type(e).__name__}: {e}".strip()
        if side.control is None:
            from megatron_gspo.rollout.side import Control

            side.control = Control(side.store, side.split, side.global_rank)
        side.control.record_exit(msg, error=True)
        side.close()
        parallel.destroy()
        if isinstance(e, USER_ERRORS):
            logging.basicConfig(level=logging.INFO, format="%(message)s")
            log.error("error: %s", e)
            exit_status.record(exit_status.EXIT_USER_ERROR, str(e))
            return exit_status.EXIT_USER_ERROR
        if is_peer_loss(e):  # another rank of the job died: its failure is the story, not this traceback
            log.error("rollout rank %d: lost a peer of the bridge (%s); the trainer checkpoints and stops",
                      side.global_rank, short_error(e))
            return exit_status.ExitCode.FAILED
        raise
    worker.close(why, error=False)
    parallel.destroy()
    exit_status.record(0, why)
    log.info("rollout rank %d: closed, exiting", side.global_rank)  # (then exit_status.leave: the process ends)
    return 0
