"""Policy losses: hand-computed values, GSPO == GSPO-token, clipping, masking, numerics, config."""

import math

import pytest
import torch

from megatron_gspo.algorithms.losses import (
    POLICY_LOSSES,
    LossConfig,
    batch_normalizer,
    compute_policy_loss,
    get_policy_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
)
from megatron_gspo.config.losses import check_loss_config, clip_range
from megatron_gspo.config import JobConfig
from megatron_gspo.runtime.metrics import reduce_metrics

X = 123.0  # a value at a masked position; must never matter


def close(a, b, **kw):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), **kw)


def grad_of(loss, logp):
    (g,) = torch.autograd.grad(loss, logp)
    return g


# Two sequences of lengths 2 and 3 on a T=3 grid (row 0 has one padding slot).
#   row 0: logp - old_logp = [0.1, -0.1]        -> mean 0        -> s_0 = 1
#   row 1: logp - old_logp = [0.2, -0.3, 0.0]   -> mean -0.1/3   -> s_1 = exp(-1/30)
def small_batch():
    logp = torch.tensor([[-1.0, -2.0, X], [-0.5, -1.5, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -X], [-0.7, -1.2, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5])
    return logp, old, adv, mask


S0, S1 = 1.0, math.exp(-0.1 / 3)


# ----------------------------------------------------------------------------------------------
# GSPO by hand
# ----------------------------------------------------------------------------------------------


def test_gspo_hand_unclipped():
    logp, old, adv, mask = small_batch()
    loss, metrics = gspo_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # Both s in [0.8, 1.2]: loss = -(s0 * 1 + s1 * (-0.5)) / 2
    close(loss, -(S0 * 1.0 + S1 * -0.5) / 2)
    # d loss / d logp[i, t] = -(1/N) * A_i * s_i * (1/L_i)
    expected = torch.tensor([[-0.5 * 1.0 * S0 / 2, -0.5 * 1.0 * S0 / 2, 0.0],
                             [0.5 * 0.5 * S1 / 3, 0.5 * 0.5 * S1 / 3, 0.5 * 0.5 * S1 / 3]])
    close(grad_of(loss, logp), expected)
    r = reduce_metrics(metrics)
    close(r["seq_ratio/hist"], [S0, S1])
    close(r["seq_ratio/mean"], (S0 + S1) / 2)
    close(r["seq_ratio/min"], S1)
    close(r["seq_ratio/max"], S0)
    assert r["clip_frac_low"] == 0.0 and r["clip_frac_high"] == 0.0
    close(r["loss"], loss.item())
    close(r["response_length/mean"], 2.5)
    assert r["response_length/min"] == 2.0 and r["response_length/max"] == 3.0
    # approx KL(old||new) = mean over 5 tokens of (old - logp) = -(0.1 - 0.1 + 0.2 - 0.3 + 0) / 5
    close(r["approx_kl"], 0.1 / 5, rtol=1e-6, atol=1e-8)
    k3 = sum(math.exp(d) - 1 - d for d in (0.1, -0.1, 0.2, -0.3, 0.0)) / 5
    close(r["approx_kl_k3"], k3, rtol=1e-5, atol=1e-8)
    close(r["advantages/mean"], 0.25)
    close(r["advantages/std"], 0.75)  # population std of {1, -0.5}
    assert r["num_sequences"] == 2.0 and r["num_tokens"] == 5.0


def test_gspo_hand_paper_clip_range():
    logp, old, adv, mask = small_batch()
    loss, metrics = gspo_loss(logp, old, adv, mask)  # 3e-4 / 4e-4
    # Row 1: A < 0 and s1 = 0.967 < 1 - 3e-4 -> clipped low: obj = (1 - 3e-4) * (-0.5), no gradient.
    close(loss, -(S0 * 1.0 + (1 - 3e-4) * -0.5) / 2)
    expected = torch.tensor([[-0.25 * S0, -0.25 * S0, 0.0], [0.0, 0.0, 0.0]])
    close(grad_of(loss, logp), expected)
    r = reduce_metrics(metrics)
    assert r["clip_frac_low"] == 0.5 and r["clip_frac_high"] == 0.0  # 1 of 2 sequences
    assert r["ratio_out_low_frac"] == 0.5 and r["ratio_out_high_frac"] == 0.0


def test_gspo_token_hand_per_token_advantages():
    logp, old, _, mask = small_batch()
    adv = torch.tensor([[1.0, 3.0, X], [-1.0, 0.0, 2.0]])
    loss, _ = gspo_token_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # Every token's weight has the value of its sequence's s_i:
    #   row 0: (s0*1 + s0*3) / 2;  row 1: (-s1 + 0 + 2*s1) / 3;  loss = -(row0 + row1) / 2
    close(loss, -((S0 * 1 + S0 * 3) / 2 + (-S1 + 0 + 2 * S1) / 3) / 2)
    # d/d logp[i, t] = -(1/N)(1/L_i) * A_it * s_i
    expected = torch.tensor([[-0.5 * 0.5 * 1 * S0, -0.5 * 0.5 * 3 * S0, 0.0],
                             [-0.5 / 3 * -1 * S1, 0.0, -0.5 / 3 * 2 * S1]])
    close(grad_of(loss, logp), expected)


def test_gspo_token_clips_on_the_sequence_ratio_per_token_sign():
    logp, old, _, mask = small_batch()
    # Row 1: s1 = 0.967 < 1 - 3e-4. Token 0 has A < 0 -> clipped; token 2 has A > 0 -> not clipped.
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 2.0]])
    loss, metrics = gspo_token_loss(logp, old, adv, mask)
    lo = 1 - 3e-4
    close(loss, -((S0 + S0) / 2 + (lo * -1 + 0 + 2 * S1) / 3) / 2)
    g = grad_of(loss, logp)
    assert g[1, 0] == 0.0 and g[1, 2] != 0.0
    # Per-sequence clip fraction = fraction of the sequence's tokens clipped: row 1 -> 1/3.
    close(reduce_metrics(metrics)["clip_frac_low"], (0 + 1 / 3) / 2)


