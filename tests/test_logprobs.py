"""The chunked vocab-parallel log-prob/entropy function against a full-vocab reference."""

import re
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_gspo.model.logprobs import vocab_parallel_logprobs


# bf16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of itself
BF16_U = 2.0 ** -8


def reference(x, tgt, V, T=1.0):
    ls = torch.log_softmax(x[..., :V].double() / T, dim=-1)
    return ls.gather(-1, tgt[..., None]).squeeze(-1), -(ls.exp() * ls).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("T", [1.0, 0.6])
def test_tp1_values_and_grads(chunk, T):
    g = torch.Generator().manual_seed(1)
    V, Vp = 50, 64  # 14 padded columns must not enter the softmax
    x = (3 * torch.randn(4, 7, Vp, generator=g)).requires_grad_()
    tgt = torch.randint(0, V, (4, 7), generator=g)
    lp, h = vocab_parallel_logprobs(x, tgt, V, temperature=T, chunk_tokens=chunk)
    assert lp.dtype == torch.float32 and lp.shape == (4, 7)
    xr = x.detach().double().requires_grad_()
    rlp, rh = reference(xr, tgt, V, T)
    assert torch.allclose(lp.double(), rlp, atol=1e-5) and torch.allclose(h.double(), rh, atol=1e-5)
    w1, w2 = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    ((lp * w1).sum() + (h * w2).sum()).backward()
    ((rlp * w1).sum() + (rh * w2).sum()).backward()
    assert torch.allclose(x.grad.double(), xr.grad, atol=1e-5)
    assert x.grad[..., V:].abs().max() == 0  # padded columns get no gradient


@pytest.mark.parametrize("used", ["logp", "entropy"])
def test_one_output_used_and_with_entropy_false(used):
    """Each backward branch alone (the other output's gradient is None), and with_entropy=False
    (the old-log-prob pass) gives the same log-probs and gradient as with the entropy."""
    g = torch.Generator().manual_seed(3)
    V, Vp = 30, 32
    x = (2 * torch.randn(3, 5, Vp, generator=g)).requires_grad_()
    tgt = torch.randint(0, V, (3, 5), generator=g)
    w = torch.randn(3, 5, generator=g)
    lp, h = vocab_parallel_logprobs(x, tgt, V, temperature=0.8, chunk_tokens=4)
    ((lp if used == "logp" else h) * w).sum().backward()
    xr = x.detach().double().requires_grad_()
    rlp, rh = reference(xr, tgt, V, 0.8)
    ((rlp if used == "logp" else rh) * w).sum().backward()
    assert torch.allclose(x.grad.double(), xr.grad, atol=1e-5)
    if used == "logp":
        x2 = x.detach().clone().requires_grad_()
        lp2, h2 = vocab_parallel_logprobs(x2, tgt, V, temperature=0.8, chunk_tokens=4, with_entropy=False)
        (lp2 * w).sum().backward()
        assert h2 is None and torch.equal(lp2, lp) and torch.allclose(x2.grad, x.grad, atol=1e-6)


def test_only_logp_used_and_bf16_input():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, 40, generator=g).bfloat16().requires_grad_()
    tgt = torch.randint(0, 40, (2, 9), generator=g)
    lp, _ = vocab_parallel_logprobs(x, tgt, 40, chunk_tokens=5)
    lp.sum().backward()  # entropy unused: its gradient path is skipped, logp's still exact
    xr = x.detach().double().requires_grad_()
    rlp, _ = reference(xr, tgt, 40)
    rlp.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert torch.allclose(lp.double(), rlp, atol=1e-5)
    # the fp32 gradient rounded to bf16 once: within half a bf16 spacing of the exact value, 2^-8 relative
    # (entries here are 1e-4 .. 1; an absolute 1e-2 would pass a 40 % error on a typical 0.025 entry)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=BF16_U, atol=1e-7)


def test_shape_and_temperature_errors():
    with pytest.raises(ValueError, match=r"logits \(2, 3, 8\) and target \(2, 4\)"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vocab_parallel_logprobs(torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.long), 8, temperature=0)


def test_tp2_matches_full_vocab(run_dist):
    p = run_dist("logprobs_tp.py", 2)
    assert p.stdout.count("'grad'") == 2


_MEM_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    from megatron_gspo.model.logprobs import vocab_parallel_logprobs
    mode = sys.argv[1]
    torch.manual_seed(0)
    V, N = 151936, 1024
    logits = torch.empty(N, V, dtype=torch.bfloat16).normal_()
    tgt = torch.randint(0, V, (N,))
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    try:
        # reset the high-water mark to the current RSS: what the setup above touched and freed
        # must not hide the measured allocation (ru_maxrss alone understated it by 0.3 GB once)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base, peak = status("VmRSS:"), lambda: status("VmHWM:")
    except OSError:  # not Linux: the process's high-water mark so far
        maxrss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
        base, peak = maxrss(), maxrss
    if mode == "naive":
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tgt[:, None])
    else:
        lp, h = vocab_parallel_logprobs(logits, tgt, V)
    print(peak() - base)
