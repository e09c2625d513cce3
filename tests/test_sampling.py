"""Token sampling (megatron_gspo.generation.sampling): the draw's distribution, and counter-based noise that
depends on (seed, row key, position) only, never on the batch it is drawn in.

Layout independence of whole rollouts (TP / EP / DP give the same tokens) is tested end to end in
tests/test_layouts.py; here the primitives: hand-checkable properties and distributions."""


import pytest
import torch

from megatron_gspo.generation.sampling import counter_uniform, mix32, sample_tokens


def test_mix32_matches_reference_lowbias32():
    # Chris Wellons' lowbias32 computed with plain Python integers (mod 2**32)
    def ref(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF]
    assert [mix32(x) for x in xs] == [ref(x) for x in xs]
    got = mix32(torch.tensor(xs, dtype=torch.long)).tolist()  # the int64-tensor path: no overflow
    assert got == [ref(x) for x in xs]


def test_counter_noise_is_a_function_of_its_keys_alone():
    rows = torch.tensor([7, 3, 1_000_000_007, 2**40 + 5])
    u = counter_uniform(11, rows, 4)
    assert u.shape == (4,) and u.dtype == torch.float64
    assert float(u.min()) > 0 and float(u.max()) < 1
    # a row's noise does not depend on the other rows, their order or the batch size
    assert torch.equal(counter_uniform(11, rows[2:3], 4)[0], u[2])
    assert torch.equal(counter_uniform(11, rows.flip(0), 4), u.flip(0))
    # every key matters
    for other in (counter_uniform(12, rows, 4), counter_uniform(11, rows, 5), counter_uniform(11, rows + 1, 4)):
        assert not (other == u).any()
    # the high word of a 64-bit key matters too
    assert not torch.equal(counter_uniform(11, torch.tensor([5]), 0), counter_uniform(11, torch.tensor([2**40 + 5]), 0))


def test_counter_noise_takes_a_position_per_row():
    """Rows at different response positions (a refilled decode batch): a [b] tensor of positions gives each
    row the bits of its own int position, and a per-row ``allowed`` [b, V] restricts each row's draw only."""
    rows = torch.tensor([0, 5, 3, 2**40 + 7])
    pos = torch.tensor([0, 17, 2**31 + 3, 4])
    got = counter_uniform(11, rows, pos)
    want = torch.stack([counter_uniform(11, rows[i:i + 1], int(pos[i]))[0] for i in range(4)])
    assert torch.equal(got, want)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    allowed = torch.ones(4, 50, dtype=torch.bool)
    allowed[1, :] = False
    allowed[1, 7] = True  # row 1 may draw token 7 only; the others anything
    tok, lp = sample_tokens(logits, 1.0, uniform=got, allowed=allowed)
    free, free_lp = sample_tokens(logits, 1.0, uniform=got)
    assert tok[1] == 7 and torch.equal(tok[[0, 2, 3]], free[[0, 2, 3]]) and torch.equal(lp[[0, 2, 3]], free_lp[[0, 2, 3]])


def test_counter_noise_is_uniform_and_uncorrelated():
    u = counter_uniform(3, torch.arange(500_000), 0)
    assert abs(u.mean().item() - 0.5) < 2e-3
    assert abs(u.var().item() - 1 / 12) < 1e-3
    hist = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 50, chi2  # 19 degrees of freedom: P(chi2 > 50) ~ 1e-4 for uniform draws
    # the low bits are random too (53 bits, not 32 stretched): the fine structure inside one bin
    fine = torch.histc((u * 2**20).frac(), bins=20, min=0, max=1)
    assert float(((fine - expected) ** 2 / expected).sum()) < 50
    # neighbouring rows and positions are not correlated
    for a, b in ((u[:-1], u[1:]), (u, counter_uniform(3, torch.arange(500_000), 1))):
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(corr) < 0.01, corr


def test_sample_tokens_distribution_and_recorded_logprobs():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40000
    logits = p.log().expand(n, 4).contiguous()
    noise = lambda pos: counter_uniform(0, torch.arange(n), pos)  # noqa: E731
    tok, lp = sample_tokens(logits, 1.0, top_p=0.7, uniform=noise(0))
    counts = torch.bincount(tok, minlength=4).float() / n
    assert counts[2:].sum() == 0  # nucleus {0, 1}: 0.5 + 0.3 >= 0.7
    assert abs(counts[0] - 0.5 / 0.8) < 0.01 and abs(counts[1] - 0.3 / 0.8) < 0.01
    torch.testing.assert_close(lp, p.log()[tok], rtol=0, atol=1e-6)  # the unfiltered policy's log-prob

    tok, _ = sample_tokens(logits, 1.0, top_k=3, uniform=noise(1))
    counts = torch.bincount(tok, minlength=4).float() / n
    assert counts[3] == 0 and abs(counts[0] - 0.5 / 0.95) < 0.01

    tok, lp = sample_tokens(logits, 2.0, uniform=noise(2))
    want = torch.log_softmax(p.log() / 2, -1)
    torch.testing.assert_close(lp, want[tok], rtol=0, atol=1e-6)
    counts = torch.bincount(tok, minlength=4).float() / n
    assert (counts - want.exp()).abs().max() < 0.01

    tok, lp = sample_tokens(logits[:3], 0.0)  # greedy: argmax, temperature-1 log-prob
    assert tok.tolist() == [0, 0, 0]
    torch.testing.assert_close(lp, p.log()[:1].expand(3), rtol=0, atol=1e-6)

    a = sample_tokens(logits, 1.0, uniform=noise(3))[0]
    assert torch.equal(a, sample_tokens(logits, 1.0, uniform=noise(3))[0])


