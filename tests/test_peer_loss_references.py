"""VESPO, DPPO (binary TV / binary KL) and the MaxRL advantage against float64 references of their formulas.

Each reference is the paper's objective transcribed literally, one sequence and one token at a time in float64
(explicit loops, products of ratios rather than sums of logs), with none of losses.py's helpers; values and
gradients (autograd through each side) must agree to float64 rounding, on hand-sized batches whose numbers are
worked out below and on random batches far enough off-policy that every mask and weight branch is taken. Where a
peer ships the loss as code that is not installed here (prime-rl's DPPO-TV + KL default loss, SkyRL's DPPO), its
per-token formula as that code states it is transcribed too (the peers' own conventions: prime-rl sums a
sequence's tokens and divides by all tokens; SkyRL's binary KL carries 1e-8 beside 1 - p). TRL 1.16's own code
runs on the same batches in tests/test_loss_peers.py. Bad settings are refused in one line naming the key.
"""

import math

import pytest
import torch

from megatron_gspo.algorithms.advantages import maxrl_advantages
from megatron_gspo.algorithms.losses import compute_policy_loss, dppo_kl_loss, dppo_tv_loss, vespo_loss
from megatron_gspo.config import ConfigError, LossConfig, load_job_config
from megatron_gspo.config.losses import clip_range
from megatron_gspo.runtime.metrics import reduce_metrics

F64 = torch.float64


def _tokens(mask, i):
    return [t for t in range(mask.shape[1]) if bool(mask[i, t])]


def _adv(adv, i, t):
    return adv[i] if adv.dim() == 1 else adv[i, t]


# ----------------------------------------------------------------------------------------------
# The papers' objectives, literally (J; the loss is -J)
# ----------------------------------------------------------------------------------------------


def ref_vespo(logp, old, adv, mask, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0, is_w=None):
    """arXiv 2602.10693 (as TRL 1.16 computes it): J = (1 / sum_i |y_i|) sum_i sum_t sg[phi(w_i)] A_it log pi(y_it),
    phi(w) = e^lambda w^k e^(-lambda w), w_i = prod_t pi(y_it) / pi_old(y_it) (times the token IS weights),
    bounded to [1e-8, e^20]; (k, lambda) by the sign of A (>= 0: the _pos pair)."""
    total, n = 0.0, 0
    for i in range(logp.shape[0]):
        ts = _tokens(mask, i)
        w = 1.0
        for t in ts:
            w = w * math.exp(float(logp[i, t] - old[i, t]))
            if is_w is not None:
                w = w * max(float(is_w[i, t]), 1e-8)
        w = min(max(w, 1e-8), math.exp(20.0))
        for t in ts:
            a = _adv(adv, i, t)
            k, lam = (k_pos, lambda_pos) if a >= 0 else (k_neg, lambda_neg)
            phi = math.exp(lam) * w ** k * math.exp(-lam * w)
            total = total + phi * a * logp[i, t]
            n += 1
    return total / n if n else logp.sum() * 0


def binary_kl(mu, p):
    """KL(Bernoulli(mu) || Bernoulli(p)), exactly."""
    return mu * math.log(mu / p) + (1 - mu) * math.log((1 - mu) / (1 - p))


def ref_dppo(logp, old, adv, mask, divergence="tv", delta_low=None, delta_high=None, tau=0.0):
    """arXiv 2602.04879 eqs. 13 / 14: J = (1 / tokens) sum_it [M_it r_it A_it] - tau (log r_it)^2; M_it = 0 where
    the token's probability moved past delta in the direction its advantage pushes (TV: |p - p_old|; KL: the
    binary KL of (p_old, p)), else 1."""
    d = 0.2 if divergence == "tv" else 0.05
    delta_low, delta_high = delta_low or d, delta_high or d
    total, n = 0.0, 0
    for i in range(logp.shape[0]):
        for t in _tokens(mask, i):
            a = float(_adv(adv, i, t))
            p, mu = math.exp(float(logp[i, t])), math.exp(float(old[i, t]))
            div = (p - mu) if divergence == "tv" else binary_kl(mu, p) * (1 if p > mu else -1)
            if divergence == "tv":
                masked = (a > 0 and p - mu > delta_high) or (a < 0 and mu - p > delta_low)
            else:
                masked = (a > 0 and p > mu and abs(div) > delta_high) or (a < 0 and p < mu and abs(div) > delta_low)
            r = torch.exp(logp[i, t] - old[i, t])
            if not masked:
                total = total + r * a
            total = total - tau * (logp[i, t] - old[i, t]) ** 2
            n += 1
    return total / n if n else logp.sum() * 0


