"""The trainer's one interface to MoE routing: off / R2 / R3 behind the same calls.

The behaviour policy's routes are a per-row field of the training batch (``TrainBatch.routes``
[B, T-1, L, k]: every row's experts at each of its input positions), sliced with the rows wherever the
rows go (micro-batches; another DP rank, with the rollout record's routes: rollout/exchange.py). The
policy keeps nothing keyed by micro-batch: each call gets the micro-batch itself. An RL step calls, in
order (the trainer never asks which mode is on)::

    with policy.generating():                          # record the rollout's routes (R3, or the reference)
        out = generate(..., on_forward=policy.on_generation_forward)
    record.routes = policy.rollout_routes(out)          # the routes it generated with, in the rollout record
    batch.routes = policy.batch_routes(record.routes, rows, width, device)   # per row, in the batch
    with policy.old_pass(micro) as rec: forward(micro) # old log-probs, when they get a pass of their own:
    batch.routes[rows of micro] = rec.routes            #   R2 / the reference recorded there (R3: replayed)
    with policy.train_pass(micro): forward(micro)      # routing change vs micro.routes (+ R2/R3 replay)
    with policy.backward(): loss.backward()            # activation recompute replays the same routes
    policy.finish_step()                               # every replayed backward recompute ran
    policy.step_metrics()                              # routing/* metrics of the step, reduced over every rank

The routing change is measured against the behaviour policy's routing: the old-log-prob pass's
when it runs, else the routes recorded while the rollout was generated (the same weights: the
same routes up to float noise). Mode "off" (GSPO's default: it needs no replay) only measures:
expert load, aux loss and that routing change.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from megatron_gspo.routing.common import RoutingReplayError, index_dtype, normalize_mode
from megatron_gspo.routing.metrics import RoutingMonitor, RoutingStats
from megatron_gspo.routing.replay import RoutingReplay
from megatron_gspo.routing.rollout_routes import RolloutRecorder, RolloutRoutes


@dataclass
class Recorded:
    """What an old-log-prob pass recorded for its micro-batch: routes [b, w-1, L, k] for the batch's rows
    (-1 where this rank saw no token: another TP rank's sequence chunk), or None (the batch's own serve)."""

    routes: Optional[torch.Tensor] = None


class RoutingPolicy:
    """mode: "off" | "R2" | "R3"; old_pass: whether the old log-probs get a forward pass of their own
    (config.old_logprob_source), which then also gives the reference routing."""

    def __init__(self, mode: str, model, state, old_pass: bool = True) -> None:
        self.mode = normalize_mode(mode)
        self.has_old_pass = old_pass
        self.replay = RoutingReplay.from_model(self.mode, model, state)
        self.sp_rank, self.sp_size = self.replay.sp_rank, self.replay.sp_size
        need_rollout_routes = self.mode == "R3" or not old_pass
        self.recorder = RolloutRecorder(model) if need_rollout_routes else None
        self.monitor = RoutingMonitor(model)
        self._stats: Optional[RoutingStats] = None  # the step's training forwards, summed

    # -- rollout ---------------------------------------------------------------------------------
    def generating(self):
        return self.recorder.recording() if self.recorder is not None else contextlib.nullcontext()

    @property
    def on_generation_forward(self) -> Optional[Callable]:
        return self.recorder.on_forward if self.recorder is not None else None

    def rollout_routes(self, out) -> Optional[RolloutRoutes]:
        """The routes of the generation that just ran (``out``: its GenerationOutput), for the rollout
        record; None when this policy records none (no R3, and an old-log-prob pass gives the
        routing reference)."""
        return self.recorder.finish(out) if self.recorder is not None else None

    def batch_routes(self, routes: Optional[RolloutRoutes], rows: torch.Tensor, width: int,
                     device: torch.device) -> torch.Tensor:
        """The batch's routes field: [len(rows), width, L, k] compact ids on ``device``. routes: the rollout
        record's; rows: the record's row of each batch row; width: the batch's input width (T - 1). From
        the rollout (R3, or the reference without an old-log-prob pass; the filler route past each row's
        tokens), else -1 until the old-log-prob pass records them (``old_pass``)."""
        if self.recorder is None:
            L, k = self.monitor.num_local_layers, self.monitor.topk
            return torch.full((rows.numel(), width, L, k), -1, dtype=index_dtype(self.monitor.num_experts),
                              device=device)
        if routes is None:
            raise RoutingReplayError(
                f"the rollout record carries no routes, but routing replay {self.mode} "
                f"{'replays them' if self.mode == 'R3' else 'compares the training routes with them (no old-log-prob pass)'}: "
                "the rollout source must record them (RoutingPolicy.rollout_routes)")
        return routes.batch_layout(rows.cpu(), width).to(device)

    def _router_layout(self, routes: torch.Tensor, pad: torch.Tensor) -> list[torch.Tensor]:
        """[b, s, L, k] batch routes -> per layer [T, k] in the order the routing monitor compares tokens:
        sequence-major, this rank's sequence chunk under sequence parallel, padding left out."""
        x, valid = routes.permute(2, 1, 0, 3), ~pad.transpose(0, 1)  # [L, s, b, k], [s, b]
        lo, hi = self._chunk(x.shape[1])
        keep = valid[lo:hi].reshape(-1).to(x.device)
        return [layer.reshape(-1, layer.shape[-1])[keep] for layer in x[:, lo:hi]]

    def _chunk(self, s: int) -> tuple[int, int]:
        """This rank's positions [lo, hi) of a sequence of ``s`` under sequence parallel (all of it otherwise)."""
        c = s // self.sp_size
        return self.sp_rank * c, (self.sp_rank + 1) * c

    def _rows_layout(self, per_layer: list[torch.Tensor], pad: torch.Tensor, padding_kept: bool) -> torch.Tensor:
        """Routes a forward's routers saw (per layer [T, k], router layout: sequence-major over this rank's
        chunk, padding included or not) -> [b, s, L, k] batch routes, -1 where this rank saw no token."""
        b, s = pad.shape
        out = torch.full((b, s, len(per_layer), self.monitor.topk), -1, dtype=index_dtype(self.monitor.num_experts),
                         device=pad.device)
        lo, hi = self._chunk(s)
        seen = torch.ones(hi - lo, b, dtype=torch.bool, device=pad.device) if padding_kept else ~pad[:, lo:hi].t()
        pos, row = seen.nonzero(as_tuple=True)  # sequence-major, as the routers order tokens
        out[row, lo + pos] = torch.stack([r.to(pad.device) for r in per_layer], 1).to(out.dtype)
        return out

    def _replay_layout(self, micro) -> torch.Tensor:
        """A micro-batch's batch routes [b, s, L, k] -> [L, b, s, k] for the replay, the filler route where no
        id is known (padding; another TP rank's chunk, which the replay leaves out). A token of this rank's
        chunk without routes cannot be replayed: an error, never the filler."""
        routes, pad = micro.routes, micro.input_padding_mask()
        lo, hi = self._chunk(routes.shape[1])
        missing = (routes[:, lo:hi] < 0).flatten(2).any(-1) & ~pad[:, lo:hi].to(routes.device)
        if bool(missing.any()):
            raise RoutingReplayError(
                f"routing replay {self.mode}: {int(missing.sum())} token(s) of a micro-batch [{routes.shape[0]} rows x "
                f"{routes.shape[1]}] have no recorded routes; under sequence parallel R2 records each rank's sequence "
                "chunk, so the training pass must run the old-log-prob pass's micro-batch widths (the batch's plan)")
        x = routes.permute(2, 0, 1, 3).long()
        filler = torch.arange(x.shape[-1], device=x.device).expand_as(x)
        return torch.where(x < 0, filler, x)

    # -- the passes --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def old_pass(self, micro) -> Iterator[Recorded]:
        """Around the old-log-prob forward of ``micro`` (a TrainBatch micro-batch): R3 replays its routes; R2,
        and mode off without rollout routes, record the pass's routes, yielded (``Recorded.routes``, filled
        when the block ends) for the caller to file with the micro-batch's rows."""
        rec = Recorded()
        pad = micro.input_padding_mask()
        if self.mode == "R2":
            with self.replay.recorded("old-log-prob pass") as got:
                yield rec
            rec.routes = self._rows_layout(got, pad, padding_kept=True)
        elif self.mode == "R3":
            with self.replay.replaying_routes(self._replay_layout(micro)):
                yield rec
        elif self.recorder is None:  # the pass's own routing is the reference
            with self.monitor.capture("old", store=True):
                yield rec
            rec.routes = self._rows_layout(self.monitor.routes("old"), pad, padding_kept=False)
            self.monitor.drop("old")
        else:
            yield rec

    @contextlib.contextmanager
    def train_pass(self, micro) -> Iterator[None]:
        """Around the training forward of ``micro``: the routing change against its behaviour routes, and under
        R2 / R3 the replay of those routes."""
        reference = self._router_layout(micro.routes, micro.input_padding_mask())
        replay = (self.replay.replaying_routes(self._replay_layout(micro)) if self.mode != "off"
                  else contextlib.nullcontext())
        with self.monitor.capture("train", compare_to=reference), replay:
            yield
        stats = self.monitor.stats("train", pop=True)
        self._stats = stats if self._stats is None else self._stats + stats

    def backward(self):
        """Around loss.backward(), outside train_pass: activation recompute re-runs the routers, which
        must replay (REPLAY_BACKWARD) but not count as a second forward in the metrics."""
        return self.replay.backward_replay()

    def finish_step(self) -> None:
        self.replay.finish_step()

    def step_metrics(self) -> dict:
        """Expert load, aux loss and the behaviour -> training routing change of the step's training
        forwards, reduced over every rank (each holds distinct tokens, or its TP rank's share)."""
        stats, self._stats = self._stats, None
        if stats is None:
            raise RoutingReplayError("step_metrics: no training forward ran this step (train_pass)")
        return stats.all_reduce().summary(prefix="routing/")
