"""Rollout correction (TIS / MIS) and the rollout-mismatch metrics, with hand-computed numbers."""

import math

import pytest
import torch

from megatron_gspo.config import ConfigError, LossConfig, RolloutCorrectionConfig, load_job_config
from megatron_gspo.algorithms.losses import compute_policy_loss
from megatron_gspo.runtime.metrics import reduce_metrics
from megatron_gspo.algorithms.rollout_correction import correction_weights, log_rho, mismatch_metrics
from log_capture import LogLines

LN = math.log


def _values(metrics):
    return {k: float(v) for k, v in reduce_metrics(metrics, None).items()}


# rows: 3 response tokens then one pad; rho per token chosen by hand
RHO = torch.tensor([[0.5, 1.0, 3.0, 7.0],
                    [1.5, 0.25, 1.0, 1.0]])
MASK = torch.tensor([[True, True, True, False],
                     [True, True, True, False]])
ROLLOUT = torch.full((2, 4), -1.0)
OLD = ROLLOUT + RHO.log()  # log rho = old - rollout


def test_tis_token_weights_are_truncated_at_the_threshold():
    w, m = correction_weights(OLD, ROLLOUT, MASK, "tis", "token", 0.5, 2.0)
    # min(rho, 2): 3.0 -> 2.0; the pad column's 7.0 is off the mask (log rho set to 0 there -> 1)
    expect = torch.tensor([[0.5, 1.0, 2.0, 1.0], [1.5, 0.25, 1.0, 1.0]])
    torch.testing.assert_close(w, expect, rtol=1e-6, atol=0)
    v = _values(m)
    assert v["rollout_correction/truncated_frac"] == pytest.approx(1 / 6)
    assert v["rollout_correction/weight_max"] == pytest.approx(2.0)
    assert v["rollout_correction/weight_min"] == pytest.approx(0.25)
    assert v["rollout_correction/weight_mean"] == pytest.approx((0.5 + 1 + 2 + 1.5 + 0.25 + 1) / 6)


def test_mis_token_weights_mask_both_tails():
    w, m = correction_weights(OLD, ROLLOUT, MASK, "mis", "token", 0.5, 2.0)
    # outside [0.5, 2]: 3.0 and 0.25 -> 0; 0.5 (on the bound) is kept
    expect = torch.tensor([[0.5, 1.0, 0.0, 1.0], [1.5, 0.0, 1.0, 1.0]])
    torch.testing.assert_close(w, expect, rtol=1e-6, atol=0)
    assert _values(m)["rollout_correction/masked_frac"] == pytest.approx(2 / 6)


def test_sequence_level_uses_the_product_of_token_ratios():
    # row 0: 0.5 * 1 * 3 = 1.5 (inside); row 1: 1.5 * 0.25 * 1 = 0.375 (below 0.5)
    torch.testing.assert_close(log_rho(OLD, ROLLOUT, MASK, "sequence").exp(), torch.tensor([1.5, 0.375]))
    w, _ = correction_weights(OLD, ROLLOUT, MASK, "tis", "sequence", 0.5, 1.2)
    torch.testing.assert_close(w, torch.tensor([1.2, 0.375]))
    w, m = correction_weights(OLD, ROLLOUT, MASK, "mis", "sequence", 0.5, 2.0)
    torch.testing.assert_close(w, torch.tensor([1.5, 0.0]))
    assert _values(m)["rollout_correction/masked_frac"] == 0.5


def test_off_is_none():
    assert correction_weights(OLD, ROLLOUT, MASK, "off", "token", 0.5, 2.0) == (None, {})


def test_mismatch_metrics_by_hand():
    m = _values(mismatch_metrics(OLD, ROLLOUT, MASK, 0.4, 2.0))  # no rho on a bound (float32 rounding)
    d = [LN(0.5), 0.0, LN(3.0), LN(1.5), LN(0.25), 0.0]
    assert m["rollout/mismatch_k3"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 6, rel=1e-6)
    assert m["rollout/logprob_diff_mean"] == pytest.approx(sum(abs(x) for x in d) / 6, rel=1e-6)
    assert m["rollout/logprob_diff_max"] == pytest.approx(LN(4.0), rel=1e-6)
    assert m["rollout/mismatch_ratio_out_frac"] == pytest.approx(2 / 6)  # 3.0 and 0.25


