"""SAPO, CISPO, GMPO and LUSPO against independent float64 references written from their papers' formulas.

Each reference below is the paper's objective transcribed literally, one sequence and one token at a
time in float64 (explicit loops, products of ratios rather than sums of logs, the papers' min / clip /
stop-gradient), with none of losses.py's helpers. The loss functions run in float64 on the same
inputs; values and gradients (autograd through each side's own formula) must agree to float64
rounding, on random batches and on hand-made edge batches: empty responses, one-token responses,
all advantages zero, extreme ratios (inside and beyond the log-ratio bound), per-token advantages.
"""

import math

import pytest
import torch

from megatron_gspo.config import LossConfig
from megatron_gspo.config.losses import clip_range
from megatron_gspo.algorithms.losses import (
    SAPO_GATED_WEIGHT,
    batch_normalizer,
    cispo_loss,
    compute_policy_loss,
    gmpo_loss,
    gspo_loss,
    luspo_loss,
    sapo_loss,
)
from megatron_gspo.runtime.metrics import reduce_metrics

F64 = torch.float64


def _adv(adv, i, t):
    return adv[i] if adv.dim() == 1 else adv[i, t]


def _tokens(mask, i):
    return [t for t in range(mask.shape[1]) if bool(mask[i, t])]


def _seq_adv(adv, mask, i):
    """A sequence's advantage: itself, or the mean of a per-token advantage over the response."""
    if adv.dim() == 1:
        return adv[i]
    ts = _tokens(mask, i)
    return sum(adv[i, t] for t in ts) / len(ts)


# ----------------------------------------------------------------------------------------------
# The papers' objectives, literally (J; the loss is -J)
# ----------------------------------------------------------------------------------------------


def ref_sapo(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """arXiv 2511.20347: J = (1/G) sum_i (1/|y_i|) sum_t f_it(r_it) A_it, f(x) = (4/tau) sigmoid(tau (x - 1)),
    tau = tau_pos if A_it > 0 else tau_neg."""
    seqs = []
    for i in range(logp.shape[0]):
        ts = _tokens(mask, i)
        if not ts:
            continue
        total = 0.0
        for t in ts:
            a = _adv(adv, i, t)
            r = torch.exp(logp[i, t] - old[i, t])
            tau = tau_pos if a > 0 else tau_neg
            total = total + (4.0 / tau) * torch.sigmoid(tau * (r - 1.0)) * a
        seqs.append(total / len(ts))
    return sum(seqs) / len(seqs) if seqs else logp.sum() * 0


def ref_cispo(logp, old, adv, mask, eps_low=1.0, eps_high=4.0):
    """arXiv 2506.13585 eq. (4): J = (1 / sum_i |o_i|) sum_i sum_t sg(r^_it) A_it log pi(o_it),
    r^ = clip(r, 1 - eps_low, 1 + eps_high)."""
    total, n = 0.0, 0
    for i in range(logp.shape[0]):
        for t in _tokens(mask, i):
            r = torch.exp(logp[i, t] - old[i, t]).detach()
            r_hat = min(max(float(r), 1.0 - eps_low), 1.0 + eps_high)
            total = total + r_hat * _adv(adv, i, t) * logp[i, t]
            n += 1
    return total / n if n else logp.sum() * 0


def ref_gmpo(logp, old, adv, mask, eps=0.4):
    """arXiv 2507.20673: J = (1/G) sum_i (prod_t min[w_it^s, clip(w_it^s, e^-eps, e^eps)]^s)^(1/|o_i|) A_i,
    s = sgn(A_i), w_it the token ratio."""
    lo, hi = math.exp(-eps), math.exp(eps)
    seqs = []
    for i in range(logp.shape[0]):
        ts = _tokens(mask, i)
        if not ts:
            continue
        a = _seq_adv(adv, mask, i)
        s = float(torch.sign(torch.as_tensor(a)))
        prod = torch.ones((), dtype=F64)
        for t in ts:
            x = torch.exp(logp[i, t] - old[i, t]) ** s
            prod = prod * torch.minimum(x, x.clamp(lo, hi)) ** s
        seqs.append(prod ** (1.0 / len(ts)) * a)
    return sum(seqs) / len(seqs) if seqs else logp.sum() * 0


def ref_gspo_sequence(logp, old, adv, mask, i, eps_low, eps_high):
    """min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), s_i = (prod_t w_it)^(1/|y_i|) (GSPO eq. 7)."""
    ts = _tokens(mask, i)
    prod = torch.ones((), dtype=F64)
    for t in ts:
        prod = prod * torch.exp(logp[i, t] - old[i, t])
    s = prod ** (1.0 / len(ts))
    a = _seq_adv(adv, mask, i)
    return torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)


