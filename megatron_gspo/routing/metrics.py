"""Routing metrics: expert load, the Switch load-balancing loss and the routing change between two
forwards, kept as local sums that reduce exactly over ranks (``RoutingStats``), filled by forward
hooks on every MoE router (``RoutingMonitor``)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields
from typing import Hashable, Iterator, Optional, Sequence, Union

import torch

from megatron_gspo.model.gpt import unwrap
from megatron_gspo.routing.common import RoutingReplayError, find_routers, index_dtype


def routing_map_to_indices(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, E] bool -> [T, k] expert ids (ascending in no particular order; -1 where a token has fewer
    than k experts, e.g. capacity dropping)."""
    vals, idx = routing_map.to(torch.float32).topk(topk, dim=1)
    return torch.where(vals > 0, idx, torch.full_like(idx, -1))


def forward_routes(maps: Sequence[tuple], num_experts: int, topk: int) -> torch.Tensor:
    """One forward's routes from its routers' outputs: ``maps`` holds per MoE layer (routing map [t * b, E],
    t, b), the router input being [t, b, H]; returns top-k expert ids [L, b, t, k] in ``index_dtype(E)``
    (the rollout routes' layout)."""
    dtype = index_dtype(num_experts)
    return torch.stack([routing_map_to_indices(rmap.reshape(-1, num_experts), topk).to(dtype)
                        .reshape(t, b, topk).transpose(0, 1) for rmap, t, b in maps])