# ----------------------------------------------------------------------------------------------
# GRPO by hand
# ----------------------------------------------------------------------------------------------
# Token log-ratios: row 0 [0.1, -0.1], row 1 [0.2, -0.3, 0.0]; A = [1, -0.5]; clip 0.2 / 0.2.
#   row 0 (A > 0): r = e^0.1 = 1.105 and e^-0.1 = 0.905, both unclipped  -> obj r * 1
#   row 1 (A < 0): r = e^0.2 = 1.221 > 1.2 but A < 0 -> unclipped       -> obj -0.5 * 1.221
#                  r = e^-0.3 = 0.741 < 0.8 and A < 0 -> clipped low     -> obj -0.5 * 0.8
#                  r = 1                                                 -> obj -0.5
R = [[math.exp(0.1), math.exp(-0.1)], [math.exp(0.2), math.exp(-0.3), 1.0]]
L_TOK = [[-R[0][0], -R[0][1]], [0.5 * R[1][0], 0.5 * 0.8, 0.5 * 1.0]]  # per-token loss = -obj


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (sum(L_TOK[0]) + sum(L_TOK[1])) / 5),
        ("seq-mean-token-mean", (sum(L_TOK[0]) / 2 + sum(L_TOK[1]) / 3) / 2),
        ("seq-mean-token-sum-norm", (sum(L_TOK[0]) / 4 + sum(L_TOK[1]) / 4) / 2),
    ],
)
def test_grpo_hand_aggregation_modes(mode, expected):
    logp, old, adv, mask = small_batch()
    const = 4.0 if mode == "seq-mean-token-sum-norm" else None
    loss, metrics = grpo_loss(logp, old, adv, mask, loss_agg_mode=mode, loss_agg_norm_constant=const)
    close(loss, expected)
    close(reduce_metrics(metrics)["loss"], expected)
    # Gradient: -A * r / (unit normalization); zero for the clipped token.
    w = {
        "token-mean": [[1 / 5] * 2, [1 / 5] * 3],
        "seq-mean-token-mean": [[1 / 4] * 2, [1 / 6] * 3],
        "seq-mean-token-sum-norm": [[1 / 8] * 2, [1 / 8] * 3],
    }[mode]
    exp_g = torch.tensor([[-1.0 * R[0][0] * w[0][0], -1.0 * R[0][1] * w[0][1], 0.0],
                          [0.5 * R[1][0] * w[1][0], 0.0, 0.5 * R[1][2] * w[1][2]]])
    close(grad_of(loss, logp), exp_g)