def ref_luspo(logp, old, adv, mask, eps_low=2e-3, eps_high=2.5e-3):
    """arXiv 2602.05261: J = (1/G) sum_i |y_i| min(s_i A_i, clip(s_i, 1 - eps_l, 1 + eps_h) A_i)."""
    seqs = [len(_tokens(mask, i)) * ref_gspo_sequence(logp, old, adv, mask, i, eps_low, eps_high)
            for i in range(logp.shape[0]) if _tokens(mask, i)]
    return sum(seqs) / len(seqs) if seqs else logp.sum() * 0


REFERENCES = {"sapo": ref_sapo, "cispo": ref_cispo, "gmpo": ref_gmpo, "luspo": ref_luspo}
LOSSES = {"sapo": sapo_loss, "cispo": cispo_loss, "gmpo": gmpo_loss, "luspo": luspo_loss}


def value_and_grad(fn, logp, *args, **kwargs):
    lp = logp.detach().clone().requires_grad_(True)
    out = fn(lp, *args, **kwargs)
    loss = out[0] if isinstance(out, tuple) else -out  # the references return J; the losses return -J
    (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach(), (torch.zeros_like(lp) if g is None else g)


def assert_matches_reference(name, logp, old, adv, mask, ref_kwargs=None, loss_kwargs=None, rtol=1e-10, atol=1e-12):
    want_v, want_g = value_and_grad(REFERENCES[name], logp, old, adv, mask, **(ref_kwargs or {}))
    got_v, got_g = value_and_grad(LOSSES[name], logp, old, adv, mask, **(loss_kwargs or {}))
    torch.testing.assert_close(got_v, want_v, rtol=rtol, atol=atol)
    torch.testing.assert_close(got_g, want_g, rtol=rtol, atol=atol)
    return got_v, got_g


def random_batch(seed, B=8, T=16, scale=0.3, adv_per_token=False, min_len=1):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 4 - 0.05
    logp = old + scale * torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.randint(min_len, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn((B, T) if adv_per_token else (B,), generator=g, dtype=F64)
    return logp, old, adv, mask


# ----------------------------------------------------------------------------------------------
# Random batches: far enough off-policy that every clip / gate branch is exercised
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(REFERENCES))
def test_random_batches_match_the_paper_formula(name, seed):
    # GMPO and LUSPO are per-sequence-advantage objectives; SAPO and CISPO take per-token advantages too
    per_token = name in ("sapo", "cispo") and seed % 2 == 1
    scale = {"sapo": 1.0, "cispo": 1.0, "gmpo": 0.4, "luspo": 0.004}[name]  # each around its own clip range
    logp, old, adv, mask = random_batch(seed, scale=scale, adv_per_token=per_token)
    assert_matches_reference(name, logp, old, adv, mask)


def test_the_random_batches_exercise_the_clip_and_gate_branches():
    """The seeds above are not all-inside-the-range cases that any PPO-like loss would pass."""
    seen = {}
    for name, scale in (("sapo", 1.0), ("cispo", 1.0), ("gmpo", 0.4), ("luspo", 0.004)):
        fracs = []
        for seed in range(4):
            logp, old, adv, mask = random_batch(seed, scale=scale)
            m = reduce_metrics(LOSSES[name](logp, old, adv, mask)[1])
            fracs.append(m["clip_frac_low"] + m["clip_frac_high"])
        seen[name] = max(fracs)
    assert all(0.02 < f < 0.9 for f in seen.values()), seen


@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.28), (0.5, 1.0), (1.0, 0.5)])
def test_cispo_truncation_ranges(eps_low, eps_high):
    logp, old, adv, mask = random_batch(7, scale=1.0)
    assert_matches_reference("cispo", logp, old, adv, mask, dict(eps_low=eps_low, eps_high=eps_high),
                             dict(clip_ratio_low=eps_low, clip_ratio_high=eps_high))


