"""What the routing modules share: the error, layouts, and megatron-core's routing-replay internals.

megatron_gspo relies on megatron-core's ``RouterReplay`` (megatron/core/transformer/moe/router_replay.py)
beyond its public surface: its class-level instance list, per-instance action / target / backward
queue, and the ``Router.router_replay`` attribute. ``megatron_api()`` checks, once, that the installed
megatron-core has every one of them (tested with megatron-core 0.16.x) and names what is missing
otherwise, instead of failing deep inside a forward.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch

VALID_MODES = ("off", "R2", "R3")
TESTED_MEGATRON = "0.16"  # megatron-core versions this module was written and tested against

Routes = Union[torch.Tensor, Sequence[torch.Tensor]]


class RoutingReplayError(RuntimeError):
    """Routing replay was used inconsistently (wrong shapes, a route consumed twice or never, ...)."""


# the parts of megatron's RouterReplay this package drives (attribute names, by owner)
_REQUIRED = {
    "RouterReplay": ("global_router_replay_instances", "set_global_router_replay_action",
                     "clear_global_router_replay_action", "set_replay_data", "clear_global_indices",
                     "clear_global_router_replay_instances", "record_indices", "get_recorded_indices"),
    "RouterReplay()": ("router_replay_action", "target_topk_idx", "replay_backward_list"),
    "RouterReplayAction": ("RECORD", "REPLAY_FORWARD", "REPLAY_BACKWARD"),
}

def megatron_api(instance=None):
    """(RouterReplay, RouterReplayAction) from megatron-core, after checking they have everything the
    routing modules use (and ``instance``, a router's RouterReplay, its per-instance state);
    RoutingReplayError naming the missing pieces and the installed version."""
    RouterReplay, RouterReplayAction = _checked_classes()
    if instance is not None:
        _check_attrs({"RouterReplay()": instance})
    return RouterReplay, RouterReplayAction


@functools.cache
def _checked_classes():
    """megatron's RouterReplay classes, checked once per process (a failed check is not cached: it raises)."""
    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    except ImportError as e:
        raise RoutingReplayError(f"megatron-core has no RouterReplay ({e}); routing replay needs megatron-core "
                                 f">= {TESTED_MEGATRON} (tested with {TESTED_MEGATRON}.x)") from e
    # (an instance is never made here: RouterReplay() registers itself in megatron's global list)
    _check_attrs({"RouterReplay": RouterReplay, "RouterReplayAction": RouterReplayAction})
    return RouterReplay, RouterReplayAction


def _check_attrs(owners: dict) -> None:
    missing = [f"{owner}.{attr}" for owner, obj in owners.items() for attr in _REQUIRED[owner] if not hasattr(obj, attr)]
    if missing:
        import megatron.core

        raise RoutingReplayError(
            f"megatron-core {getattr(megatron.core, '__version__', '?')} lacks {missing}, which routing "
            f"replay drives; this version of megatron_gspo was tested with megatron-core {TESTED_MEGATRON}.x")


def normalize_mode(mode: str) -> str:
    """'off' | 'R2' | 'R3' (case-insensitive); anything else raises ValueError naming the valid ones."""
    if isinstance(mode, str):
        for m in VALID_MODES:
            if mode.strip().lower() == m.lower():
                return m
    raise ValueError(f"routing replay mode {mode!r} is not one of {list(VALID_MODES)}")


def find_routers(model) -> list:
    """The MoE routers (megatron ``Router`` modules, i.e. each layer's ``mlp.router``) of this
    rank's model chunk, in layer order (the order their RouterReplay instances were created)."""
    from megatron.core.transformer.moe.router import Router

    routers = [m for m in model.modules() if isinstance(m, Router)]
    if all(r.layer_number is not None for r in routers):
        routers.sort(key=lambda r: r.layer_number)  # stable; modules() is already in layer order
    return routers


def index_dtype(num_experts: Optional[int]) -> torch.dtype:
    # compact storage (ids < E); RouterReplay's gather needs int64, converted at replay time
    if num_experts is not None and num_experts <= torch.iinfo(torch.int16).max:
        return torch.int16
    return torch.int32


def in_backward() -> bool:
    f = getattr(torch._C, "_current_graph_task_id", None)
    return f is not None and f() != -1


def tokens_seen(args, kwargs) -> tuple[int, tuple]:
    x = args[0] if args else kwargs["input"]
    return x.numel() // x.shape[-1], tuple(x.shape[:-1])


def as_layer_list(routes: Routes, num_layers: int, what: str) -> list[torch.Tensor]:
    if isinstance(routes, torch.Tensor):
        routes = list(routes.unbind(0))
    routes = list(routes)
    if len(routes) != num_layers:
        raise RoutingReplayError(f"{what}: got routes for {len(routes)} layers, the model has {num_layers} MoE layers")
    return routes
