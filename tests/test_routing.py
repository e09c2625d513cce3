"""Routing replay (R2 / R3 on megatron's RouterReplay) and MoE routing metrics.

Model tests use the tiny Qwen3-MoE (2 layers, 4 experts, top-2) with the aux loss off where the
router's gradient must come only through the probabilities gathered at the replayed experts.
Distributed layouts (EP=2, TP=2 + sequence parallel + recompute) run in one torchrun call
(dist_scripts/routing_dist.py) whose per-rank numbers are asserted here.
"""

import math
import re

import pytest
import torch

from megatron_gspo.config import ConfigError, ParallelConfig, model_config_from_preset
from megatron_gspo.routing import (
    RolloutRoutes,
    RoutingMonitor,
    RoutingReplay,
    RoutingReplayError,
    RoutingStats,
    change_counts,
    routing_map_to_indices,
)


# ------------------------------------------------------------------------------------------------
# Pure functions: hand-checked numbers
# ------------------------------------------------------------------------------------------------


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match=re.escape("['off', 'R2', 'R3']")):
        RoutingReplay("R4", 2)
    assert RoutingReplay("r2", 2).mode == "R2"
    off = RoutingReplay("off", 2)
    with off.recording(0), off.replaying(0), off.backward_replay():
        pass
    off.load(0, torch.zeros(2, 1, 3, 2, dtype=torch.long))
    off.finish_step()  # nothing stored, nothing to check


def test_change_counts_hand_example():
    ref = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3]])
    cur = torch.tensor([[1, 0], [2, 1], [3, 0], [0, 3]])
    # token 0: same set, other order -> 0; token 1: {2,3} vs {2,1} -> 1; token 2: {1,2} vs {3,0} -> 2; token 3 -> 0
    changed, compared = change_counts(ref, cur, num_experts=4)
    assert (int(changed), int(compared)) == (3, 8)
    cur_map = torch.zeros(4, 4, dtype=torch.bool).scatter(1, cur, True)
    assert tuple(map(int, change_counts(ref, cur_map, 4))) == (3, 8)
    assert routing_map_to_indices(cur_map, 2).sort(1).values.tolist() == cur.sort(1).values.tolist()
    # a dropped choice (-1) in the reference is not compared
    ref2 = ref.clone()
    ref2[2, 1] = -1
    assert tuple(map(int, change_counts(ref2, cur, 4))) == (2, 7)


