"""Two implementations of the same model on the same weights must give the same log-probs: the
Transformer Engine spec against the local spec, and the fast expert path that ``auto`` picks
(TE grouped GEMM, or the local spec's batched experts) against megatron's per-expert loop.

Weights are copied in memory, renamed between the specs' parameter names, so the check needs no
shared filesystem under torchrun."""

from __future__ import annotations

import dataclasses
import re

import torch

from megatron_gspo.preflight.context import Context, need_te

# log-prob tolerances, by compute dtype: bf16 rounds every GEMM output to 8 bits of mantissa and the
# two paths sum in different orders; fp32 differences are summation order only.
TOLERANCE = {"bf16": {"max": 0.1, "mean": 0.02}, "fp32": {"max": 1e-4, "mean": 1e-5}}
NUMERICS_QUICK_MODEL = {"preset": "tiny"}
NUMERICS_FULL_MODEL = {"preset": "qwen3-moe-2b-proxy", "num_layers": 2}

# local spec name -> TE spec name (TE fuses the input norm into linear_qkv; grouped experts keep one
# weight<i> per expert inside linear_fc1 / linear_fc2)
_RENAMES = [(re.compile(r"\.input_layernorm\.weight$"), ".self_attention.linear_qkv.layer_norm_weight"),
            (re.compile(r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"), r".experts.\2.weight\1")]


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Every parameter of ``src`` into ``dst`` under the other spec's name; refuses a partial copy."""
    dst_sd = dst.state_dict()
    out, unused = {}, []
    for name, t in src.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        target = name
        if target not in dst_sd:
            for pat, rep in _RENAMES:
                target = pat.sub(rep, target)
        if target not in dst_sd:
            unused.append(name)
            continue
        out[target] = t
    missing = [k for k in dst_sd if k not in out and not k.endswith("_extra_state")]
    if unused or missing:
        raise RuntimeError(f"weights do not map between the two models: unused {unused[:4]}, missing {missing[:4]}")
    dst.load_state_dict(out, strict=False)


def compare_logprobs(ctx: Context, ref_cfg, test_cfg) -> dict:
    """Build both models on this device, same weights, same tokens: the log-prob differences."""
    from megatron_gspo import parallel
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.logprobs import vocab_parallel_logprobs
    from megatron_gspo.model import build_model, forward_logits

    par = ParallelConfig(use_distributed_optimizer=False, device=ctx.device.type)
    state = parallel.initialize(ref_cfg, par)
    ref = build_model(ref_cfg, par, state).eval()
    test = build_model(test_cfg, par, state).eval()
    copy_weights(ref, test)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    tokens = torch.randint(0, ref_cfg.vocab_size, (2, 33), generator=gen, device=ctx.device)
    with torch.no_grad():
        lps = [vocab_parallel_logprobs(forward_logits(m, tokens[:, :-1]), tokens[:, 1:], ref_cfg.vocab_size,
                                       state.tp_group, with_entropy=False)[0] for m in (ref, test)]
    diff = (lps[0] - lps[1]).abs()
    if not torch.isfinite(diff).all():
        raise RuntimeError("non-finite log-probs")
    tol = TOLERANCE[ref_cfg.precision]
    res = {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()), "tolerance": tol,
           "dtype": ref_cfg.precision, "model": ref_cfg.preset, "num_layers": ref_cfg.num_layers,
           "tokens": int(diff.numel())}
    if res["max_abs_diff"] > tol["max"] or res["mean_abs_diff"] > tol["mean"]:
        raise RuntimeError(f"log-probs differ beyond tolerance: max |d| {res['max_abs_diff']:.3g} (tol {tol['max']}), "
                           f"mean {res['mean_abs_diff']:.3g} (tol {tol['mean']})")
    return res


def _model(ctx: Context, precision: str):
    m = ctx.job("numerics", model=NUMERICS_QUICK_MODEL if ctx.quick else NUMERICS_FULL_MODEL).model
    return dataclasses.replace(m, precision=precision)


def _value(what: str, r: dict) -> str:
    return (f"{what}: log-prob max |d| {r['max_abs_diff']:.2g}, mean {r['mean_abs_diff']:.2g} "
            f"(tol {r['tolerance']['max']:g} / {r['tolerance']['mean']:g}, {r['dtype']}, {r['model']} "
            f"{r['num_layers']} layers)")


def check_te_vs_local(ctx: Context):
    need_te(ctx)
    m = _model(ctx, "bf16")
    local = dataclasses.replace(m, transformer_impl="local", moe_expert_impl="sequential")
    te = dataclasses.replace(m, transformer_impl="transformer_engine", moe_expert_impl="sequential")
    r = compare_logprobs(ctx, local, te)
    return _value("TE spec vs local spec", r), r


def check_experts(ctx: Context):
    """The expert path ``auto`` picks against megatron's SequentialMLP loop, same spec; runs on the
    CPU too (bf16 on a GPU, fp32 on a CPU: the precision each one trains in by default)."""
    from megatron_gspo.model import resolve_expert_impl, resolve_impl

    m = _model(ctx, "bf16" if ctx.cuda else "fp32")
    fast = dataclasses.replace(m, moe_expert_impl="auto")
    impl = resolve_expert_impl(fast, resolve_impl(fast, ctx.device))
    r = compare_logprobs(ctx, dataclasses.replace(m, moe_expert_impl="sequential"), fast)
    r["expert_impl"] = impl
    return _value(f"{impl} experts vs sequential loop", r), r
