"""Routing replay for one model on this rank: record the top-k of every MoE layer in one forward
(R2: the old-log-prob pass) or take them from elsewhere (R3: the rollout), then make the training
forward (and its activation recompute) use exactly those experts. See routing/__init__.py."""

from __future__ import annotations

import contextlib
from typing import Hashable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_gspo.model.gpt import unwrap
from megatron_gspo.routing.common import (
    RoutingReplayError,
    Routes,
    as_layer_list,
    find_routers,
    in_backward,
    index_dtype,
    megatron_api,
    normalize_mode,
    tokens_seen,
)


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
        inner = unwrap(model)
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
            megatron_api(routers[0].router_replay)  # the RouterReplay internals this class drives exist
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
        routers = find_routers(unwrap(model))
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
        _, A = megatron_api()
        act = inst.router_replay_action
        n, shape = tokens_seen(args, kwargs)
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
        elif inst.replay_backward_list and in_backward():
            raise RoutingReplayError(
                f"{where} is recomputed in backward while {len(inst.replay_backward_list)} replayed micro-batch(es) "
                "await their backward recompute, but REPLAY_BACKWARD is not set: wrap loss.backward() in "
                "RoutingReplay.backward_replay()")

    def _instances(self) -> list:
        RR, _ = megatron_api()
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
            r = r.detach().to(index_dtype(self.num_experts))
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
        if mb_id in self._routes:
            raise RoutingReplayError(f"routes for micro-batch {mb_id!r} were already recorded this step")
        with self.recorded(f"recording({mb_id!r})") as got:
            yield
        self._store(mb_id, got, f"recording({mb_id!r})")

    @contextlib.contextmanager
    def recorded(self, what: str = "recorded()") -> Iterator[list[torch.Tensor]]:
        """Record the top-k of every MoE layer during this forward and hand them over: the yielded list holds,
        once the block is over, per layer [T, k] int64 (router layout); nothing is stored here (the caller
        keeps them: routing/policy.py files them with the batch's rows). R2 only."""
        if self.mode != "R2":
            raise RoutingReplayError(f"mode {self.mode} records no routes: R3 takes its routes from rollout generation "
                                     "(RolloutRoutes + load()); recording is the R2 path")
        RR, A = megatron_api()
        inst = self._instances()
        self._check_idle(inst)
        for i in inst:
            i.record_indices(None)
        got: list[torch.Tensor] = []
        RR.set_global_router_replay_action(A.RECORD)
        try:
            yield got
        finally:
            RR.clear_global_router_replay_action()
            got += [i.get_recorded_indices() for i in inst]
            for i in inst:
                i.record_indices(None)
        missing = [l for l, g in enumerate(got) if g is None]
        if missing:
            raise RoutingReplayError(f"{what}: MoE layers {missing} did not run a forward")

    # -- loading (R3, or any externally produced routes) -----------------------------------------------

    def load(self, mb_id: Hashable, routes: Routes) -> None:
        """Store the routes of micro-batch ``mb_id`` given per layer as [b, s, k] (batch-major, the full
        sequence of the tokens the training forward is fed), e.g. ``RolloutRoutes.routes_for``.
        Converted to the router layout [s_local * b, k] (sequence-major; this TP rank's sequence chunk
        under sequence parallel). No-op in mode "off"."""
        if self.mode == "off":
            return
        self._store(mb_id, self._router_routes(routes, f"load({mb_id!r})"), f"load({mb_id!r})")

    def _router_routes(self, routes: Routes, what: str) -> list[torch.Tensor]:
        """Per layer [b, s, k] (batch-major, full sequences) -> per layer [s_local * b, k] (router layout, this
        TP rank's sequence chunk under sequence parallel), checked."""
        per_layer = as_layer_list(routes, self.num_layers, what)
        out = []
        for l, r in enumerate(per_layer):
            if r.dim() != 3:
                raise RoutingReplayError(f"{what}: layer {l} routes have shape {tuple(r.shape)}, expected [b, s, k]")
            if r.shape != per_layer[0].shape:
                raise RoutingReplayError(f"{what}: layer {l} routes {tuple(r.shape)} differ from layer 0 "
                                         f"{tuple(per_layer[0].shape)}")
            if bool((r < 0).any()):
                raise RoutingReplayError(f"{what}: layer {l} has unfilled (-1) expert ids; "
                                         "use RolloutRoutes.routes_for, which fills padding")
            if self.num_experts is not None and bool((r >= self.num_experts).any()):
                raise RoutingReplayError(f"{what}: layer {l} has expert ids >= num_experts={self.num_experts}")
            b, s, k = r.shape
            x = r.transpose(0, 1)  # [s, b, k]
            if self.sp_size > 1:
                if s % self.sp_size:
                    raise RoutingReplayError(f"{what}: sequence length {s} is not divisible by the "
                                             f"sequence-parallel size {self.sp_size}")
                c = s // self.sp_size
                x = x[self.sp_rank * c:(self.sp_rank + 1) * c]
            out.append(x.reshape(-1, k))
        return out

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
        self._consumed.add(mb_id)
        with self._replay(self._routes[mb_id], mb_id):
            yield

    @contextlib.contextmanager
    def replaying_routes(self, routes: Routes) -> Iterator[None]:
        """Replay ``routes`` (per layer [b, s, k], the micro-batch's full sequences, as ``load`` takes them) in
        this forward without storing them: the caller keeps them (routing/policy.py: a field of the batch's
        rows). Activation recompute in the backward replays them too (``backward_replay``)."""
        if self.mode == "off":
            yield
            return
        with self._replay(self._router_routes(routes, "replaying_routes"), "replaying_routes"):
            yield

    @contextlib.contextmanager
    def _replay(self, routes: list[torch.Tensor], tag: Hashable) -> Iterator[None]:
        RR, A = megatron_api()
        inst = self._instances()
        self._check_idle(inst)
        targets = [r.to(device=self._device, dtype=torch.long) if self._device is not None else r.long()
                   for r in routes]
        RR.set_replay_data(targets)  # sets target_topk_idx and appends to replay_backward_list
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
                self._pending.append(tag)

    @contextlib.contextmanager
    def backward_replay(self) -> Iterator[None]:
        """Wrap ``loss.backward()`` of a replayed micro-batch: activation recompute in the backward
        replays the same routes (REPLAY_BACKWARD). Checks that every recomputed layer consumed exactly
        that micro-batch's routes. A no-op when nothing awaits a backward recompute."""
        if self.mode == "off" or not self._pending:
            yield
            return
        RR, A = megatron_api()
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
            RR, _ = megatron_api()
            RR.clear_global_indices()
            RR.clear_global_router_replay_action()
