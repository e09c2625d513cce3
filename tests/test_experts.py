"""Batched experts (megatron_gspo.model.experts.BatchedSequentialMLP) == megatron's SequentialMLP.

- the grouped GEMM variants (grouped_mm, loop, padded bmm) agree with a per-expert reference,
  forward and backward, with empty experts and zero-stride incoming gradients;
- the module equals SequentialMLP (outputs and every gradient, fp32) on the same weights, with
  packed (zero-copy) and with stacked (rebound) weights, and in no-grad decode-sized calls;
- whole models: a checkpoint saved by the sequential model (megatron_gspo.checkpoint.save_model)
  loads into the batched one, same sharded keys and shapes; logits and gradients equal;
- under torchrun: EP=2 and expert-TP=2 (DDP, finalized grads), same comparison per rank, weights
  saved by the batched model (EP=2) and loaded by every other model.
"""

import dataclasses

import pytest
import torch

from megatron_gspo.checkpoint import load_model, save_model
from megatron_gspo.config import ConfigError, ParallelConfig, model_config_from_preset
from megatron_gspo.model.experts import BatchedSequentialMLP, _packed_view, grouped_linear, stacked_weights
from megatron_gspo.model.gpt import build_model, forward_logits, resolve_expert_impl

TOL = 1e-5


def _tiny(**kw):
    return model_config_from_preset("tiny", vocab_size=100, num_moe_experts=8, moe_router_topk=2, **kw)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop", "bmm"])
def test_grouped_linear_matches_per_expert_matmuls(impl):
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1, 0, 7]
    x = torch.randn(sum(counts), 16, generator=g, requires_grad=True)
    ws = [torch.randn(12, 16, generator=g, requires_grad=True) for _ in counts]
    y = grouped_linear(x, ws, counts, impl)
    # reference: one matmul per expert
    x2 = x.detach().clone().requires_grad_()
    ws2 = [w.detach().clone().requires_grad_() for w in ws]
    ref = torch.cat([xi @ w.t() for xi, w in zip(torch.split(x2, counts), ws2)])
    assert torch.allclose(y, ref, atol=1e-6)
    y.sum().backward()  # a zero-stride gradient (grouped_mm's backward refuses it unless made contiguous)
    ref.sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-6)
    for w, w2, n in zip(ws, ws2, counts):
        assert torch.allclose(w.grad, w2.grad, atol=1e-6)
        if n == 0:
            assert not w.grad.abs().any()


def test_packed_weights_are_zero_copy_and_differentiable():
    ws = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(5)]
    buf = torch.stack([w.detach() for w in ws])
    for i, w in enumerate(ws):
        w.data = buf[i]
    packed = stacked_weights(ws)
    assert packed.data_ptr() == buf.data_ptr() and torch.equal(packed, buf)
    (packed * torch.arange(5.0)[:, None, None]).sum().backward()
    for i, w in enumerate(ws):
        assert torch.equal(w.grad, torch.full((4, 3), float(i)))
    ws[2].data = ws[2].data.clone()  # rebound storage: falls back to a stacked copy
    assert _packed_view(ws) is None
    assert torch.equal(stacked_weights(ws), buf)


def _expert_modules(model):
    return [m for m in model.modules() if hasattr(m, "local_experts")]


