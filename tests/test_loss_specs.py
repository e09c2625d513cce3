"""A loss is one spec: a loss from a module of its own runs a real RL step, its settings checked by key from its
spec; the settings' bounds hold in the training precision (what overflows there is refused at config load);
SAPO's loss is computed stably."""

import math
import os
import re

import pytest
import torch

from megatron_gspo.config import ConfigError, load_job_config
from megatron_gspo.runtime.metrics import reduce_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
SPO = f"loss.name={HERE}/loss_plugins.py:spo_loss"
FP32, BF16 = torch.finfo(torch.float32), torch.finfo(torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# A new loss from a module of its own
# ----------------------------------------------------------------------------------------------


def test_a_plug_in_loss_is_checked_by_key_from_its_spec():
    from megatron_gspo.config.losses import clip_range, describe_loss

    loss = load_job_config(None, [SPO]).loss
    assert clip_range(loss) == (0.2, 0.2) and describe_loss(loss) == "clip 0.2 / 0.2"  # its spec's defaults
    with pytest.raises(ConfigError, match=r"loss\.clip_ratio_low must be in \(0, 1\), got 1\.5"):  # its units
        load_job_config(None, [SPO, "loss.clip_ratio_low=1.5"])
    with pytest.raises(ConfigError, match=r"loss\.dual_clip_c applies to loss\.name='grpo' only"):
        load_job_config(None, [SPO, "loss.dual_clip_c=3"])
    # its ratios are per token: routing replay applies (a sequence-ratio loss is refused it)
    assert load_job_config(None, [SPO, "train.routing_replay=R2"]).train.routing_replay == "R2"
    # its aggregation is the configurable one: token-mean by default, seq-mean-token-mean on request
    assert load_job_config(None, [SPO, "loss.loss_agg_mode=seq-mean-token-mean"]).loss.loss_agg_mode \
        == "seq-mean-token-mean"
    with pytest.raises(ConfigError, match=r"loss\.name='.*/no_such_file\.py:spo_loss': file .* not found"):
        load_job_config(None, [f"loss.name={HERE}/no_such_file.py:spo_loss"])
    with pytest.raises(ConfigError, match=r"loss\.name='.*loss_plugins\.py:nope': .* has no attribute 'nope'"):
        load_job_config(None, [f"loss.name={HERE}/loss_plugins.py:nope"])


def test_the_plug_in_loss_is_its_formula():
    """SPO's value and gradient by hand, through the shared plumbing (settings from the config, normalizer)."""
    from megatron_gspo.algorithms.losses import batch_normalizer, compute_policy_loss

    cfg = load_job_config(None, [SPO, "loss.clip_ratio_low=0.1", "loss.clip_ratio_high=0.3"]).loss
    old = torch.zeros(2, 3, dtype=torch.float64)
    lr = torch.tensor([[0.3, -0.1, 0.0], [-0.2, 0.4, 9.0]], dtype=torch.float64)
    logp = lr.clone().requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, metrics = compute_policy_loss(cfg, logp, old, adv, mask)
    r, a = lr.exp(), adv[:, None]
    eps = torch.where(a > 0, 0.3, 0.1)
    obj = r * a - a.abs() * (r - 1) ** 2 / (2 * eps)
    assert batch_normalizer(cfg, mask).item() == 5  # token-mean: every response token weighs the same
    torch.testing.assert_close(loss, -(obj * mask).sum() / 5, rtol=1e-12, atol=0)
    grad = -(a * r - a.abs() * (r - 1) * r / eps) * mask / 5
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], grad, rtol=1e-12, atol=0)
    m = reduce_metrics(metrics)
    # past the penalty's peak r = 1 + eps sign(A): e^0.3 > 1.3 (A > 0), e^-0.2 < 0.9 (A < 0)
    assert (m["clip_frac_high"], m["clip_frac_low"]) == (pytest.approx(1 / 5), pytest.approx(1 / 5))
    assert m["token_ratio/max"] == pytest.approx(math.exp(9.0))