def prime_rl_default_loss(logp, old, adv, mask, mask_low=0.2, mask_high=0.2, kl_tau=1e-3):
    """prime-rl's default RL loss (src/prime_rl/trainer/rl/loss.py default_loss_fn: DPPO-Binary-TV + Kimi-K2.5's
    squared log-ratio), its per-token formula as written there, summed over all tokens and divided by their number
    (its normalization: one global token count)."""
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    diff = (torch.exp(logp) - torch.exp(old)).detach()
    a = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    invalid = torch.where(a > 0, diff > mask_high, diff < -mask_low)
    keep = mask & ~invalid
    per_token = -(keep * a * ratio) + kl_tau * (mask * log_ratio ** 2)
    return per_token.sum() / mask.sum()


def skyrl_dppo_loss(logp, old, adv, mask, dppo_type, delta_low, delta_high):
    """SkyRL's dppo_policy_loss (skyrl/backends/skyrl_train/utils/ppo_utils.py), its formula as written there,
    token-mean reduced: -(ratio * A * M), M from the binary TV or the binary KL (1e-8 beside 1 - p)."""
    ratio = torch.exp(logp - old)
    a = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    with torch.no_grad():
        p, mu = torch.exp(logp), torch.exp(old)
        diff = p - mu
        m = torch.ones_like(a)
        if dppo_type == "binary_tv":
            m[(a > 0) & (diff > delta_high)] = 0.0
            m[(a < 0) & (-diff > delta_low)] = 0.0
        else:
            kl = mu * (old - logp) + (1 - mu) * torch.log((1 - mu + 1e-8) / (1 - p + 1e-8))
            m[(a > 0) & (diff > 0) & (kl > delta_high)] = 0.0
            m[(a < 0) & (diff < 0) & (kl > delta_low)] = 0.0
    loss = -(ratio * a * m)
    return (loss * mask).sum() / mask.sum()


