"""MoE routing replay (R2 / R3) on megatron-core's native ``RouterReplay``, and routing metrics.

Why: an MoE policy's log-prob depends on which experts each token is routed to. After an
optimizer step (or between the rollout engine and the trainer) the top-k choice flips for some
tokens, so the importance ratio of GRPO mixes a routing change with a policy change. Routing
replay fixes the expert choice to the one the behaviour policy made and lets gradients flow only
through the router *probabilities* gathered at those experts.

Modes (``RoutingReplay(mode, ...)``):

    "off"  no replay; every method is a no-op so the trainer can call them unconditionally.
    "R2"   record the top-k of every MoE layer in the old-log-prob forward (``recording(mb)``),
           replay it in the training forward (``replaying(mb)``) and in activation recompute
           (``backward_replay()`` around ``loss.backward()``).
    "R3"   the routes come from rollout generation: :class:`RolloutRecorder` (the ``on_forward``
           callback of ``generation.generate``) or any generator calling
           ``RolloutRoutes.add_step`` once per forward (prefill, then each decode step) accumulates
           them into per-sequence order, ``load(mb, routes)`` hands a micro-batch's routes to the
           replay, and the training forward replays them as in R2. The last token of a sequence is
           sampled but never fed to the model, so it has no route: the training forward's input
           ``tokens[:, :-1]`` has exactly one recorded route per position (checked).

Limits: one model chunk per rank (no virtual pipeline), no context parallelism. megatron's own aux
loss (when its coefficient is > 0) is computed on a fresh top-k even under replay.

Mechanism: megatron-core 0.16 builds one ``RouterReplay`` per MoE layer when the model is built
with ``TransformerConfig(moe_enable_routing_replay=True)`` (``build_model(..., routing_replay=True)``)
and keeps them, in layer order, in the class-level ``RouterReplay.global_router_replay_instances``
(``build_model`` clears it, so a rebuilt model has exactly one instance per local MoE layer). Its
top-k hook (``moe_utils.topk_routing_with_score_function``) obeys a per-instance action:

    RECORD          normal top-k, the indices are kept (``recorded_topk_idx``)
    REPLAY_FORWARD  indices = ``target_topk_idx``; probs = scores.gather(1, indices)
    REPLAY_BACKWARD indices = ``replay_backward_list.pop(0)`` (activation recompute in backward)

Nothing in megatron sets REPLAY_BACKWARD, and ``set_target_indices`` appends to
``replay_backward_list`` on every call; this module sets the action around the backward and keeps
that list consistent (one entry per replayed micro-batch awaiting a backward recompute, removed
otherwise). The fused top-k kernel (``moe_router_fusion=True``) returns before the hook, which
``model.build_transformer_config`` refuses together with routing replay.

Layouts (``T`` = tokens one router sees, ``k`` = moe_router_topk, ``E`` = num_moe_experts):

    router input           [s_local, b, H] (sequence-major); s_local = s / tp under sequence
                           parallel (this TP rank's contiguous sequence chunk), s otherwise
    recorded / replayed    per layer [T, k] integer expert ids, T = s_local * b, row t = s_idx * b + b_idx
    ``load()`` input       per layer [b, s, k] (batch-major, the micro-batch's full sequence, as the
                           token tensor fed to the training forward); converted to the router
                           layout and, under sequence parallel, sliced to this TP rank's chunk
    router output (hooks)  (probs [T, E] float, routing_map [T, E] bool)

Each rank records and replays its own tokens: under expert parallelism the router runs before
token dispatch on this rank's (data-parallel) tokens; under TP + sequence parallel on this TP
rank's sequence chunk. Routes are keyed by micro-batch id; the old-log-prob pass and the training
pass must use the same micro-batch partition. Every recorded micro-batch must be replayed exactly
once per training pass (``finish_pass()`` / ``finish_step()`` raise otherwise, replaying twice
raises at once), and ``finish_step()`` clears megatron's recorded indices
(``RouterReplay.clear_global_indices``).

Metrics: :class:`RoutingMonitor` puts forward hooks on every layer's ``mlp.router`` and reports,
per layer, the expert load (tokens per expert, max/mean), the standard Switch load-balancing loss
(computed here from the full softmax scores and the routing map of the forward, coefficient 1,
the same normalization megatron's ``load_balancing_loss`` tracker uses) and the routing change
fraction: the share of (token, k) expert choices of a reference routing (old policy) that the
current forward does not choose. All are kept as local sums (:class:`RoutingStats`) that reduce
exactly with one SUM all-reduce.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields
from typing import Hashable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

VALID_MODES = ("off", "R2", "R3")

Routes = Union[torch.Tensor, Sequence[torch.Tensor]]


class RoutingReplayError(RuntimeError):
    """Routing replay was used inconsistently (wrong shapes, a route consumed twice or never, ...)."""


def _rr():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    return RouterReplay, RouterReplayAction


def normalize_mode(mode: str) -> str:
    """'off' | 'R2' | 'R3' (case-insensitive); anything else raises ValueError naming the valid ones."""
    if isinstance(mode, str):
        for m in VALID_MODES:
            if mode.strip().lower() == m.lower():
                return m
    raise ValueError(f"routing replay mode {mode!r} is not one of {list(VALID_MODES)}")


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def find_routers(model) -> list:
    """The MoE routers (megatron ``Router`` modules, i.e. each layer's ``mlp.router``) of this
    rank's model chunk, in layer order (the order their RouterReplay instances were created)."""
    from megatron.core.transformer.moe.router import Router

    routers = [m for m in model.modules() if isinstance(m, Router)]
    if all(r.layer_number is not None for r in routers):
        routers.sort(key=lambda r: r.layer_number)  # stable; modules() is already in layer order
    return routers


def _index_dtype(num_experts: Optional[int]) -> torch.dtype:
    # compact storage (ids < E); RouterReplay's gather needs int64, converted at replay time
    if num_experts is not None and num_experts <= torch.iinfo(torch.int16).max:
        return torch.int16
    return torch.int32


def _in_backward() -> bool:
    f = getattr(torch._C, "_current_graph_task_id", None)
    return f is not None and f() != -1


def _tokens_seen(args, kwargs) -> tuple[int, tuple]:
    x = args[0] if args else kwargs["input"]
    return x.numel() // x.shape[-1], tuple(x.shape[:-1])


def _as_layer_list(routes: Routes, num_layers: int, what: str) -> list[torch.Tensor]:
    if isinstance(routes, torch.Tensor):
        routes = list(routes.unbind(0))
    routes = list(routes)
    if len(routes) != num_layers:
        raise RoutingReplayError(f"{what}: got routes for {len(routes)} layers, the model has {num_layers} MoE layers")
    return routes


# ------------------------------------------------------------------------------------------------
# Replay
# ------------------------------------------------------------------------------------------------


class RoutingReplay:
    """Per-micro-batch routing replay for one model (one pipeline chunk) on this rank.

    Args:
        mode: "off" | "R2" | "R3".
        num_layers: MoE layers on this rank (== ``len(RouterReplay.global_router_replay_instances)``).
        topk / num_experts: checked against recorded / loaded routes when given.
        sp_rank / sp_size: this rank's index and the number of sequence chunks under sequence
            parallel (TP rank / TP size with SP on; 0 / 1 otherwise). Used by ``load()`` only.
        recompute: activation recompute may re-run routers in backward (full recompute, or
            selective recompute of the MoE layer). Replayed routes then stay queued for
            ``backward_replay()``.
        model: when given, routers get pre-hooks that check the replayed routes' token count
            against what each router sees, and that a backward recompute runs under
            ``backward_replay()``; ``from_model`` is the usual constructor.
        offload_to_cpu: keep stored routes on the CPU between the two passes.

    Trainer protocol (R2)::

        replay = RoutingReplay.from_model("R2", model, state)
        for mb, batch in enumerate(micro_batches):               # old-log-prob pass
            with torch.no_grad(), replay.recording(mb):
                old_logits = forward_logits(model, batch.input)
        for mb, batch in enumerate(micro_batches):               # training pass (any order)
            with replay.replaying(mb):
                loss = loss_fn(forward_logits(model, batch.input))
            with replay.backward_replay():
                loss.backward()
        replay.finish_pass()     # optional between PPO epochs that re-replay the same routes
        replay.finish_step()     # after the last pass of the step

    R3: instead of ``recording``, ``replay.load(mb, rollout_routes.routes_for(rows, seq_len))``
    for each micro-batch, then the same training pass.
    """

    def __init__(self, mode: str, num_layers: int, *, topk: Optional[int] = None,
                 num_experts: Optional[int] = None, sp_rank: int = 0, sp_size: int = 1,
                 recompute: bool = False, model=None, offload_to_cpu: bool = False):
        self.mode = normalize_mode(mode)
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
        if not (0 <= sp_rank < sp_size):
            raise ValueError(f"sp_rank={sp_rank} must be in [0, sp_size={sp_size})")
        self.num_layers = num_layers
        self.topk = topk
        self.num_experts = num_experts
        self.sp_rank, self.sp_size = sp_rank, sp_size
        self.recompute = bool(recompute)
        self.offload_to_cpu = offload_to_cpu
        self._routes: dict[Hashable, list[torch.Tensor]] = {}
        self._consumed: set = set()
        self._passes_done = 0
        self._pending: list[Hashable] = []  # replayed micro-batches awaiting a backward recompute
        self._routers: Optional[list] = None
        self._hooks: list = []
        self._device: Optional[torch.device] = None
        self.last_backward_recomputed_layers: list[int] = []  # set by backward_replay()
        if model is not None and self.enabled:
            self._attach(model)

    @classmethod
    def from_model(cls, mode: str, model, state=None, **kw) -> "RoutingReplay":
        """Build for ``model`` (GPTModel or a DDP wrapper). ``state``: the ParallelState (TP rank for
        sequence parallel); without it the TP group is taken from the model's pg_collection."""
        mode = normalize_mode(mode)
        inner = _unwrap(model)
        cfg = inner.config
        routers = find_routers(inner)
        if not routers:
            raise RoutingReplayError("the model has no MoE routers")
        if mode != "off":
            if getattr(cfg, "moe_router_fusion", False):
                raise RoutingReplayError("moe_router_fusion=True: the fused top-k path skips RouterReplay in "
                                         "megatron-core 0.16; routing replay needs moe_router_fusion=False")
            if not getattr(cfg, "moe_enable_routing_replay", False) or any(r.router_replay is None for r in routers):
                raise RoutingReplayError(f"routing replay mode {mode!r} needs a model built with "
                                         "build_model(..., routing_replay=True) (moe_enable_routing_replay)")
        sp_rank, sp_size = 0, 1
        if cfg.sequence_parallel:
            if state is not None:
                sp_rank, sp_size = state.tp_rank, state.tp
            else:
                group = inner.pg_collection.tp
                sp_rank, sp_size = dist.get_rank(group), dist.get_world_size(group)
        if getattr(cfg, "context_parallel_size", 1) > 1:
            raise RoutingReplayError("routing replay with context parallelism is not supported")
        recompute = cfg.recompute_granularity == "full" or (
            cfg.recompute_granularity == "selective" and "moe" in (cfg.recompute_modules or []))
        kw.setdefault("topk", cfg.moe_router_topk)
        kw.setdefault("num_experts", cfg.num_moe_experts)
        kw.setdefault("recompute", recompute)
        return cls(mode, len(routers), sp_rank=sp_rank, sp_size=sp_size, model=model, **kw)

    # -- properties --------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def recorded_ids(self) -> list:
        return list(self._routes)

    @property
    def pending_backward(self) -> int:
        """Replayed micro-batches whose backward recompute has not run yet."""
        return len(self._pending)

    def routes(self, mb_id: Hashable) -> list[torch.Tensor]:
        """The stored routes of a micro-batch: per layer [T, k] (router layout, compact ints)."""
        if mb_id not in self._routes:
            raise RoutingReplayError(f"no routes stored for micro-batch {mb_id!r} (stored: {self.recorded_ids})")
        return self._routes[mb_id]

    # -- internals ---------------------------------------------------------------------------------

    def _attach(self, model) -> None:
        routers = find_routers(_unwrap(model))
        if len(routers) != self.num_layers:
            raise RoutingReplayError(f"num_layers={self.num_layers} but the model has {len(routers)} MoE routers")
        self._routers = routers
        self._device = routers[0].weight.device
        for l, r in enumerate(routers):
            self._hooks.append(r.register_forward_pre_hook(
                lambda mod, args, kwargs, l=l: self._pre_hook(l, mod, args, kwargs), with_kwargs=True))

    def close(self) -> None:
        """Remove the router hooks (a model outliving this object gets no stale checks)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _pre_hook(self, layer: int, router, args, kwargs) -> None:
        inst = router.router_replay
        if inst is None:
            return
        _, A = _rr()
        act = inst.router_replay_action
        n, shape = _tokens_seen(args, kwargs)
        where = f"layer {layer} (router input {shape}, sequence x batch{', this TP rank chunk' if self.sp_size > 1 else ''})"
        if act == A.REPLAY_FORWARD:
            tgt = inst.target_topk_idx
            if tgt is None:
                raise RoutingReplayError(f"{where}: REPLAY_FORWARD without target indices")
            if tgt.shape[0] != n:
                raise RoutingReplayError(f"{where}: replayed routes have {tgt.shape[0]} tokens, the router sees {n}")
        elif act == A.REPLAY_BACKWARD:
            if not inst.replay_backward_list:
                raise RoutingReplayError(f"{where}: backward recompute found no queued replay routes")
            if inst.replay_backward_list[0].shape[0] != n:
                raise RoutingReplayError(f"{where}: queued replay routes have {inst.replay_backward_list[0].shape[0]} "
                                         f"tokens, the recomputed router sees {n}")
        elif inst.replay_backward_list and _in_backward():
            raise RoutingReplayError(
                f"{where} is recomputed in backward while {len(inst.replay_backward_list)} replayed micro-batch(es) "
                "await their backward recompute, but REPLAY_BACKWARD is not set: wrap loss.backward() in "
                "RoutingReplay.backward_replay()")

    def _instances(self) -> list:
        RR, _ = _rr()
        inst = RR.global_router_replay_instances
        if len(inst) != self.num_layers:
            raise RoutingReplayError(
                f"{len(inst)} RouterReplay instances are registered but this replay expects {self.num_layers} MoE layers: "
                "build the model with build_model(..., routing_replay=True), and only one model per process "
                "(build_model clears the class-level list; a second model replaces the first's instances)")
        if self._routers is not None and any(r.router_replay is not i for r, i in zip(self._routers, inst)):
            raise RoutingReplayError("the registered RouterReplay instances belong to another (rebuilt) model; "
                                     "create a new RoutingReplay for the current model")
        return inst

    def _check_idle(self, inst) -> None:
        busy = [l for l, i in enumerate(inst) if i.router_replay_action is not None]
        if busy:
            raise RoutingReplayError(f"a router replay action is already set on layers {busy} "
                                     "(nested recording/replaying contexts are not allowed)")

    def _store(self, mb_id: Hashable, per_layer: list[torch.Tensor], what: str) -> None:
        if mb_id in self._routes:
            raise RoutingReplayError(f"{what}: routes for micro-batch {mb_id!r} are already stored this step")
        n = per_layer[0].shape[0]
        for l, r in enumerate(per_layer):
            if r.dim() != 2 or r.shape[0] != n or (self.topk is not None and r.shape[1] != self.topk):
                raise RoutingReplayError(
                    f"{what}: layer {l} routes have shape {tuple(r.shape)}; expected [{n}, "
                    f"{self.topk if self.topk is not None else 'k'}] (same tokens at every layer)")
            if r.is_floating_point():
                raise RoutingReplayError(f"{what}: layer {l} routes are {r.dtype}, expected integer expert ids")
        stored = []
        for r in per_layer:
            r = r.detach().to(_index_dtype(self.num_experts))
            if self.offload_to_cpu:
                r = r.to("cpu")
            stored.append(r)
        self._routes[mb_id] = stored

    # -- recording (R2) ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self, mb_id: Hashable) -> Iterator[None]:
        """Record the top-k of every MoE layer during this forward (the old-log-prob pass) as the
        routes of micro-batch ``mb_id``. One forward of the whole micro-batch per context."""
        if self.mode == "off":
            yield
            return
        if self.mode == "R3":
            raise RoutingReplayError("mode R3 takes its routes from rollout generation (RolloutRoutes + load()); "
                                     "recording() is the R2 path")
        if mb_id in self._routes:
            raise RoutingReplayError(f"routes for micro-batch {mb_id!r} were already recorded this step")
        RR, A = _rr()
        inst = self._instances()
        self._check_idle(inst)
        for i in inst:
            i.record_indices(None)
        RR.set_global_router_replay_action(A.RECORD)
        try:
            yield
        finally:
            RR.clear_global_router_replay_action()
            got = [i.get_recorded_indices() for i in inst]
            for i in inst:
                i.record_indices(None)
        missing = [l for l, g in enumerate(got) if g is None]
        if missing:
            raise RoutingReplayError(f"recording({mb_id!r}): MoE layers {missing} did not run a forward")
        self._store(mb_id, got, f"recording({mb_id!r})")

    # -- loading (R3, or any externally produced routes) -----------------------------------------------

    def load(self, mb_id: Hashable, routes: Routes) -> None:
        """Store the routes of micro-batch ``mb_id`` given per layer as [b, s, k] (batch-major, the full
        sequence of the tokens the training forward is fed), e.g. ``RolloutRoutes.routes_for``.
        Converted to the router layout [s_local * b, k] (sequence-major; this TP rank's sequence chunk
        under sequence parallel). No-op in mode "off"."""
        if self.mode == "off":
            return
        per_layer = _as_layer_list(routes, self.num_layers, f"load({mb_id!r})")
        out = []
        for l, r in enumerate(per_layer):
            if r.dim() != 3:
                raise RoutingReplayError(f"load({mb_id!r}): layer {l} routes have shape {tuple(r.shape)}, expected [b, s, k]")
            if r.shape != per_layer[0].shape:
                raise RoutingReplayError(f"load({mb_id!r}): layer {l} routes {tuple(r.shape)} differ from layer 0 "
                                         f"{tuple(per_layer[0].shape)}")
            if bool((r < 0).any()):
                raise RoutingReplayError(f"load({mb_id!r}): layer {l} has unfilled (-1) expert ids; "
                                         "use RolloutRoutes.routes_for, which fills padding")
            if self.num_experts is not None and bool((r >= self.num_experts).any()):
                raise RoutingReplayError(f"load({mb_id!r}): layer {l} has expert ids >= num_experts={self.num_experts}")
            b, s, k = r.shape
            x = r.transpose(0, 1)  # [s, b, k]
            if self.sp_size > 1:
                if s % self.sp_size:
                    raise RoutingReplayError(f"load({mb_id!r}): sequence length {s} is not divisible by the "
                                             f"sequence-parallel size {self.sp_size}")
                c = s // self.sp_size
                x = x[self.sp_rank * c:(self.sp_rank + 1) * c]
            out.append(x.reshape(-1, k))
        self._store(mb_id, out, f"load({mb_id!r})")

    # -- replaying -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def replaying(self, mb_id: Hashable) -> Iterator[None]:
        """Replay the stored routes of ``mb_id`` in this forward (the training forward). Consumes them:
        a second replay of the same micro-batch in this pass raises."""
        if self.mode == "off":
            yield
            return
        if mb_id not in self._routes:
            raise RoutingReplayError(f"replaying({mb_id!r}): no routes stored for this micro-batch "
                                     f"(stored: {self.recorded_ids}); R2 records them in the old-log-prob pass")
        if mb_id in self._consumed:
            raise RoutingReplayError(f"replaying({mb_id!r}): the routes of this micro-batch were already consumed in "
                                     "this training pass (call finish_pass() before replaying them again)")
        RR, A = _rr()
        inst = self._instances()
        self._check_idle(inst)
        targets = [r.to(device=self._device, dtype=torch.long) if self._device is not None else r.long()
                   for r in self._routes[mb_id]]
        RR.set_replay_data(targets)  # sets target_topk_idx and appends to replay_backward_list
        self._consumed.add(mb_id)
        keep = self.recompute and torch.is_grad_enabled()
        ok = False
        RR.set_global_router_replay_action(A.REPLAY_FORWARD)
        try:
            yield
            ok = True
        finally:
            RR.clear_global_router_replay_action()
            for i, t in zip(inst, targets):
                i.target_topk_idx = None
                if not (keep and ok):
                    # no backward recompute will pop it: take back what set_replay_data appended
                    if i.replay_backward_list and i.replay_backward_list[-1] is t:
                        i.replay_backward_list.pop()
            if keep and ok:
                self._pending.append(mb_id)

    @contextlib.contextmanager
    def backward_replay(self) -> Iterator[None]:
        """Wrap ``loss.backward()`` of a replayed micro-batch: activation recompute in the backward
        replays the same routes (REPLAY_BACKWARD). Checks that every recomputed layer consumed exactly
        that micro-batch's routes. A no-op when nothing awaits a backward recompute."""
        if self.mode == "off" or not self._pending:
            yield
            return
        RR, A = _rr()
        inst = self._instances()
        self._check_idle(inst)
        before = [len(i.replay_backward_list) for i in inst]
        RR.set_global_router_replay_action(A.REPLAY_BACKWARD)
        try:
            yield
        finally:
            RR.clear_global_router_replay_action()
        mb_id = self._pending.pop(0)
        popped = [b - len(i.replay_backward_list) for b, i in zip(before, inst)]
        bad = {l: p for l, p in enumerate(popped) if p not in (0, 1)}
        if bad:
            raise RoutingReplayError(f"backward_replay for micro-batch {mb_id!r}: layers consumed {bad} routes "
                                     "(expected 1 per recomputed layer); one backward per replayed forward")
        for i, p in zip(inst, popped):
            if p == 0:  # layer not recomputed (e.g. recompute_method='block'): drop its queued entry
                i.replay_backward_list.pop(0)
        self.last_backward_recomputed_layers = [l for l, p in enumerate(popped) if p == 1]

    # -- step bookkeeping ---------------------------------------------------------------------------

    def finish_pass(self) -> None:
        """End of one training pass over the step's micro-batches: every stored micro-batch must have
        been replayed exactly once and every replayed backward recompute must have run. The routes stay
        stored for another pass (PPO epochs)."""
        if self.mode == "off":
            return
        if self._pending:
            raise RoutingReplayError(f"micro-batches {self._pending} were replayed with activation recompute but their "
                                     "backward did not run under backward_replay()")
        missing = [m for m in self._routes if m not in self._consumed]
        if missing:
            raise RoutingReplayError(f"routes of micro-batches {missing} were stored but not replayed in this training "
                                     f"pass ({len(self._consumed)}/{len(self._routes)} consumed); the old-log-prob and "
                                     "training passes must use the same micro-batch partition")
        self._consumed.clear()
        self._passes_done += 1

    def finish_step(self) -> None:
        """End of the RL step: check the last pass (as ``finish_pass``), then drop all routes and clear
        megatron's recorded/target indices (``RouterReplay.clear_global_indices``)."""
        if self.mode == "off":
            return
        if self._consumed or self._passes_done == 0 or self._pending:
            self.finish_pass()
        self.reset()

    def reset(self) -> None:
        """Drop everything without checks (after a failed step)."""
        self._routes.clear()
        self._consumed.clear()
        self._pending.clear()
        self._passes_done = 0
        if self.mode != "off":
            RR, _ = _rr()
            RR.clear_global_indices()
            RR.clear_global_router_replay_action()


# ------------------------------------------------------------------------------------------------
# R3: routes recorded during rollout generation
# ------------------------------------------------------------------------------------------------


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
        self.routes = torch.full((num_layers, batch_size, max_len, topk), -1, dtype=_index_dtype(num_experts),
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
    def from_generation(cls, steps: Sequence[torch.Tensor], prompt_lengths: torch.Tensor,
                        response_lengths: torch.Tensor, topk: int, num_experts: Optional[int] = None) -> "RolloutRoutes":
        """Routes of a ``generation.generate`` call from its per-forward records.

        steps: step 0 (prefill) [L, B, P, k] over the left-padded prompt block, then one [L, B, 1, k]
        per decode step (step j feeds response token j - 1). B may exceed the real rows (EP dummy rows,
        dropped). Valid positions: prefill columns >= P - prompt_length; decode step j for rows whose
        response is longer than j tokens (a row's last response token is never its own input; finished
        rows are fed padding). Checked: n real tokens -> n - 1 routes per row.
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
        for j, d in enumerate(steps[1:], start=1):
            if d.shape[1:3] != (B, 1):
                raise RoutingReplayError(f"from_generation: decode step {j} routes {tuple(d.shape)}; expected [L, {B}, 1, k]")
            rr.add_step(d[:, :n].cpu(), valid=(rlen > j)[:, None])
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
    """R3 recorder for ``megatron_gspo.generation.generate`` (which calls ``on_forward(step, kind)``
    after every model forward: step 0 "prefill", then "decode" steps)::

        rec = RolloutRecorder(model)                    # once per model (hooks on every router)
        with rec.recording():
            out = generate(model, prompts, gen_cfg, vocab_size=V, state=st, on_forward=rec.on_forward)
        routes = rec.finish(out)                        # RolloutRoutes, contract checked
        for mb, rows in enumerate(micro_batch_rows):    # input = out.tokens[rows, :-1] (S - 1 columns)
            replay.load(mb, routes.routes_for(rows, seq_len=out.tokens.shape[1] - 1))

    Forward hooks on the routers read each forward's routing map, whose router input [t, B, H] gives
    the step's shape; the generator runs the MoE layers on full sequences (no sequence split), so every
    TP rank records all of its rows' tokens and ``RoutingReplay.load`` takes this rank's chunk.
    """

    def __init__(self, model):
        self.routers = find_routers(_unwrap(model))
        if not self.routers:
            raise ValueError("RolloutRecorder: the model has no MoE routers")
        cfg = self.routers[0].config
        self.topk, self.num_experts = cfg.moe_router_topk, cfg.num_moe_experts
        self._active = False
        self._cur: list[Optional[torch.Tensor]] = [None] * len(self.routers)
        self.steps: list[torch.Tensor] = []
        self._hooks = [r.register_forward_hook(
            lambda mod, args, kwargs, out, l=l: self._hook(l, args, kwargs, out), with_kwargs=True)
            for l, r in enumerate(self.routers)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @contextlib.contextmanager
    def recording(self) -> Iterator["RolloutRecorder"]:
        self.steps, self._cur = [], [None] * len(self.routers)
        self._active = True
        try:
            yield self
        finally:
            self._active = False

    def _hook(self, l: int, args, kwargs, out) -> None:
        if not self._active:
            return
        x = args[0] if args else kwargs["input"]
        t, b = x.shape[0], x.shape[1]
        if self._cur[l] is not None:
            raise RoutingReplayError(f"RolloutRecorder: router of layer {l} ran twice before on_forward() was called")
        idx = routing_map_to_indices(out[1].reshape(-1, self.num_experts), self.topk)
        self._cur[l] = idx.to(_index_dtype(self.num_experts)).reshape(t, b, self.topk).transpose(0, 1)

    def on_forward(self, step: int, kind: str) -> None:
        """The generator's callback: files the routes of the forward that just ran as step ``step``."""
        if not self._active:
            raise RoutingReplayError("RolloutRecorder.on_forward outside recording()")
        if step != len(self.steps) or (kind == "prefill") != (step == 0):
            raise RoutingReplayError(f"RolloutRecorder: got step {step} ({kind}) after {len(self.steps)} recorded forwards")
        missing = [l for l, c in enumerate(self._cur) if c is None]
        if missing:
            raise RoutingReplayError(f"RolloutRecorder: step {step}: MoE layers {missing} did not run")
        self.steps.append(torch.stack(self._cur))  # [L, B, t, k]
        self._cur = [None] * len(self.routers)

    def finish(self, out) -> RolloutRoutes:
        """RolloutRoutes for ``out`` (a GenerationOutput: prompt_lengths, response_lengths)."""
        return RolloutRoutes.from_generation(self.steps, out.prompt_lengths, out.response_lengths,
                                             self.topk, self.num_experts)


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------


def routing_map_to_indices(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, E] bool -> [T, k] expert ids (ascending in no particular order; -1 where a token has fewer
    than k experts, e.g. capacity dropping)."""
    vals, idx = routing_map.to(torch.float32).topk(topk, dim=1)
    return torch.where(vals > 0, idx, torch.full_like(idx, -1))


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
        from megatron_gspo import comm

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
        from megatron_gspo.metrics import Metric

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
        inner = _unwrap(model)
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
                cap.routes[l].append(routing_map_to_indices(rmap, self.topk).to(_index_dtype(self.num_experts)))
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