def test_every_built_in_loss_is_one_spec_beside_its_function():
    """What the config used to list by name (LOSS_NAMES, DEFAULT_CLIP_RATIOS, TOKEN_RATIO_LOSSES, AGG_MODE_LOSSES,
    SAPO_TAUS) is each loss's spec; the function's defaults are the config's, its keywords the spec's."""
    import inspect

    from megatron_gspo.config.loss_spec import CONFIGURABLE, TOKEN
    from megatron_gspo.config.losses import config_values, describe_loss, loss_spec, losses_where
    from megatron_gspo.algorithms.losses import POLICY_LOSSES, LossConfig, gspo_loss

    assert list(POLICY_LOSSES) == ["gspo", "gspo_token", "grpo", "sapo", "cispo", "gmpo", "luspo", "vespo", "dppo_tv",
                                   "dppo_kl"]
    assert losses_where(lambda spec: spec.ratio == TOKEN) == ["grpo", "sapo", "cispo", "gmpo", "vespo", "dppo_tv",
                                                              "dppo_kl"]
    assert losses_where(lambda spec: spec.aggregation == CONFIGURABLE) == ["grpo", "cispo", "dppo_tv", "dppo_kl"]
    assert losses_where(lambda spec: spec.clip is None) == ["sapo", "vespo"]
    for name, fn in POLICY_LOSSES.items():
        assert loss_spec(name) is fn.spec and fn.spec.name == name
        assert config_values(LossConfig(name=name)) == fn.spec.defaults()
        params = inspect.signature(fn).parameters
        assert list(params)[:4] == ["logp", "old_logp", "advantages", "mask"]
        assert {p: params[p].default for p in fn.spec.defaults()} == fn.spec.defaults()
    assert describe_loss(LossConfig(name="sapo")) == "gate tau 1 / 1.05"
    assert describe_loss(LossConfig(name="gmpo")) == "clip 0.4 / 0.4 (log-ratio)"
    assert describe_loss(LossConfig(name="vespo")) == "phi k / lambda 2 / 3 (A >= 0), 3 / 2 (A < 0)"
    assert describe_loss(LossConfig(name="dppo_tv")) == "clip 0.2 / 0.2 (probability change)"
    assert describe_loss(LossConfig(name="dppo_kl")) == "clip 0.05 / 0.05 (binary KL)"
    logp, mask = torch.zeros(1, 2, requires_grad=True), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"gspo_loss\(\) got an unexpected keyword argument 'tau_pos'"):
        gspo_loss(logp, torch.zeros(1, 2), torch.ones(1), mask, tau_pos=1.0)


# one short step of the demo's task on the CPU, on-policy (one minibatch, the old log-probs recomputed: ratio 1)
STEP = ["parallel.device=cpu", "train.num_steps=1", "train.sft_steps=0", "train.tensorboard=false", "eval.interval=0",
        "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "train.micro_batch_size=16",
        "train.num_minibatches=1", "train.old_logprobs=recompute", f"reward.name={HERE}/reward_plugins.py:digit_fraction"]


def test_a_plug_in_loss_runs_a_real_rl_step(tmp_path):
    """The plug-in runs the trainer's step (rollout, rewards, advantages, objective, backward, optimizer). On
    policy its surrogate is GRPO's (r = 1: value -A and gradient A grad log pi per token), so the step's loss,
    gradient norm and clip fractions match GRPO's exactly."""
    from job_runner import run_job_rows

    rows = {name: run_job_rows(load_job_config(None, STEP + [loss, f"train.output_dir={tmp_path}/{name}"]))
            for name, loss in (("grpo", "loss.name=grpo"), ("spo", SPO))}
    grpo, spo = rows["grpo"][0], rows["spo"][0]
    assert spo["loss/token_ratio/max"] == 1.0 and spo["loss/advantages/max"] > 0  # on policy, with a signal
    for key in ("loss/loss", "loss/pg_loss", "train/grad_norm", "loss/num_tokens", "loss/clip_frac"):
        assert spo[key] == grpo[key], key
    assert spo["loss/loss"] != 0 and spo["train/grad_norm"] > 0