def value_and_grad(fn, logp, *args, **kwargs):
    lp = logp.detach().clone().requires_grad_(True)
    out = fn(lp, *args, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach(), (torch.zeros_like(lp) if g is None else g)


def assert_matches(loss_fn, ref, logp, old, adv, mask, loss_kwargs=None, ref_kwargs=None, negate=True,
                   rtol=1e-10, atol=1e-12):
    """The loss against a reference (J when ``negate``, a loss otherwise): value and gradient."""
    want_v, want_g = value_and_grad(ref, logp, old, adv, mask, **(ref_kwargs or {}))
    if negate:
        want_v, want_g = -want_v, -want_g
    got_v, got_g = value_and_grad(loss_fn, logp, old, adv, mask, **(loss_kwargs or {}))
    torch.testing.assert_close(got_v, want_v, rtol=rtol, atol=atol)
    torch.testing.assert_close(got_g, want_g, rtol=rtol, atol=atol)
    return got_v, got_g


def random_batch(seed, B=8, T=12, scale=0.3, adv_per_token=False, prob=False):
    """Log-probs of sampled tokens: spread over (0, 1) in probability (``prob``: DPPO's masks read p itself)."""
    g = torch.Generator().manual_seed(seed)
    old = (torch.rand(B, T, generator=g, dtype=F64) * 0.9 + 0.05).log() if prob else \
        -torch.rand(B, T, generator=g, dtype=F64) * 4 - 0.05
    logp = (old + scale * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    mask = torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
    adv = torch.randn((B, T) if adv_per_token else (B,), generator=g, dtype=F64)
    return logp, old, adv, mask


def _metrics(fn, *args, **kwargs):
    return {k: float(v) for k, v in reduce_metrics(fn(*args, **kwargs)[1]).items() if not k.endswith("/hist")}


# ----------------------------------------------------------------------------------------------
# VESPO
# ----------------------------------------------------------------------------------------------


def test_vespo_hand_sized():
    """Row 0: log-ratios 0.1, -0.3, 0.2 sum to 0, w = 1, phi(1) = e^3 e^-3 = 1, A = 1 >= 0. Row 1: log-ratios
    ln 2 and 0 (one pad), w = 2, A = -1 < 0: phi = e^2 2^3 e^-4 = 8 e^-2. The loss is -(1/5) sum phi A log pi,
    its gradient -phi A / 5 on each token."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]], dtype=F64)
    logp = old + torch.tensor([[0.1, -0.3, 0.2], [math.log(2.0), 0.0, 9.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    phi1 = 8 * math.exp(-2)
    want = -(1.0 * (-0.9 - 2.3 - 0.3) + phi1 * -1.0 * (logp[1, 0].item() + -0.7)) / 5
    v, g = value_and_grad(vespo_loss, logp, old, adv, mask)
    assert v.item() == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(g, torch.tensor([[-0.2, -0.2, -0.2], [phi1 / 5, phi1 / 5, 0.0]], dtype=F64))
    m = _metrics(vespo_loss, logp, old, adv, mask)
    assert m["vespo/phi_max"] == pytest.approx(phi1) and m["vespo/phi_min"] == pytest.approx(1.0)
    assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0  # phi >= 1/2 everywhere
    # w = 1 / 8: phi_neg = e^2 8^-3 e^-0.25 = 0.011 < 1/2, below 1: clipped low on both tokens of the row
    logp2 = logp.clone()
    logp2[1, 0] = old[1, 0] - math.log(8.0)
    m = _metrics(vespo_loss, logp2, old, adv, mask)
    assert m["clip_frac_low"] == pytest.approx(2 / 5) and m["clip_frac_high"] == 0.0
    assert m["vespo/phi_min"] == pytest.approx(math.exp(2) * 8.0 ** -3 * math.exp(-2 / 8))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("params", [{}, dict(k_pos=1.0, lambda_pos=1.5, k_neg=4.0, lambda_neg=5.0)])
def test_vespo_random_batches_match_the_formula(seed, params):
    logp, old, adv, mask = random_batch(seed, scale=0.3, adv_per_token=seed % 2 == 1)
    assert_matches(vespo_loss, ref_vespo, logp, old, adv, mask, params, params)


def test_the_random_batches_exercise_every_branch():
    """The seeds above are not all-inside cases: VESPO's weight cuts sequences on both sides of w = 1, DPPO masks
    tokens on both sides, on some seeds, and never everything."""
    seen = {}
    for name, fn, kw in (("vespo", vespo_loss, dict(scale=0.3)), ("dppo_tv", dppo_tv_loss, dict(scale=0.6, prob=True)),
                         ("dppo_kl", dppo_kl_loss, dict(scale=0.6, prob=True))):
        ms = [_metrics(fn, *random_batch(seed, **kw)) for seed in range(4)]
        seen[name] = (max(m["clip_frac_low"] for m in ms), max(m["clip_frac_high"] for m in ms))
        assert all(m["clip_frac_low"] + m["clip_frac_high"] < 0.6 for m in ms), name
    assert all(0.02 < lo and 0.02 < hi for lo, hi in seen.values()), seen


def test_vespo_token_weights_join_the_sequence_weight_and_sequence_weights_multiply():
    """TRL's rule: token IS weights enter w (each bounded below by 1e-8: a masked token's 0 makes w tiny, not 0);
    a weight per response multiplies its terms."""
    logp, old, adv, mask = random_batch(5, scale=0.1)
    g = torch.Generator().manual_seed(1)
    w_tok = torch.where(torch.rand(logp.shape, generator=g) < 0.1, 0.0, 0.5 + torch.rand(logp.shape, generator=g))
    w_tok = w_tok.to(F64)
    assert_matches(vespo_loss, ref_vespo, logp, old, adv, mask, dict(is_weights=w_tok), dict(is_w=w_tok))
    w_seq = torch.linspace(0.0, 2.0, logp.shape[0], dtype=F64)
    v, g = value_and_grad(vespo_loss, logp, old, adv, mask, is_weights=w_seq)
    _, g1 = value_and_grad(vespo_loss, logp, old, adv, mask)
    torch.testing.assert_close(g, g1 * w_seq[:, None], rtol=1e-12, atol=1e-15)


def test_vespo_on_policy_is_the_token_mean_policy_gradient():
    logp, old, adv, mask = random_batch(6)
    _, g = value_and_grad(vespo_loss, logp, logp.clone(), adv, mask)
    torch.testing.assert_close(g, torch.where(mask, -adv[:, None] / mask.sum(), 0.0), rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------------------------
# DPPO
# ----------------------------------------------------------------------------------------------


def _dppo_hand_batch():
    """p_old = 0.5 everywhere; p per token: 0.8 (+0.3), 0.6 (+0.1), 0.2 (-0.3), 0.9 (+0.4)."""
    old = torch.full((2, 2), math.log(0.5), dtype=F64)
    logp = torch.tensor([[0.8, 0.6], [0.2, 0.9]], dtype=F64).log()
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    return logp, old, adv, mask


def test_dppo_tv_hand_sized():
    """A > 0: +0.3 > 0.2 is masked, +0.1 kept (ratio 1.2); A < 0: -0.3 is masked, +0.4 (the other way) kept (ratio
    1.8). loss = -(1.2 - 1.8) / 4; each kept token's gradient is -A r / 4."""
    logp, old, adv, mask = _dppo_hand_batch()
    v, g = value_and_grad(dppo_tv_loss, logp, old, adv, mask)
    assert v.item() == pytest.approx(-(1.2 - 1.8) / 4, rel=1e-12)
    torch.testing.assert_close(g, torch.tensor([[0.0, -1.2 / 4], [0.0, 1.8 / 4]], dtype=F64))
    m = _metrics(dppo_tv_loss, logp, old, adv, mask)
    assert (m["clip_frac_low"], m["clip_frac_high"]) == (0.25, 0.25)
    assert (m["ratio_out_low_frac"], m["ratio_out_high_frac"]) == (0.25, 0.5)  # +0.4 is past delta too
    assert m["dppo/tv_max"] == pytest.approx(0.4)
    # Kimi-K2.5's term: + tau (log r)^2 per token, whatever the mask
    tau = 0.1
    v2, g2 = value_and_grad(dppo_tv_loss, logp, old, adv, mask, kl_tau=tau)
    lr = logp - old
    assert v2.item() == pytest.approx(v.item() + tau * float((lr ** 2).sum()) / 4, rel=1e-12)
    torch.testing.assert_close(g2, g + 2 * tau * lr / 4)


def test_dppo_kl_hand_sized():
    """Binary KL from p_old = 0.5: to 0.8 it is 0.223 (> 0.05, A > 0, rising: masked), to 0.6 0.0204 (kept),
    to 0.2 0.223 (A < 0, falling: masked), to 0.9 0.511 (rising with A < 0: kept)."""
    logp, old, adv, mask = _dppo_hand_batch()
    assert binary_kl(0.5, 0.8) == pytest.approx(0.2231, abs=1e-4) and binary_kl(0.5, 0.6) == pytest.approx(0.0204, abs=1e-4)
    v, g = value_and_grad(dppo_kl_loss, logp, old, adv, mask)
    assert v.item() == pytest.approx(-(1.2 - 1.8) / 4, rel=1e-12)
    torch.testing.assert_close(g, torch.tensor([[0.0, -1.2 / 4], [0.0, 1.8 / 4]], dtype=F64))
    m = _metrics(dppo_kl_loss, logp, old, adv, mask)
    assert (m["clip_frac_low"], m["clip_frac_high"]) == (0.25, 0.25)
    assert m["dppo/kl_max"] == pytest.approx(binary_kl(0.5, 0.9), rel=1e-6)
    # a wider KL region (0.25 / 0.25) keeps the 0.223 moves: nothing masked
    _, g = value_and_grad(dppo_kl_loss, logp, old, adv, mask, clip_ratio_low=0.25, clip_ratio_high=0.25)
    assert (g != 0).all()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("divergence, fn", [("tv", dppo_tv_loss), ("kl", dppo_kl_loss)])
def test_dppo_random_batches_match_the_formula(seed, divergence, fn):
    logp, old, adv, mask = random_batch(seed, scale=0.6, adv_per_token=seed % 2 == 1, prob=True)
    assert_matches(fn, ref_dppo, logp, old, adv, mask, ref_kwargs=dict(divergence=divergence))
    deltas = dict(clip_ratio_low=0.1, clip_ratio_high=0.3)
    assert_matches(fn, ref_dppo, logp, old, adv, mask, dict(**deltas, kl_tau=0.01),
                   dict(divergence=divergence, delta_low=0.1, delta_high=0.3, tau=0.01))


@pytest.mark.parametrize("seed", range(3))
def test_dppo_tv_with_tau_is_prime_rls_default_loss(seed):
    """prime-rl's default loss (DPPO-TV, masks 0.2 / 0.2, kl_tau 1e-3), transcribed, on the same batch."""
    logp, old, adv, mask = random_batch(seed, scale=0.6, adv_per_token=seed == 2, prob=True)
    assert_matches(dppo_tv_loss, prime_rl_default_loss, logp, old, adv, mask, dict(kl_tau=1e-3), negate=False)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dppo_type, fn, deltas", [("binary_tv", dppo_tv_loss, (0.2, 0.2)),
                                                    ("binary_kl", dppo_kl_loss, (0.05, 0.05)),
                                                    ("binary_kl", dppo_kl_loss, (0.02, 0.1))])
