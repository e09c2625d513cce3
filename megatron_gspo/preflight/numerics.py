"""Two implementations of the same model on the same weights must give the same log-probs: the
Transformer Engine spec against the local spec, the fast expert path that ``auto`` picks
(TE grouped GEMM, or the local spec's batched experts) against megatron's per-expert loop, and the
fused output-layer log-probs against the logits path (values, gradients, time and memory).

Weights are copied in memory, renamed between the specs' parameter names, so the check needs no
shared filesystem under torchrun."""

from __future__ import annotations

import dataclasses
import re
import time

import torch

from megatron_gspo.preflight.context import Context, need_cuda, need_te

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
    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model.logprobs import vocab_parallel_logprobs
    from megatron_gspo.model.gpt import build_model, forward_logits

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
    from megatron_gspo.model.gpt import resolve_expert_impl, resolve_impl

    m = _model(ctx, "bf16" if ctx.cuda else "fp32")
    fast = dataclasses.replace(m, moe_expert_impl="auto")
    impl = resolve_expert_impl(fast, resolve_impl(fast, ctx.device))
    r = compare_logprobs(ctx, dataclasses.replace(m, moe_expert_impl="sequential"), fast)
    r["expert_impl"] = impl
    return _value(f"{impl} experts vs sequential loop", r), r


# ----------------------------------------------------------------------------------------------
# Fused log-probs (output layer inside the chunked log-prob) against the logits path
# ----------------------------------------------------------------------------------------------

FUSED_FULL = {"tokens": 16384, "hidden": 2048, "vocab": 151936}  # 2B proxy / 30B output layer, 64 x 256 tokens
FUSED_QUICK = {"tokens": 512, "hidden": 256, "vocab": 32000}
# fused vs logits path, by dtype: values (max |d log-prob|) and gradients (relative norm of the difference)
FUSED_TOLERANCE = {"bfloat16": {"value": 0.05, "grad": 0.02}, "float32": {"value": 1e-4, "grad": 1e-4}}


def measure_fused_logprobs(device: torch.device, dtype: torch.dtype, tokens: int, hidden: int, vocab: int,
                           seed: int = 0) -> dict:
    """Output layer + log-probs + backward two ways on the same [tokens, hidden] states and [vocab, hidden]
    weight: ``F.linear`` -> [tokens, vocab] logits -> ``vocab_parallel_logprobs`` (the path before issue
    23), and ``fused_logprobs.output_layer_logprobs`` (vocabulary chunks, no logits tensor). Returns the
    log-prob and gradient differences, each path's wall ms (second of two runs) and, on CUDA, its peak
    memory above the inputs (GiB)."""
    import torch.nn.functional as F

    from megatron_gspo.model.fused_logprobs import output_layer_logprobs
    from megatron_gspo.model.logprobs import vocab_parallel_logprobs

    g = torch.Generator(device=device).manual_seed(seed)
    h0 = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    w0 = (0.02 * torch.randn(vocab, hidden, generator=g, device=device)).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    cuda = device.type == "cuda"

    def logits_path(h, w):
        return vocab_parallel_logprobs(F.linear(h, w), target, vocab, with_entropy=False)[0]

    def fused_path(h, w):
        return output_layer_logprobs(h, w, target, vocab, None, with_entropy=False)[0]

    out = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": str(dtype).replace("torch.", "")}
    results = {}
    for name, fn in (("logits", logits_path), ("fused", fused_path)):
        for _ in range(2):  # the second run is timed (the first pays for kernel selection)
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            lp = fn(h, w)
            lp.sum().backward()
            if cuda:
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
        out[f"{name}_ms"] = 1e3 * dt
        out[f"{name}_peak_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if cuda else None
        results[name] = (lp.detach().float(), h.grad.float(), w.grad.float())
        del h, w, lp
    (lp_a, gh_a, gw_a), (lp_b, gh_b, gw_b) = results["logits"], results["fused"]
    out["max_abs_diff"] = float((lp_a - lp_b).abs().max())
    out["grad_hidden_rel"] = float((gh_a - gh_b).norm() / gh_a.norm())
    out["grad_weight_rel"] = float((gw_a - gw_b).norm() / gw_a.norm())
    if not all(torch.isfinite(t).all() for r in results.values() for t in r):
        raise RuntimeError("non-finite log-probs or gradients")
    return out


def check_fused_logprobs(ctx: Context):
    """On CUDA only: values and gradients are tested on the CPU (tests/test_logprobs.py); the speed and
    the memory, what the fused path is for, mean something on the GPU."""
    need_cuda(ctx)
    shape = FUSED_QUICK if ctx.quick else FUSED_FULL
    r = measure_fused_logprobs(ctx.device, torch.bfloat16, **shape)
    tol = FUSED_TOLERANCE[r["dtype"]]
    if r["max_abs_diff"] > tol["value"] or max(r["grad_hidden_rel"], r["grad_weight_rel"]) > tol["grad"]:
        raise RuntimeError(f"fused log-probs differ from the logits path: max |d| {r['max_abs_diff']:.3g} (tol "
                           f"{tol['value']}), gradient rel. {r['grad_hidden_rel']:.3g} / {r['grad_weight_rel']:.3g} "
                           f"(tol {tol['grad']})")
    return (f"fused {r['fused_ms']:.1f} ms, {r['fused_peak_gib']:.2f} GiB vs logits path {r['logits_ms']:.1f} ms, "
            f"{r['logits_peak_gib']:.2f} GiB ({r['tokens']} tokens x vocab {r['vocab']}, {r['dtype']}); max |d log-prob| "
            f"{r['max_abs_diff']:.2g}, gradient rel. diff {max(r['grad_hidden_rel'], r['grad_weight_rel']):.2g}"), r
