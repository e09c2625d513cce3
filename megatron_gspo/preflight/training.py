"""Real RL steps on this device through the project's Trainer: the demo job's step (generation, old
log-probs, a GSPO update), the same in FP8, and the speed of each phase on the 2B proxy.

The Trainer is used as the training entry point uses it, except that the process groups stay up
afterwards (train.run_trainer tears them down: the checks after this one still need them)."""

from __future__ import annotations

import math

import torch

from megatron_gspo.model.flops import flops_per_token, mfu, peak_flops
from megatron_gspo.runtime.hooks import TrainerHook
from megatron_gspo.preflight.context import Context, need_bf16, need_fp8
from megatron_gspo.preflight.runner import Skip

SPEED_PRESET = "qwen3-moe-2b-proxy"
# --quick (and a CPU, where the 2B proxy's 151936-row embedding, its gradient and Adam state alone
# take ~11 GiB): the proxy's family at the tiny preset's size. A GPU without --quick runs the proxy.
SPEED_QUICK_MODEL = {"preset": "tiny", "precision": "bf16"}
SPEED_FULL_MODEL = {"preset": SPEED_PRESET}
FP8 = ["model.fp8=hybrid", "model.transformer_impl=transformer_engine"]


class _BatchShapes(TrainerHook):
    """This rank's rollout of each step: rows, forwarded width and its own generation timing (the
    trainer's perf/gen_tokens is summed over DP; per-device rates need the local numbers)."""

    def __init__(self):
        self.steps: list[dict] = []

    def after_rollout(self, trainer, batch) -> None:
        self.steps.append({"rows": batch.num_rows, "width": batch.tokens.shape[1] - 1,
                           "gen_tokens": int(batch.timings["gen_tokens"]), "gen_s": float(batch.timings["gen_s"])})


def run_steps(cfg) -> tuple[dict, dict]:
    """Run ``cfg`` (train.num_steps steps) in this process; (last step's metrics, its local batch)."""
    from megatron_gspo.trainer.loop import Trainer

    shapes = _BatchShapes()
    trainer = Trainer(cfg, hooks=[shapes])
    try:
        history = trainer.run()["history"]
    finally:
        trainer.close()
    return history[-1], shapes.steps[-1]


def _step_summary(m: dict, shape: dict, cfg, device) -> tuple[str, dict]:
    from megatron_gspo.model.gpt import job_precision

    precision = job_precision(cfg.model, device)[0]  # what the job ran in (model.precision=auto resolved)
    loss, gnorm = m["loss/loss"], m["train/grad_norm"]
    if not (math.isfinite(loss) and math.isfinite(gnorm)) or m["train/skipped_updates"]:
        raise RuntimeError(f"non-finite step: loss {loss}, grad norm {gnorm}, {m['train/skipped_updates']:.0f} "
                           "update(s) skipped")
    data = {"loss": loss, "grad_norm": gnorm, "reward_mean": m["rollout/reward_mean"],
            "rows": shape["rows"], "seq_len": shape["width"] + 1, "step_time_s": m["perf/step_time_s"],
            "model": cfg.model.preset, "precision": precision, "fp8": cfg.model.fp8}
    value = (f"loss {loss:.4g}, grad norm {gnorm:.3g}, reward {data['reward_mean']:.3f}, {shape['rows']} rows x "
             f"{data['seq_len']} tokens, {data['step_time_s']:.2f} s ({cfg.model.preset}, {precision}"
             f"{', fp8 ' + cfg.model.fp8 if cfg.model.fp8 else ''})")
    return value, data


def check_rl_step(ctx: Context):
    cfg = ctx.job("rl_step")
    return _step_summary(*run_steps(cfg), cfg, ctx.device)


def check_rl_step_fp8(ctx: Context):
    need_fp8(ctx)
    # the demo's tiny model in bf16 + FP8 GEMMs (TE needs the bf16 path under FP8)
    cfg = ctx.job("rl_step_fp8", "model.precision=bf16", *FP8)
    return _step_summary(*run_steps(cfg), cfg, ctx.device)


# ----------------------------------------------------------------------------------------------
# Speed
# ----------------------------------------------------------------------------------------------