def test_dppo_is_skyrls(seed, dppo_type, fn, deltas):
    """SkyRL's dppo_policy_loss, transcribed, with its recommended deltas (0.2 TV, 0.05 KL) and another pair."""
    logp, old, adv, mask = random_batch(10 + seed, scale=0.6, prob=True)
    assert_matches(fn, skyrl_dppo_loss, logp, old, adv, mask, dict(clip_ratio_low=deltas[0], clip_ratio_high=deltas[1]),
                   dict(dppo_type=dppo_type, delta_low=deltas[0], delta_high=deltas[1]), negate=False)


def test_dppo_on_policy_masks_nothing():
    logp, old, adv, mask = random_batch(7, prob=True)
    for fn in (dppo_tv_loss, dppo_kl_loss):
        _, g = value_and_grad(fn, logp, logp.clone(), adv, mask)
        torch.testing.assert_close(g, torch.where(mask, -adv[:, None] / mask.sum(), 0.0), rtol=1e-12, atol=1e-15)
        m = _metrics(fn, logp, logp.clone(), adv, mask)
        assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0


# ----------------------------------------------------------------------------------------------
# MaxRL
# ----------------------------------------------------------------------------------------------


def ref_maxrl(rewards, G):
    """arXiv 2602.02710 (prime-rl's MaxRLAlgorithm.score_group): (r - mean) / mean per group; 0 if mean <= 0."""
    out = []
    for k in range(0, len(rewards), G):
        g = [float(x) for x in rewards[k:k + G]]
        mean = sum(g) / G
        out += [0.0 if mean <= 0 else (x - mean) / mean for x in g]
    return torch.tensor(out, dtype=F64)


