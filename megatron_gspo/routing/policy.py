"""The trainer's one interface to MoE routing: off / R2 / R3 behind the same calls.

An RL step calls, in order (the trainer never asks which mode is on)::

    with policy.generating():                          # R3: record the rollout's routes
        out = generate(..., on_forward=policy.on_generation_forward)
    policy.after_generation(out, micro_batches, T - 1) # R3: the rollout's routes -> replay, per micro-batch
    with policy.old_pass(i): forward(micro-batch i)    # old log-probs: reference routes (+ R2 record, R3 replay)
    policy.after_old_pass()                            # R3: the training pass replays the same routes again
    with policy.train_pass(i): forward(micro-batch i)  # routing change vs the old pass (+ R2/R3 replay)
    with policy.backward(): loss.backward()            # activation recompute replays the same routes
    policy.finish_step()                               # every recorded route was replayed exactly once
    policy.step_metrics(num_micro_batches)             # routing/* metrics, reduced over every rank

Mode "off" (GSPO's default: it needs no replay) only measures: expert load, aux loss and the share
of expert choices that changed between the old-log-prob pass and the training forward.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from megatron_gspo.routing.common import normalize_mode
from megatron_gspo.routing.metrics import RoutingMonitor
from megatron_gspo.routing.replay import RoutingReplay
from megatron_gspo.routing.rollout_routes import RolloutRecorder


class RoutingPolicy:
    def __init__(self, mode: str, model, state) -> None:
        self.mode = normalize_mode(mode)
        self.replay = RoutingReplay.from_model(self.mode, model, state)
        self.recorder = RolloutRecorder(model) if self.mode == "R3" else None
        self.monitor = RoutingMonitor(model)

    # -- rollout ---------------------------------------------------------------------------------
    def generating(self):
        return self.recorder.recording() if self.recorder is not None else contextlib.nullcontext()

    @property
    def on_generation_forward(self) -> Optional[Callable[[int, str], None]]:
        return self.recorder.on_forward if self.recorder is not None else None

    def after_generation(self, out, micro_batches: list[slice], seq_len: int) -> None:
        if self.recorder is None:
            return
        routes = self.recorder.finish(out)  # in the micro-batch partition both passes use
        for i, rows in enumerate(micro_batches):
            self.replay.load(i, routes.routes_for(list(range(rows.start, rows.stop)), seq_len=seq_len))

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
        with self.monitor.capture(("train", mb), compare_to=("old", mb)), self.replay.replaying(mb):
            yield

    def backward(self):
        """Around loss.backward(), outside train_pass: activation recompute re-runs the routers, which
        must replay (REPLAY_BACKWARD) but not count as a second forward in the metrics."""
        return self.replay.backward_replay()

    def finish_step(self) -> None:
        self.replay.finish_step()

    def step_metrics(self, num_micro_batches: int) -> dict:
        """Expert load, aux loss and the old -> training routing change of the step's micro-batches,
        reduced over every rank (each holds distinct tokens, or its TP rank's share of them)."""
        stats = None
        for i in range(num_micro_batches):
            s = self.monitor.stats(("train", i), pop=True)
            stats = s if stats is None else stats + s
            self.monitor.drop(("old", i))
        return stats.all_reduce().summary(prefix="routing/")