@pytest.mark.parametrize("eps", [0.1, 0.4, 1.0])
def test_gmpo_clip_widths(eps):
    logp, old, adv, mask = random_batch(8, scale=0.6)
    assert_matches_reference("gmpo", logp, old, adv, mask, dict(eps=eps), dict(clip_ratio_low=eps, clip_ratio_high=eps))


@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 2.0), (3.0, 3.0)])
def test_sapo_temperatures(taus):
    logp, old, adv, mask = random_batch(9, scale=1.0, adv_per_token=True)
    assert_matches_reference("sapo", logp, old, adv, mask, dict(tau_pos=taus[0], tau_neg=taus[1]),
                             dict(tau_pos=taus[0], tau_neg=taus[1]))


# ----------------------------------------------------------------------------------------------
# Edge batches
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(REFERENCES))
def test_empty_responses_are_ignored_and_an_empty_batch_is_zero(name):
    logp, old, adv, mask = random_batch(3, B=6, T=5, scale=0.3)
    mask[1] = False
    mask[4] = False
    adv[1] = 50.0  # an empty row's advantage must not count anywhere
    v, g = assert_matches_reference(name, logp, old, adv, mask)
    assert (g[1] == 0).all() and (g[4] == 0).all()
    norm = batch_normalizer(LossConfig(name=name), mask)
    assert float(norm) == (4.0 if name != "cispo" else float(mask.sum()))
    # nothing to train on: zero loss and zero gradient, not 0/0
    v, g = value_and_grad(LOSSES[name], logp, old, adv, torch.zeros_like(mask))
    assert v.item() == 0.0 and torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("name", list(REFERENCES))
def test_one_token_responses(name):
    logp, old, adv, mask = random_batch(4, B=8, T=3, scale=0.5)
    mask[:] = False
    mask[:, 0] = True
    assert_matches_reference(name, logp, old, adv, mask)


