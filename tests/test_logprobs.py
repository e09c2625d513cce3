"""The chunked vocab-parallel log-prob/entropy function against a full-vocab reference."""

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_gspo.logprobs import vocab_parallel_logprobs


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
    assert torch.allclose(x.grad.double(), xr.grad, atol=1e-2)  # bf16 gradient storage


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
    from megatron_gspo.logprobs import vocab_parallel_logprobs
    mode = sys.argv[1]
    torch.manual_seed(0)
    V, N = 151936, 1024
    logits = torch.empty(N, V, dtype=torch.bfloat16).normal_()
    tgt = torch.randint(0, V, (N,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "naive":
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tgt[:, None])
    else:
        lp, h = vocab_parallel_logprobs(logits, tgt, V)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) * 1024)
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