def test_grpo_clip_fractions_count_tokens():
    logp, old, adv, mask = small_batch()
    _, metrics = grpo_loss(logp, old, adv, mask)
    r = reduce_metrics(metrics)
    assert r["clip_frac_low"] == pytest.approx(1 / 5)  # only e^-0.3 with A < 0
    assert r["clip_frac_high"] == 0.0  # e^0.2 > 1.2 but its A < 0
    assert r["ratio_out_high_frac"] == pytest.approx(1 / 5)
    assert r["ratio_out_low_frac"] == pytest.approx(1 / 5)
    close(r["token_ratio/max"], R[1][0])
    close(r["token_ratio/min"], R[1][1])
    # GRPO also reports GSPO's sequence ratio for comparison.
    close(r["seq_ratio/hist"], [S0, S1])


def test_grpo_clip_higher_and_asymmetric_range():
    logp, old, _, mask = small_batch()
    adv = torch.tensor([1.0, 1.0])
    # A > 0 everywhere: e^0.2 = 1.2214 is clipped at 1.2 with eps_high=0.2, not with 0.28.
    l1, m1 = grpo_loss(logp, old, adv, mask, clip_ratio_high=0.2)
    l2, m2 = grpo_loss(logp, old, adv, mask, clip_ratio_high=0.28)
    base = R[0][0] + R[0][1] + R[1][1] + R[1][2]
    close(l1, -(base + 1.2) / 5)
    close(l2, -(base + R[1][0]) / 5)
    assert reduce_metrics(m1)["clip_frac_high"] == pytest.approx(1 / 5)
    assert reduce_metrics(m2)["clip_frac_high"] == 0.0


def test_grpo_dual_clip():
    logp, old, adv, mask = small_batch()
    # c = 1.15: row 1 token 0 has A = -0.5 < 0 and r = 1.2214 > c -> obj = c * A = -0.575, no grad.
    loss, metrics = grpo_loss(logp, old, adv, mask, dual_clip_c=1.15)
    close(loss, (L_TOK[0][0] + L_TOK[0][1] + 0.575 + 0.4 + 0.5) / 5)
    g = grad_of(loss, logp)
    assert g[1, 0] == 0.0 and g[1, 2] != 0.0 and g[0, 0] != 0.0
    assert reduce_metrics(metrics)["dual_clip_frac"] == pytest.approx(1 / 5)
    # With c = 1.3 the ratio 1.2214 stays below c: same as no dual clip.
    close(grpo_loss(logp, old, adv, mask, dual_clip_c=1.3)[0], sum(L_TOK[0] + L_TOK[1]) / 5)


def test_grpo_k3_kl_and_entropy_by_hand():
    logp, old, adv, mask = small_batch()
    ref = torch.tensor([[-1.2, -1.7, X], [-0.5, -1.0, -1.4]])
    ent = torch.tensor([[0.5, 1.5, X], [2.0, 1.0, 0.0]])
    # d = ref - logp: [-0.2, 0.3], [0.0, 0.5, -0.4];  k3 = e^d - d - 1
    d = [[-0.2, 0.3], [0.0, 0.5, -0.4]]
    k3 = [[math.exp(x) - x - 1 for x in row] for row in d]
    kl_coef, ent_coef = 0.1, 0.01
    loss, metrics = grpo_loss(logp, old, adv, mask, ref_logp=ref, entropy=ent,
                              kl_coef=kl_coef, entropy_coef=ent_coef)
    pg = sum(L_TOK[0] + L_TOK[1]) / 5
    kl = sum(k3[0] + k3[1]) / 5
    ent_mean = (0.5 + 1.5 + 2.0 + 1.0 + 0.0) / 5
    close(loss, pg + kl_coef * kl - ent_coef * ent_mean)
    r = reduce_metrics(metrics)
    close(r["kl_ref"], kl)
    close(r["entropy"], ent_mean)
    close(r["pg_loss"], pg)
    # The KL term's gradient w.r.t. logp is kl_coef * (1 - e^d) / 5 on top of the policy term.
    g_kl = grad_of(grpo_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=kl_coef)[0], logp) - grad_of(
        grpo_loss(logp, old, adv, mask)[0], logp)
    exp_g = torch.tensor([[kl_coef * (1 - math.exp(d[0][0])) / 5, kl_coef * (1 - math.exp(d[0][1])) / 5, 0.0],
                          [kl_coef * (1 - math.exp(x)) / 5 for x in d[1]]])
    close(g_kl, exp_g, rtol=1e-5, atol=1e-7)