# what each bad plug-in returns, as the line refusing it says
BAD_RETURNS = [
    ("float_loss", r"its formula returned a float \(0\.5\), not a losses\.PolicyTerms"),
    ("reduced_loss", r"its formula returned terms as a tensor of shape \(\) for a batch of \[B, T\] = \(\d+, \d+\); "
                     r"they must be \[B, T\] = \(\d+, \d+\) \(per_token=True\)"),
    ("row_short_loss", r"its formula returned terms as a tensor of shape \(\d+,\) for a batch of \[B, T\] = "
                       r"\(\d+, \d+\); they must be \[B\] = \(\d+,\) \(per_token=False\)"),
    ("no_metrics_loss", r"its formula's metrics lack clip_frac_low and clip_frac_high \(got \[\]\)"),
    ("float_metrics_loss", r"its formula's metric 'clip_frac_low' is a float \(0\.0\), not a runtime\.metrics\.Metric"),
]


@pytest.mark.parametrize("fn, says", BAD_RETURNS)
def test_a_plug_in_that_returns_the_wrong_thing_is_named_in_one_line(fn, says):
    """A formula's return value is checked on every call (shapes and keys, no host sync) before the plumbing reads
    it: a float, terms of the wrong shape, missing or non-Metric clip fractions are a ConfigError naming
    loss.name, not 'float' object has no attribute 'metrics' / a size mismatch / KeyError: 'clip_frac_low'."""
    from megatron_gspo.algorithms.losses import compute_policy_loss

    name = f"{HERE}/loss_plugins.py:{fn}"
    cfg = load_job_config(None, [f"loss.name={name}"]).loss
    logp = torch.zeros(3, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    with pytest.raises(ConfigError, match=rf"^loss\.name='{re.escape(name)}': " + says):
        compute_policy_loss(cfg, logp, torch.zeros(3, 4), torch.tensor([1.0, -1.0, 0.5]), mask)


@pytest.mark.slow
@pytest.mark.parametrize("fn, says", [BAD_RETURNS[i] for i in (0, 2, 3)])  # a float, a wrong shape, no metrics
def test_a_job_whose_plug_in_loss_returns_the_wrong_thing_exits_2_with_one_line(tmp_path, fn, says):
    """The trainer's command line: the first micro-batch refuses the plug-in's return value, the job ends with one
    'error: ' line naming the plug-in and what it returned, exit 2 (USER_ERRORS), no traceback."""
    import subprocess
    import sys

    root = os.path.dirname(HERE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "WORLD_SIZE", "RANK")}
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="1")
    name = f"tests/loss_plugins.py:{fn}"
    p = subprocess.run([sys.executable, "-m", "megatron_gspo.train", *STEP, f"loss.name={name}",
                        f"train.output_dir={tmp_path}"], capture_output=True, text=True, cwd=root, env=env, timeout=600)
    out = p.stdout + p.stderr
    errors = [ln for ln in out.splitlines() if re.match(r"(\d\d:\d\d:\d\d )?error: ", ln) or "Traceback" in ln]
    assert p.returncode == 2 and len(errors) == 1, out[-3000:]
    assert re.search(rf"error: loss\.name='{re.escape(name)}': " + says, errors[0]), errors[0]


# ----------------------------------------------------------------------------------------------
# Bounds in the training precision
# ----------------------------------------------------------------------------------------------

SUM_NORM = ["loss.name=grpo", "loss.loss_agg_mode=seq-mean-token-sum-norm"]
LARGEST = {"fp32": FP32.max, "bf16": BF16.max, "auto": min(FP32.max, BF16.max)}  # auto: fp32 or bf16