def change_counts(ref: torch.Tensor, cur: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing change between two routings of the same tokens.

    ref, cur: [T, k] expert ids (-1 = none) or [T, E] bool routing maps. Returns (changed, compared):
    compared = number of (token, expert) choices in ``ref``; changed = how many of them ``cur`` does
    not choose. changed / compared is the routing change fraction (order within the top-k is ignored).
    """
    if ref.dtype == torch.bool:
        ref = routing_map_to_indices(ref, int(ref.sum(1).max()) if ref.numel() else 1)
    if cur.dtype == torch.bool:
        cur_map = cur
    else:
        cur = cur.long()
        cur_map = torch.zeros(cur.shape[0], num_experts + 1, dtype=torch.bool, device=cur.device)
        cur_map.scatter_(1, torch.where(cur >= 0, cur, num_experts), True)
        cur_map = cur_map[:, :num_experts]
    if ref.shape[0] != cur_map.shape[0]:
        raise ValueError(f"change_counts: reference has {ref.shape[0]} tokens, current {cur_map.shape[0]}")
    ref = ref.to(cur_map.device).long()
    valid = ref >= 0
    hit = cur_map.gather(1, ref.clamp(min=0)) & valid
    compared = valid.sum()
    return compared - hit.sum(), compared


@dataclass
class RoutingStats:
    """Local sums of routing statistics over tokens, per global layer slot (``layer_number - 1``).

    Every field is a sum, so stats of micro-batches add (``+``) and ranks reduce with one SUM
    all-reduce (``all_reduce``). Reduce over every rank that holds distinct tokens: the data-parallel
    ranks, and the TP ranks too under sequence parallel; with PP the stages fill disjoint layer slots.
    For PP = 1 that is the whole world (``group=None``).

        tokens_per_expert  [L, E]  tokens routed to each expert (sum over tokens of routing_map)
        prob_per_expert    [L, E]  sum over tokens of the full router scores (softmax over E)
        num_tokens         [L]     tokens routed (sum of tokens_per_expert = num_tokens * k)
        changed / compared [L]     (token, k) choices of the reference routing not chosen now / compared
    """

    tokens_per_expert: torch.Tensor
    prob_per_expert: torch.Tensor
    num_tokens: torch.Tensor
    changed: torch.Tensor
    compared: torch.Tensor
    topk: int

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int, topk: int, device=None) -> "RoutingStats":
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(num_layers, num_experts), z(num_layers, num_experts), z(num_layers), z(num_layers),
                   z(num_layers), topk)

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "topk"]

    def __add__(self, other: "RoutingStats") -> "RoutingStats":
        if other.topk != self.topk:
            raise ValueError("RoutingStats with different topk")
        return RoutingStats(*[a + b.to(a.device) for a, b in zip(self._tensors(), other._tensors())], topk=self.topk)

    def all_reduce(self, group=None) -> "RoutingStats":
        """SUM over ``group`` in place (one collective); no-op without torch.distributed."""
        from megatron_gspo.runtime import comm

        if comm.world_size(group) == 1:
            return self
        ts = self._tensors()
        buf = torch.cat([t.reshape(-1) for t in ts])
        comm.all_reduce(buf, "sum", group, what="routing statistics")
        for t, part in zip(ts, buf.split([t.numel() for t in ts])):
            t.copy_(part.view_as(t))
        return self

    # -- derived (call after all_reduce for global values) -------------------------------------------

    def load_max_over_mean(self) -> torch.Tensor:
        """[L] max over experts of tokens_per_expert / its mean (1 = perfectly balanced); nan if no tokens."""
        mean = self.tokens_per_expert.mean(1)
        return torch.where(mean > 0, self.tokens_per_expert.max(1).values / mean.clamp(min=1e-30), math.nan)

    def aux_loss(self) -> torch.Tensor:
        """[L] Switch load-balancing loss with coefficient 1 over the tokens summed here:
        E / (k T^2) * sum_e P_e f_e, P_e = summed scores, f_e = tokens per expert, T = tokens
        (megatron's switch_load_balancing_loss_func / coeff). nan where no tokens were seen."""
        E = self.tokens_per_expert.shape[1]
        T = self.num_tokens
        val = (self.prob_per_expert * self.tokens_per_expert).sum(1) * E / (self.topk * T.clamp(min=1) ** 2)
        return torch.where(T > 0, val, math.nan)

    def change_fraction(self) -> torch.Tensor:
        """[L] changed / compared; nan where nothing was compared."""
        return torch.where(self.compared > 0, self.changed / self.compared.clamp(min=1), math.nan)

    def summary(self, prefix: str = "moe/", per_layer: bool = True) -> dict[str, float]:
        """Scalars for logging: layer averages (over layers with data) and, optionally, per layer."""
        out: dict[str, float] = {}

        def mean(t: torch.Tensor) -> float:
            t = t[~torch.isnan(t)]
            return float(t.mean()) if t.numel() else math.nan

        load, aux, chg = self.load_max_over_mean(), self.aux_loss(), self.change_fraction()
        out[f"{prefix}load_max_over_mean"] = mean(load)
        out[f"{prefix}aux_loss"] = mean(aux)
        c = float(self.compared.sum())
        out[f"{prefix}routing_change_frac"] = float(self.changed.sum()) / c if c > 0 else math.nan
        if per_layer:
            for l in range(load.numel()):
                if self.num_tokens[l] > 0:
                    out[f"{prefix}load_max_over_mean/layer_{l}"] = float(load[l])
                    out[f"{prefix}aux_loss/layer_{l}"] = float(aux[l])
                if self.compared[l] > 0:
                    out[f"{prefix}routing_change_frac/layer_{l}"] = float(chg[l])
        return out

    def to_metrics(self, prefix: str = "moe/") -> dict:
        """The change fraction as ``metrics.Metric`` sum/count pairs (overall and per layer with data),
        for ``metrics.reduce_metrics``. Load and aux loss are ratios of sums: use all_reduce + summary."""
        from megatron_gspo.runtime.metrics import Metric

        out = {f"{prefix}routing_change_frac": Metric.from_sum_count(self.changed.sum(), self.compared.sum())}
        for l in range(self.changed.numel()):
            out[f"{prefix}routing_change_frac/layer_{l}"] = Metric.from_sum_count(self.changed[l], self.compared[l])
        return out


class _Capture:
    def __init__(self, tag, stats: RoutingStats, n_local: int, ref: Optional[list], store: bool):
        self.tag, self.stats, self.ref, self.store = tag, stats, ref, store
        self.routes: list[list[torch.Tensor]] = [[] for _ in range(n_local)]
        self.cursor = [0] * n_local
        self.calls = [0] * n_local


class RoutingMonitor:
    """Routing metrics from forward hooks on every MoE layer's ``mlp.router``.

    Hooks do nothing outside ``capture(tag)``. Inside, every router call adds to the capture's
    :class:`RoutingStats` (load, aux-loss sums; change counts when ``compare_to`` is given) and, with
    ``store=True``, keeps the call's routes ([T, k] ids per local layer, concatenated over calls in call
    order) for a later ``change_fraction`` or as a reference. A router that runs twice within one
    capture (two micro-batches, or a forward and its backward recompute) contributes twice.

    GSPO / GRPO without replay (routing change between the old-log-prob pass and the training pass)::

        mon = RoutingMonitor(model)
        with torch.no_grad(), mon.capture(("old", mb)):          # old-log-prob pass, stores routes
            old = forward_logits(model, x)
        ...
        with mon.capture(("train", mb), compare_to=("old", mb)):  # training forward, compares on the fly
            loss = ...
        loss.backward()                                          # outside the capture
        step_stats = step_stats + mon.stats(("train", mb), pop=True); mon.drop(("old", mb))
        logs = step_stats.all_reduce().summary()

    With R2 the reference can be the replay's own routes: ``compare_to=replay.routes(mb)``.

    aux_loss=True recomputes the router logits (router.gating, no grad) in the hook to get the full
    softmax scores the Switch loss needs: one extra [T, H] x [H, E] GEMM per layer, only while capturing.
    """

    def __init__(self, model, *, aux_loss: bool = True):
        inner = unwrap(model)
        self.routers = find_routers(inner)
        if not self.routers:
            raise ValueError("RoutingMonitor: the model has no MoE routers")
        cfg = self.routers[0].config
        self.num_experts = cfg.num_moe_experts
        self.topk = cfg.moe_router_topk
        self.num_layers = cfg.num_layers + (cfg.mtp_num_layers or 0)
        self.slots = [(r.layer_number - 1) if r.layer_number is not None else l for l, r in enumerate(self.routers)]
        self.aux_loss = aux_loss
        self._active: Optional[_Capture] = None
        self._routes: dict[Hashable, list[torch.Tensor]] = {}
        self._stats: dict[Hashable, RoutingStats] = {}
        self.last_calls: list[int] = []  # router calls per local layer in the last finished capture
        self._hooks = [r.register_forward_hook(
            lambda mod, args, kwargs, out, l=l: self._hook(l, mod, args, kwargs, out), with_kwargs=True)
            for l, r in enumerate(self.routers)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @property
    def num_local_layers(self) -> int:
        return len(self.routers)

    @contextlib.contextmanager
    def capture(self, tag: Hashable, compare_to: Union[Hashable, Sequence[torch.Tensor], None] = None,
                store: Optional[bool] = None) -> Iterator[RoutingStats]:
        """Capture router calls under ``tag``. compare_to: a stored tag or per-local-layer [T, k] routes
        (router layout) to count routing changes against, consumed token by token in call order (all of
        it must be consumed by the end). store: keep the routes (default: only without compare_to)."""
        if self._active is not None:
            raise RuntimeError(f"RoutingMonitor: capture({tag!r}) inside capture({self._active.tag!r})")
        if tag in self._stats:
            raise RuntimeError(f"RoutingMonitor: tag {tag!r} was already captured (drop() it first)")
        ref = None
        if compare_to is not None:
            if isinstance(compare_to, (list, tuple)) and compare_to and isinstance(compare_to[0], torch.Tensor):
                ref = list(compare_to)
            else:
                ref = self.routes(compare_to)
            if len(ref) != self.num_local_layers:
                raise ValueError(f"compare_to has routes for {len(ref)} layers; this rank has {self.num_local_layers}")
        store = compare_to is None if store is None else store
        stats = RoutingStats.zeros(self.num_layers, self.num_experts, self.topk, device=self.routers[0].weight.device)
        cap = _Capture(tag, stats, self.num_local_layers, ref, store)
        self._active = cap
        try:
            yield stats
        finally:
            self._active = None
        if ref is not None:
            short = {l: (cap.cursor[l], ref[l].shape[0]) for l in range(len(ref)) if cap.cursor[l] != ref[l].shape[0]}
            if short:
                raise RoutingReplayError(f"capture({tag!r}): compared tokens != reference tokens at layers {short} "
                                         "(same micro-batch, same partition?)")
        self._stats[tag] = stats
        if store:
            self._routes[tag] = [torch.cat(rs) if rs else torch.empty(0, self.topk, dtype=torch.int16)
                                 for rs in cap.routes]
        self.last_calls = list(cap.calls)

    def _hook(self, l: int, router, args, kwargs, out) -> None:
        cap = self._active
        if cap is None:
            return
        _, rmap = out
        slot = self.slots[l]
        st = cap.stats
        # megatron's padding mask ([s, b], True = padding; the router's second argument): padding
        # positions are no tokens of any sequence and do not count, so the statistics do not depend
        # on how much padding a layout adds
        pad = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        with torch.no_grad():
            rmap = rmap.reshape(-1, self.num_experts)
            valid = None if pad is None else ~pad.reshape(-1)
            if valid is not None:
                rmap = rmap[valid]
            n = rmap.shape[0]
            st.tokens_per_expert[slot] += rmap.sum(0).to(st.tokens_per_expert)
            st.num_tokens[slot] += n
            if self.aux_loss:
                x = args[0] if args else kwargs["input"]
                logits = router.gating(x).reshape(-1, self.num_experts).float()
                if valid is not None:
                    logits = logits[valid]
                if getattr(router, "score_function", "softmax") == "sigmoid":
                    scores = torch.sigmoid(logits)
                    scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
                else:
                    scores = torch.softmax(logits, dim=-1)
                st.prob_per_expert[slot] += scores.sum(0).to(st.prob_per_expert)
            if cap.ref is not None:
                c = cap.cursor[l]
                ref = cap.ref[l]
                if c + n > ref.shape[0]:
                    raise RoutingReplayError(f"capture({cap.tag!r}): layer {l} saw {c + n} tokens, the reference "
                                             f"has {ref.shape[0]}")
                changed, compared = change_counts(ref[c:c + n], rmap, self.num_experts)
                st.changed[slot] += changed.to(st.changed)
                st.compared[slot] += compared.to(st.compared)
                cap.cursor[l] = c + n
            if cap.store:
                cap.routes[l].append(routing_map_to_indices(rmap, self.topk).to(index_dtype(self.num_experts)))
        cap.calls[l] += 1

    # -- results -----------------------------------------------------------------------------------

    def routes(self, tag: Hashable) -> list[torch.Tensor]:
        """Stored routes of a capture: per local layer [T, k] (router layout)."""
        if tag not in self._routes:
            raise KeyError(f"RoutingMonitor: no stored routes for tag {tag!r} (stored: {list(self._routes)})")
        return self._routes[tag]

    def stats(self, tag: Hashable, pop: bool = False) -> RoutingStats:
        """The RoutingStats summed during ``capture(tag)`` (local; ``all_reduce`` for global)."""
        if tag not in self._stats:
            raise KeyError(f"RoutingMonitor: tag {tag!r} was not captured (captured: {list(self._stats)})")
        return self._stats.pop(tag) if pop else self._stats[tag]

    def change_fraction(self, ref_tag: Hashable, cur_tag: Hashable) -> RoutingStats:
        """Routing change of ``cur_tag`` against ``ref_tag`` (both stored): a RoutingStats with only
        ``changed`` / ``compared`` filled; ``.change_fraction()`` per layer, ``.summary()`` overall."""
        ref, cur = self.routes(ref_tag), self.routes(cur_tag)
        st = RoutingStats.zeros(self.num_layers, self.num_experts, self.topk, device=ref[0].device)
        for l, (a, b) in enumerate(zip(ref, cur)):
            if a.shape != b.shape:
                raise ValueError(f"change_fraction: layer {l} routes {tuple(a.shape)} vs {tuple(b.shape)}")
            changed, compared = change_counts(a, b, self.num_experts)
            st.changed[self.slots[l]] += changed.to(st.changed)
            st.compared[self.slots[l]] += compared.to(st.compared)
        return st

    def drop(self, tag: Hashable) -> None:
        self._routes.pop(tag, None)
        self._stats.pop(tag, None)

    def clear(self) -> None:
        self._routes.clear()
        self._stats.clear()
