"""The remote rollout source, the trainer's end of an asynchronous job: ``RemoteSource.collect(step)``.

    1. push the current weights as policy version ``step`` (every trainer rank: weight_sync.WeightSender;
       the first call also tells the rollout ranks where to start: the step and the data position)
    2. wait for step ``step``'s rows (trainer rank 0 polls the control plane, receives every rollout
       leader's rows over the bridge and broadcasts them over the trainer's world; the others wait in that
       broadcast, kept under the collective timeout by "still waiting" headers)
    3. check the staleness bound, and return this rank's rows as a RolloutRecord, cut as a colocated job
       cuts them (the trainer prepares it as any record: rollout/prepare.py)
The rows travel in the wire format of record.py (pack / unpack / concat), over the bridge and again over
the trainer's world.

The data position saved in a checkpoint is the one after the *consumed* batch (the rollout ranks run
ahead of it): a resumed job regenerates what was in flight, from that position, with the same noise.
A rollout rank that failed, went silent or was lost mid-push stops the job: every trainer rank raises
exit_status.StoppedFor with the rollout rank's StopReason, the trainer checkpoints and exits (trainer/stopping.py).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from typing import Optional

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.runtime.exit_status import StopReason, StoppedFor
from megatron_gspo.runtime.hooks import TrainerHook
from megatron_gspo.rollout.record import (COUNTS, HEADER, RolloutRecord, WireFormatError, check_header, concat,
                                          empty_payload, pack, unpack)
from megatron_gspo.rollout.rows import local_rows
from megatron_gspo.rollout.side import PeerState, short_error
from megatron_gspo.rollout.weight_sync import WeightSender

log = logging.getLogger("megatron_gspo")

_DATA, _WAIT, _STOP = 1, 2, 3
_KEEPALIVE_S = 10.0  # "still waiting" headers to the other trainer ranks: far below any collective timeout
# what a rollout rank's state means for the job (the exit code follows from the reason: exit_status.StopReason)
_REASON = {PeerState.FAILED: StopReason.ROLLOUT_RANK_FAILED, PeerState.EXITED: StopReason.ROLLOUT_RANK_EXITED,
           PeerState.SILENT: StopReason.ROLLOUT_RANK_SILENT}


class RemoteSource:
    """A RolloutSource (rollout/source.py) whose rows the rollout ranks generate (module doc). ``side``: this
    trainer rank's rollout.side.Side (bridge open); ``stop``: the job's stop flag (``.set``, ``.received``).

    perf/decode_row_steps, perf/prefill_tokens, perf/decode_batch_fill: the rollout ranks' counts go to the
    record of DP rank 0 only, so the DP sum of the metric counts them once."""

    def __init__(self, cfg, state, model, sampler, gen_cfg, side, timer, *, stop) -> None:
        self.cfg, self.state, self.model, self.sampler, self.gen_cfg = cfg, state, model, sampler, gen_cfg
        self.timer, self.stop = timer, stop
        r = cfg.rollout
        self.side, self.control = side, side.control
        self.sender = WeightSender(model, state, side.sync_pg, int(r.weight_sync_bucket_mb * 2**20))
        self.max_staleness = r.max_staleness
        self.rollout_ranks = [side.split.trainer_size + i for i in range(side.split.rollout_size)]
        self.started = False
        log.info("asynchronous rollouts: %d more rank(s) generate (TP %d, EP %d), max staleness %d, partial "
                 "rollouts: %s", r.world_size, r.tensor_model_parallel_size, r.expert_model_parallel_size,
                 r.max_staleness, r.partial_rollouts)

    def hooks(self) -> list:
        return [_AsyncHook()]

    def close(self) -> None:
        pass  # the trainer closes the side (it joined it before the process groups existed)

    # ------------------------------------------------------------------------------------------
    def collect(self, step: int) -> RolloutRecord:
        st, dev, t = self.state, self.state.device, self.cfg.train
        if not self.started:  # where the rollout ranks start: this step, the data position of a resume
            if st.is_main:
                self.control.announce_start(step, self.sampler.state_dict())
            self.started = True
        with self.timer("weight_sync"):
            sync = self._push(step)
        t0 = time.perf_counter()
        with self.timer("rollout_wait"):
            full = self._receive(step)
        wait_s = time.perf_counter() - t0
        R = t.prompts_per_step * self.gen_cfg.n_samples_per_prompt
        row_ids, v_start, v_end = full.row_ids, full.version_start, full.version_end
        if sorted(row_ids.tolist()) != list(range(R)):
            raise RuntimeError(f"step {step + 1}: the rollout ranks sent rows {sorted(row_ids.tolist())[:8]}..., "
                               f"not each of the {R} rows once")
        staleness = step - v_start
        if bool((staleness < 0).any()) or int(staleness.max()) > self.max_staleness:
            raise RuntimeError(f"step {step + 1}: rollout rows of policy versions {sorted(set(v_start.tolist()))} "
                               f"break the staleness bound rollout.max_staleness={self.max_staleness}")
        self.sampler.load_state_dict(full.data_state)  # the position after the consumed batch (checkpoints save it)
        # this rank's rows, in its order, cut as a colocated generation would cut them
        rows = local_rows(R, t.num_minibatches, st.dp, st.dp_rank)
        where = torch.empty(R, dtype=torch.long, device=dev)
        where[row_ids] = torch.arange(full.num_rows, device=dev)
        mine = full.select(where[torch.tensor(rows, dtype=torch.long, device=dev)])
        self.timer.record("generate", full.gen_s)  # the rollout ranks' generation seconds (perf/gen_tokens_per_s)
        if full.trajectories:  # perf/env_s: the part of it in environment steps (the slowest leader's), as colocated
            self.timer.record("env", full.stats["env_s"])
        raw, hist = full.stats, staleness.double()
        stats = {
            "async/staleness_mean": float(hist.mean()), "async/staleness_max": float(hist.max()),
            "async/staleness": hist,  # the histogram (tensorboard)
            **{f"async/staleness_frac_{j}": float((staleness == j).double().mean()) for j in range(self.max_staleness + 1)},
            "async/mixed_version_rows": float((v_end != v_start).sum()),
            "async/weight_sync_s": sync.seconds, "async/weight_sync_bytes": float(sync.bytes),
            "async/weight_sync_buckets": float(sync.buckets),
            "async/trainer_wait_s": wait_s,
            "async/rollout_idle_frac": raw["idle_frac"], "async/rollout_sync_s": raw["sync_s"],
            "async/partial_finished_rows": float(raw["partial_finished"]),
            "async/partial_dropped_rows": float(raw["dropped"]),
            "async/mid_generation_updates": float(raw["updates"]),
        }
        if self.cfg.rollout.engine == "vllm":  # as a colocated job on vLLM logs them
            from megatron_gspo.rollout.colocated import engine_metrics

            stats.update(engine_metrics(raw["engine_sync_bytes"], raw["prefix_queries"], raw["prefix_hits"]))
        # step, gen_s and data_state are the whole step's (select keeps them); the tokens are this rank's
        return dataclasses.replace(mine, gen_tokens=int(mine.loss_mask.sum().item()),  # sampled: a multi-turn row's turns
                                   **{k: getattr(full, k) if st.dp_rank == 0 else 0 for k in COUNTS if k != "gen_tokens"},
                                   stats=stats)

    # ------------------------------------------------------------------------------------------
    def _push(self, version: int):
        """Every trainer rank; raises StoppedFor (on every rank) if the stream could not reach them."""
        why, reason = None, StopReason.ROLLOUT_RANK_GONE
        if self.side.on_bridge:
            state, problem = self._rollout_state()
            if state is PeerState.ALIVE:
                self.control.announce_push(version)
            else:
                why, reason = problem, _REASON[state]
        stats, err = self.sender.push(version, bridge=why is None)
        if err is not None and why is None:
            why = f"the weight push of version {version} to the rollout ranks failed: {err}"
            # the push fails on whichever rollout rank died: name it, as the other stops do
            state, problem = self._rollout_state()
            gone = problem if state is not PeerState.ALIVE else self._gone_ranks()
            reason = _REASON.get(state, StopReason.ROLLOUT_RANK_GONE)
            if gone:
                why = f"{gone}; {why}"
        if comm.any_rank(why is not None, self.state.device, what="async: the weight push failed"):
            self._stop_everywhere(why, reason)
        return stats

    def _rollout_state(self) -> tuple[PeerState, str]:
        return self.control.check_peers(self.rollout_ranks, self.cfg.rollout.heartbeat_timeout_s, "rollout")

    def _receive(self, step: int) -> RolloutRecord:
        """Step ``step``'s rows (every rollout leader's) on every trainer rank; see the module doc."""
        dev = self.state.device
        if self.state.is_main:
            status, payload = self._gather_on_main(step)
            while status == _WAIT:
                self._status(_WAIT)
                status, payload = self._gather_on_main(step)
            if status == _STOP:
                self._status(_STOP)
                self._stop_everywhere(*payload)
            header, ints, floats, meta = pack(payload)
            self._status(_DATA, *header.tolist())
        else:
            head = self._status()
            while head[0] == _WAIT:
                head = self._status()
            if head[0] == _STOP:
                self._stop_everywhere(None, None)
            header = head[1:]
            ints, floats, meta = empty_payload(check_header(header, step, "trainer rank 0"), dev)
        ints = comm.broadcast(ints, 0, None, what="async: rollout rows (ints)")
        floats = comm.broadcast(floats, 0, None, what="async: rollout rows (floats)")
        meta = comm.broadcast(meta, 0, None, what="async: rollout rows (meta)")
        return unpack(header, ints, floats, meta, step=step, sender="trainer rank 0")

    def _gather_on_main(self, step: int):
        """Trainer rank 0: (DATA, record) once every rollout leader's rows of ``step`` arrived (concatenated),
        (WAIT, None) after _KEEPALIVE_S without, or (STOP, (message, StopReason))."""
        dev, split = self.state.device, self.side.split
        t0, last_check = time.monotonic(), 0.0
        leaders = range(split.rollout_dp)
        while True:
            if all(self.control.ready(step, i) for i in leaders):
                break
            now = time.monotonic()
            if now - last_check > 0.5:
                last_check = now
                state, problem = self._rollout_state()
                if state is not PeerState.ALIVE:
                    return _STOP, (f"{problem}; waiting for the rows of step {step + 1}", _REASON[state])
                if self.stop.set or self.control.stop_request() is not None:
                    return _STOP, (self._signalled(step), StopReason.PREEMPTED)
            if now - t0 > _KEEPALIVE_S:
                return _WAIT, None
            time.sleep(0.002)
        parts = []
        try:
            for i in leaders:
                src = 1 + split.rollout_leaders[i]
                sender = f"rollout leader {i}"
                recv = lambda t, what: comm.bridge_recv(t, src, self.side.data_pg, what=what)  # noqa: E731
                header = recv(torch.zeros(len(HEADER), dtype=torch.long, device=dev), "async: rollout rows header")
                ints, floats, meta = [recv(t, f"async: rollout rows ({what})") for t, what in
                                      zip(empty_payload(check_header(header, step, sender), dev), ("ints", "floats", "meta"))]
                parts.append(unpack(header, ints, floats, meta, step=step, sender=sender))
                self.control.consumed(step, i)
        except RuntimeError as e:
            if isinstance(e, WireFormatError):
                raise
            return _STOP, (f"rollout leader {i} (global rank {split.trainer_size + split.rollout_leaders[i]}) is gone: "
                           f"receiving its rows of step {step + 1} failed ({short_error(e)})", StopReason.ROLLOUT_RANK_GONE)
        return _DATA, concat(parts, self.gen_cfg.pad_id)

    def stop_if_ranks_lost(self, signal_name: str) -> None:
        """Every trainer rank, as the job stops for a stop signal (``signal_name``, as the stop line names it):
        if a rollout rank is gone (it raised or exited, or its heartbeat stands still for a few seconds), raise
        StoppedFor naming it on every rank, as when the trainer finds the loss itself. torchrun SIGTERMs
        every rank when one dies, and its signal may reach the trainer before the dead rank does (in an update,
        the next vote sees the signal first): the stop line names the dead rank either way."""
        why, reason = None, None
        if self.state.is_main:
            state, problem = self._rollout_state()
            gone = problem if state is not PeerState.ALIVE else self._gone_ranks()
            if gone:
                why = f"{gone}, and the job got {signal_name} (torchrun stops every rank when one exits)"
                reason = _REASON.get(state, StopReason.ROLLOUT_RANK_GONE)
        if comm.any_rank(why is not None, self.state.device, what="async: rollout ranks lost, at a stop signal"):
            self._stop_everywhere(why, reason)

    def peer_stop_request(self) -> Optional[str]:
        """A rollout rank got a stop signal and asked the trainer to stop: the signal, as the stop line names it
        (trainer rank 0 reads it; the trainer's votes spread it). None: no request (or not trainer rank 0)."""
        if not self.state.is_main:
            return None
        request = self.control.stop_request()
        return None if request is None else f"{request['signal']} (on rollout rank {request['rank']})"

    def _silent_ranks(self, window_s: float = 5.0) -> list[int]:
        """The rollout ranks whose heartbeat does not move for ``window_s`` (several beats): the dead ones,
        once the bridge or a signal says something is wrong (trainer rank 0)."""
        still = set(self.rollout_ranks)
        deadline = time.monotonic() + window_s
        first = {r: self.control.silent_for(r) for r in still}  # noqa: F841 (starts the clocks)
        while still and time.monotonic() < deadline:
            time.sleep(0.25)
            still = {r for r in still if self.control.silent_for(r) > 0}
        return sorted(still)

    def _gone_ranks(self) -> str:
        """'rollout rank(s) [..] stopped beating (...)' for the ranks _silent_ranks finds, or ''."""
        gone = self._silent_ranks()
        return f"rollout rank(s) {gone} stopped beating (killed, or their node is gone)" if gone else ""

    def _signalled(self, step: int) -> str:
        """The job got SIGTERM / SIGUSR1 while waiting for the rollout ranks: a preemption, or torchrun
        stopping every rank because one exited. Rollout ranks whose heartbeat stays still for a few seconds
        are named."""
        gone = self._gone_ranks()
        request = self.control.stop_request()
        sig = (signal.Signals(self.stop.received).name if self.stop.received
               else f"{request['signal']} (on rollout rank {request['rank']})" if request else "a signal")
        if gone:
            return (f"{gone} and the job got {sig} while waiting for the rows of step {step + 1} (torchrun stops "
                    "every rank when one exits)")
        return f"preempted by signal {sig} while waiting for the rows of step {step + 1}"

    # -- trainer-world messages ---------------------------------------------------------------------
    def _status(self, *values: int) -> list[int]:
        """Trainer rank 0's [status, wire header...] to every trainer rank (the others pass no values)."""
        t = torch.zeros(1 + len(HEADER), dtype=torch.long, device=self.state.device)
        if values:
            t[: len(values)] = torch.tensor(values, dtype=torch.long)
        return comm.broadcast(t, 0, None, what="async: rollout batch header").tolist()

    def _bytes(self, raw: bytes) -> bytes:
        """Trainer rank 0's ``raw`` to every trainer rank (the others pass as many zero bytes)."""
        t = torch.tensor(list(raw), dtype=torch.uint8, device=self.state.device)
        return bytes(comm.broadcast(t, 0, None, what="async: rollout batch text").cpu().tolist())

    def _stop_everywhere(self, why: Optional[str], reason: Optional[StopReason]) -> None:
        """Every trainer rank (collectively): raise StoppedFor with trainer rank 0's message and reason (the
        rank on the bridge: the one that knows why; the exit code follows from it: 1 for a rollout rank that
        failed, 75 where a resume is the remedy)."""
        main = self.state.is_main
        text = (why or "the rollout ranks cannot go on").encode() if main else b""
        n = comm.max_int(len(text), self.state.device, what="async: stop message length")
        reasons = list(StopReason)
        index = comm.max_int(reasons.index(reason) + 1 if main and reason is not None else 0, self.state.device,
                             what="async: stop reason")
        text = self._bytes(text.ljust(n) if self.state.is_main else bytes(n)).decode().strip()
        raise StoppedFor(text, reasons[index - 1] if index else StopReason.ROLLOUT_RANK_GONE)


class _AsyncHook(TrainerHook):
    """Per-step async metrics that need the step's wall time."""

    def after_step(self, trainer, metrics: dict) -> None:
        step_s = metrics.get("perf/step_time_s")
        if step_s and "async/trainer_wait_s" in metrics:
            metrics["async/trainer_idle_frac"] = metrics["async/trainer_wait_s"] / step_s