@pytest.mark.parametrize("precision", ["fp32", "bf16", "auto"])
def test_a_norm_constant_whose_gradient_overflows_the_training_precision_is_refused_by_key(precision):
    """A token's gradient is its ratio (up to e^log_ratio_bound) x A / loss_agg_norm_constant; Adam's second
    moment and the gradient norm square it. 1e-30 was accepted (finite in float64) and every update was NaN."""
    job = SUM_NORM + [f"model.precision={precision}"]
    with pytest.raises(ConfigError, match=r"loss\.loss_agg_norm_constant=1e-30 is below [0-9.e+-]+, .*" + precision):
        load_job_config(None, job + ["loss.loss_agg_norm_constant=1e-30"])
    floor = math.exp(20.0) / math.sqrt(LARGEST[precision])
    load_job_config(None, job + [f"loss.loss_agg_norm_constant={floor * 1.01!r}"])
    with pytest.raises(ConfigError, match=r"loss\.loss_agg_norm_constant="):
        load_job_config(None, job + [f"loss.loss_agg_norm_constant={floor * 0.99!r}"])


def test_the_norm_constant_floor_is_where_the_squared_gradient_overflows():
    """One token at the log-ratio bound with A < 0 (GRPO's unclipped side): its fp32 gradient is e^20 / C, whose
    square is finite just above the floor and inf below it; the loss function refuses what the config refuses."""
    from megatron_gspo.algorithms.losses import grpo_loss

    floor = math.exp(20.0) / math.sqrt(FP32.max)

    def squared_grad(c):
        logp = torch.tensor([[20.0]], requires_grad=True)
        loss, _ = grpo_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool),
                            loss_agg_mode="seq-mean-token-sum-norm", loss_agg_norm_constant=c)
        (g,) = torch.autograd.grad(loss, logp)
        return g.square()

    assert torch.isfinite(squared_grad(floor * 1.01)).all()
    with pytest.raises(ValueError, match=r"loss_agg_norm_constant=.* is below .* fp32"):
        squared_grad(floor / 4)
    with pytest.raises(ValueError, match=r"loss_agg_norm_constant=1e-30 is below"):
        squared_grad(1e-30)


@pytest.mark.parametrize("override, match", [
    ("loss.log_ratio_bound=50", r"loss\.log_ratio_bound=50\.0 exceeds 44\.3"),  # e^50 squared: inf in fp32
    ("loss.kl_coef=1e39", r"loss\.kl_coef=1e\+39 exceeds"),
    ("loss.entropy_coef=1e39", r"loss\.entropy_coef=1e\+39 exceeds"),
])
def test_settings_that_overflow_fp32_are_refused_by_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_job_config(None, ["model.precision=fp32", override])


# ----------------------------------------------------------------------------------------------
# SAPO: the gate's temperatures in the training precision, the loss computed stably
# ----------------------------------------------------------------------------------------------

SAPO = ["loss.name=sapo"]
TAU_MAX = math.sqrt(FP32.max)  # SAPO's arithmetic is fp32 in every precision (the loss runs in >= fp32)
TAU_MIN = 2.0 ** -13  # (2 / tau) x fp32's unit roundoff 2^-24 <= 2^-10


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sapo_temperatures_outside_the_precision_are_refused_by_key(precision):
    job = SAPO + [f"model.precision={precision}"]
    with pytest.raises(ConfigError, match=r"loss\.sapo_tau_neg=1e\+39 exceeds 1\.84e\+19, .*fp32"):
        load_job_config(None, job + ["loss.sapo_tau_neg=1e39"])
    with pytest.raises(ConfigError, match=r"loss\.sapo_tau_pos=1e-12 is below 0\.000122, .*fp32"):
        load_job_config(None, job + ["loss.sapo_tau_pos=1e-12"])
    load_job_config(None, job + [f"loss.sapo_tau_pos={TAU_MIN!r}", f"loss.sapo_tau_neg={TAU_MAX * 0.99!r}"])