def test_maxrl_hand_sized():
    """1 of 4 solved: mean 1/4, advantages 3, -1, -1, -1 (a hard prompt's success weighs 1 / p); 2 of 4: 1 and -1;
    none or all solved: 0."""
    r = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1], dtype=F64)
    want = torch.tensor([3, -1, -1, -1, 1, 1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0], dtype=F64)
    torch.testing.assert_close(maxrl_advantages(r, 4), want)


@pytest.mark.parametrize("seed", range(3))
def test_maxrl_random_rewards_match_the_formula_and_skyrls(seed):
    g = torch.Generator().manual_seed(seed)
    r = (torch.rand(8 * 6, generator=g) < 0.3).to(F64) * torch.rand(8 * 6, generator=g, dtype=F64)
    r[:6] = 0.0  # a group with nothing solved
    torch.testing.assert_close(maxrl_advantages(r, 6), ref_maxrl(r, 6), rtol=1e-12, atol=1e-15)
    r = (r > 0).to(F64)  # binary rewards (pass / fail), where SkyRL's epsilon is below 1e-5 relative
    got = maxrl_advantages(r, 6)
    torch.testing.assert_close(got, ref_maxrl(r, 6), rtol=1e-12, atol=1e-15)
    skyrl = []  # SkyRL's compute_maxrl_advantage: (r - mean) / (mean + 1e-6)
    for k in range(0, len(r), 6):
        mean = r[k:k + 6].mean()
        skyrl.append((r[k:k + 6] - mean) / (mean + 1e-6))
    torch.testing.assert_close(got, torch.cat(skyrl), rtol=1e-5, atol=1e-9)


