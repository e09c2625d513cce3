"""Routing replay on 2 ranks, two layouts in one process group: EP=2, then TP=2 + sequence parallel
with full activation recompute. For each: record routes in an old-log-prob pass, take an Adam step
(DDP-reduced gradients), then check that a plain forward routes differently while a replayed forward
(and, under recompute, its backward recompute) reproduces the recorded routes exactly, that gradients
reach the router and the experts, and that every route is consumed. Under TP+SP, the full-sequence
routes assembled from both TP ranks and passed through ``RoutingReplay.load`` (the R3 path) must land
on each rank as exactly the routes its router saw.

Prints ``CHECK <phase> rank<r> <name> <value>`` lines (asserted by tests/test_routing.py) and exits
with status 3 when a check fails on this rank.
"""

import os
import sys

import torch
import torch.distributed as dist

from megatron_gspo.runtime import parallel
from megatron_gspo.config import ParallelConfig, model_config_from_preset
from megatron_gspo.model.logprobs import vocab_parallel_logprobs
from megatron_gspo.model.gpt import build_model, finalize_grads, forward_logits, wrap_ddp
from megatron_gspo.routing import RoutingMonitor, RoutingReplay, RoutingReplayError, RoutingStats

FAILED = []


def emit(phase, rank, name, value, ok=True):
    # one write(2) per line: both ranks share the pipe, and a short write is never interleaved
    os.write(1, f"CHECK {phase} rank{rank} {name} {float(value)}\n".encode())
    if not ok:
        FAILED.append(f"{phase}/{name}={value}")


def loss_fn(logits, tokens, vocab, tp_group):
    lp, _ = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], vocab, tp_group, with_entropy=False)
    w = torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp)
    return (lp * w).sum()


