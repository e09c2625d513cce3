"""The rollout-correction masks since TIS / MIS: IcePop, SkyRL's geometric sequence mask, NeMo-RL's sequence
log-prob error mask and DeepSeek-V3.2's off-policy sequence mask (OPSM), against float64 references of their
definitions (hand-sized and random batches), in the loss (a masked response is the loss with its advantage zeroed:
it stays in the normalizer), and their settings refused by key. TRL's own OPSM (its ``_compute_loss`` with
``off_policy_mask_threshold``) runs on the same batches in tests/test_loss_peers.py; TRL's IcePop (its
``vllm_importance_sampling_mode="token_mask"``) lives in its generation step, so its two lines are transcribed
below (``trl_token_mask``)."""

import math

import pytest
import torch

from megatron_gspo.algorithms.losses import POLICY_LOSSES
from megatron_gspo.algorithms.rollout_correction import correction_weights, inactive_reason
from megatron_gspo.config import ConfigError, RolloutCorrectionConfig, load_job_config
from megatron_gspo.runtime.metrics import reduce_metrics

F64 = torch.float64
LN = math.log

# as tests/test_rollout_correction.py: rho per token [0.5, 1, 3] and [1.5, 0.25, 1], one pad column
RHO = torch.tensor([[0.5, 1.0, 3.0, 7.0], [1.5, 0.25, 1.0, 1.0]], dtype=F64)
MASK = torch.tensor([[True, True, True, False], [True, True, True, False]])
ROLLOUT = torch.full((2, 4), -1.0, dtype=F64)
OLD = ROLLOUT + RHO.log()


def _values(metrics):
    return {k: float(v) for k, v in reduce_metrics(metrics, None).items()}


# ----------------------------------------------------------------------------------------------
# The definitions, literally, in float64
# ----------------------------------------------------------------------------------------------


def _tokens(mask, i):
    return [t for t in range(mask.shape[1]) if bool(mask[i, t])]


def ref_icepop(old, rollout, mask, low=0.5, high=5.0):
    """IcePop (arXiv 2510.18855): M(k) = k if low <= k <= high else 0, k = pi_old / pi_rollout per token."""
    w = torch.zeros_like(old)
    for i in range(old.shape[0]):
        for t in _tokens(mask, i):
            k = math.exp(float(old[i, t] - rollout[i, t]))
            w[i, t] = k if low <= k <= high else 0.0
    return w


def trl_token_mask(old, rollout, mask, clip_min, clip_max):
    """TRL 1.16 GRPOTrainer, vllm_importance_sampling_mode="token_mask" (its generation step), as written there."""
    ratio = torch.exp((old - rollout) * mask)
    invalid = (ratio < clip_min) | (ratio > clip_max)
    return ratio.masked_fill(invalid, value=0.0)


def ref_geo_mask(old, rollout, mask, low=0.99, high=1.01):
    """SkyRL: keep response i iff low <= (prod_t rho_it)^(1/|y_i|) <= high."""
    keep = []
    for i in range(old.shape[0]):
        ts = _tokens(mask, i)
        prod = 1.0
        for t in ts:
            prod *= math.exp(float(old[i, t] - rollout[i, t]))
        g = prod ** (1.0 / max(len(ts), 1))
        keep.append(1.0 if low <= g <= high else 0.0)
    return torch.tensor(keep, dtype=F64)


def ref_seq_logprob_error(old, rollout, mask, threshold=1.5):
    """NeMo-RL: keep response i iff (1/|y_i|) sum_t exp|log pi_rollout - log pi_old| <= threshold."""
    keep = []
    for i in range(old.shape[0]):
        ts = _tokens(mask, i)
        err = sum(math.exp(abs(float(rollout[i, t] - old[i, t]))) for t in ts) / max(len(ts), 1)
        keep.append(1.0 if err <= threshold else 0.0)
    return torch.tensor(keep, dtype=F64)


def ref_opsm(logp, rollout, adv, mask, delta=0.5):
    """DeepSeek-V3.2 eq. 9: keep response i iff A_i >= 0 or (1/|y_i|) sum_t log(pi_rollout / pi_theta) <= delta."""
    keep = []
    for i in range(logp.shape[0]):
        ts = _tokens(mask, i)
        kl = sum(float(rollout[i, t] - logp[i, t]) for t in ts) / max(len(ts), 1)
        keep.append(1.0 if float(adv[i]) >= 0 or kl <= delta else 0.0)
    return torch.tensor(keep, dtype=F64)


# ----------------------------------------------------------------------------------------------
# Hand-sized
# ----------------------------------------------------------------------------------------------