def test_routing_stats_hand_example():
    st = RoutingStats.zeros(num_layers=2, num_experts=4, topk=2)
    # layer 0: 4 tokens, perfectly balanced, uniform scores: f = [2,2,2,2], P = [1,1,1,1]
    st.tokens_per_expert[0] = torch.tensor([2.0, 2, 2, 2])
    st.prob_per_expert[0] = torch.tensor([1.0, 1, 1, 1])
    st.num_tokens[0] = 4
    # layer 1: 4 tokens all on experts 0 and 1: f = [4,4,0,0], P = [2,2,0,0]
    st.tokens_per_expert[1] = torch.tensor([4.0, 4, 0, 0])
    st.prob_per_expert[1] = torch.tensor([2.0, 2, 0, 0])
    st.num_tokens[1] = 4
    st.changed[1], st.compared[1] = 3, 8
    # aux = E / (k T^2) * sum P f: layer 0: 4/32 * 8 = 1; layer 1: 4/32 * 16 = 2
    torch.testing.assert_close(st.aux_loss(), torch.tensor([1.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(st.load_max_over_mean(), torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert math.isnan(st.change_fraction()[0]) and st.change_fraction()[1] == 3 / 8
    s = (st + st).summary()
    assert s["moe/aux_loss"] == pytest.approx(1.5) and s["moe/load_max_over_mean"] == pytest.approx(1.5)
    assert s["moe/routing_change_frac"] == 3 / 8 and s["moe/routing_change_frac/layer_1"] == 3 / 8
    assert "moe/routing_change_frac/layer_0" not in s
    from megatron_gspo.runtime.metrics import reduce_metrics

    red = reduce_metrics(st.to_metrics())
    assert red["moe/routing_change_frac"] == 3 / 8 and math.isnan(red["moe/routing_change_frac/layer_0"])


def test_rollout_routes_contract_hand_example():
    L, k = 1, 2
    rr = RolloutRoutes(num_layers=L, batch_size=2, max_len=6, topk=k, num_experts=8)

    def ids(b, t, base):  # route of (row r, fed column c) = [base + 10 r + c, 0] (distinct per position)
        r = torch.arange(b)[:, None, None] * 10 + torch.arange(t)[None, :, None] + base
        return torch.cat([r, torch.zeros_like(r)], -1)[None]  # [1, b, t, 2]

    # prefill over a left-padded block of 3: row 0 has 3 prompt tokens, row 1 has 2 (one pad slot)
    rr.add_step(ids(2, 3, 100), valid=torch.tensor([[True, True, True], [False, True, True]]))
    rr.add_step(ids(2, 1, 200))                                        # decode 1: both rows fed
    rr.add_step(ids(2, 1, 300), valid=torch.tensor([[True], [False]]))  # decode 2: row 1 finished
    assert rr.count.tolist() == [5, 3]
    # row 0: 3 prompt + 3 response tokens (the last never fed) -> 5 routes; row 1: 2 + 2 -> 3 routes
    with pytest.raises(RoutingReplayError, match="never fed"):
        rr.check(torch.tensor([6, 5]))
    with pytest.raises(RoutingReplayError, match="check"):
        rr.routes_for([0], 5)
    rr.check(torch.tensor([6, 4]))
    got = rr.routes_for([1, 0], seq_len=6)  # rows in micro-batch order, full tokens fed (S = 6)
    assert got.shape == (1, 2, 6, 2) and got.dtype == torch.long
    assert got[0, 1, :, 0].tolist() == [100, 101, 102, 200, 300, 0]   # last column: filler [0, 1]
    assert got[0, 0, :, 0].tolist() == [111, 112, 210, 0, 0, 0]       # row 1: its pad slot 110 skipped
    assert got[0, 0, 3:].tolist() == [[0, 1]] * 3 and got[0, 1, 5].tolist() == [0, 1]
    with pytest.raises(RoutingReplayError, match="shorter"):
        rr.routes_for([0], 4)
    with pytest.raises(RoutingReplayError, match=r"expected \[L=1, b, t, k=2\]"):
        rr.add_step(torch.zeros(1, 2, 1, 3, dtype=torch.long))
    # router layout [t * b, k] (sequence-major) -> [L, b, t, k]
    x = torch.arange(12).reshape(1, 6, 2)  # t=3, b=2: row s*2+b
    y = RolloutRoutes.from_router_layout(x, batch=2)
    assert y.shape == (1, 2, 3, 2) and y[0, 1, 2].tolist() == x[0, 5].tolist() and y[0, 0, 1].tolist() == x[0, 2].tolist()


def test_rollout_routes_select_and_cat_keep_each_row_its_own_routes():
    """Dynamic sampling keeps groups of several generation rounds: select() cuts a round's rows out, cat()
    joins rounds of different widths; each row keeps its routes and count (routes_for as in its round)."""

    def round_of(base, lengths, max_len):  # row r's route at position j: [base + 10 r + j, 1]
        rr = RolloutRoutes(num_layers=1, batch_size=len(lengths), max_len=max_len, topk=2, num_experts=8)
        b = len(lengths)
        pos = torch.arange(b)[:, None] * 10 + torch.arange(max_len)[None, :] + base
        rr.add_step(torch.stack([pos, torch.ones_like(pos)], -1)[None],
                    valid=torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None] - 1)
        rr.check(torch.tensor(lengths))
        return rr

    a, b = round_of(100, [4, 6, 3], max_len=5), round_of(500, [7, 2], max_len=6)
    kept = RolloutRoutes.cat([a.select([2, 0]), b.select(torch.tensor([0]))])
    assert (kept.batch_size, kept.max_len) == (3, 6) and kept.count.tolist() == [2, 3, 6]
    got = kept.routes_for([0, 1, 2], seq_len=7)
    assert got[0, 0, :, 0].tolist() == [120, 121, 0, 0, 0, 0, 0]  # a's row 2, then the filler
    assert got[0, 1, :, 0].tolist() == [100, 101, 102, 0, 0, 0, 0]  # a's row 0
    assert got[0, 2, :, 0].tolist() == [500, 501, 502, 503, 504, 505, 0]  # b's row 0, wider than a's grid
    assert torch.equal(kept.routes_for([1], 7), a.routes_for([0], 7))
    with pytest.raises(RoutingReplayError, match="check"):
        RolloutRoutes.cat([RolloutRoutes(num_layers=1, batch_size=1, max_len=2, topk=2)])


def test_load_converts_to_sequence_parallel_router_layout():
    # [b=2, s=4, k=2] per layer; TP rank 1 of 2 under SP sees positions 2, 3 in order (s, b)
    routes = torch.tensor([[[[10 * b + s, 0] for s in range(4)] for b in range(2)]])  # [L=1, 2, 4, 2]
    rep = RoutingReplay("R3", 1, topk=2, sp_rank=1, sp_size=2)
    rep.load("mb", routes)
    assert rep.routes("mb")[0][:, 0].tolist() == [2, 12, 3, 13]
    with pytest.raises(RoutingReplayError, match="already stored"):
        rep.load("mb", routes)
    with pytest.raises(RoutingReplayError, match="not divisible"):
        rep.load("odd", routes[:, :, :3])
    with pytest.raises(RoutingReplayError, match="recording"):
        with rep.recording("x"):
            pass


def test_router_fusion_with_replay_is_refused():
    from megatron_gspo.model.gpt import build_transformer_config

    cfg = model_config_from_preset("tiny", moe_router_fusion=True)
    with pytest.raises(ConfigError, match="moe_router_fusion=true cannot be combined with routing replay"):
        build_transformer_config(cfg, ParallelConfig(device="cpu"), torch.device("cpu"), routing_replay=True)


# ------------------------------------------------------------------------------------------------
# Tiny MoE, one rank
# ------------------------------------------------------------------------------------------------


def _loss(logits, tokens, vocab):
    from megatron_gspo.model.logprobs import vocab_parallel_logprobs

    lp, _ = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], vocab, None, with_entropy=False)
    w = torch.linspace(-1.0, 1.0, lp.numel(), device=lp.device).view_as(lp)  # a fixed, non-trivial weighting
    return (lp * w).sum()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _set_equal(a, b):
    return torch.equal(a.long().sort(1).values, b.long().sort(1).values)


def test_r2_replay_single_rank(single_rank):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_gspo.model.gpt import build_model, forward_logits

    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=0.0)
    par = ParallelConfig(device="cpu", seed=5)
    st = single_rank(cfg, par)

    # rebuilding resets megatron's class-level instance list; a replay bound to the old model refuses
    old = build_model(cfg, par, st, routing_replay=True)
    stale = RoutingReplay.from_model("R2", old, st)
    model = build_model(cfg, par, st, routing_replay=True)
    assert len(RouterReplay.global_router_replay_instances) == cfg.num_layers == 2
    assert [r.router_replay for r in (l.mlp.router for l in model.decoder.layers)] == \
        RouterReplay.global_router_replay_instances
    with pytest.raises(RoutingReplayError, match="another \\(rebuilt\\) model"):
        with stale.recording(0):
            pass
    stale.close()

    replay = RoutingReplay.from_model("R2", model, st)
    mon = RoutingMonitor(model)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (4, 12), generator=g).to(st.device)
    mbs = [tokens[:2], tokens[2:]]
    T, k = 2 * 12, cfg.moe_router_topk

    # old-log-prob pass: record (replay) and capture (monitor) the same forward
    old_logits = []
    for i, x in enumerate(mbs):
        with torch.no_grad(), replay.recording(i), mon.capture(("old", i)):
            old_logits.append(forward_logits(model, x))
        rec = replay.routes(i)
        assert [tuple(r.shape) for r in rec] == [(T, k)] * 2
        assert all(_set_equal(a, b) for a, b in zip(rec, mon.routes(("old", i))))
        s = mon.stats(("old", i))
        assert s.tokens_per_expert.sum(1).tolist() == [T * k] * 2 and s.num_tokens.tolist() == [T] * 2
    with pytest.raises(RoutingReplayError, match="already recorded"):
        with replay.recording(0):
            pass

    # same weights: replayed forward == normal forward, logits and gradients bit for bit
    model.zero_grad()
    _loss(forward_logits(model, mbs[0]), mbs[0], cfg.vocab_size).backward()
    ref_grads = _grads(model)
    model.zero_grad()
    with replay.replaying(0):
        logits = forward_logits(model, mbs[0])
    assert torch.equal(logits, old_logits[0])
    _loss(logits, mbs[0], cfg.vocab_size).backward()
    got = _grads(model)
    assert got.keys() == ref_grads.keys() and all(torch.equal(got[n], ref_grads[n]) for n in got)
    with pytest.raises(RoutingReplayError, match="already consumed"):
        with replay.replaying(0):
            pass
    with pytest.raises(RoutingReplayError, match=r"\[1\] were stored but not replayed"):
        replay.finish_pass()
    with replay.replaying(1), torch.no_grad():
        forward_logits(model, mbs[1])
    replay.finish_pass()

    # an optimizer step moves the routing
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    model.zero_grad()
    for x in mbs:
        _loss(forward_logits(model, x), x, cfg.vocab_size).backward()
    opt.step()

    plain, replayed = RoutingStats.zeros(2, 4, k), RoutingStats.zeros(2, 4, k)
    for i, x in enumerate(mbs):
        with torch.no_grad(), mon.capture(("new", i), compare_to=("old", i), store=True):
            forward_logits(model, x)
        plain = plain + mon.stats(("new", i))
        # offline comparison of the stored routes agrees with the on-the-fly counts
        off = mon.change_fraction(("old", i), ("new", i))
        assert torch.equal(off.changed, mon.stats(("new", i)).changed)
    assert plain.compared.tolist() == [2 * T * k] * 2
    assert plain.changed.sum() > 0, "the optimizer step did not change any routing; raise the LR"

    model.zero_grad()
    for i, x in enumerate(mbs):
        with replay.replaying(i), mon.capture(("replay", i), compare_to=replay.routes(i)):
            loss = _loss(forward_logits(model, x), x, cfg.vocab_size)
        loss.backward()
        replayed = replayed + mon.stats(("replay", i))
    assert replayed.compared.tolist() == [2 * T * k] * 2
    assert replayed.changed.tolist() == [0.0, 0.0]
    assert replayed.summary()["moe/routing_change_frac"] == 0.0 and plain.summary()["moe/routing_change_frac"] > 0
    # with the aux loss off, the router's gradient can only come through the replayed probabilities
    for layer in model.decoder.layers:
        assert layer.mlp.router.weight.grad.abs().sum() > 0
        assert sum(p.grad.abs().sum() for n, p in layer.mlp.experts.named_parameters()) > 0

    # every recorded route consumed; clearing resets megatron's per-layer state
    replay.finish_step()
    assert replay.recorded_ids == []
    for inst in RouterReplay.global_router_replay_instances:
        assert inst.recorded_topk_idx is None and inst.target_topk_idx is None
        assert inst.replay_backward_list == [] and inst.router_replay_action is None
    # finish_step raises when a recorded micro-batch was not replayed
    with torch.no_grad(), replay.recording("a"):
        forward_logits(model, mbs[0])
    with pytest.raises(RoutingReplayError, match="not replayed"):
        replay.finish_step()
    replay.reset()