def test_maxrl_negative_mean_is_zero_and_rows_are_prompt_major():
    r = torch.tensor([[-1.0, 0.5], [2.0, 0.0]])
    torch.testing.assert_close(maxrl_advantages(r, 2), torch.tensor([0.0, 0.0, 1.0, -1.0]))


# ----------------------------------------------------------------------------------------------
# Config: paper defaults, the trainer's path, refusals by key
# ----------------------------------------------------------------------------------------------


def test_config_defaults_are_the_papers_and_the_trainers_path_uses_them():
    assert clip_range(LossConfig(name="dppo_tv")) == (0.2, 0.2) and clip_range(LossConfig(name="dppo_kl")) == (0.05, 0.05)
    v = LossConfig(name="vespo")
    assert clip_range(v) is None
    assert (v.vespo_k_pos, v.vespo_lambda_pos, v.vespo_k_neg, v.vespo_lambda_neg, v.dppo_kl_tau) == (2, 3, 3, 2, 0)
    logp, old, adv, mask = random_batch(12, scale=0.3, prob=True)
    for name, fn in (("vespo", vespo_loss), ("dppo_tv", dppo_tv_loss), ("dppo_kl", dppo_kl_loss)):
        got, _ = compute_policy_loss(LossConfig(name=name), logp.float(), old.float(), adv.float(), mask)
        want, _ = fn(logp.float(), old.float(), adv.float(), mask)
        assert torch.equal(got, want), name
    got, _ = compute_policy_loss(LossConfig(name="vespo", vespo_k_neg=1.0, vespo_lambda_neg=4.0), logp, old, adv, mask)
    torch.testing.assert_close(got, -ref_vespo(logp, old, adv, mask, k_neg=1.0, lambda_neg=4.0), rtol=1e-10, atol=1e-12)
    assert load_job_config(None, ["train.advantage_estimator=maxrl"]).train.advantage_estimator == "maxrl"


@pytest.mark.parametrize("overrides, said", [
    (["loss.name=vespo", "loss.clip_ratio_low=0.1"],
     "loss.clip_ratio_low=0.1 does not apply to loss.name='vespo': VESPO has no clip range, its sequence weight is "
     "set by loss.vespo_k_* / loss.vespo_lambda_*"),
    (["loss.name=gspo", "loss.vespo_k_pos=1"],
     "loss.vespo_k_pos / loss.vespo_k_neg / loss.vespo_lambda_pos / loss.vespo_lambda_neg (1.0 / 3.0 / 3.0 / 2.0) "
     "apply to loss.name='vespo' only, got name='gspo'"),
    (["loss.name=grpo", "loss.dppo_kl_tau=0.001"],
     "loss.dppo_kl_tau applies to loss.name in ['dppo_tv', 'dppo_kl'] only, got name='grpo'"),
    (["loss.name=vespo", "loss.vespo_lambda_pos=0"], "loss.vespo_lambda_pos must be a finite number > 0, got 0.0"),
    (["loss.name=vespo", "loss.vespo_k_neg=-1"], "loss.vespo_k_neg must be a finite number >= 0, got -1.0"),
    (["loss.name=vespo", "loss.vespo_k_pos=60", "loss.vespo_lambda_pos=1e-3"],
     "loss.vespo_lambda_pos=0.001 with loss.vespo_k_pos=60.0 gives a sequence weight phi up to e^600.1, above "
     "e^44.36, the largest"),
    (["loss.name=dppo_tv", "loss.clip_ratio_high=1.5"],
     "loss.clip_ratio_high must be in (0, 1) (dppo_tv: the largest change of a token's probability), got 1.5"),
    (["loss.name=dppo_kl", "loss.clip_ratio_low=0"],
     "loss.clip_ratio_low must be a finite number > 0 (dppo_kl: a divergence threshold), got 0.0"),
    (["loss.name=dppo"], "loss.name='dppo' is not one of ['gspo', 'gspo_token', 'grpo', 'sapo', 'cispo', 'gmpo', "
                         "'luspo', 'vespo', 'dppo_tv', 'dppo_kl']"),
    (["train.advantage_estimator=max_rl"], "train.advantage_estimator='max_rl' is not one of"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_key(overrides, said):
    with pytest.raises(ConfigError) as e:
        load_job_config(None, overrides)
    msg = str(e.value)
    assert said in msg and "\n" not in msg, msg