def test_icepop_masks_tokens_outside_its_band():
    """Band [0.5, 5]: 0.5 (on the bound), 1, 3, 1.5, 1 keep their rho; 0.25 is masked (low)."""
    w, m = correction_weights(OLD, ROLLOUT, MASK, "icepop", "token", *RolloutCorrectionConfig(mode="icepop").mode_bounds)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 3.0, 1.0], [1.5, 0.0, 1.0, 1.0]]), rtol=1e-6, atol=0)
    v = _values(m)
    assert v["rollout_correction/masked_frac"] == pytest.approx(1 / 6)
    assert (v["rollout_correction/masked_frac_low"], v["rollout_correction/masked_frac_high"]) == (pytest.approx(1 / 6), 0)
    # band [0.6, 2]: 0.5 and 0.25 low, 3.0 high
    w, m = correction_weights(OLD, ROLLOUT, MASK, "icepop", "token", 0.6, 2.0)
    v = _values(m)
    assert (v["rollout_correction/masked_frac_low"], v["rollout_correction/masked_frac_high"]) == (
        pytest.approx(2 / 6), pytest.approx(1 / 6))


def test_geo_mask_keeps_responses_whose_geometric_mean_is_in_the_band():
    """Geometric means: 1.5^(1/3) = 1.145 and 0.375^(1/3) = 0.721. SkyRL's default band [0.99, 1.01] masks both
    (one above, one below); [0.8, 1.2] masks the second only; [0.7, 1.2] neither."""
    for band, want, low, high in (((0.99, 1.01), [0.0, 0.0], 0.5, 0.5), ((0.8, 1.2), [1.0, 0.0], 0.5, 0.0),
                                  ((0.7, 1.2), [1.0, 1.0], 0.0, 0.0)):
        w, m = correction_weights(OLD, ROLLOUT, MASK, "geo_mask", "token", *band)
        assert w.tolist() == want
        v = _values(m)
        assert (v["rollout_correction/masked_frac_low"], v["rollout_correction/masked_frac_high"]) == (low, high)


def test_seq_logprob_error_mask():
    """mean_t exp|log rho|: row 0 (2 + 1 + 3) / 3 = 2 (mean log rho = ln 1.5 / 3 > 0: high), row 1
    (1.5 + 4 + 1) / 3 = 2.167 (below: low). Threshold 1.5 masks both; 2.1 the second only."""
    w, m = correction_weights(OLD, ROLLOUT, MASK, "seq_logprob_error", "token", 1.0, 1.5)
    assert w.tolist() == [0.0, 0.0]
    v = _values(m)
    assert (v["rollout_correction/masked_frac_low"], v["rollout_correction/masked_frac_high"]) == (0.5, 0.5)
    w, _ = correction_weights(OLD, ROLLOUT, MASK, "seq_logprob_error", "token", 1.0, 2.1)
    assert w.tolist() == [1.0, 0.0]


def test_opsm_drops_negative_advantage_responses_that_drifted():
    """Current log-probs 0.6 / 0.6 / 0.4 nats below the rollout's on average: the first (A < 0, 0.6 > 0.5) is
    dropped, the second kept (A > 0), the third kept (0.4 <= 0.5). It reads the current policy, not pi_old: the
    same with old == rollout."""
    rollout = torch.full((3, 3), -1.0, dtype=F64)
    logp = rollout - torch.tensor([[0.6], [0.6], [0.4]], dtype=F64) + torch.tensor([[0.1, -0.1, 0.0]], dtype=F64)
    mask = torch.ones(3, 3, dtype=torch.bool)
    adv = torch.tensor([-1.0, 2.0, -0.5], dtype=F64)
    for old in (rollout, rollout - 0.3):
        w, m = correction_weights(old, rollout, mask, "opsm", "token", 0.0, 0.5, logp=logp, advantages=adv)
        assert w.tolist() == [0.0, 1.0, 1.0]
        v = _values(m)
        assert v["rollout_correction/masked_frac"] == pytest.approx(1 / 3)
        assert (v["rollout_correction/masked_frac_low"], v["rollout_correction/masked_frac_high"]) == (
            pytest.approx(1 / 3), 0.0)
    with pytest.raises(ValueError, match="'opsm' needs the current log-probs"):
        correction_weights(rollout, rollout, mask, "opsm", "token", 0.0, 0.5)
    assert inactive_reason("opsm", False) is None  # acts without the old-log-prob pass


# ----------------------------------------------------------------------------------------------
# Random batches against the definitions
# ----------------------------------------------------------------------------------------------


def _random(seed, B=16, T=10, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05
    old = rollout + scale * torch.randn(B, T, generator=g, dtype=F64)
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]
    adv = torch.randn(B, generator=g, dtype=F64)
    return logp, old, rollout, adv, mask