def test_monitor_without_replay_matches_megatron_aux_loss(single_rank):
    """GSPO-style: no replay; the monitor's aux loss equals megatron's tracked load_balancing_loss."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_gspo.model.gpt import build_model, forward_logits

    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss")
    st = single_rank(cfg, ParallelConfig(device="cpu", seed=9))
    model = build_model(cfg, ParallelConfig(device="cpu", seed=9), st, routing_replay=False)
    with pytest.raises(RoutingReplayError, match="routing_replay=True"):
        RoutingReplay.from_model("R2", model, st)
    assert RoutingReplay.from_model("off", model, st).mode == "off"
    mon = RoutingMonitor(model)
    x = torch.randint(0, cfg.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1)).to(st.device)
    moe_utils.clear_aux_losses_tracker()
    with mon.capture("train"):
        loss = _loss(forward_logits(model, x), x, cfg.vocab_size)  # grad on: megatron applies+tracks the aux loss
    tracked = moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    ours = mon.stats("train").aux_loss()
    assert tracked.shape == (2,) and (tracked > 0).all()
    torch.testing.assert_close(ours, tracked.double(), rtol=1e-5, atol=0)
    moe_utils.clear_aux_losses_tracker()


def test_r2_replay_inside_activation_recompute(single_rank, monkeypatch):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_gspo.model.gpt import build_model, forward_logits

    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=0.0, recompute_granularity="full",
                                   recompute_method="uniform", recompute_num_layers=1)
    st = single_rank(cfg, ParallelConfig(device="cpu", seed=7))
    model = build_model(cfg, ParallelConfig(device="cpu", seed=7), st, routing_replay=True)
    assert model.config.recompute_granularity == "full"
    replay = RoutingReplay.from_model("R2", model, st)
    assert replay.recompute
    mon = RoutingMonitor(model)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)).to(st.device)
    T, k = 32, cfg.moe_router_topk

    with torch.no_grad(), replay.recording(0):
        forward_logits(model, x)
    rec = replay.routes(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    _loss(forward_logits(model, x), x, cfg.vocab_size).backward()  # no replay pending: plain recompute
    opt.step()
    with torch.no_grad(), mon.capture("moved", compare_to=rec):
        forward_logits(model, x)
    assert mon.stats("moved").changed.sum() > 0

    # replayed forward + backward recompute under REPLAY_BACKWARD
    model.zero_grad()
    with replay.replaying(0), mon.capture("fwd", compare_to=rec):
        loss = _loss(forward_logits(model, x), x, cfg.vocab_size)
    assert replay.pending_backward == 1
    assert [len(i.replay_backward_list) for i in RouterReplay.global_router_replay_instances] == [1, 1]
    with mon.capture("bwd", compare_to=rec), replay.backward_replay():
        loss.backward()
    assert mon.last_calls == [1, 1], "the routers did not run in the backward recompute"
    assert mon.stats("bwd").compared.tolist() == [T * k] * 2 and mon.stats("bwd").changed.tolist() == [0, 0]
    assert mon.stats("fwd").changed.tolist() == [0, 0]
    assert replay.pending_backward == 0 and replay.last_backward_recomputed_layers == [0, 1]
    assert [len(i.replay_backward_list) for i in RouterReplay.global_router_replay_instances] == [0, 0]
    g_recompute = _grads(model)
    replay.finish_pass()

    # the same replayed step without recompute gives the same gradients
    model.config.recompute_granularity = None
    try:
        model.zero_grad()
        with replay.replaying(0):
            loss = _loss(forward_logits(model, x), x, cfg.vocab_size)
        with replay.backward_replay():  # nothing is recomputed: the queued routes are dropped
            loss.backward()
        assert replay.last_backward_recomputed_layers == []
    finally:
        model.config.recompute_granularity = "full"
    g_plain = _grads(model)
    assert g_plain.keys() == g_recompute.keys()
    for n in g_plain:
        torch.testing.assert_close(g_recompute[n], g_plain[n], rtol=1e-5, atol=1e-7, msg=n)
    replay.finish_pass()

    # a backward recompute without backward_replay() is caught (it would route afresh)
    with replay.replaying(0):
        loss = _loss(forward_logits(model, x), x, cfg.vocab_size)
    with pytest.raises(RoutingReplayError, match="backward_replay"):
        loss.backward()
    with pytest.raises(RoutingReplayError, match="backward did not run"):
        replay.finish_step()
    replay.reset()
    assert [len(i.replay_backward_list) for i in RouterReplay.global_router_replay_instances] == [0, 0]


def test_r3_routes_from_generation_replay_exactly(single_rank):
    generation = pytest.importorskip("megatron_gspo.generation.generator")
    from megatron_gspo.model.gpt import build_model, forward_logits
    from megatron_gspo.routing import RolloutRecorder

    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=0.0)
    st = single_rank(cfg, ParallelConfig(device="cpu", seed=3))
    model = build_model(cfg, ParallelConfig(device="cpu", seed=3), st, routing_replay=True)
    replay = RoutingReplay.from_model("R3", model, st)
    rec, mon = RolloutRecorder(model), RoutingMonitor(model)
    gcfg = generation.GenerationConfig(max_new_tokens=6, n_samples_per_prompt=2, temperature=1.0,
                                       stop_token_ids=list(range(40)), seed=11)
    with rec.recording():
        out = generation.generate(model, [[50, 61, 72, 83, 94], [100, 111], [45, 46, 47]], gcfg,
                                  vocab_size=cfg.vocab_size, state=st, on_forward=rec.on_forward)
    plen, rlen = out.prompt_lengths, out.response_lengths
    assert len(rec.steps) == int(rlen.max())  # prefill + (longest response - 1) decode forwards
    # decode steps hold the rows still generating (finished rows leave the batch: compaction)
    assert rec.steps[0].shape == (2, 6, 5, 2) and all(s.shape[::2] == (2, 1) and s.shape[3] == 2 for s in rec.steps[1:])
    assert min(s.shape[1] for s in rec.steps[1:]) < 6, "want the decode batch to shrink (rows named by on_forward)"
    assert int(rlen.min()) < int(rlen.max()), "want ragged responses to exercise the finished-row masks"
    routes = rec.finish(out)  # asserts n - 1 routes per row
    assert routes.count.tolist() == (plen + rlen - 1).tolist()

    S = out.tokens.shape[1]
    n = plen + rlen
    for mb, rows in enumerate([[0, 1, 2], [3, 4, 5]]):
        x = out.tokens[rows, :-1]  # training input: the last token of each row needs no route
        mb_routes = routes.routes_for(rows, S - 1)
        replay.load(mb, mb_routes)
        # the generator's (KV-cache) routes are the routes of a plain training forward, position by position
        with torch.no_grad(), mon.capture(("plain", mb)):
            forward_logits(model, x)
        plain = RolloutRoutes.from_router_layout(mon.routes(("plain", mb)), len(rows))
        for l in range(cfg.num_layers):
            for i, r in enumerate(rows):
                m = int(n[r]) - 1
                changed, compared = change_counts(mb_routes[l, i, :m], plain[l, i, :m], 4)
                assert (int(changed), int(compared)) == (0, 2 * m)
        with replay.replaying(mb), mon.capture(("replay", mb), compare_to=replay.routes(mb)):
            forward_logits(model, x)
        assert mon.stats(("replay", mb)).changed.tolist() == [0, 0]
        assert mon.stats(("replay", mb)).compared.tolist() == [3 * (S - 1) * 2] * 2
    # routes for the full tokens (S columns) replayed on the S - 1 column input: refused, not silently misaligned
    replay.load("bad", routes.routes_for([0, 1, 2], S))
    with pytest.raises(RoutingReplayError, match=f"replayed routes have {3 * S} tokens, the router sees {3 * (S - 1)}"):
        with replay.replaying("bad"), torch.no_grad():
            forward_logits(model, out.tokens[[0, 1, 2], :-1])
    replay.finish_step()


# ------------------------------------------------------------------------------------------------
# EP=2 and TP=2 + sequence parallel (+ recompute), one torchrun call
# ------------------------------------------------------------------------------------------------


def _checks(stdout):
    out = {}
    for m in re.finditer(r"CHECK (\S+) rank(\d) (\S+) (-?(?:\d+\.\d+(?:e[-+]?\d+)?|nan|inf))", stdout):
        out[(m.group(1), int(m.group(2)), m.group(3))] = float(m.group(4))
    return out


def test_replay_under_ep2_and_tp2_sequence_parallel(run_dist):
    p = run_dist("routing_dist.py", 2, timeout=240)
    c = _checks(p.stdout)
    for rank in (0, 1):
        for phase in ("ep2", "tp2sp"):
            get = lambda name: c[(phase, rank, name)]  # noqa: E731
            assert get("replay_changed") == 0 and get("replay_compared") > 0
            assert get("plain_changed") > 0
            assert get("router_grad") > 0 and get("expert_grad") > 0
            assert get("load_sum") == get("tokens") * 2
            assert get("reduced_tokens") == 2 * get("tokens")  # both ranks hold distinct tokens
            assert get("consumed_ok") == 1
        # EP: each rank routes its own 2 x 16 tokens; TP+SP: this rank's half of the sequence
        assert c[("ep2", rank, "tokens")] == 2 * 16
        assert c[("tp2sp", rank, "tokens")] == 2 * 16 // 2
        assert c[("tp2sp", rank, "bwd_changed")] == 0 and c[("tp2sp", rank, "bwd_calls")] == 2
        assert c[("tp2sp", rank, "load_layout_equal")] == 1 and c[("tp2sp", rank, "load_replay_changed")] == 0


def test_megatron_internals_are_checked_with_a_clear_error(monkeypatch):
    """The RouterReplay internals routing replay drives are checked against the installed megatron:
    a missing one is named (with the tested version), not met deep inside a forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_gspo.routing import common

    common._checked_classes.cache_clear()  # the check runs once per process: again here
    monkeypatch.delattr(RouterReplay, "set_replay_data")
    with pytest.raises(RoutingReplayError, match=r"lacks \['RouterReplay.set_replay_data'\].*tested with megatron-core 0.16"):
        common.megatron_api()
    inst = type("Instance", (), {"router_replay_action": None, "target_topk_idx": None})()
    monkeypatch.undo()
    common._checked_classes.cache_clear()
    with pytest.raises(RoutingReplayError, match=r"RouterReplay\(\)\.replay_backward_list"):
        common.megatron_api(inst)