def test_gspo_kl_is_averaged_per_sequence():
    logp, old, adv, mask = small_batch()
    ref = torch.tensor([[-1.2, -1.7, X], [-0.5, -1.0, -1.4]])
    k3 = [[math.exp(x) - x - 1 for x in row] for row in [[-0.2, 0.3], [0.0, 0.5, -0.4]]]
    base, _ = gspo_loss(logp, old, adv, mask)
    loss, metrics = gspo_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.5)
    kl = (sum(k3[0]) / 2 + sum(k3[1]) / 3) / 2
    close(loss - base, 0.5 * kl)
    close(reduce_metrics(metrics)["kl_ref"], kl)


# ----------------------------------------------------------------------------------------------
# GSPO == GSPO-token, and GSPO == the paper's formula
# ----------------------------------------------------------------------------------------------


def random_batch(seed, B=8, T=24, tok_scale=0.02, seq_scale=2e-3, adv_per_token=False):
    """Random responses at random offsets on the grid (prompt before, padding after)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T - 3, (B,), generator=g)
    starts = (torch.rand(B, generator=g) * (T - lengths)).long()
    pos = torch.arange(T)[None]
    mask = (pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])
    logp = (torch.randn(B, T, generator=g) * 0.5 - 2.0).requires_grad_()
    # Per-sequence drift (decides clipping) plus per-token noise.
    drift = torch.randn(B, 1, generator=g) * seq_scale
    old = logp.detach() - drift - torch.randn(B, T, generator=g) * tok_scale
    adv = torch.randn(B, T, generator=g) if adv_per_token else torch.randn(B, generator=g)
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", range(8))
def test_gspo_token_equals_gspo_value_and_gradient(seed):
    logp, old, adv, mask = random_batch(seed)
    # Row 0 sits exactly on-policy (never clipped); row 1 is beyond the log-ratio bound.
    old = old.clone()
    old[0] = logp.detach()[0]
    old[1] = logp.detach()[1] - 30.0
    l_seq, m_seq = gspo_loss(logp, old, adv, mask)
    l_tok, m_tok = gspo_token_loss(logp, old, adv, mask)
    close(l_tok, l_seq, rtol=1e-6, atol=1e-7)
    g_seq, g_tok = grad_of(l_seq, logp), grad_of(l_tok, logp)
    close(g_tok, g_seq, rtol=1e-5, atol=1e-8)
    r_seq, r_tok = reduce_metrics(m_seq), reduce_metrics(m_tok)
    # The batch must exercise both clipped and unclipped sequences for the check to mean anything.
    clipped = r_seq["clip_frac_low"] + r_seq["clip_frac_high"]
    assert 0 < clipped < 1
    for k in ("clip_frac_low", "clip_frac_high", "ratio_out_low_frac", "seq_ratio/mean"):
        close(r_tok[k], r_seq[k])
    # Clipped sequences have zero gradient in both forms.
    zero_rows = (g_seq.abs().sum(dim=1) == 0)
    assert torch.equal(zero_rows, g_tok.abs().sum(dim=1) == 0)
    assert zero_rows[1]  # out of bound


@pytest.mark.parametrize("seed", range(4))
def test_gspo_matches_literal_paper_formula(seed):
    # J = mean_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i) written with torch.min / torch.clamp.
    logp, old, adv, mask = random_batch(seed)
    low, high = 3e-4, 4e-4
    m = mask.float()
    s = torch.exp(((logp - old) * m).sum(1) / m.sum(1))
    ref = -torch.min(s * adv, torch.clamp(s, 1 - low, 1 + high) * adv).mean()
    loss, _ = gspo_loss(logp, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high)
    close(loss, ref, rtol=1e-6, atol=1e-7)
    close(grad_of(loss, logp), grad_of(ref, logp), rtol=1e-5, atol=1e-8)


def test_gspo_with_one_token_responses_is_sequence_level_ppo():
    g = torch.Generator().manual_seed(0)
    B, T = 10, 5
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True
    logp = (torch.randn(B, T, generator=g) - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, generator=g) * 1e-3
    adv = torch.randn(B, generator=g)
    low, high = 3e-4, 4e-4
    loss, _ = gspo_loss(logp, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high)
    # Hand-written PPO on the single token of each sequence.
    r = torch.exp((logp - old)[mask])
    ppo = -torch.min(r * adv, torch.clamp(r, 1 - low, 1 + high) * adv).mean()
    close(loss, ppo, rtol=1e-6, atol=1e-8)
    g = grad_of(loss, logp)
    close(g, grad_of(ppo, logp), rtol=1e-5, atol=1e-9)
    # The batch must contain clipped and unclipped sequences.
    assert 0 < (g.abs().sum(dim=1) == 0).sum() < B
    # ...and GRPO (token-mean) with the same clip range is the same thing.
    l_grpo, _ = grpo_loss(logp, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high)
    close(loss, l_grpo, rtol=1e-6, atol=1e-8)
    close(g, grad_of(l_grpo, logp), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("loss_fn", [gspo_loss, gspo_token_loss])
def test_clipping_zeroes_exactly_the_right_sequences(loss_fn):
    T = 4
    logp = torch.full((5, T), -1.0, requires_grad=True)
    # Per-row constant log-ratio d -> s = e^d.
    d = torch.tensor([0.01, -0.01, -0.01, 0.01, 1e-4])
    old = logp.detach() - d[:, None]
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    mask = torch.ones(5, T, dtype=torch.bool)
    loss, metrics = loss_fn(logp, old, adv, mask)  # clip range [1 - 3e-4, 1 + 4e-4]
    g = grad_of(loss, logp).abs().sum(dim=1)
    # row 0: A>0, s>1+eps -> clipped; row 1: A<0, s<1-eps -> clipped;
    # row 2: A>0, s<1-eps -> kept (update moves s back up); row 3: A<0, s>1+eps -> kept;
    # row 4: s inside the range -> kept.
    assert g.tolist()[:2] == [0.0, 0.0]
    assert (g[2:] > 0).all()
    r = reduce_metrics(metrics)
    assert r["clip_frac_high"] == pytest.approx(1 / 5) and r["clip_frac_low"] == pytest.approx(1 / 5)
    assert r["ratio_out_high_frac"] == pytest.approx(2 / 5) and r["ratio_out_low_frac"] == pytest.approx(2 / 5)


def test_grpo_clipping_zeroes_exactly_the_right_tokens():
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    d = torch.tensor([[0.5, -0.5, 0.0], [0.5, -0.5, 0.0]])
    old = logp.detach() - d
    adv = torch.tensor([1.0, -1.0])
    loss, _ = grpo_loss(logp, old, adv, torch.ones(2, 3))
    g = grad_of(loss, logp)
    # A>0: r=e^0.5 clipped high (0), r=e^-0.5 kept; A<0: r=e^0.5 kept, r=e^-0.5 clipped low (0).
    assert (g == 0).tolist() == [[True, False, False], [False, True, False]]


def test_length_normalization_duplicated_tokens_keep_s():
    g = torch.Generator().manual_seed(3)
    L = 5
    lr = torch.randn(L, generator=g) * 0.01
    base = torch.randn(L, generator=g) - 1
    # Row 0: the response; row 1: every token's log-ratio duplicated (length 2L).
    logp = torch.zeros(2, 2 * L)
    logp[0, :L] = base
    logp[1] = base.repeat_interleave(2)
    old = logp.clone()
    old[0, :L] -= lr
    old[1] -= lr.repeat_interleave(2)
    mask = torch.zeros(2, 2 * L, dtype=torch.bool)
    mask[0, :L] = True
    mask[1] = True
    adv = torch.tensor([0.7, 0.7])
    for fn in (gspo_loss, gspo_token_loss):
        lp = logp.clone().requires_grad_()
        loss, metrics = fn(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
        hist = reduce_metrics(metrics)["seq_ratio/hist"]
        close(hist[0], math.exp(lr.mean().item()), rtol=1e-6, atol=0)
        close(hist[1], hist[0], rtol=1e-6, atol=0)
        # ...so both sequences contribute the same objective; each token gets half the gradient.
        grad = grad_of(loss, lp)
        close(grad[1].reshape(L, 2).sum(1), grad[0, :L], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_32k_token_response_with_large_log_ratios_is_finite(name):
    T = 32768
    logp = torch.full((4, T), -3.0, requires_grad=True)
    old = torch.empty(4, T)
    # e^100 overflows float32: without the log-ratio bound these rows give inf / NaN.
    old[0] = -3.0 - 100.0  # mean log-ratio +100: beyond the bound, A < 0 keeps the unclipped branch
    old[1] = -3.0 + 100.0  # -100
    old[2] = -3.0 - 15.0  # +15: inside the bound, s = e^15, A < 0 -> large but finite gradient
    old[3] = -3.0 - torch.linspace(-200, 200, T)  # wildly varying per-token ratios
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    mask = torch.ones(4, T, dtype=torch.bool)
    mask[3, : T // 3] = False
    cfg = LossConfig(name=name, kl_coef=0.1)
    ref = torch.full((4, T), -80.0)
    loss, metrics = compute_policy_loss(cfg, logp, old, adv, mask, ref_logp=ref)
    assert torch.isfinite(loss)
    g = grad_of(loss, logp)
    assert torch.isfinite(g).all()
    for k, v in reduce_metrics(metrics).items():
        assert torch.isfinite(torch.as_tensor(v, dtype=torch.float64)).all(), k


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_masked_positions_change_nothing(name):
    logp, old, adv, mask = random_batch(5, adv_per_token=(name != "gspo"))
    ref = logp.detach() + 0.05
    ent = torch.rand(logp.shape)
    cfg = LossConfig(name=name, kl_coef=0.1, entropy_coef=0.01)
    loss1, m1 = compute_policy_loss(cfg, logp, old, adv, mask, ref_logp=ref, entropy=ent)
    g1 = grad_of(loss1, logp)

    junk = torch.where(torch.rand(logp.shape) < 0.5, float("nan"), float("inf"))
    logp2 = torch.where(mask, logp.detach(), junk).requires_grad_()
    old2 = torch.where(mask, old, -junk)
    ref2 = torch.where(mask, ref, junk)
    ent2 = torch.where(mask, ent, junk)
    adv2 = torch.where(mask, adv, junk) if adv.dim() == 2 else adv
    loss2, m2 = compute_policy_loss(cfg, logp2, old2, adv2, mask, ref_logp=ref2, entropy=ent2)
    g2 = grad_of(loss2, logp2)
    assert torch.equal(loss1, loss2)
    assert torch.equal(g1, g2)
    assert (g2[~mask] == 0).all()
    r1, r2 = reduce_metrics(m1), reduce_metrics(m2)
    assert r1.keys() == r2.keys()
    for k in r1:
        assert torch.equal(torch.as_tensor(r1[k]), torch.as_tensor(r2[k])), k


def test_empty_rows_are_ignored():  # the successors' edge batches: tests/test_loss_references.py
    logp, old, adv, mask = small_batch()
    # Append a row with no response tokens: nothing changes, it counts as no sequence.
    logp3 = torch.cat([logp.detach(), torch.full((1, 3), X)]).requires_grad_()
    old3 = torch.cat([old, torch.zeros(1, 3)])
    adv3 = torch.cat([adv, torch.tensor([5.0])])
    mask3 = torch.cat([mask, torch.zeros(1, 3)])
    for fn in (gspo_loss, gspo_token_loss, grpo_loss):
        close(fn(logp3, old3, adv3, mask3)[0], fn(logp, old, adv, mask)[0])
        r = reduce_metrics(fn(logp3, old3, adv3, mask3)[1])
        assert r["num_sequences"] == 2.0 and r["advantages/max"] == 1.0
    # An all-empty batch gives a zero loss (not NaN) that still backpropagates.
    loss, metrics = gspo_loss(logp, old, adv, torch.zeros(2, 3))
    assert loss.item() == 0.0 and torch.equal(grad_of(loss, logp), torch.zeros(2, 3))
    assert math.isnan(reduce_metrics(metrics)["seq_ratio/mean"])


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(name="gspo"),
        LossConfig(name="gspo_token"),
        LossConfig(name="grpo"),
        LossConfig(name="grpo", loss_agg_mode="seq-mean-token-mean"),
        LossConfig(name="grpo", loss_agg_mode="seq-mean-token-sum-norm", loss_agg_norm_constant=24),
        LossConfig(name="sapo", kl_coef=0.05),
        LossConfig(name="cispo"),
        LossConfig(name="cispo", loss_agg_mode="seq-mean-token-mean"),
        LossConfig(name="gmpo", entropy_coef=0.01),
        LossConfig(name="luspo", kl_coef=0.05),
    ],
    ids=lambda c: f"{c.name}-{c.loss_agg_mode}",
)
def test_global_normalizer_makes_microbatch_losses_and_grads_add_up(cfg):
    logp, old, adv, mask = random_batch(11, B=8)
    extra = {}
    if cfg.kl_coef:
        extra["ref_logp"] = logp.detach() + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    if cfg.entropy_coef:
        extra["entropy"] = torch.rand(logp.shape, generator=torch.Generator().manual_seed(2))
    full, _ = compute_policy_loss(cfg, logp, old, adv, mask, **extra)
    g_full = grad_of(full, logp)
    parts = [slice(0, 3), slice(3, 8)]  # uneven micro-batches
    norm = sum(batch_normalizer(cfg, mask[p]) for p in parts)
    total, g_sum = 0.0, torch.zeros_like(logp)
    for p in parts:
        loss, _ = compute_policy_loss(cfg, logp[p], old[p], adv[p], mask[p], global_batch_normalizer=norm,
                                      **{k: v[p] for k, v in extra.items()})
        total = total + loss.detach()
        g_sum += grad_of(loss, logp)
    close(total, full.detach(), rtol=1e-6, atol=1e-7)
    close(g_sum, g_full, rtol=1e-5, atol=1e-8)
    # Without the global normalizer the average of micro-batch losses is a different number.
    naive = sum(compute_policy_loss(cfg, logp[p], old[p], adv[p], mask[p], **{k: v[p] for k, v in extra.items()})[0]
                .detach() for p in parts) / 2
    assert not torch.allclose(naive, full.detach(), rtol=1e-4)


def test_batch_normalizer_units():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert batch_normalizer(LossConfig(name="gspo"), mask).item() == 2
    assert batch_normalizer(LossConfig(name="grpo"), mask).item() == 5
    assert batch_normalizer(LossConfig(name="grpo", loss_agg_mode="seq-mean-token-mean"), mask).item() == 2
    # CISPO normalizes by tokens (its paper's 1 / sum_i |o_i|); SAPO, GMPO and LUSPO by sequences
    assert batch_normalizer(LossConfig(name="cispo"), mask).item() == 5
    assert batch_normalizer(LossConfig(name="cispo", loss_agg_mode="seq-mean-token-mean"), mask).item() == 2
    for name in ("sapo", "gmpo", "luspo"):
        assert batch_normalizer(LossConfig(name=name), mask).item() == 2


def test_bf16_inputs_are_computed_in_float32():
    logp, old, adv, mask = small_batch()
    lp = logp.detach().to(torch.bfloat16).requires_grad_()
    loss, _ = gspo_loss(lp, old.to(torch.bfloat16), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss.dtype == torch.float32
    assert grad_of(loss, lp).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# Config and errors
# ----------------------------------------------------------------------------------------------


def test_loss_config_defaults_per_loss():
    assert clip_range(LossConfig(name="gspo")) == (3e-4, 4e-4)
    assert clip_range(LossConfig(name="gspo_token")) == (3e-4, 4e-4)
    assert clip_range(LossConfig(name="grpo")) == (0.2, 0.2)
    assert clip_range(LossConfig(name="grpo", clip_ratio_high=0.28)) == (0.2, 0.28)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(clip_ratio_low=1.5), r"loss\.clip_ratio_low must be in \(0, 1\), got 1\.5"),
        (dict(clip_ratio_high=0.0), r"loss\.clip_ratio_high"),
        (dict(name="ppo"), r"loss\.name='ppo' is not one of \['gspo', 'gspo_token', 'grpo', 'sapo', 'cispo', 'gmpo', 'luspo', 'vespo', 'dppo_tv', 'dppo_kl'\]"),
        (dict(name="grpo", loss_agg_mode="sum"), r"loss\.loss_agg_mode='sum' is not one of"),
        (dict(name="gspo", loss_agg_mode="seq-mean-token-mean"), r"loss\.loss_agg_mode='seq-mean-token-mean' applies to loss\.name in \['grpo', 'cispo', 'dppo_tv', 'dppo_kl'\] only"),
        (dict(name="grpo", loss_agg_mode="seq-mean-token-sum-norm"), r"loss\.loss_agg_norm_constant"),
        (dict(name="grpo", loss_agg_norm_constant=100.0), r"loss\.loss_agg_norm_constant is only used"),
        (dict(name="grpo", dual_clip_c=1.0), r"loss\.dual_clip_c must be a finite number > 1 or null, got 1\.0"),
        (dict(name="gspo", dual_clip_c=3.0), r"loss\.dual_clip_c applies to loss\.name='grpo' only"),
        (dict(kl_coef=-0.1), r"loss\.kl_coef must be a finite number >= 0"),
        (dict(entropy_coef=float("nan")), r"loss\.entropy_coef"),
        (dict(name="grpo", log_ratio_bound=0.1), r"loss\.log_ratio_bound=0\.1 must exceed"),
        (dict(name="sapo", clip_ratio_high=0.2), r"loss\.clip_ratio_high=0\.2 does not apply to loss\.name='sapo'"),
        (dict(name="sapo", sapo_tau_neg=0.0), r"loss\.sapo_tau_neg must be a finite number > 0, got 0\.0"),
        (dict(name="gspo", sapo_tau_pos=2.0), r"loss\.sapo_tau_pos / loss\.sapo_tau_neg \(2\.0 / 1\.05\) apply to "
                                              r"loss\.name='sapo' only"),
        (dict(name="cispo", clip_ratio_low=1.5), r"loss\.clip_ratio_low must be in \(0, 1\] \(cispo: 1 = no lower bound"),
        (dict(name="cispo", clip_ratio_high=1e9), r"loss\.log_ratio_bound=20\.0 must exceed the clip range's log-width"),
        (dict(name="gmpo", clip_ratio_low=-0.4), r"loss\.clip_ratio_low must be a finite number > 0 \(gmpo: a log-ratio"),
        (dict(name="gmpo", clip_ratio_high=25.0), r"loss\.log_ratio_bound=20\.0 must exceed gmpo's log-ratio clip range"),
        (dict(name="luspo", clip_ratio_low=1.0), r"loss\.clip_ratio_low must be in \(0, 1\), got 1\.0"),
        (dict(name="gmpo", loss_agg_mode="seq-mean-token-mean"), r"applies to loss\.name in \['grpo', 'cispo', 'dppo_tv', 'dppo_kl'\] only"),
        (dict(name="cispo", dual_clip_c=3.0), r"loss\.dual_clip_c applies to loss\.name='grpo' only"),
    ],
)
def test_loss_config_validation_names_the_field(kwargs, match):
    """The same refusal, by key, on every path a loss section takes: its check against the loss's spec
    (check_loss_config; a knob's own bounds are refused by the LossConfig itself), the job's rules (what
    load_job_config builds) and the loss function's dispatch."""
    refusals = {
        "check_loss_config": lambda: check_loss_config(LossConfig(**kwargs)),
        "JobConfig": lambda: JobConfig(loss=LossConfig(**kwargs)),
        "compute_policy_loss": lambda: compute_policy_loss(LossConfig(**kwargs), *small_batch()),
    }
    for path, refuse in refusals.items():
        with pytest.raises(ValueError, match=match):
            refuse()
            pytest.fail(f"{path} took {kwargs}")


def test_a_loss_key_is_refused_before_the_other_rules():
    """The loss section's own mistake is the one reported, whatever else the job gets wrong (the job's first rule)."""
    from megatron_gspo.config import load_job_config

    with pytest.raises(ValueError, match=r"loss\.dual_clip_c applies to loss\.name='grpo' only"):
        load_job_config(None, ["loss.dual_clip_c=3", "train.num_minibatches=7"])


def test_registry_and_dispatch_errors():
    assert get_policy_loss("gspo") is gspo_loss
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'; valid names: \['gspo', 'gspo_token', 'grpo', 'sapo', 'cispo', 'gmpo', 'luspo', 'vespo', 'dppo_tv', 'dppo_kl'\]"):
        get_policy_loss("ppo")
    logp, old, adv, mask = small_batch()
    with pytest.raises(ValueError, match="needs ref_logp"):
        compute_policy_loss(LossConfig(kl_coef=0.1), logp, old, adv, mask)
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        compute_policy_loss(LossConfig(entropy_coef=0.1), logp, old, adv, mask)
    with pytest.raises(ValueError, match=r"old_logp must have logp's shape \(2, 3\), got \(2, 4\)"):
        gspo_loss(logp, torch.zeros(2, 4), adv, mask)
    with pytest.raises(ValueError, match="advantages must be"):
        gspo_loss(logp, old, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="loss_agg_norm_constant"):
        grpo_loss(logp, old, adv, mask, loss_agg_mode="seq-mean-token-sum-norm")