def _loss_and_grad(cfg, logp, old, adv, mask, weights):
    logp = logp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(cfg, logp, old, adv, mask, is_weights=weights)
    loss.backward()
    return loss.detach(), logp.grad


@pytest.mark.parametrize("loss", ["gspo", "gspo_token", "grpo", "sapo", "cispo", "gmpo", "luspo"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_corrections_are_exact_no_ops_at_ratio_one(loss, mode, level):
    """rho == 1 (old log-probs = rollout log-probs): weights exactly 1.0; loss and gradient bit-identical."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    mask = torch.rand(B, T, generator=g) < 0.8
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=g)  # off-policy enough that clipping is active
    adv = torch.randn(B, generator=g)
    cfg = LossConfig(name=loss)
    w, _ = correction_weights(old, old.clone(), mask, mode, level, 0.5, 2.0)
    assert torch.equal(w, torch.ones_like(w))
    base = _loss_and_grad(cfg, logp, old, adv, mask, None)
    corr = _loss_and_grad(cfg, logp, old, adv, mask, w)
    assert torch.equal(base[0], corr[0]) and torch.equal(base[1], corr[1])


@pytest.mark.parametrize("loss", ["gspo_token", "grpo", "sapo", "cispo"])
def test_token_weights_scale_each_tokens_term(loss):
    """On-policy (logp = old), a token's policy-gradient term is -w_t A / |y| (seq-mean-token-mean) or
    -w_t A / N_tokens (token-mean): its gradient scales by exactly w_t."""
    mask = torch.tensor([[True, True, True, False]])
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    w = torch.tensor([[2.0, 0.0, 0.5, 9.0]])
    cfg = LossConfig(name=loss)
    _, grad = _loss_and_grad(cfg, old, old, torch.tensor([1.0]), mask, w)
    # d/dlogp of -(r * A * w)/3 at r = 1: -w / 3 (the pad column contributes nothing)
    torch.testing.assert_close(grad, torch.tensor([[-2 / 3, 0.0, -0.5 / 3, 0.0]]))


def test_gspo_takes_the_mean_token_weight_per_sequence():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    old = torch.zeros(2, 3)
    w = torch.tensor([[2.0, 1.0, 5.0], [0.0, 0.0, 3.0]])
    loss, _ = _loss_and_grad(LossConfig(name="gspo"), old, old, torch.tensor([1.0, -2.0]), mask, w)
    # s_i = 1: loss = -(1/2) (1 * 1.5 + (-2) * 1.0)
    assert float(loss) == pytest.approx(0.25)
    # LUSPO: the same objective per sequence, times its length
    loss, _ = _loss_and_grad(LossConfig(name="luspo"), old, old, torch.tensor([1.0, -2.0]), mask, w)
    assert float(loss) == pytest.approx(-(2 * 1.5 + 3 * (-2) * 1.0) / 2)


def test_gmpo_takes_the_geometric_mean_token_weight_per_sequence():
    """GMPO's ratio is a geometric mean, so a token-level correction enters as one too (GM(r rho) =
    GM(r) GM(rho)); a masked-out token (MIS weight 0) zeroes its sequence."""
    mask = torch.tensor([[True, True, False], [True, True, True]])
    old = torch.zeros(2, 3)
    w = torch.tensor([[2.0, 0.5, 7.0], [4.0, 0.0, 1.0]])
    loss, grad = _loss_and_grad(LossConfig(name="gmpo"), old, old, torch.tensor([1.0, -2.0]), mask, w)
    # ratio 1: loss = -(1/2) (1 * sqrt(2 * 0.5) + (-2) * 0)
    assert float(loss) == pytest.approx(-0.5)
    assert torch.equal(grad[1], torch.zeros(3))


@pytest.mark.parametrize("override, field", [
    ("rollout_correction.mode=sometimes", "rollout_correction.mode"),
    ("rollout_correction.level=batch", "rollout_correction.level"),
    ("rollout_correction.threshold=1.0", "rollout_correction.threshold"),
    ("rollout_correction.threshold_low=1.5", "rollout_correction.threshold_low"),
])
def test_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_job_config(None, [override])


def test_threshold_low_defaults_to_the_reciprocal():
    assert RolloutCorrectionConfig(threshold=4.0).bounds == (0.25, 4.0)
    assert RolloutCorrectionConfig(threshold=4.0, threshold_low=0.0).bounds == (0.0, 4.0)


# ----------------------------------------------------------------------------------------------
# In the trainer
# ----------------------------------------------------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = ["parallel.device=cpu", "train.num_steps=2", "train.prompts_per_step=4", "generation.n_samples_per_prompt=4",
       "generation.max_new_tokens=4", "train.micro_batch_size=8", "train.num_minibatches=2",
       f"reward.name={HERE}/reward_plugins.py:digit_fraction", "optimizer.lr=1e-3", "train.tensorboard=false"]


def _train(tmp_path, name, overrides):
    from megatron_gspo.runtime import parallel
    from megatron_gspo.train import Trainer

    t = Trainer(load_job_config(None, JOB + [f"train.output_dir={tmp_path}/{name}"] + overrides))
    try:
        t.run()
        weights = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    finally:
        t.close()
        parallel.destroy()
    return weights, [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]


@pytest.mark.parametrize("loss", ["gspo", "sapo", "cispo", "gmpo", "luspo"])
def test_corrections_without_an_old_pass_train_bit_identically(tmp_path, loss):
    """train.old_logprobs=rollout: rho == 1 by construction, so TIS and MIS change no bit of training."""
    base, rows = _train(tmp_path, "off", ["train.old_logprobs=rollout", f"loss.name={loss}"])
    for mode, level in (("tis", "token"), ("mis", "sequence")):
        w, rows_c = _train(tmp_path, mode, ["train.old_logprobs=rollout", f"rollout_correction.mode={mode}",
                                            f"rollout_correction.level={level}", f"loss.name={loss}"])
        assert all(torch.equal(base[n], w[n]) for n in base), mode
        for a, b in zip(rows, rows_c):
            assert a["loss/loss"] == b["loss/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
            assert b["rollout_correction/weight_min"] == b["rollout_correction/weight_max"] == 1.0


def test_mismatch_is_float_noise_when_generation_runs_the_training_weights(tmp_path):
    _, rows = _train(tmp_path, "rec", ["train.old_logprobs=recompute", "rollout_correction.mode=tis"])
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4 and 0 <= r["rollout/mismatch_k3"] < 1e-8
        assert r["rollout/mismatch_ratio_out_frac"] == 0.0
        assert r["rollout_correction/truncated_frac"] == 0.0
        assert abs(r["rollout_correction/weight_mean"] - 1) < 1e-4


def test_a_correction_that_cannot_correct_anything_says_so(tmp_path):
    """rollout_correction.mode=tis / mis without the old-log-prob pass (train.old_logprobs=auto resolving
    to the rollout's, or rollout): legal, a no-op bit for bit, and said once when the trainer starts. The
    decision is the job's resolved old-log-prob source (config.old_logprob_source)."""
    import logging

    from megatron_gspo.runtime import parallel
    from megatron_gspo.train import Trainer

    said = {}
    # the rollout's log-probs asked for by name: "auto" resolves to them only for fp32 on the CPU
    for name, overrides in (("rollout", ["train.old_logprobs=rollout"]), ("recompute", ["train.old_logprobs=recompute"]),
                            ("off", ["rollout_correction.mode=off"])):
        cfg = load_job_config(None, JOB + [f"train.output_dir={tmp_path}/{name}", "rollout_correction.mode=tis"]
                              + overrides)
        try:
            with LogLines(logging.WARNING) as lines:
                Trainer(cfg).close()
        finally:
            parallel.destroy()
        said[name] = [m for m in lines.lines if "rollout_correction.mode" in m]
    assert len(said["rollout"]) == 1 and said["rollout"][0].startswith(
        "rollout_correction.mode=tis corrects nothing in this job: the old log-probs are the rollout's"), said
    assert "train.old_logprobs=recompute" in said["rollout"][0]
    assert said["recompute"] == [] and said["off"] == []
    from megatron_gspo.algorithms.rollout_correction import inactive_reason

    assert inactive_reason("off", False) is None and inactive_reason("tis", True) is None
    assert inactive_reason("mis", False).startswith("rollout_correction.mode=mis corrects nothing in this job")