@pytest.mark.parametrize("seed", range(3))
def test_random_batches_match_the_definitions(seed):
    logp, old, rollout, adv, mask = _random(seed)
    _, o2, r2, _, m2 = _random(seed, scale=1.0)  # IcePop's band needs token ratios far from 1
    w, _ = correction_weights(o2, r2, m2, "icepop", "token", 0.5, 5.0)
    want = ref_icepop(o2, r2, m2)
    assert 0 < int((m2 & (want == 0)).sum()) < int(m2.sum())
    torch.testing.assert_close(torch.where(m2, w.double(), 0.0), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.where(m2, w.double(), 0.0), torch.where(m2, trl_token_mask(o2, r2, m2, 0.5, 5.0), 0.0),
                               rtol=1e-6, atol=0)
    checks = (("geo_mask", (0.99, 1.01), ref_geo_mask(old, rollout, mask)),
              ("seq_logprob_error", (1.0, 1.05), ref_seq_logprob_error(old, rollout, mask, 1.05)),
              ("opsm", (0.0, 0.1), ref_opsm(logp, rollout, adv, mask, 0.1)))
    for mode, band, want in checks:
        w, m = correction_weights(old, rollout, mask, mode, "token", *band, logp=logp, advantages=adv)
        assert torch.equal(w.double(), want), mode
        assert 0 < float(want.sum()) < len(want), mode  # some responses masked, not all
        assert _values(m)["rollout_correction/masked_frac"] == pytest.approx(1 - float(want.mean())), mode


@pytest.mark.parametrize("loss", ["gspo", "grpo", "sapo", "cispo", "gmpo", "luspo", "vespo", "dppo_tv", "dppo_kl"])
def test_a_sequence_mask_is_the_loss_with_the_masked_advantages_zeroed(loss):
    """A masked response contributes nothing and stays in the normalizer (as TRL's masks): the loss and its gradient
    equal the loss with that response's advantage set to 0."""
    logp, old, rollout, adv, mask = _random(4)
    w, _ = correction_weights(old, rollout, mask, "opsm", "token", 0.0, 0.0, logp=logp, advantages=adv)
    assert 0 < float(w.sum()) < len(w)
    fn = POLICY_LOSSES[loss]

    def run(a, weights):
        lp = logp.clone().requires_grad_(True)
        value, _ = fn(lp, old, a, mask, is_weights=weights)
        return value.detach(), torch.autograd.grad(value, lp)[0]

    got_v, got_g = run(adv, w)
    want_v, want_g = run(adv * w.double(), None)
    torch.testing.assert_close(got_v, want_v, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_g, want_g, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


def test_defaults_are_the_sources():
    assert RolloutCorrectionConfig(mode="icepop").mode_bounds == (0.5, 5.0)  # IcePop's alpha, beta
    assert RolloutCorrectionConfig(mode="geo_mask").mode_bounds == (0.99, 1.01)  # SkyRL's
    assert RolloutCorrectionConfig(mode="seq_logprob_error").mode_bounds == (1.0, 1.5)  # NeMo-RL's example
    assert RolloutCorrectionConfig(mode="opsm").mode_bounds == (0.0, 0.5)  # TRL's example
    assert RolloutCorrectionConfig(mode="mis", threshold=4.0).mode_bounds == (0.25, 4.0)


@pytest.mark.parametrize("overrides, said", [
    (["rollout_correction.mode=tis", "rollout_correction.geo_mask_low=0.9"],
     "rollout_correction.geo_mask_low=0.9 applies to rollout_correction.mode in ['geo_mask'] only, got mode='tis'"),
    (["rollout_correction.mode=icepop", "rollout_correction.level=sequence"],
     "rollout_correction.level=sequence applies to rollout_correction.mode in ['off', 'tis', 'mis'] only, got "
     "mode='icepop'"),
    (["rollout_correction.off_policy_mask_threshold=0.2"],
     "rollout_correction.off_policy_mask_threshold=0.2 applies to rollout_correction.mode in ['opsm'] only, got "
     "mode='off'"),
    (["rollout_correction.mode=geo_mask", "rollout_correction.geo_mask_high=0.9"],
     "rollout_correction.geo_mask_high must be"),
    (["rollout_correction.mode=icepop", "rollout_correction.icepop_low=1.5"], "rollout_correction.icepop_low must be"),
    (["rollout_correction.mode=opsm", "rollout_correction.off_policy_mask_threshold=0"],
     "rollout_correction.off_policy_mask_threshold must be"),
    (["rollout_correction.mode=icepops"], "rollout_correction.mode='icepops' is not one of"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_key(overrides, said):
    with pytest.raises(ConfigError) as e:
        load_job_config(None, overrides)
    msg = str(e.value)
    assert said in msg and "\n" not in msg, msg
