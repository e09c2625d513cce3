"""algorithms.objective: one micro-batch's loss and metrics, against hand-computed numbers and against
its parts composed by hand (the composition Trainer.accumulate_gradients wrote out before objective())."""

import math

import pytest
import torch

from megatron_gspo.algorithms import POLICY_LOSSES, get_policy_loss, register_policy_loss
from megatron_gspo.algorithms.advantages import ADVANTAGE_ESTIMATORS, register_advantage
from megatron_gspo.algorithms.losses import batch_normalizer, compute_policy_loss, on_policy_metrics
from megatron_gspo.algorithms.objective import ObjectiveConfig, loss_units, objective
from megatron_gspo.algorithms.rollout_correction import correction_weights, mismatch_metrics
from megatron_gspo.config import LossConfig, RolloutCorrectionConfig, load_job_config
from megatron_gspo.runtime.metrics import reduce_metrics
from megatron_gspo.rollout.prepare import TrainBatch
from megatron_gspo.algorithms.objective import nonfinite_rows


def _values(metrics):
    return {k: float(v) for k, v in reduce_metrics(metrics, None).items() if not isinstance(v, torch.Tensor)}


def _micro(logp_old, sample, adv, lengths, truncated=(False, False, False), width=5):
    """A micro-batch of len(lengths) rows on a [b, width-1] grid: row i's response is its first lengths[i]
    targets (no prompt: the grid is the loss's, what the objective reads)."""
    b = len(lengths)
    mask = torch.zeros(b, width - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    return TrainBatch(
        tokens=torch.ones(b, width, dtype=torch.long), mask=mask, seq_lengths=torch.tensor(lengths) + 1,
        row_ids=torch.arange(b), rewards=torch.zeros(b), advantages=torch.tensor(adv),
        sample_logprobs=torch.tensor(sample), old_logprobs=torch.tensor(logp_old),
        truncated=torch.tensor(truncated), sample_ids=[f"p#{i}" for i in range(b)])


# three responses of 2, 1 and 3 tokens; the pad columns hold garbage the objective must never read
OLD = [[-1.0, -2.0, 9.0, 9.0], [-0.5, 9.0, 9.0, 9.0], [-1.0, -1.0, -1.0, 9.0]]
SAMPLE = [[-1.0, -2.0, -7.0, -7.0], [-0.5, -7.0, -7.0, -7.0], [-1.0, -1.0, -1.0, -7.0]]
ADV = [1.0, -1.0, 0.5]


def _cfg(name="gspo", mode="off", overlong=False, **loss):
    return ObjectiveConfig(LossConfig(name=name, **loss), RolloutCorrectionConfig(mode=mode), overlong)


def test_gspo_objective_matches_the_formula_by_hand():
    """GSPO eq. (5)-(7) on three responses, the sequence ratios chosen by hand: s_0 = e^0.1 (A > 0, above
    1 + 4e-4: clipped high, no gradient), s_1 = e^-0.2 (A < 0, below 1 - 3e-4: clipped low), s_2 = 1 (kept).
    loss = -(1/N) sum_i min(s_i A_i, clip(s_i) A_i), N = the normalizer (here 4: other micro-batches)."""
    micro = _micro(OLD, SAMPLE, ADV, [2, 1, 3])
    delta = torch.tensor([[0.05, 0.15, 0.0, 0.0], [-0.2, 0.0, 0.0, 0.0], [0.3, -0.1, -0.2, 0.0]])
    logp = (micro.old_logprobs + delta).requires_grad_()
    loss, metrics = objective(_cfg(), micro, logp, None, torch.tensor(4.0))
    expect = -((1 + 4e-4) * 1.0 + (1 - 3e-4) * -1.0 + 1.0 * 0.5) / 4
    assert loss.item() == pytest.approx(expect, rel=1e-6)
    loss.backward()
    # d loss / d logp_t of row 2 = -(1/N) A s / |y| = -0.5 / (4 * 3) at s = 1; rows 0 and 1 are clipped
    g = torch.zeros(3, 4)
    g[2, :3] = -0.5 / 12
    torch.testing.assert_close(logp.grad, g)
    v = _values(metrics)
    assert v["clip_frac_high"] == pytest.approx(1 / 3) and v["clip_frac_low"] == pytest.approx(1 / 3)
    assert v["num_sequences"] == 3 and v["num_tokens"] == 6
    assert not [k for k in metrics if k.startswith(("rollout/", "onpolicy/", "rollout_correction/"))]


@pytest.mark.parametrize("name,mode,level", [("gspo", "tis", "token"), ("grpo", "mis", "sequence"),
                                             ("gspo", "off", "token"), ("cispo", "tis", "sequence")])
@pytest.mark.parametrize("first", [False, True])
def test_objective_is_the_parts_composed_by_hand(name, mode, level, first):
    """Value, gradient, metric keys (in order) and values equal the composition the trainer wrote by hand:
    correction_weights -> compute_policy_loss -> rollout-correction metrics -> on the first minibatch the
    mismatch and on-policy metrics; with overlong filtering dropping the truncated row from the loss."""
    gen = torch.Generator().manual_seed(0)
    old = torch.tensor(OLD)
    sample = old + 0.3 * torch.randn(3, 4, generator=gen)  # a real rollout mismatch: the weights matter
    micro = _micro(OLD, sample.tolist(), ADV, [2, 1, 3], truncated=(False, True, False))
    micro.ref_logprobs = old + 0.1 * torch.randn(3, 4, generator=gen)
    delta = 0.05 * torch.randn(3, 4, generator=gen)
    ent = torch.rand(3, 4, generator=gen)
    loss_cfg = LossConfig(name=name, kl_coef=0.01, entropy_coef=0.001)
    rc = RolloutCorrectionConfig(mode=mode, level=level, threshold=1.5)
    cfg = ObjectiveConfig(loss_cfg, rc, overlong_filtering=True)
    norm = torch.tensor([7.0])[0]

    logp = (old + delta).requires_grad_()
    loss, metrics = objective(cfg, micro, logp, ent, norm, on_sampling_weights=first)
    loss.backward()

    ref = (old + delta).requires_grad_()
    mask = micro.mask & ~micro.truncated[:, None]
    weights, rc_metrics = correction_weights(micro.old_logprobs, micro.sample_logprobs, mask, rc.mode, rc.level,
                                             *rc.bounds)
    ref_loss, ref_metrics = compute_policy_loss(loss_cfg, ref, micro.old_logprobs, micro.advantages, mask,
                                                ref_logp=micro.ref_logprobs, entropy=ent,
                                                global_batch_normalizer=norm, is_weights=weights)
    ref_metrics.update(rc_metrics)
    if first:
        ref_metrics.update(mismatch_metrics(ref, micro.sample_logprobs, micro.mask, *rc.bounds))
        ref_metrics.update(on_policy_metrics(ref, micro.old_logprobs, mask, ref_metrics))
    ref_loss.backward()

    assert torch.equal(loss, ref_loss) and torch.equal(logp.grad, ref.grad)
    assert logp.grad[1].abs().sum() == 0  # the truncated row left the loss
    assert list(metrics) == list(ref_metrics)
    for k in metrics:
        assert torch.equal(metrics[k].stats, ref_metrics[k].stats), k
    assert ("rollout/mismatch_k3" in metrics) == first and ("onpolicy/seq_ratio_dev_max" in metrics) == first
    assert ("rollout_correction/weight_mean" in metrics) == (mode != "off")
    assert loss_units(cfg, micro) == batch_normalizer(loss_cfg, mask)


def test_on_sampling_weights_at_ratio_one_measure_no_gap_and_clip_nothing():
    """The first minibatch trains on the weights that sampled it: with the old and the rollout log-probs
    equal to the forward's, every on-policy and mismatch metric is exactly 0 (GSPO §4.1)."""
    micro = _micro(OLD, OLD, ADV, [2, 1, 3])
    logp = micro.old_logprobs.clone().requires_grad_()
    _, metrics = objective(_cfg(mode="tis"), micro, logp, None, torch.tensor(3.0), on_sampling_weights=True)
    v = _values(metrics)
    for k in ("onpolicy/seq_ratio_dev_max", "onpolicy/log_ratio_abs_max", "onpolicy/clip_frac_low",
              "onpolicy/clip_frac_high", "rollout/mismatch_k3", "rollout/logprob_diff_max",
              "rollout/mismatch_ratio_out_frac", "rollout_correction/truncated_frac", "clip_frac_low",
              "clip_frac_high"):
        assert v[k] == 0.0, k
    assert v["rollout_correction/weight_min"] == v["rollout_correction/weight_max"] == 1.0


def test_loss_units_count_what_the_loss_divides_by():
    micro = _micro(OLD, SAMPLE, ADV, [2, 1, 3], truncated=(True, False, False))
    assert loss_units(_cfg(), micro).item() == 3  # responses
    assert loss_units(_cfg(overlong=True), micro).item() == 2  # the truncated one left the loss
    assert loss_units(_cfg("grpo"), micro).item() == 6  # tokens (token-mean)
    assert loss_units(_cfg("grpo", overlong=True), micro).item() == 4
    assert loss_units(_cfg("grpo", loss_agg_mode="seq-mean-token-mean"), micro).item() == 3


def test_nonfinite_rows_look_at_response_tokens_only():
    micro = _micro(OLD, SAMPLE, ADV, [2, 1, 3])
    logp = micro.old_logprobs.clone()
    logp[0, 3] = math.nan  # padding: not a fault
    logp[2, 1] = -math.inf
    micro.old_logprobs[1, 0] = math.inf
    assert nonfinite_rows(micro, logp).tolist() == [False, True, True]


def test_objective_config_is_the_jobs_loss_correction_and_overlong_filtering():
    job = load_job_config(None, ["loss.name=grpo", "rollout_correction.mode=mis", "train.overlong_filtering=true"])
    cfg = ObjectiveConfig.of(job)
    assert cfg == ObjectiveConfig(job.loss, job.rollout_correction, True)
    with pytest.raises(AttributeError):
        cfg.overlong_filtering = False  # frozen: a view, never a second place to change the job


def test_registries_refuse_a_second_loss_or_estimator_of_one_name_and_name_the_unknown():
    assert list(POLICY_LOSSES) == ["gspo", "gspo_token", "grpo", "sapo", "cispo", "gmpo", "luspo", "vespo", "dppo_tv",
                                   "dppo_kl"]
    gspo = get_policy_loss("gspo")
    with pytest.raises(ValueError, match=r"policy loss 'gspo' is registered twice \(gspo_loss and "):
        register_policy_loss("gspo")(lambda *a, **k: None)
    assert get_policy_loss("gspo") is gspo
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'; valid names: \['gspo', 'gspo_token'"):
        get_policy_loss("ppo")
    with pytest.raises(ValueError, match=r"advantage estimator 'mean_only' is registered twice"):
        register_advantage("mean_only")(lambda r, g: r)
    assert list(ADVANTAGE_ESTIMATORS) == ["grpo", "dr_grpo", "mean_only", "maxrl"]


def test_a_registered_loss_is_what_get_policy_loss_returns():
    """The decorator registers the function itself (unchanged) under its name, after the built-in ones."""
    def constant_loss(logp, old_logp, advantages, mask, **kwargs):
        return logp.sum() * 0, {}

    try:
        assert register_policy_loss("test_constant")(constant_loss) is constant_loss
        assert get_policy_loss("test_constant") is constant_loss and list(POLICY_LOSSES)[-1] == "test_constant"
    finally:
        POLICY_LOSSES.pop("test_constant")