def test_sapo_refuses_a_temperature_its_inputs_cannot_hold():
    """In the precision of its inputs: 1e39 is inf in fp32 (every update NaN), 1e-12 leaves fp32's rounding of
    2 A / tau above the policy term; both are fine in float64, where the gradient at 1e-12 is the unclipped
    policy gradient's (the gate's weight sech^2 is 1 to 1e-24) and the value within the documented rounding."""
    from megatron_gspo.config.loss_spec import VALUE_ROUNDING
    from megatron_gspo.algorithms.losses import sapo_loss

    logp, old, adv, mask = _sapo_case(torch.float32)
    with pytest.raises(ValueError, match=r"tau_neg=1e\+39 exceeds 1\.84e\+19, .* fp32"):
        sapo_loss(logp, old, adv, mask, tau_neg=1e39)
    with pytest.raises(ValueError, match=r"tau_pos=1e-12 is below 0\.000122, .* fp32"):
        sapo_loss(logp, old, adv, mask, tau_pos=1e-12)
    logp, old, adv, mask = _sapo_case(torch.float64, seed=1)
    loss, _ = sapo_loss(logp, old, adv, mask, tau_pos=1e-12, tau_neg=1e-12)
    value, grad = _sapo_exact(logp, old, adv, 1e-12)
    assert abs(loss.item() - value.item()) <= VALUE_ROUNDING * adv.abs().mean().item()
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], grad, rtol=1e-12, atol=0)
    r = (logp.detach() - old).exp()
    torch.testing.assert_close(grad, -r * adv[:, None] / logp.numel(), rtol=1e-12, atol=0)
    loss, _ = sapo_loss(logp, old, adv, mask, tau_neg=1e39)  # float64 holds it: finite, gradient finite
    assert torch.isfinite(loss) and torch.isfinite(torch.autograd.grad(loss, logp)[0]).all()


def _sapo_case(dtype, seed=0):
    """Off-policy ratios near 1 and advantages that cancel exactly (a group's +a and -a)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(64, 16, generator=g, dtype=torch.float64) * 3
    lr = torch.randn(64, 16, generator=g, dtype=torch.float64) * 1e-2
    a = torch.randn(32, generator=g, dtype=torch.float64)
    adv = torch.cat([a, -a])
    return (old + lr).to(dtype).requires_grad_(), old.to(dtype), adv.to(dtype), torch.ones(64, 16, dtype=torch.bool)


def _sapo_exact(logp, old, adv, tau):
    """SAPO's loss and gradient in float64 from the same inputs, f(r) = (4/tau) sigmoid(tau (r - 1)) written
    as 2/tau + (2/tau) tanh(tau (r - 1) / 2): the constant 2 A / tau apart (its sum is exactly 0 here)."""
    lr = (logp.detach().double() - old.double())
    r, a = lr.exp(), adv.double()[:, None]
    n, length = logp.shape
    value = -((2 / tau) * torch.tanh(tau * (r - 1) / 2) * a).mean(1).sum() / n
    grad = -(1 / torch.cosh(tau * (r - 1) / 2) ** 2) * r * a / (n * length)
    return value, grad


@pytest.mark.parametrize("tau", [1e-3, TAU_MIN])
def test_sapo_loss_is_computed_stably_in_fp32(tau):
    """(4/tau) sigmoid(tau (r - 1)) in fp32 is 2/tau plus a part that sigmoid's rounding near 1/2 blurs, and
    2/tau A swamps the sum: at tau = 1e-3 the loss was off by 2.6%. Logged and returned, it is now exact to
    fp32 rounding, and so is its gradient."""
    from megatron_gspo.algorithms.losses import sapo_loss

    logp, old, adv, mask = _sapo_case(torch.float32)
    loss, metrics = sapo_loss(logp, old, adv, mask, tau_pos=tau, tau_neg=tau)
    value, grad = _sapo_exact(logp, old, adv, tau)
    assert reduce_metrics(metrics)["loss"] == pytest.approx(value.item(), rel=1e-4)
    assert loss.item() == pytest.approx(value.item(), rel=1e-4)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0].double(), grad, rtol=1e-4, atol=1e-9)
