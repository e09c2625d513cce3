"""R3: the routes the rollout was generated with, recorded during generation and laid out per
sequence for the training forward (``RolloutRoutes``; ``RolloutRecorder`` is generation's callback)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Union

import torch

from megatron_gspo.model.gpt import unwrap
from megatron_gspo.routing.common import RoutingReplayError, Routes, find_routers, index_dtype
from megatron_gspo.routing.metrics import forward_routes


class RolloutRoutes:
    """Accumulates the routes recorded by the generator (R3) into per-sequence token order.

    Contract with the generator: it calls ``add_step`` once per model forward, prefill first and then
    every decode step, with the top-k expert ids of every MoE layer for the tokens it *fed* in that
    forward: ``layers`` [L, b, t, k] (or a list of L tensors [b, t, k]); t = fed positions (prefill:
    the padded prompt length; decode: 1). ``valid`` [b, t] marks the positions that are real tokens of
    the row's sequence (False for left/right padding and for rows that already finished); ``rows`` [b]
    says which sequences the b rows are (default: all ``batch_size`` sequences in order). Valid
    positions are appended to their sequence in order, so routes[l, r, j] is the route of token j of
    sequence r, whatever padding the generator used.

    The last response token is sampled but never fed to the model, so it has no route: a sequence of
    n real tokens (prompt + response) must end with exactly n - 1 routes, one per token of the
    training forward's input ``tokens[:, :-1]`` (``check(lengths)`` asserts it). If the trainer feeds
    the full ``tokens`` instead, ``routes_for`` gives the last position (and right padding) a filler
    route [0, 1, ..., k-1]: it only affects outputs at positions no loss reads (causal attention).
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, topk: int,
                 num_experts: Optional[int] = None, device: Union[str, torch.device] = "cpu"):
        for name, v in (("num_layers", num_layers), ("batch_size", batch_size), ("max_len", max_len), ("topk", topk)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"RolloutRoutes: {name} must be a positive integer, got {v!r}")
        self.num_layers, self.batch_size, self.max_len, self.topk = num_layers, batch_size, max_len, topk
        self.num_experts = num_experts
        self.routes = torch.full((num_layers, batch_size, max_len, topk), -1, dtype=index_dtype(num_experts),
                                 device=device)
        self.count = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.num_steps = 0
        self._checked = False

    def add_step(self, layers: Routes, valid: Optional[torch.Tensor] = None,
                 rows: Optional[torch.Tensor] = None) -> None:
        """Append one forward's routes (see the class docstring for shapes)."""
        x = torch.stack(list(layers)) if not isinstance(layers, torch.Tensor) else layers
        if x.dim() != 4 or x.shape[0] != self.num_layers or x.shape[3] != self.topk:
            raise RoutingReplayError(f"add_step: routes of shape {tuple(x.shape)}; expected [L={self.num_layers}, b, t, "
                                     f"k={self.topk}]")
        if x.is_floating_point():
            raise RoutingReplayError(f"add_step: routes are {x.dtype}, expected integer expert ids")
        _, b, t, _ = x.shape
        dev = self.routes.device
        if rows is None:
            if b != self.batch_size:
                raise RoutingReplayError(f"add_step: {b} rows but batch_size={self.batch_size}; pass rows= for a subset")
            rows = torch.arange(b, device=dev)
        rows = torch.as_tensor(rows, device=dev).long().reshape(-1)
        if rows.numel() != b:
            raise RoutingReplayError(f"add_step: rows has {rows.numel()} entries for {b} rows of routes")
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=dev)
        valid = torch.as_tensor(valid, device=dev).bool()
        if valid.shape != (b, t):
            raise RoutingReplayError(f"add_step: valid has shape {tuple(valid.shape)}, expected {(b, t)}")
        pos = self.count[rows][:, None] + valid.long().cumsum(1) - 1  # destination column per position
        rr, cc = valid.nonzero(as_tuple=True)
        dest_r, dest_c = rows[rr], pos[rr, cc]
        if dest_c.numel() and int(dest_c.max()) >= self.max_len:
            raise RoutingReplayError(f"add_step: a sequence exceeds max_len={self.max_len} routed positions")
        self.routes[:, dest_r, dest_c] = x.to(dev)[:, rr, cc].to(self.routes.dtype)
        self.count.index_add_(0, rows, valid.long().sum(1))
        self.num_steps += 1
        self._checked = False

    def check(self, lengths: torch.Tensor) -> None:
        """Assert the contract: sequence r (``lengths[r]`` real tokens, prompt + response) has exactly
        lengths[r] - 1 routes (its last token was never fed)."""
        lengths = torch.as_tensor(lengths, device=self.count.device).long().reshape(-1)
        if lengths.numel() != self.batch_size:
            raise RoutingReplayError(f"check: {lengths.numel()} lengths for batch_size={self.batch_size}")
        bad = (self.count != lengths - 1).nonzero().reshape(-1).tolist()
        if bad:
            r = bad[0]
            raise RoutingReplayError(
                f"R3 routes do not match the sequences: rows {bad[:8]}{'...' if len(bad) > 8 else ''}; e.g. row {r} has "
                f"{int(self.count[r])} routed positions for {int(lengths[r])} tokens (expected {int(lengths[r]) - 1}: every "
                "token but the last one, which is sampled and never fed to the model)")
        self._checked = True

    def routes_for(self, rows: Sequence[int] | torch.Tensor, seq_len: int) -> torch.Tensor:
        """Routes of a training micro-batch: [L, len(rows), seq_len, k] int64 for input tokens
        right-padded to ``seq_len`` (``tokens[:, :-1]``: seq_len = S - 1; full tokens: seq_len = S).
        Positions past a sequence's routes get the filler route [0, ..., k-1]. Needs ``check()``."""
        if not self._checked:
            raise RoutingReplayError("routes_for: call check(lengths) after the last add_step")
        rows = torch.as_tensor(rows, device=self.routes.device).long().reshape(-1)
        longest = int(self.count[rows].max()) if rows.numel() else 0
        if seq_len < longest:
            raise RoutingReplayError(f"routes_for: seq_len={seq_len} is shorter than a sequence's {longest} routed positions")
        out = torch.empty(self.num_layers, rows.numel(), seq_len, self.topk, dtype=torch.long, device=self.routes.device)
        n = min(seq_len, self.max_len)
        out[:, :, :n] = self.routes[:, rows, :n].long()
        if seq_len > n:
            out[:, :, n:] = -1
        filler = torch.arange(self.topk, device=out.device)
        pad = torch.arange(seq_len, device=out.device)[None, :] >= self.count[rows][:, None]  # [b, s]
        out[:, pad] = filler
        return out

    @classmethod
    def _of(cls, routes: torch.Tensor, count: torch.Tensor, num_experts: Optional[int], num_steps: int,
            checked: bool) -> "RolloutRoutes":
        """A RolloutRoutes around existing tensors: routes [L, B, max_len, k], count [B]."""
        out = cls.__new__(cls)
        out.num_layers, out.batch_size, out.max_len, out.topk = routes.shape
        out.num_experts, out.routes, out.count, out.num_steps, out._checked = num_experts, routes, count, num_steps, checked
        return out

    def select(self, rows: Sequence[int] | torch.Tensor) -> "RolloutRoutes":
        """The routes of sequences ``rows`` (in that order), as a RolloutRoutes of len(rows) sequences."""
        rows = torch.as_tensor(rows, device=self.routes.device).long().reshape(-1)
        return self._of(self.routes[:, rows], self.count[rows], self.num_experts, self.num_steps, self._checked)

    def row(self, i: int) -> torch.Tensor:
        """Sequence ``i``'s own routes: [L, n - 1, k] for its n tokens (every token but the last)."""
        return self.routes[:, i, :int(self.count[i])]

    @classmethod
    def from_rows(cls, rows: Sequence[torch.Tensor], num_layers: int, topk: int,
                  num_experts: Optional[int] = None) -> "RolloutRoutes":
        """Checked routes of sequences given one by one (``row``'s [L, n_i - 1, k]), e.g. rows that moved
        between ranks (rollout/exchange.py)."""
        for i, r in enumerate(rows):
            if r.dim() != 3 or r.shape[0] != num_layers or r.shape[2] != topk:
                raise RoutingReplayError(f"from_rows: row {i} routes {tuple(r.shape)}; expected [L={num_layers}, n, "
                                         f"k={topk}]")
        count = torch.tensor([r.shape[1] for r in rows], dtype=torch.long)
        width = max(1, int(count.max())) if rows else 1
        out = torch.full((num_layers, len(rows), width, topk), -1, dtype=index_dtype(num_experts))
        for i, r in enumerate(rows):
            out[:, i, :r.shape[1]] = r.to(out.dtype)
        return cls._of(out, count, num_experts, 0, True)

    def batch_layout(self, rows: Sequence[int] | torch.Tensor, seq_len: int) -> torch.Tensor:
        """The routes of sequences ``rows`` in the training batch's layout: [len(rows), seq_len, L, k], compact
        ids (``index_dtype``), the filler route [0, ..., k-1] past each sequence's routes (``routes_for``)."""
        if not self._checked:
            raise RoutingReplayError("batch_layout: call check(lengths) after the last add_step")
        rows = torch.as_tensor(rows, device=self.routes.device).long().reshape(-1)
        count = self.count[rows]
        if rows.numel() and seq_len < int(count.max()):
            raise RoutingReplayError(f"batch_layout: seq_len={seq_len} is shorter than a sequence's {int(count.max())} "
                                     "routed positions")
        n = min(seq_len, self.max_len)
        out = torch.empty(rows.numel(), seq_len, self.num_layers, self.topk, dtype=self.routes.dtype,
                          device=self.routes.device)
        out[:, :n] = self.routes[:, rows, :n].permute(1, 2, 0, 3)
        pad = torch.arange(seq_len, device=out.device)[None, :] >= count[:, None]  # [b, s]
        out[pad] = torch.arange(self.topk, dtype=out.dtype, device=out.device)
        return out

    @classmethod
    def cat(cls, parts: Sequence["RolloutRoutes"]) -> "RolloutRoutes":
        """Several generations' routes as one (sequences in order; dynamic sampling keeps groups of several
        rounds). Every part must be checked; so is the result."""
        if not parts or any(not p._checked for p in parts):
            raise RoutingReplayError("RolloutRoutes.cat: needs at least one part, each check()ed")
        if len({(p.num_layers, p.topk) for p in parts}) > 1:
            raise RoutingReplayError(f"RolloutRoutes.cat: parts of {[(p.num_layers, p.topk) for p in parts]} "
                                     "(layers, top-k) differ")
        width = max(p.max_len for p in parts)
        routes = torch.cat([torch.nn.functional.pad(p.routes, (0, 0, 0, width - p.max_len), value=-1) for p in parts], 1)
        return cls._of(routes, torch.cat([p.count for p in parts]), parts[0].num_experts,
                       sum(p.num_steps for p in parts), True)

    @classmethod
    def from_generation(cls, steps: Sequence[torch.Tensor], prompt_lengths: torch.Tensor,
                        response_lengths: torch.Tensor, topk: int, num_experts: Optional[int] = None,
                        rows: Optional[Sequence[Optional[torch.Tensor]]] = None) -> "RolloutRoutes":
        """Routes of a ``generation.generate`` call from its per-forward records.

        steps: step 0 (prefill) [L, B, P, k] over the left-padded prompt block, then one [L, b, 1, k]
        per decode step (step j feeds response token j - 1). rows[j]: the original row of each of step
        j's b batch positions (None: all B in order; generation drops finished rows from the batch).
        Rows >= the real rows are EP dummy rows, dropped. Valid positions: prefill columns >=
        P - prompt_length; decode step j for rows whose response is longer than j tokens (a row's last
        response token is never its own input; finished rows are fed padding). Checked: n real tokens
        -> n - 1 routes per row.
        """
        if not steps:
            raise RoutingReplayError("from_generation: no forwards were recorded")
        plen = torch.as_tensor(prompt_lengths).long().cpu()
        rlen = torch.as_tensor(response_lengths).long().cpu()
        n = plen.numel()
        pre = steps[0]
        L, B, P, _ = pre.shape
        if B < n or int(plen.max()) > P:
            raise RoutingReplayError(f"from_generation: prefill routes {tuple(pre.shape)} do not cover {n} rows with "
                                     f"prompts up to {int(plen.max())} tokens")
        rr = cls(L, n, P + len(steps) - 1, topk, num_experts)
        rr.add_step(pre[:, :n].cpu(), valid=torch.arange(P)[None, :] >= (P - plen)[:, None])
        # every decode step's routes (and fed rows) to the host in one copy each, then filed on the CPU
        dec = steps[1:]
        for j, d in enumerate(dec, start=1):
            if d.dim() != 4 or d.shape[2] != 1:
                raise RoutingReplayError(f"from_generation: decode step {j} routes {tuple(d.shape)}; expected [L, b, 1, k]")
        flat = torch.cat([d.reshape(L, -1, d.shape[-1]) for d in dec], dim=1).cpu() if dec else None
        given = [r for r in (rows or [])[1:] if r is not None]
        fed_all = torch.cat([torch.as_tensor(r).reshape(-1) for r in given]).long().cpu() if given else None
        at, at_rows = 0, 0
        for j, d in enumerate(dec, start=1):
            b = d.shape[1]
            if rows is None or rows[j] is None:
                fed = torch.arange(B)
            else:
                fed = fed_all[at_rows:at_rows + torch.as_tensor(rows[j]).numel()]
                at_rows += fed.numel()
            if b != fed.numel():
                raise RoutingReplayError(f"from_generation: decode step {j} routes {tuple(d.shape)}; expected "
                                         f"[L, {fed.numel()}, 1, k]")
            real = fed < n
            idx = fed[real]
            rr.add_step(flat[:, at:at + b][:, real][:, :, None], valid=(rlen[idx] > j)[:, None], rows=idx)
            at += b
        rr.check(plen + rlen)
        return rr

    @staticmethod
    def from_router_layout(per_layer: Routes, batch: int) -> torch.Tensor:
        """Megatron router layout (per layer [t * b, k], sequence-major; e.g. RouterReplay RECORD or
        RoutingMonitor routes of a generator that runs the megatron model) -> [L, b, t, k]."""
        x = torch.stack(list(per_layer)) if not isinstance(per_layer, torch.Tensor) else per_layer
        L, n, k = x.shape
        if n % batch:
            raise RoutingReplayError(f"from_router_layout: {n} tokens are not a multiple of batch={batch}")
        return x.reshape(L, n // batch, batch, k).transpose(1, 2)


class RolloutRecorder:
    """R3 recorder for ``megatron_gspo.generation.generator.generate`` (which calls ``on_forward(step, kind)``
    after every model forward: step 0 "prefill", then "decode" steps)::

        rec = RolloutRecorder(model)                    # once per model (hooks on every router)
        with rec.recording():
            out = generate(model, prompts, gen_cfg, vocab_size=V, state=st, on_forward=rec.on_forward)
        routes = rec.finish(out)                        # RolloutRoutes, contract checked
        for mb, rows in enumerate(micro_batch_rows):    # input = out.tokens[rows, :-1] (S - 1 columns)
            replay.load(mb, routes.routes_for(rows, seq_len=out.tokens.shape[1] - 1))

    Forward hooks on the routers read each forward's routing map, whose router input [t, B, H] gives
    the step's shape; the generator runs the MoE layers on full sequences (no sequence split), so every
    TP rank records all of its rows' tokens and ``RoutingReplay.load`` takes this rank's chunk. A
    decode back-end that produces the routes itself (the lean decoder, whose captured steps run no
    Python hooks) hands them to ``on_forward(..., routes=...)`` instead; the hooks then only keep a
    reference that is dropped. Either way nothing waits for the device during generation: the ids
    stay where they were computed until ``finish`` moves them in one copy.
    """

    def __init__(self, model):
        self.routers = find_routers(unwrap(model))
        if not self.routers:
            raise ValueError("RolloutRecorder: the model has no MoE routers")
        cfg = self.routers[0].config
        self.topk, self.num_experts = cfg.moe_router_topk, cfg.num_moe_experts
        self._active = False
        self._cur: list[Optional[torch.Tensor]] = [None] * len(self.routers)
        self.steps: list[torch.Tensor] = []
        self.rows: list[Optional[torch.Tensor]] = []  # per step: the original rows fed (None: all)
        self._hooks = [r.register_forward_hook(
            lambda mod, args, kwargs, out, l=l: self._hook(l, args, kwargs, out), with_kwargs=True)
            for l, r in enumerate(self.routers)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @contextlib.contextmanager
    def recording(self) -> Iterator["RolloutRecorder"]:
        self.steps, self.rows, self._cur = [], [], [None] * len(self.routers)
        self._active = True
        try:
            yield self
        finally:
            self._active = False

    def _hook(self, l: int, args, kwargs, out) -> None:
        if not self._active:
            return
        x = args[0] if args else kwargs["input"]
        if self._cur[l] is not None:
            raise RoutingReplayError(f"RolloutRecorder: router of layer {l} ran twice before on_forward() was called")
        self._cur[l] = (out[1], x.shape[0], x.shape[1])  # the routing map, ids computed in on_forward if needed

    def on_forward(self, step: int, kind: str, rows: Optional[torch.Tensor] = None,
                   routes: Optional[torch.Tensor] = None) -> None:
        """The generator's callback: files the routes of the forward that just ran as step ``step``
        (``rows``: the original row of each batch position, None for all rows in order; ``routes``:
        [L, b, t, k] expert ids when the decode back-end produced them, else the routers' hooks')."""
        if not self._active:
            raise RoutingReplayError("RolloutRecorder.on_forward outside recording()")
        if step != len(self.steps) or (kind == "prefill") != (step == 0):
            raise RoutingReplayError(f"RolloutRecorder: got step {step} ({kind}) after {len(self.steps)} recorded forwards")
        if routes is None:
            missing = [l for l, c in enumerate(self._cur) if c is None]
            if missing:
                raise RoutingReplayError(f"RolloutRecorder: step {step}: MoE layers {missing} did not run")
            routes = forward_routes(self._cur, self.num_experts, self.topk)
        elif routes.dim() != 4 or routes.shape[0] != len(self.routers) or routes.shape[3] != self.topk:
            raise RoutingReplayError(f"RolloutRecorder: step {step}: routes {tuple(routes.shape)}, expected "
                                     f"[L={len(self.routers)}, b, t, k={self.topk}]")
        self.steps.append(routes)  # [L, b, t, k], on the device
        self.rows.append(None if rows is None else rows.detach().clone())
        self._cur = [None] * len(self.routers)

    def finish(self, out) -> RolloutRoutes:
        """RolloutRoutes for ``out`` (a GenerationOutput: prompt_lengths, response_lengths)."""
        return RolloutRoutes.from_generation(self.steps, out.prompt_lengths, out.response_lengths,
                                             self.topk, self.num_experts, rows=self.rows)
