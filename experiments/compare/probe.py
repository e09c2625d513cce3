"""The routing-volatility probe: how much MoE routing moves in ONE optimizer update, router free.

A :class:`~megatron_gspo.trainer.hooks.TrainerHook`, attached with ``Trainer(cfg, hooks=[RoutingProbe(path)])``;
the trainer is unchanged:

    after_rollout   (first rollout only, before any update of the run) keep a fixed probe batch, the
                    first ``rows`` sequences of this rank's share, and take its routes
    after_update    after every APPLIED optimizer step: one extra no-grad forward of the probe batch,
                    compared with the routes before this update and with the initial ones
    close           flush the last step to tensorboard, remove the router hooks

Why a separate forward: the trainer's own ``routing/routing_change_frac`` compares the old-log-prob
pass with the training forward of the same micro-batch, an average over 0 .. num_minibatches-1
updates, and is 0 by construction under routing replay. The probe runs outside the trainer's
training forward, where replay is not active, so it sees the router's own drift for every variant:
the GSPO paper's "about 10% of the activated experts change per update" quantity. Replay hides that
drift from the loss; it does not stop it.

Rows of ``path`` (rank 0, JSON lines), one per update: ``step``, ``update``; ``change_frac``, the
share of (token, expert) choices that changed (RoutingMonitor's measure, as the trainer's metric);
``token_change_frac``, the share of tokens whose top-k expert *set* changed; ``tokens`` compared per
layer; ``layers`` (per MoE layer); ``vs_init`` (the same against the initial model). Only real input
positions count (``TrainBatch.input_padding_mask``: the router's statistics leave padding out).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.trainer.hooks import TrainerHook
from megatron_gspo.model.gpt import forward_logits
from megatron_gspo.routing import RoutingMonitor, change_counts

from experiments.compare._shared import mean


class RoutingProbe(TrainerHook):
    """Routing change per applied optimizer update on a fixed probe batch (see the module docstring).

    path: where rank 0 writes the rows (``probe.jsonl``; the tensorboard points go to the run's
    ``train.output_dir``); rows: sequences of the first rollout in the probe batch, per rank."""

    def __init__(self, path: str, rows: int = 64):
        self.path = path
        self.rows = rows
        self.monitor: Optional[RoutingMonitor] = None
        self.tokens: Optional[torch.Tensor] = None  # [n, T] the probe rows of the first rollout
        self.padding: Optional[torch.Tensor] = None  # [n, T-1] True where the forward's input is no real token
        self.init_routes: Optional[list[torch.Tensor]] = None
        self.prev_routes: Optional[list[torch.Tensor]] = None
        self.updates = 0
        self.file = None
        self.tb = None
        self._step_rows: list[dict] = []

    # -- hook points -----------------------------------------------------------------------------
    def after_rollout(self, trainer, batch) -> None:
        if self.tokens is not None:
            return
        self.monitor = RoutingMonitor(trainer.ddp, aux_loss=False)  # hooks idle outside its captures
        probe = batch.rows(slice(0, min(self.rows, batch.num_rows)))
        # copies: views would keep the whole first rollout alive for the run
        self.tokens, self.padding = probe.tokens.clone(), probe.input_padding_mask()
        self.init_routes = self.prev_routes = self._routes(trainer)

    def after_update(self, trainer, minibatch: int) -> None:
        self.updates += 1
        cur = self._routes(trainer)
        # the trainer counts steps from 0 and increments after the update: this is RL step step + 1
        row = {"step": trainer.step + 1, "update": self.updates}
        row.update(self._compare(self.prev_routes, cur))
        vs = self._compare(self.init_routes, cur)
        row["vs_init"] = {k: vs[k] for k in ("change_frac", "token_change_frac", "layers")}
        self.prev_routes = cur
        if trainer.state.is_main:
            self._write(trainer, row)

    def close(self, trainer) -> None:
        self._flush_tb(trainer)  # the last step's rows (rank 0 holds them)
        if self.monitor is not None:
            self.monitor.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()

    # -- routes --------------------------------------------------------------------------------
    def _routes(self, trainer) -> list[torch.Tensor]:
        """Per local MoE layer [T, k] expert ids of the probe batch's real positions (router layout),
        in the trainer's micro-batches (the forward's shapes are the training forward's)."""
        mbs = trainer.cfg.train.micro_batch_size
        tag = ("probe", self.updates)
        with torch.no_grad(), self.monitor.capture(tag, store=True):
            for lo in range(0, self.tokens.shape[0], mbs):
                forward_logits(trainer.ddp, self.tokens[lo:lo + mbs, :-1], padding_mask=self.padding[lo:lo + mbs])
        routes = [r.long() for r in self.monitor.routes(tag)]
        self.monitor.drop(tag)
        return routes

    def _compare(self, ref: list[torch.Tensor], cur: list[torch.Tensor]) -> dict:
        E = self.monitor.num_experts
        # per layer: changed choices, compared choices, tokens whose expert set changed, tokens
        counts = torch.zeros(len(ref), 4, dtype=torch.float64, device=ref[0].device)
        for l, (a, b) in enumerate(zip(ref, cur)):
            changed, compared = change_counts(a, b, E)
            tok = (a.sort(dim=1).values != b.sort(dim=1).values).any(dim=1)
            counts[l] = torch.tensor([float(changed), float(compared), float(tok.sum()), float(tok.numel())])
        # TP ranks without sequence parallel see the same tokens: duplicates scale both sums alike
        comm.all_reduce(counts, "sum", None, what="comparison probe: routing change counts")

        def frac(num, den) -> float:
            return float(num / den) if den > 0 else math.nan

        slots = self.monitor.slots
        return {"change_frac": frac(counts[:, 0].sum(), counts[:, 1].sum()),
                "token_change_frac": frac(counts[:, 2].sum(), counts[:, 3].sum()),
                "tokens": float(counts[:, 3].sum() / max(1, len(ref))),
                "layers": {str(slots[l]): {"change_frac": frac(counts[l, 0], counts[l, 1]),
                                           "token_change_frac": frac(counts[l, 2], counts[l, 3])}
                           for l in range(len(ref))}}

    # -- output (rank 0) -----------------------------------------------------------------------
    def _write(self, trainer, row: dict) -> None:
        if self.file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.file = open(self.path, "a", encoding="utf-8")
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self._step_rows and self._step_rows[-1]["step"] != row["step"]:
            self._flush_tb(trainer)
        self._step_rows.append(row)

    def _flush_tb(self, trainer) -> None:
        """Per RL step (the trainer's x axis): the mean over the step's updates, into the run's tensorboard."""
        rows, self._step_rows = self._step_rows, []
        if not rows or not trainer.cfg.train.tensorboard:
            return
        if self.tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(trainer.cfg.train.output_dir, "tensorboard"),
                                    filename_suffix=".probe")
        step = rows[0]["step"]
        self.tb.add_scalar("probe/routing_change_per_update", mean([r["change_frac"] for r in rows]), step)
        self.tb.add_scalar("probe/token_change_per_update", mean([r["token_change_frac"] for r in rows]), step)
        self.tb.add_scalar("probe/routing_change_vs_init", rows[-1]["vs_init"]["change_frac"], step)
        for layer in rows[0]["layers"]:
            self.tb.add_scalar(f"probe/routing_change_per_update/layer_{layer}",
                               mean([r["layers"][layer]["change_frac"] for r in rows]), step)
        self.tb.flush()