def test_inverse_cdf_draw_by_hand():
    # cdf of [0.1, 0, 0.6, 0.3] = [0.1, 0.1, 0.7, 1.0]: u picks the first token whose cdf exceeds it
    logits = torch.tensor([0.1, 0.0, 0.6, 0.3]).log().expand(6, 4)
    u = torch.tensor([1e-9, 0.0999, 0.1001, 0.6999, 0.7001, 1 - 1e-12], dtype=torch.float64)
    tok, _ = sample_tokens(logits, 1.0, uniform=u)
    assert tok.tolist() == [0, 0, 2, 2, 3, 3]  # never token 1 (probability 0), never out of range
    # a forbidden token (allowed=False) gets an empty interval
    allowed = torch.tensor([True, True, True, False])
    tok, lp = sample_tokens(logits, 1.0, uniform=u, allowed=allowed)
    assert tok.tolist() == [0, 0, 0, 2, 2, 2]  # renormalized: cdf [1/7, 1/7, 1, 1], 0.1001 < 1/7
    torch.testing.assert_close(lp, torch.tensor([0.1, 0.1, 0.1, 0.6, 0.6, 0.6]).log())  # unrestricted log-probs
    with pytest.raises(ValueError, match="one number per row"):
        sample_tokens(logits, 1.0, uniform=torch.rand(6, 4))


@pytest.mark.parametrize("bad", [(-1, 0), (0, -1)])
def test_counter_noise_refuses_negative_keys(bad):
    with pytest.raises(ValueError, match="must be >= 0"):
        counter_uniform(bad[0], torch.arange(2), bad[1])


def _sample_tokens_before_issue_23(logits, temperature, top_k=0, top_p=1.0, uniform=None, allowed=None):
    """The sampler as it was (a materialized log-softmax, a separate temperature copy): the reference
    the current one must draw the same tokens as, for the same noise."""
    from megatron_gspo.generation.sampling import filter_top_k_top_p

    x = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(x, dim=-1)
        tok = (x if allowed is None else x.masked_fill(~allowed, float("-inf"))).argmax(dim=-1)
    else:
        x = x / temperature
        logp = torch.log_softmax(x, dim=-1)
        if allowed is not None:
            x = x.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(filter_top_k_top_p(x, top_k, top_p), dim=-1)
        cdf = probs.double().cumsum(dim=-1)
        tok = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


@pytest.mark.parametrize("V", [100, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.0),
                                     dict(temperature=0.9, top_k=40), dict(temperature=1.0, top_p=0.9),
                                     dict(temperature=0.8, top_k=50, top_p=0.95), dict(temperature=1.0, allowed=True)],
                         ids=["T1", "T0.7", "greedy", "topk", "topp", "topk-topp", "allowed"])
def test_same_tokens_as_before_for_the_same_noise(V, dtype, setting):
    """Draw for draw, the current sampler picks the tokens the pre-issue-23 one picks (same noise, same
    logits, fp32 and bf16 logits, every filter), and records the same log-probs to fp32 rounding;
    the caller's logits are left untouched."""
    b = 16 if V > 1000 else 512
    kw = dict(setting)
    g = torch.Generator().manual_seed(V + len(kw))
    logits = (torch.randn(b, V, generator=g) * 3).to(dtype)
    before = logits.clone()
    if kw.pop("allowed", False):
        kw["allowed"] = torch.rand(V, generator=g) > 0.3
    for pos in range(3):
        u = counter_uniform(9, torch.arange(b), pos)
        want_tok, want_lp = _sample_tokens_before_issue_23(logits, uniform=u, **kw)
        tok, lp = sample_tokens(logits, uniform=u, **kw)
        assert torch.equal(tok, want_tok)
        torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-4 if V > 1000 else 2e-6)
        # the old log-softmax drifted up to ~5e-5 from float64 at V=151936; x[tok] - logsumexp stays close
        x = logits.double() / (kw["temperature"] or 1.0)
        exact = torch.log_softmax(x, -1).gather(-1, tok[:, None]).squeeze(-1)
        assert (lp.double() - exact).abs().max() < 1e-5
    assert torch.equal(logits, before)