def test_one_token_luspo_is_gspo_and_lengths_scale_luspo():
    """|y_i| = 1 everywhere: LUSPO's length factor is 1, so it is GSPO with the same range, value and
    gradient; with lengths 1 and 3, LUSPO's per-sequence gradient is GSPO's times the length."""
    logp, old, adv, mask = random_batch(5, B=4, T=3, scale=1e-3)
    mask[:] = False
    mask[:, 0] = True
    kw = dict(clip_ratio_low=2e-3, clip_ratio_high=2.5e-3)
    lv, lg = value_and_grad(luspo_loss, logp, old, adv, mask)
    gv, gg = value_and_grad(gspo_loss, logp, old, adv, mask, **kw)
    torch.testing.assert_close(lv, gv, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(lg, gg, rtol=1e-12, atol=1e-15)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    lv, lg = value_and_grad(luspo_loss, logp[:2], old[:2], adv[:2], mask)
    gv, gg = value_and_grad(gspo_loss, logp[:2], old[:2], adv[:2], mask, **kw)
    torch.testing.assert_close(lg, gg * torch.tensor([[1.0], [3.0]], dtype=F64), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", list(REFERENCES))
def test_all_advantages_zero_give_zero_loss_and_gradient(name):
    logp, old, adv, mask = random_batch(6, scale=0.5)
    adv = torch.zeros_like(adv)
    v, g = assert_matches_reference(name, logp, old, adv, mask)
    assert v.item() == 0.0 and torch.equal(g, torch.zeros_like(g))


def _extreme_batch(bound_excess=False):
    """Log-ratios of +-15 (ratio 3.3e6 / 3e-7: inside the default bound 20), or +-35 (beyond it)."""
    x = 35.0 if bound_excess else 15.0
    old = torch.full((4, 3), -2.0, dtype=F64)
    logp = old + torch.tensor([[x, 0.1, -0.1], [-x, 0.2, 0.0], [x, -x, 0.3], [0.05, x, x]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, -0.5, 2.0], dtype=F64)
    return logp, old, adv, mask


@pytest.mark.parametrize("name", list(REFERENCES))
def test_extreme_ratios_inside_the_bound_match(name):
    logp, old, adv, mask = _extreme_batch()
    assert_matches_reference(name, logp, old, adv, mask)


@pytest.mark.parametrize("name", list(REFERENCES))
def test_extreme_ratios_beyond_the_bound(name):
    """|log-ratio| = 35 > log_ratio_bound = 20: the losses evaluate the formula at the bounded
    log-ratio (the reference, fed with old log-probs moved to within the bound of the current ones,
    gives the same value: the formulas read logp - old_logp only, CISPO's logp itself) and stay finite
    in float32 as in float64. Beyond the bound a token's ratio is constant: SAPO / GMPO / LUSPO pass no
    gradient through it, CISPO (whose ratio is a detached weight anyway) still trains the token."""
    logp, old, adv, mask = _extreme_batch(bound_excess=True)
    lr = torch.where(mask, logp - old, 0.0)
    if name == "luspo":  # GSPO's ratio bounds the sequence's mean log-ratio, not each token's
        mean = lr.sum(1, keepdim=True) / mask.sum(1, keepdim=True)
        out = (mean.abs() > 20).expand_as(mask)
        old_within = logp - lr * (mean.clamp(-20, 20) / mean)
    else:
        out = lr.abs() > 20
        old_within = logp - lr.clamp(-20, 20)
    assert (out & mask).any()
    want_v, _ = value_and_grad(REFERENCES[name], logp, old_within, adv, mask)
    got_v, got_g = value_and_grad(LOSSES[name], logp, old, adv, mask)
    torch.testing.assert_close(got_v, want_v, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(got_g).all()
    if name == "cispo":
        assert (got_g[out & mask] != 0).all()
    else:
        assert (got_g[out & mask] == 0).all()
    v32, g32 = value_and_grad(LOSSES[name], logp.float(), old.float(), adv.float(), mask)
    assert torch.isfinite(v32) and torch.isfinite(g32).all()
    torch.testing.assert_close(v32.double(), got_v, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Properties the papers state, checked directly
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("taus", [(1.0, 1.05), (4.0, 4.0)])
def test_sapo_gradient_is_the_gated_policy_gradient(taus):
    """SAPO's gradient per token: -(1/N)(1/|y_i|) w_it r_it A_it with w = 4 sigma (1 - sigma),
    sigma = sigmoid(tau (r - 1)): 1 at r = 1, smaller as r leaves 1 on either side; gate metrics match.
    Below r = 1 the gate's argument is at least -tau, so at the paper's temperatures the weight stays
    above 4 sigma(-1.05) (1 - sigma(-1.05)) = 0.78 and only r > 1 can be gated below 1/2; hotter
    gates (tau = 4) cut both sides."""
    tau_pos, tau_neg = taus
    logp, old, adv, mask = random_batch(10, B=6, T=8, scale=2.0)
    _, g = value_and_grad(sapo_loss, logp, old, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg)
    r = torch.exp(logp - old)
    tau = torch.where(adv[:, None] > 0, torch.tensor(tau_pos, dtype=F64), torch.tensor(tau_neg, dtype=F64))
    sig = torch.sigmoid(tau * (r - 1))
    w = 4 * sig * (1 - sig)
    lengths = mask.sum(1, keepdim=True).to(F64)
    want = torch.where(mask, -w * r * adv[:, None] / lengths / mask.any(1).sum(), 0.0)
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-14)
    m = reduce_metrics(sapo_loss(logp, old, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg)[1])
    gated = (w < SAPO_GATED_WEIGHT) & mask
    assert m["clip_frac_high"] == pytest.approx(float((gated & (r > 1)).sum() / mask.sum()))
    assert m["clip_frac_low"] == pytest.approx(float((gated & (r < 1)).sum() / mask.sum()))
    assert m["clip_frac_high"] > 0 and (m["clip_frac_low"] > 0) == (tau_neg > 2)
    assert m["gate/weight_mean"] == pytest.approx(float(w[mask].mean()))
    assert m["gate/weight_min"] == pytest.approx(float(w[mask].min()))


@pytest.mark.parametrize("name", list(REFERENCES))
def test_on_policy_every_loss_is_the_policy_gradient_and_clips_nothing(name):
    """At ratio 1 (the first minibatch of a step) no clip or gate is active and each gradient is the
    plain policy gradient -A grad log pi with the loss's own weights: SAPO / GMPO 1/(N |y_i|), CISPO
    1/(number of tokens), LUSPO 1/N (a token sum per sequence)."""
    logp, old, adv, mask = random_batch(11, B=6, T=7)
    old = logp.clone()
    loss, metrics = LOSSES[name](logp.clone().requires_grad_(True), old, adv, mask)
    _, g = value_and_grad(LOSSES[name], logp, old, adv, mask)
    lengths = mask.sum(1, keepdim=True).to(F64)
    n = float(mask.any(1).sum())
    weight = {"sapo": 1 / (n * lengths), "gmpo": 1 / (n * lengths), "luspo": torch.full_like(lengths, 1 / n),
              "cispo": torch.full_like(lengths, 1 / float(mask.sum()))}[name]
    torch.testing.assert_close(g, torch.where(mask, -adv[:, None] * weight, 0.0), rtol=1e-12, atol=1e-15)
    m = reduce_metrics(metrics)
    assert m["clip_frac_low"] == 0 and m["clip_frac_high"] == 0


def test_cispo_keeps_a_gradient_where_ppo_clipping_drops_it():
    """A token far above the range with A > 0: GRPO-style clipping zeroes it, CISPO keeps it with the
    truncated weight 1 + eps_high (MiniMax-M1's motivation: rare reflective tokens keep learning)."""
    old = torch.tensor([[-3.0, -1.0]], dtype=F64)
    logp = torch.tensor([[-3.0 + math.log(8.0), -1.0]], dtype=F64)  # ratios 8 and 1
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, g = value_and_grad(cispo_loss, logp, old, torch.tensor([1.0], dtype=F64), mask)
    torch.testing.assert_close(g, torch.tensor([[-5.0 / 2, -1.0 / 2]], dtype=F64))  # weights min(8, 5) and 1
    m = reduce_metrics(cispo_loss(logp, old, torch.tensor([1.0], dtype=F64), mask)[1])
    assert m["clip_frac_high"] == 0.5 and m["clip_frac_low"] == 0.0


def test_gmpo_clips_tokens_before_the_mean_one_sided_by_the_advantage_sign():
    """Log-ratios [0.6, -0.6, 0]: with A > 0 only the first token is clipped (to 0.4: zero gradient),
    with A < 0 only the second (to -0.4); the sequence ratio is exp of the clipped mean."""
    old = torch.zeros(1, 3, dtype=F64)
    logp = torch.tensor([[0.6, -0.6, 0.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    for a, clipped, free in ((1.0, 0, [1, 2]), (-1.0, 1, [0, 2])):
        v, g = value_and_grad(gmpo_loss, logp, old, torch.tensor([a], dtype=F64), mask)
        lr = [0.4 if (a > 0 and k == 0) else -0.4 if (a < 0 and k == 1) else x for k, x in enumerate([0.6, -0.6, 0.0])]
        ratio = math.exp(sum(lr) / 3)
        assert v.item() == pytest.approx(-a * ratio, rel=1e-12)
        assert g[0, clipped] == 0
        torch.testing.assert_close(g[0, free], torch.full((2,), -a * ratio / 3, dtype=F64))


def test_config_defaults_are_the_papers():
    assert clip_range(LossConfig(name="cispo")) == (1.0, 4.0)
    assert clip_range(LossConfig(name="gmpo")) == (0.4, 0.4)
    assert clip_range(LossConfig(name="luspo")) == (2e-3, 2.5e-3)
    sapo = LossConfig(name="sapo")
    assert clip_range(sapo) is None and (sapo.sapo_tau_pos, sapo.sapo_tau_neg) == (1.0, 1.05)
    # compute_policy_loss hands each loss its config (float32 path here, as in the trainer)
    logp, old, adv, mask = random_batch(12, scale=0.5)
    for name, fn in LOSSES.items():
        got, _ = compute_policy_loss(LossConfig(name=name), logp.float(), old.float(), adv.float(), mask)
        want, _ = fn(logp.float(), old.float(), adv.float(), mask)
        assert torch.equal(got, want), name
    got, _ = compute_policy_loss(LossConfig(name="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0), logp, old, adv, mask)
    torch.testing.assert_close(got, -ref_sapo(logp, old, adv, mask, 2.0, 3.0), rtol=1e-10, atol=1e-12)