""")


@pytest.mark.slow
def test_chunked_peak_memory_is_bounded():
    """Vocab 151936, 1024 tokens of bf16 logits (311 MB): the naive fp32 log-softmax allocates
    >= 2 x 622 MB on top; the chunked path at most a few 64 MiB chunks."""
    def peak(mode):
        out = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip().splitlines()[-1])

    naive, chunked = peak("naive"), peak("chunked")
    assert naive > 1.0e9, naive
    assert chunked < 0.25 * naive, (chunked, naive)


# ----------------------------------------------------------------------------------------------
# Fused output layer (fused_logprobs.py): hidden states + weight in, vocabulary chunks
# ----------------------------------------------------------------------------------------------

from megatron_gspo.model.fused_logprobs import output_layer_logprobs, vocab_chunk  # noqa: E402


def _hidden_weight(dtype=torch.float32, seed=4, n=(3, 7), h=16, vp=64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n, h, generator=g).to(dtype)
    weight = (torch.randn(vp, h, generator=g) / 2).to(dtype)
    return hidden, weight, g


@pytest.mark.parametrize("chunk_rows", [16, 32, 1000])
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("T", [1.0, 0.6])
def test_fused_values_and_grads(chunk_rows, keep, T):
    """Several vocabulary chunks (the last one holding the 14 padded rows), logits kept or recomputed:
    log-probs, entropy and the gradients of hidden states and weight equal a float64 reference of
    log_softmax(hidden @ W^T / T) over the real vocabulary; padded rows get no gradient."""
    V = 50
    hidden, weight, g = _hidden_weight()
    tgt = torch.randint(0, V, (3, 7), generator=g)
    w1, w2 = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = output_layer_logprobs(h, w, tgt, V, temperature=T, chunk_bytes=chunk_rows * 4 * 21,
                                    keep_logits_bytes=1 << 30 if keep else 0)
    assert vocab_chunk(21, 64, chunk_rows * 4 * 21) == min(chunk_rows, 64)
    assert lp.dtype == torch.float32 and lp.shape == (3, 7) and ent.shape == (3, 7)
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    rlp, rh = reference(hr @ wr.t(), tgt, V, T)
    ((rlp * w1).sum() + (rh * w2).sum()).backward()
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.double(), rh, rtol=0, atol=2e-6)
    torch.testing.assert_close(h.grad.double(), hr.grad, rtol=0, atol=5e-6)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=0, atol=5e-6)
    assert w.grad[V:].abs().max() == 0


@pytest.mark.parametrize("used", ["logp", "entropy"])
def test_fused_one_output_used_and_equal_to_the_logits_path(used):
    """Each backward branch alone; and the fused function gives what vocab_parallel_logprobs gives on
    the full logits F.linear(hidden, W), with_entropy=False included."""
    V = 60
    hidden, weight, g = _hidden_weight(seed=5)
    tgt = torch.randint(0, V, (3, 7), generator=g)
    w = torch.randn(3, 7, generator=g)
    outs = {}
    for path in ("fused", "logits"):
        h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if path == "fused":
            lp, ent = output_layer_logprobs(h, wt, tgt, V, temperature=0.8, chunk_bytes=16 * 4 * 21)
        else:
            lp, ent = vocab_parallel_logprobs(torch.nn.functional.linear(h, wt), tgt, V, temperature=0.8)
        ((lp if used == "logp" else ent) * w).sum().backward()
        outs[path] = (lp.detach(), ent.detach(), h.grad, wt.grad)
    for a, b in zip(outs["fused"], outs["logits"]):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    lp2, ent2 = output_layer_logprobs(hidden, weight, tgt, V, temperature=0.8, with_entropy=False)
    assert ent2 is None and torch.allclose(lp2, outs["logits"][0], atol=2e-6)


def test_fused_bf16_equals_the_logits_path_in_bf16():
    """bf16 hidden states and weight: the chunk logits are the bf16 output layer's (as the generator
    sees them), the math fp32: log-probs equal the logits path's; gradients within bf16 rounding,
    the weight's in bf16 and the hidden states' summed over chunks in fp32.

    "Within bf16 rounding" of a gradient entry that sums terms of both signs is measured against the sum
    of the terms' magnitudes (the error bound of a rounded dot product), not against the entry. Both paths
    compute the same fp32 logit gradient from the same bf16 logits and round it to bf16 alike; then the
    fused path rounds each vocabulary chunk's product to bf16 (<= u = 2^-8 of the terms) and both paths
    their result (<= u each): |fused - logits| <= 3 u (|dL/dlogits| @ |W|) for the hidden states, checked
    at 4 u; the weight's rows are the same products on both paths, rounded once each: 2 u (|dL/dlogits|^T @ |h|).
    (The former rtol 1e-2 on the weight passed a weight gradient 0.75 % off everywhere.)"""
    V = 60
    hidden, weight, g = _hidden_weight(torch.bfloat16, seed=6, n=(4, 9), h=32)
    tgt = torch.randint(0, V, (4, 9), generator=g)
    w1 = torch.randn(4, 9, generator=g)
    # the terms' magnitudes, from the exact (float64) gradient of the logits
    z = (hidden.double() @ weight.double().t()).requires_grad_()
    (reference(z, tgt, V)[0] * w1).sum().backward()
    dz = z.grad.abs().reshape(-1, weight.shape[0])
    scale_h = (dz @ weight.double().abs()).reshape(hidden.shape)
    scale_w = dz.t() @ hidden.double().abs().reshape(dz.shape[0], -1)
    res = {}
    for path in ("fused", "logits"):
        h, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if path == "fused":
            lp, ent = output_layer_logprobs(h, wt, tgt, V, chunk_bytes=16 * 4 * 36, keep_logits_bytes=0)
        else:
            lp, ent = vocab_parallel_logprobs(torch.nn.functional.linear(h, wt), tgt, V)
        (lp * w1).sum().backward()
        res[path] = (lp.detach(), ent.detach(), h.grad, wt.grad)
    f, l = res["fused"], res["logits"]
    assert f[2].dtype == f[3].dtype == torch.bfloat16
    torch.testing.assert_close(f[0], l[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(f[1], l[1], rtol=0, atol=2e-6)
    err_h = (f[2].double() - l[2].double()).abs() / (BF16_U * scale_h)
    err_w = (f[3].double() - l[3].double()).abs() / (BF16_U * scale_w).clamp(min=1e-30)
    assert err_h.max() <= 4, f"hidden-state gradients {err_h.max():.2f} u x the terms' magnitude apart (> 4)"
    assert err_w.max() <= 2, f"weight gradients {err_w.max():.2f} u x the terms' magnitude apart (> 2)"


def test_fused_shape_errors():
    with pytest.raises(ValueError, match=r"hidden \(2, 3, 8\) and target \(2, 4\)"):
        output_layer_logprobs(torch.zeros(2, 3, 8), torch.zeros(16, 8), torch.zeros(2, 4, dtype=torch.long), 16)
    with pytest.raises(ValueError, match=r"weight \(16, 4\) does not match hidden size 8"):
        output_layer_logprobs(torch.zeros(2, 3, 8), torch.zeros(16, 4), torch.zeros(2, 3, dtype=torch.long), 16)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_forward_logprobs_equals_the_logits_path_on_the_model(single_rank, tied):
    """model.forward_logprobs (the trainer's, the old-log-prob pass's and SFT's path) against
    vocab_parallel_logprobs(forward_logits(...)) on the tiny MoE model with a padding mask and the
    MoE aux loss on: same log-probs and entropy, same gradient of every parameter (router included:
    the aux loss and the padding mask reach megatron unchanged)."""
    from megatron_gspo.config import ParallelConfig, model_config_from_preset
    from megatron_gspo.model.gpt import build_model, forward_logits, forward_logprobs, input_padding_mask

    cfg = model_config_from_preset("tiny", vocab_size=100, moe_aux_loss_coeff=1e-2,
                                   untie_embeddings_and_output_weights=not tied)
    st = single_rank(cfg, ParallelConfig(device="cpu", seed=3))
    m = build_model(cfg, ParallelConfig(device="cpu", seed=3), st)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 100, (3, 11), generator=g).to(st.device)
    pad = input_padding_mask(torch.tensor([11, 7, 9], device=st.device), 10)
    w1, w2 = torch.randn(3, 10, generator=g).to(st.device), torch.randn(3, 10, generator=g).to(st.device)
    res = {}
    for path in ("logits", "fused"):
        m.zero_grad(set_to_none=True)
        if path == "fused":
            lp, ent = forward_logprobs(m, tok[:, :-1], tok[:, 1:], 100, temperature=0.7, padding_mask=pad)
        else:
            lp, ent = vocab_parallel_logprobs(forward_logits(m, tok[:, :-1], padding_mask=pad), tok[:, 1:], 100,
                                              temperature=0.7)
        ((lp * w1).sum() + (ent * w2).sum()).backward()
        res[path] = (lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    (lf, ef, gf), (ll, el, gl) = res["fused"], res["logits"]
    torch.testing.assert_close(lf, ll, rtol=0, atol=2e-6)
    torch.testing.assert_close(ef, el, rtol=0, atol=2e-6)
    assert set(gf) == set(gl) and any("router" in n for n in gf)
    for n in gl:
        torch.testing.assert_close(gf[n], gl[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow
def test_fused_peak_memory_of_forward_and_backward():
    """Vocabulary 151936, 2048 fp32 tokens, output layer + log-probs + entropy + backward: the logits
    path holds [N, V] logits and their gradient (2 x 1.2 GB); the fused path a few 64 MiB chunks."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.logprob_memory", "--tokens", "2048"],
                         capture_output=True, text=True, check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    peaks = dict(re.findall(r"^(\w+)\s+peak\s+([\d.]+) MiB", out.stdout, re.M))
    logits, fused = float(peaks["logits"]), float(peaks["fused"])
    assert logits > 2000, out.stdout
    assert fused < 0.25 * logits, out.stdout
