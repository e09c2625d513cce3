"""The trainer's end of an asynchronous job: ``AsyncRollouts.collect(step)`` in place of generating.

    1. push the current weights as policy version ``step`` (every trainer rank: weight_sync.WeightSender;
       the first call also tells the rollout ranks where to start: the step and the data position)
    2. wait for step ``step``'s rows (trainer rank 0 polls the control plane, receives every rollout
       leader's rows over the bridge and broadcasts them over the trainer's world; the others wait in that
       broadcast, kept under the collective timeout by "still waiting" headers)
    3. check the staleness bound, and build this rank's RolloutBatch exactly as a colocated job does
       (Rollouts.assemble: advantages, micro-batches, the old policy's log-probs recomputed, reference)

The data position saved in a checkpoint is the one after the *consumed* batch (the rollout ranks run
ahead of it): a resumed job regenerates what was in flight, from that position, with the same noise.
A rollout rank that failed, went silent or was lost mid-push stops the job through ``RolloutRanksLost``:
the trainer checkpoints and exits (trainer.py).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Optional

import torch

from megatron_gspo import comm
from megatron_gspo.async_rollout.side import short_error
from megatron_gspo.async_rollout.weight_sync import WeightSender
from megatron_gspo.async_rollout.worker import HEADER, MAGIC
from megatron_gspo.exit_status import EXIT_PREEMPTED
from megatron_gspo.generation import GenerationOutput
from megatron_gspo.hooks import TrainerHook
from megatron_gspo.rollout import RolloutBatch, Rollouts, local_rows

log = logging.getLogger("megatron_gspo")

_DATA, _WAIT, _STOP = 1, 2, 3
_KEEPALIVE_S = 10.0  # "still waiting" headers to the other trainer ranks: far below any collective timeout


class RolloutRanksLost(Exception):
    """The rollout ranks cannot go on (failed, silent, gone mid-push) or the job was signalled while waiting
    for them. ``exit_code``: 1 for a failure, EXIT_PREEMPTED where a resume is the remedy."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class AsyncRollouts(Rollouts):
    """Rollouts whose generation happens on the rollout ranks (module doc). ``side``: this trainer rank's
    async_rollout.side.Side (bridge open); ``preempt``: the trainer's PreemptionFlag."""

    def __init__(self, *args, side, preempt, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        r = self.cfg.rollout
        self.side, self.control, self.preempt = side, side.control, preempt
        self.sender = WeightSender(self.model, self.state, side.sync_pg, int(r.weight_sync_bucket_mb * 2**20))
        self.max_staleness = r.max_staleness
        self.rollout_ranks = [side.split.trainer_size + i for i in range(side.split.rollout_size)]
        self.started = False
        self.hook = _AsyncHook(self)

    # ------------------------------------------------------------------------------------------
    def collect(self, step: int) -> RolloutBatch:
        st, dev, t = self.state, self.state.device, self.cfg.train
        if not self.started:  # where the rollout ranks start: this step, the data position of a resume
            if st.is_main:
                self.control.announce_start(step, self.sampler.state_dict())
            self.started = True
        with self.timer("weight_sync"):
            sync = self._push(step)
        t0 = time.perf_counter()
        with self.timer("rollout_wait"):
            ints, floats, meta = self._receive(step)
        wait_s = time.perf_counter() - t0
        R = t.prompts_per_step * self.gen_cfg.n_samples_per_prompt
        n, T = meta["rows"], meta["width"]
        tokens = ints[: n * T].view(n, T)
        cols = ints[n * T:].view(6, n)
        prompt_len, resp_len, row_ids, stopped, v_start, v_end = cols
        logprobs, rewards = floats[: n * T].view(n, T), floats[n * T:]
        if sorted(row_ids.tolist()) != list(range(R)):
            raise RuntimeError(f"step {step + 1}: the rollout ranks sent rows {sorted(row_ids.tolist())[:8]}..., "
                               f"not each of the {R} rows once")
        staleness = step - v_start
        if bool((staleness < 0).any()) or int(staleness.max()) > self.max_staleness:
            raise RuntimeError(f"step {step + 1}: rollout rows of policy versions {sorted(set(v_start.tolist()))} "
                               f"break the staleness bound rollout.max_staleness={self.max_staleness}")
        self.sampler.load_state_dict(meta["data"])  # the position after the consumed batch (checkpoints save it)
        # this rank's rows, in its order, cut as a colocated generation would cut them
        rows = local_rows(R, t.num_minibatches, st.dp, st.dp_rank)
        where = torch.empty(R, dtype=torch.long, device=dev)
        where[row_ids] = torch.arange(n, device=dev)
        idx = where[torch.tensor(rows, dtype=torch.long, device=dev)]
        total = prompt_len[idx] + resp_len[idx]
        width = int(total.max())
        grid = torch.arange(width, device=dev)[None, :]
        out = GenerationOutput(
            tokens=tokens[idx, :width], prompt_lengths=prompt_len[idx], response_lengths=resp_len[idx],
            response_mask=(grid >= prompt_len[idx, None]) & (grid < total[:, None]),
            logprobs=logprobs[idx, :width], stopped=stopped[idx].bool(),
            prompt_index=torch.arange(len(rows), device=dev), elapsed_s=meta["gen_s"],
            decode_row_steps=meta["decode_row_steps"] if st.dp_rank == 0 else 0,
            temperature=self.gen_cfg.temperature)
        self.timer.times["generate"] = meta["gen_s"]  # the rollout ranks' generation seconds (perf/gen_tokens_per_s)
        pick = idx.tolist()
        batch = self.assemble(rows, [meta["prompt_ids"][i] for i in pick], out, [meta["texts"][i] for i in pick],
                              rewards[idx], {})
        hist = staleness.double()
        batch.stats.update({
            "async/staleness_mean": float(hist.mean()), "async/staleness_max": float(hist.max()),
            "async/staleness": hist,  # the histogram (tensorboard)
            **{f"async/staleness_frac_{j}": float((staleness == j).double().mean()) for j in range(self.max_staleness + 1)},
            "async/mixed_version_rows": float((v_end != v_start).sum()),
            "async/weight_sync_s": sync.seconds, "async/weight_sync_bytes": float(sync.bytes),
            "async/weight_sync_buckets": float(sync.buckets),
            "async/trainer_wait_s": wait_s,
            "async/rollout_idle_frac": meta["idle_frac"], "async/rollout_sync_s": meta["sync_s"],
            "async/partial_finished_rows": float(meta["partial_finished"]),
            "async/partial_dropped_rows": float(meta["dropped"]),
            "async/mid_generation_updates": float(meta["updates"]),
        })
        return batch

    # ------------------------------------------------------------------------------------------
    def _push(self, version: int):
        """Every trainer rank; raises RolloutRanksLost (on every rank) if the stream could not reach them."""
        why, code = None, EXIT_PREEMPTED
        if self.side.on_bridge:
            problem = self._rollout_problem()
            if problem is None:
                self.control.announce_push(version)
            else:
                why, code = problem.message, _exit_code(problem)
        stats, err = self.sender.push(version, bridge=why is None)
        if err is not None and why is None:
            why = f"the weight push of version {version} to the rollout ranks failed: {err}"
            # the push fails on whichever rollout rank died: name it, as the other stops do
            problem = self._rollout_problem()
            gone = problem.message if problem is not None else self._gone_ranks()
            code = _exit_code(problem)
            if gone:
                why = f"{gone}; {why}"
        if comm.any_rank(why is not None, self.state.device, what="async: the weight push failed"):
            self._stop_everywhere(why, code)
        return stats

    def _rollout_problem(self):
        return self.control.peer_problem(self.rollout_ranks, self.cfg.rollout.heartbeat_timeout_s, "rollout")

    def _receive(self, step: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Step ``step``'s rows on every trainer rank: (ints, floats, meta); see the module doc."""
        dev = self.state.device
        if self.state.is_main:
            status, payload = self._gather_on_main(step)
            while status == _WAIT:
                self._header(_WAIT)
                status, payload = self._gather_on_main(step)
            if status == _STOP:
                self._header(_STOP)
                self._stop_everywhere(*payload)
            ints, floats, meta = payload
            raw = json.dumps(meta).encode()
            self._header(_DATA, ints.numel(), floats.numel(), len(raw))
        else:
            head = self._header()
            while head[0] == _WAIT:
                head = self._header()
            if head[0] == _STOP:
                self._stop_everywhere(None, 0)
            ints = torch.empty(head[1], dtype=torch.long, device=dev)
            floats = torch.empty(head[2], dtype=torch.float32, device=dev)
            raw = bytes(head[3])
        ints = comm.broadcast(ints, 0, None, what="async: rollout rows (ints)")
        floats = comm.broadcast(floats, 0, None, what="async: rollout rows (floats)")
        return ints, floats, json.loads(self._bytes(raw).decode())

    def _gather_on_main(self, step: int):
        """Trainer rank 0: (DATA, (ints, floats, meta)) once every rollout leader's rows of ``step`` arrived,
        (WAIT, None) after _KEEPALIVE_S without, or (STOP, (message, exit code))."""
        dev, split = self.state.device, self.side.split
        t0, last_check = time.monotonic(), 0.0
        leaders = range(split.rollout_dp)
        while True:
            if all(self.control.ready(step, i) for i in leaders):
                break
            now = time.monotonic()
            if now - last_check > 0.5:
                last_check = now
                problem = self._rollout_problem()
                if problem is not None:
                    return _STOP, (f"{problem.message}; waiting for the rows of step {step + 1}", _exit_code(problem))
                if self.preempt.set or self.control.stop_request() is not None:
                    return _STOP, (self._signalled(step), EXIT_PREEMPTED)
            if now - t0 > _KEEPALIVE_S:
                return _WAIT, None
            time.sleep(0.002)
        parts = []
        try:
            for i in leaders:
                src = 1 + split.rollout_leaders[i]
                head = comm.bridge_recv(torch.zeros(HEADER, dtype=torch.long, device=dev), src, self.side.data_pg,
                                        what="async: rollout rows header").tolist()
                if head[0] != MAGIC or head[1] != step:
                    raise RuntimeError(f"rollout leader {i} sent step {head[1] + 1}'s rows (magic {head[0]:#x}) "
                                       f"where step {step + 1}'s were expected")
                ints = comm.bridge_recv(torch.empty(head[4], dtype=torch.long, device=dev), src, self.side.data_pg,
                                        what="async: rollout rows (ints)")
                floats = comm.bridge_recv(torch.empty(head[5], dtype=torch.float32, device=dev), src,
                                          self.side.data_pg, what="async: rollout rows (floats)")
                raw = comm.bridge_recv(torch.empty(head[6], dtype=torch.uint8, device=dev), src, self.side.data_pg,
                                       what="async: rollout rows (meta)")
                parts.append((head[2], head[3], ints, floats, json.loads(bytes(raw.cpu().tolist()).decode())))
                self.control.consumed(step, i)
        except RuntimeError as e:
            return _STOP, (f"rollout leader {i} (global rank {split.trainer_size + split.rollout_leaders[i]}) is gone: "
                           f"receiving its rows of step {step + 1} failed ({short_error(e)})", EXIT_PREEMPTED)
        return _DATA, self._merge(parts)

    def _merge(self, parts):
        """Every leader's rows on one [R, T] grid (T: the widest), the meta of the whole batch."""
        T = max(p[1] for p in parts)
        tok, cols, lps, rew, meta = [], [], [], [], {"prompt_ids": [], "texts": []}
        for n, w, ints, floats, m in parts:
            tok.append(torch.nn.functional.pad(ints[: n * w].view(n, w), (0, T - w), value=self.gen_cfg.pad_id))
            cols.append(ints[n * w:].view(6, n))
            lps.append(torch.nn.functional.pad(floats[: n * w].view(n, w), (0, T - w)))
            rew.append(floats[n * w:])
            meta["prompt_ids"] += m["prompt_ids"]
            meta["texts"] += m["texts"]
        stats = [p[4]["stats"] for p in parts]
        n = sum(p[0] for p in parts)
        meta.update({
            "rows": n, "width": T, "data": parts[0][4]["data"],
            "gen_s": max(s["gen_s"] for s in stats), "decode_row_steps": sum(s["decode_row_steps"] for s in stats),
            "idle_frac": sum(s["idle_s"] / max(s["wall_s"], 1e-9) for s in stats) / len(stats),
            "sync_s": max(s["sync_s"] for s in stats), "partial_finished": sum(s["partial_finished"] for s in stats),
            "dropped": sum(s["dropped"] for s in stats), "updates": max(s["updates"] for s in stats)})
        ints = torch.cat([torch.cat(tok).reshape(-1), torch.cat(cols, dim=1).reshape(-1)])
        floats = torch.cat([torch.cat(lps).reshape(-1), torch.cat(rew)])
        return ints, floats, meta

    def stop_requested_by_rollout_ranks(self) -> bool:
        """A rollout rank got a stop signal and asked the trainer to stop (trainer rank 0 reads it; the
        trainer's votes spread it)."""
        return self.state.is_main and self.control.stop_request() is not None

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
        import signal as _signal

        request = self.control.stop_request()
        sig = (_signal.Signals(self.preempt.received).name if self.preempt.received
               else f"{request['signal']} (on rollout rank {request['rank']})" if request else "a signal")
        if gone:
            return (f"{gone} and the job got {sig} while waiting for the rows of step {step + 1} (torchrun stops "
                    "every rank when one exits)")
        return f"preempted by signal {sig} while waiting for the rows of step {step + 1}"

    # -- trainer-world messages ---------------------------------------------------------------------
    def _header(self, *values: int) -> list[int]:
        """Trainer rank 0's [status, sizes...] to every trainer rank (the others pass no values)."""
        t = torch.zeros(4, dtype=torch.long, device=self.state.device)
        if values:
            t[: len(values)] = torch.tensor(values, dtype=torch.long)
        return comm.broadcast(t, 0, None, what="async: rollout batch header").tolist()

    def _bytes(self, raw: bytes) -> bytes:
        """Trainer rank 0's ``raw`` to every trainer rank (the others pass as many zero bytes)."""
        t = torch.tensor(list(raw), dtype=torch.uint8, device=self.state.device)
        return bytes(comm.broadcast(t, 0, None, what="async: rollout batch text").cpu().tolist())

    def _stop_everywhere(self, why: Optional[str], code: int) -> None:
        """Every trainer rank (collectively): raise RolloutRanksLost with trainer rank 0's message and code."""
        text = (why or "the rollout ranks cannot go on").encode() if self.state.is_main else b""
        n = comm.max_int(len(text), self.state.device, what="async: stop message length")
        code = comm.max_int(code, self.state.device, what="async: stop exit code")
        text = self._bytes(text.ljust(n) if self.state.is_main else bytes(n)).decode().strip()
        raise RolloutRanksLost(text, code)


def _exit_code(problem) -> int:
    """A rollout rank that raised (side.PeerProblem.failed) is a failure: exit 1. One that is gone (killed,
    silent, left, its connection closed) or none known: a checkpoint was written and a resume is the remedy."""
    return 1 if problem is not None and problem.failed else EXIT_PREEMPTED


class _AsyncHook(TrainerHook):
    """Per-step async metrics that need the step's wall time, and the stop at the end."""

    def __init__(self, source: AsyncRollouts) -> None:
        self.source = source

    def after_step(self, trainer, metrics: dict) -> None:
        step_s = metrics.get("perf/step_time_s")
        if step_s and "async/trainer_wait_s" in metrics:
            metrics["async/trainer_idle_frac"] = metrics["async/trainer_wait_s"] / step_s