def test_module_equals_sequential_mlp(single_rank):
    cfg = _tiny(moe_expert_impl="sequential")
    par = ParallelConfig(device="cpu")
    st = single_rank(cfg, par)
    seq = build_model(cfg, par, st)
    bat = build_model(dataclasses.replace(cfg, moe_expert_impl="batched"), par, st)
    bat.load_state_dict(seq.state_dict())
    es, eb = _expert_modules(seq)[0], _expert_modules(bat)[0]
    assert type(es).__name__ == "SequentialMLP" and isinstance(eb, BatchedSequentialMLP)
    assert _packed_view([e.linear_fc2.weight for e in eb.local_experts]) is not None
    g = torch.Generator().manual_seed(1)
    for counts in ([5, 0, 9, 1, 0, 3, 2, 0], [0] * 8, [1, 0, 0, 1, 0, 1, 0, 1]):
        n = sum(counts)
        # inputs on the model's device, as megatron's token dispatcher hands them over
        x = torch.randn(n, cfg.hidden_size, generator=g).to(st.device)
        probs = torch.rand(n, generator=g).to(st.device)
        tpe = torch.tensor(counts, device=st.device)
        for packed in (True, False):
            if not packed:  # rebind one expert's storage: the stacked-copy path
                w = eb.local_experts[3].linear_fc1.weight
                w.data = w.data.clone()
                assert _packed_view([e.linear_fc1.weight for e in eb.local_experts]) is None
            outs = []
            for mod in (es, eb):
                mod.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_()
                y, bias = mod(xi, tpe, probs)
                assert bias is None
                (y * torch.linspace(-1, 1, cfg.hidden_size, device=st.device)).sum().backward()
                with torch.no_grad():
                    y_ng, _ = mod(x, tpe, probs)
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in mod.parameters()]
                outs.append((y.detach(), y_ng, xi.grad, grads))
            (y1, n1, gx1, gw1), (y2, n2, gx2, gw2) = outs
            assert y2.shape == y1.shape == (n, cfg.hidden_size)
            assert torch.allclose(y1, y2, atol=TOL) and torch.allclose(n1, n2, atol=TOL)
            assert torch.allclose(gx1, gx2, atol=TOL)
            assert all(torch.allclose(a, b, atol=TOL) for a, b in zip(gw1, gw2))
        bat.load_state_dict(seq.state_dict())


def test_checkpoint_roundtrip_and_model_parity(single_rank, tmp_path):
    cfg = _tiny(moe_expert_impl="sequential")
    par = ParallelConfig(device="cpu")
    st = single_rank(cfg, par)
    seq = build_model(cfg, par, st)
    save_model(seq, str(tmp_path / "seq"))
    bat = build_model(dataclasses.replace(cfg, moe_expert_impl="batched"), par, st)
    # same sharded checkpoint layout: keys, global shapes
    sd_s = {k: tuple(v.global_shape) for k, v in seq.sharded_state_dict().items() if hasattr(v, "global_shape")}
    sd_b = {k: tuple(v.global_shape) for k, v in bat.sharded_state_dict().items() if hasattr(v, "global_shape")}
    assert sd_s == sd_b and any("experts" in k for k in sd_s)
    assert [n for n, _ in seq.named_parameters()] == [n for n, _ in bat.named_parameters()]
    load_model(bat, str(tmp_path / "seq"))
    for e in _expert_modules(bat):  # loading copies in place: the zero-copy layout survives
        assert _packed_view([x.linear_fc1.weight for x in e.local_experts]) is not None
    for (n, a), (_, b) in zip(seq.state_dict().items(), bat.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), n
    # (the other direction, batched -> checkpoint -> sequential, runs under EP=2 in experts_parity.py)

    tokens = torch.randint(0, cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(2)).to(st.device)
    res = []
    for m in (seq, bat):
        logits = forward_logits(m, tokens)
        (logits.float().log_softmax(-1)[..., 5].sum()).backward()
        res.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    assert (res[0][0] - res[1][0]).abs().max().item() <= TOL
    for n, g in res[0][1].items():
        assert (g - res[1][1][n]).abs().max().item() <= TOL * max(1.0, g.abs().max().item()), n


def test_expert_impl_resolution():
    assert resolve_expert_impl(_tiny(), "local") == "batched"
    assert resolve_expert_impl(_tiny(), "transformer_engine") == "te_grouped"
    assert resolve_expert_impl(_tiny(moe_expert_impl="sequential"), "local") == "sequential"
    with pytest.raises(ConfigError, match="batched"):
        resolve_expert_impl(_tiny(moe_expert_impl="batched"), "transformer_engine")
    with pytest.raises(ConfigError, match="moe_expert_impl"):
        _tiny(moe_expert_impl="nope")


def test_parallel_layouts_match_sequential(run_dist, tmp_path):
    p = run_dist("experts_parity.py", 2, "--dir", str(tmp_path), "--layouts", "ep2,etp2")
    # one line per rank and layout (two ranks may share a line of torchrun's merged stdout)
    assert p.stdout.count("PARITY ep2 rank") == 2 and p.stdout.count("PARITY etp2 rank") == 2, p.stdout