def run_phase(phase, tp, ep, recompute):
    rc = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=0.0, **rc)
    par = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, seed=21,
                         use_distributed_optimizer=False)  # gradients read whole from the DDP buffers
    st = parallel.initialize(cfg, par)
    model = build_model(cfg, par, st, routing_replay=True)
    ddp = wrap_ddp(model, st)
    replay = RoutingReplay.from_model("R2", ddp, st)
    mon = RoutingMonitor(ddp)
    r, k, V = st.rank, cfg.moe_router_topk, cfg.vocab_size
    tpg = st.tp_group if st.tp > 1 else None
    g = torch.Generator().manual_seed(100 + st.dp_rank)  # DP ranks differ, TP ranks share the batch
    mbs = [torch.randint(0, V, (2, 16), generator=g) for _ in range(2)]
    T = 2 * 16 // (st.tp if st.sequence_parallel else 1)  # tokens one router sees on this rank

    # old-log-prob pass
    for i, x in enumerate(mbs):
        with torch.no_grad(), replay.recording(i), mon.capture(("old", i)):
            forward_logits(ddp, x)
    shapes_ok = all(tuple(t.shape) == (T, k) for i in range(2) for t in replay.routes(i))
    emit(phase, r, "record_shape_ok", shapes_ok, shapes_ok)

    # one Adam step on DDP-reduced gradients
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    ddp.zero_grad_buffer()
    for x in mbs:
        loss_fn(forward_logits(ddp, x), x, V, tpg).backward()
    finalize_grads(ddp, st)
    for p in model.parameters():
        p.grad = p.main_grad
    opt.step()
    for p in model.parameters():
        p.grad = None  # DDP accumulates into main_grad; an aliased .grad would be added twice

    plain = RoutingStats.zeros(cfg.num_layers, cfg.num_moe_experts, k)
    for i, x in enumerate(mbs):
        with torch.no_grad(), mon.capture(("new", i), compare_to=("old", i)):
            forward_logits(ddp, x)
        plain = plain + mon.stats(("new", i))
    emit(phase, r, "plain_changed", plain.changed.sum(), plain.changed.sum() > 0)

    # training pass with replay (and backward recompute under replay)
    replayed = RoutingStats.zeros(cfg.num_layers, cfg.num_moe_experts, k)
    bwd = RoutingStats.zeros(cfg.num_layers, cfg.num_moe_experts, k)
    bwd_calls = []
    ddp.zero_grad_buffer()
    for i, x in enumerate(mbs):
        with replay.replaying(i), mon.capture(("rep", i), compare_to=replay.routes(i)):
            loss = loss_fn(forward_logits(ddp, x), x, V, tpg)
        replayed = replayed + mon.stats(("rep", i))
        if recompute:
            with mon.capture(("bwd", i), compare_to=replay.routes(i)), replay.backward_replay():
                loss.backward()
            bwd = bwd + mon.stats(("bwd", i))
            bwd_calls.append(sum(mon.last_calls))
        else:
            with replay.backward_replay():  # no recompute: a no-op
                loss.backward()
    finalize_grads(ddp, st)
    emit(phase, r, "replay_changed", replayed.changed.sum(), replayed.changed.sum() == 0)
    emit(phase, r, "replay_compared", replayed.compared.sum(), replayed.compared.sum() == 2 * 2 * T * k)
    if recompute:
        emit(phase, r, "bwd_changed", bwd.changed.sum(), bwd.changed.sum() == 0 and bwd.compared.sum() == 2 * 2 * T * k)
        emit(phase, r, "bwd_calls", bwd_calls[0], bwd_calls == [cfg.num_layers] * 2)
    router_g = min(float(l.mlp.router.weight.main_grad.abs().sum()) for l in model.decoder.layers)
    expert_g = min(float(sum(p.main_grad.abs().sum() for p in l.mlp.experts.parameters())) for l in model.decoder.layers)
    emit(phase, r, "router_grad", router_g, router_g > 0)
    emit(phase, r, "expert_grad", expert_g, expert_g > 0)
    try:
        replay.finish_step()
        consumed = 1
    except RoutingReplayError as e:
        print(f"[rank {r}] {e}", flush=True)
        consumed = 0
    emit(phase, r, "consumed_ok", consumed, consumed == 1)

    # load metrics: local per micro-batch, then summed over both ranks (distinct tokens)
    s0 = mon.stats(("rep", 0))
    emit(phase, r, "tokens", s0.num_tokens[0], s0.num_tokens.tolist() == [T] * cfg.num_layers)
    emit(phase, r, "load_sum", s0.tokens_per_expert[0].sum(),
         s0.tokens_per_expert.sum(1).tolist() == [T * k] * cfg.num_layers)
    red = RoutingStats(*[t.clone() for t in s0._tensors()], topk=k).all_reduce()
    emit(phase, r, "reduced_tokens", red.num_tokens[0], red.num_tokens.tolist() == [2 * T] * cfg.num_layers)

    if st.tp > 1 and st.sequence_parallel:
        # R3 path: full-sequence routes [b, s, k] (gathered from both TP ranks' chunks) -> load() -> this
        # rank's chunk in router layout must equal what its router saw
        rec = mon.routes(("old", 0))  # per layer [T, k] = [s/2 * b, k], sequence-major
        full = []
        for t in rec:
            t = t.long()  # gloo has no int16 collectives
            parts = [torch.empty_like(t) for _ in range(st.tp)]
            dist.all_gather(parts, t, group=st.tp_group)
            seq = torch.cat([p.view(-1, 2, k) for p in parts], 0)  # [s, b, k]
            full.append(seq.transpose(0, 1).long())  # [b, s, k]
        r3 = RoutingReplay.from_model("R3", ddp, st)
        r3.load("x", torch.stack(full))
        same = all(torch.equal(a.long(), b.long()) for a, b in zip(r3.routes("x"), rec))
        emit(phase, r, "load_layout_equal", same, same)
        with torch.no_grad(), r3.replaying("x"), mon.capture("r3", compare_to=rec):
            forward_logits(ddp, mbs[0])
        ch = mon.stats("r3").changed.sum()
        emit(phase, r, "load_replay_changed", ch, ch == 0)
        r3.finish_step()
        r3.close()
    replay.close()
    mon.close()


def main():
    run_phase("ep2", tp=1, ep=2, recompute=False)
    run_phase("tp2sp", tp=2, ep=1, recompute=True)
    parallel.destroy()
    if FAILED:
        print(f"FAILED checks: {FAILED}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