def measure_speed(ctx: Context, fp8: bool) -> dict:
    """Two RL steps of the speed job; the second one's phases (the first pays for warm-up: kernel
    selection, allocator growth). Rates are per device: this rank's tokens over its own time."""
    full = ctx.cuda and not ctx.quick
    extra = ["train.num_steps=2"] + (FP8 if fp8 else []) + (["generation.max_new_tokens=64"] if full else [])
    cfg = ctx.job("speed_fp8" if fp8 else "speed_bf16", *extra, model=SPEED_FULL_MODEL if full else SPEED_QUICK_MODEL)
    m, shape = run_steps(cfg)
    # The work the model did: every row at the padded width (what forward_logits computes over).
    width, tokens = shape["width"], shape["rows"] * shape["width"]
    dtype = "fp8" if fp8 else cfg.model.precision
    peak = peak_flops(torch.cuda.get_device_name(ctx.device), dtype) if ctx.cuda else None
    train_f, lp_f = flops_per_token(cfg.model, width), flops_per_token(cfg.model, width, training=False)
    train_tps, lp_tps = tokens / m["perf/train_s"], tokens / m["perf/old_logprob_s"]
    return {
        "model": cfg.model.preset if full else f"{cfg.model.preset} ({'--quick' if ctx.quick else 'no CUDA'}: "
                                               f"not {SPEED_PRESET})",
        "dtype": dtype, "tokens": tokens, "rows": shape["rows"], "seq_len": width + 1,
        "train_s": m["perf/train_s"], "train_tokens_per_s": train_tps, "train_tflops": train_tps * train_f / 1e12,
        "train_mfu": mfu(train_tps, train_f, peak), "peak_flops": peak,
        "logprob_s": m["perf/old_logprob_s"], "logprob_tokens_per_s": lp_tps, "logprob_tflops": lp_tps * lp_f / 1e12,
        "gen_tokens": shape["gen_tokens"], "gen_s": shape["gen_s"],
        "gen_tokens_per_s": shape["gen_tokens"] / max(shape["gen_s"], 1e-9),
    }


def _speed(ctx: Context, fp8: bool) -> dict:
    need_fp8(ctx) if fp8 else need_bf16(ctx)
    return ctx.memo(f"speed_fp8={fp8}", lambda: measure_speed(ctx, fp8))


def _positive(value: float, what: str) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise RuntimeError(f"{what} is {value}")
    return value


def _train(ctx: Context, fp8: bool):
    s = _speed(ctx, fp8)
    _positive(s["train_tokens_per_s"], "training tokens/s")
    return (f"{s['train_tokens_per_s']:.1f} tokens/s, {s['train_tflops']:.4g} TFLOP/s per device "
            f"({s['model']}, {s['dtype']}, {s['rows']} rows x {s['seq_len']})"), s


def _mfu(ctx: Context, fp8: bool):
    s = _speed(ctx, fp8)
    if s["train_mfu"] is None:
        raise Skip(f"no peak for this device ({torch.cuda.get_device_name(ctx.device) if ctx.cuda else 'CPU'}, "
                   f"{s['dtype']}); TFLOP/s in speed.train_{'fp8' if fp8 else 'bf16'}")
    return f"{100 * s['train_mfu']:.1f}% of {s['peak_flops'] / 1e12:.0f} TFLOP/s {s['dtype']} peak", s


def check_train_bf16(ctx):
    return _train(ctx, fp8=False)


def check_mfu_bf16(ctx):
    return _mfu(ctx, fp8=False)


def check_train_fp8(ctx):
    return _train(ctx, fp8=True)


def check_mfu_fp8(ctx):
    return _mfu(ctx, fp8=True)


def check_generation(ctx):
    s = _speed(ctx, fp8=False)
    _positive(s["gen_tokens_per_s"], "generation tokens/s")
    return f"{s['gen_tokens_per_s']:.1f} generated tokens/s per device ({s['gen_tokens']} tokens, KV cache)", \
        {k: s[k] for k in ("gen_tokens", "gen_s", "gen_tokens_per_s", "model", "dtype")}


def check_logprob(ctx):
    s = _speed(ctx, fp8=False)
    _positive(s["logprob_tokens_per_s"], "log-prob pass tokens/s")
    return (f"{s['logprob_tokens_per_s']:.1f} tokens/s, {s['logprob_tflops']:.4g} TFLOP/s per device "
            f"(old-policy pass, no grad)"), \
        {k: s[k] for k in ("logprob_s", "logprob_tokens_per_s", "logprob_tflops", "tokens", "model", "dtype")}
