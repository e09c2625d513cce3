"""MoE routing replay (R2 / R3) on megatron-core's native ``RouterReplay``, and routing metrics.

Why: an MoE policy's log-prob depends on which experts each token is routed to. After an
optimizer step (or between the rollout engine and the trainer) the top-k choice flips for some
tokens, so the importance ratio of GRPO mixes a routing change with a policy change. Routing
replay fixes the expert choice to the one the behaviour policy made and lets gradients flow only
through the router *probabilities* gathered at those experts.

The package, by concern::

    policy.py          RoutingPolicy: the trainer's one interface (off / R2 / R3 behind the same calls)
    replay.py          RoutingReplay: record / load / replay per micro-batch on megatron's RouterReplay
    rollout_routes.py  R3: routes recorded during generation, laid out per sequence
    metrics.py         RoutingMonitor / RoutingStats: expert load, aux loss, routing change
    common.py          the error, layouts, and the checked access to megatron's RouterReplay internals

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
exactly with one SUM all-reduce."""

from megatron_gspo.routing.common import VALID_MODES, RoutingReplayError, find_routers, megatron_api, normalize_mode
from megatron_gspo.routing.metrics import RoutingMonitor, RoutingStats, change_counts, routing_map_to_indices
from megatron_gspo.routing.policy import RoutingPolicy
from megatron_gspo.routing.replay import RoutingReplay
from megatron_gspo.routing.rollout_routes import RolloutRecorder, RolloutRoutes

__all__ = ["VALID_MODES", "RolloutRecorder", "RolloutRoutes", "RoutingMonitor", "RoutingPolicy", "RoutingReplay",
           "RoutingReplayError", "RoutingStats", "change_counts", "find_routers", "megatron_api", "normalize_mode",
           "routing_map_to_indices"]
