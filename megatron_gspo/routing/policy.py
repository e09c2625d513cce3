"""The trainer's one interface to MoE routing: off / R2 / R3 behind the same calls.

An RL step calls, in order (the trainer never asks which mode is on)::

    with policy.generating():                          # record the rollout's routes (R3, or the reference)
        out = generate(..., on_forward=policy.on_generation_forward)
    record.routes = policy.rollout_routes(out)          # the routes it generated with, in the rollout record
    policy.after_generation(record.routes, rows, widths, pads)  # R3: the record's routes -> replay, per micro-batch
    with policy.old_pass(i): forward(micro-batch i)    # old log-probs, when they get a pass of their own:
    policy.after_old_pass()                            #   reference routes (+ R2 record, R3 replay)
    with policy.train_pass(i): forward(micro-batch i)  # routing change vs the reference (+ R2/R3 replay)
    with policy.backward(): loss.backward()            # activation recompute replays the same routes
    policy.finish_step()                               # every recorded route was replayed exactly once
    policy.step_metrics(num_micro_batches)             # routing/* metrics, reduced over every rank

The routing change is measured against the behaviour policy's routing: the old-log-prob pass's
when it runs, else the routes recorded while the rollout was generated (the same weights: the
same routes up to float noise). Mode "off" (GSPO's default: it needs no replay) only measures:
expert load, aux loss and that routing change.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from megatron_gspo.routing.common import RoutingReplayError, normalize_mode
from megatron_gspo.routing.metrics import RoutingMonitor
from megatron_gspo.routing.replay import RoutingReplay
from megatron_gspo.routing.rollout_routes import RolloutRecorder, RolloutRoutes


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
        self._references: dict[int, list[torch.Tensor]] = {}

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

    def after_generation(self, routes: Optional[RolloutRoutes], rows: list[torch.Tensor], widths: list[int],
                         pads: list[torch.Tensor]) -> None:
        """routes: the rollout record's (rollout_routes); rows[i]: the record's rows of micro-batch i;
        widths[i]: its token-grid width (the forward's input is widths[i] - 1 wide); pads[i]: that input's
        padding mask [b, widths[i] - 1]."""
        if self.recorder is None:
            return
        if routes is None:
            raise RoutingReplayError(
                f"the rollout record carries no routes, but routing replay {self.mode} "
                f"{'replays them' if self.mode == 'R3' else 'compares the training routes with them (no old-log-prob pass)'}: "
                "the rollout source must record them (RoutingPolicy.rollout_routes)")
        for i, (r, w, pad) in enumerate(zip(rows, widths, pads)):
            mb_routes = routes.routes_for(r, seq_len=w - 1)  # [L, b, w-1, k]
            if self.mode == "R3":
                self.replay.load(i, mb_routes)
            if not self.has_old_pass:
                self._references[i] = self._router_layout(mb_routes, pad)

    def _router_layout(self, routes: torch.Tensor, pad: torch.Tensor) -> list[torch.Tensor]:
        """[L, b, s, k] routes -> per layer [T, k] in the order the routing monitor compares tokens:
        sequence-major, this rank's sequence chunk under sequence parallel, padding left out."""
        x, valid = routes.transpose(1, 2), ~pad.transpose(0, 1)  # [L, s, b, k], [s, b]
        if self.sp_size > 1:
            c = x.shape[1] // self.sp_size
            x = x[:, self.sp_rank * c:(self.sp_rank + 1) * c]
            valid = valid[self.sp_rank * c:(self.sp_rank + 1) * c]
        keep = valid.reshape(-1).to(x.device)
        return [layer.reshape(-1, layer.shape[-1])[keep] for layer in x]

    @contextlib.contextmanager
    def old_pass(self, mb: int) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.monitor.capture(("old", mb)))
            if self.mode == "R2":
                stack.enter_context(self.replay.recording(mb))
            elif self.mode == "R3":
                stack.enter_context(self.replay.replaying(mb))
            yield

    def after_old_pass(self) -> None:
        if self.mode == "R3":
            self.replay.finish_pass()  # the training pass replays the same routes once more

    # -- training --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def train_pass(self, mb: int) -> Iterator[None]:
        reference = ("old", mb) if self.has_old_pass else self._references[mb]
        with self.monitor.capture(("train", mb), compare_to=reference), self.replay.replaying(mb):
            yield

    def backward(self):
        """Around loss.backward(), outside train_pass: activation recompute re-runs the routers, which
        must replay (REPLAY_BACKWARD) but not count as a second forward in the metrics."""
        return self.replay.backward_replay()

    def finish_step(self) -> None:
        self.replay.finish_step()

    def step_metrics(self, num_micro_batches: int) -> dict:
        """Expert load, aux loss and the behaviour -> training routing change of the step's
        micro-batches, reduced over every rank (each holds distinct tokens, or its TP rank's share)."""
        stats = None
        for i in range(num_micro_batches):
            s = self.monitor.stats(("train", i), pop=True)
            stats = s if stats is None else stats + s
            self.monitor.drop(("old", i))
        self._references.clear()
        return stats.all_reduce().summary(prefix="routing/")
