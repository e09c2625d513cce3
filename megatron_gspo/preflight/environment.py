"""What this node has: software versions, the device, bf16 / FP8 capability, and what ``auto``
picks for the model's implementation here (model.resolve_*: the same code the trainer runs)."""

from __future__ import annotations

import torch

from megatron_gspo.preflight.context import Context, bf16_support, need_fp8
from megatron_gspo.preflight.runner import Skip
from megatron_gspo.runtime.sysinfo import machine_info, package_version


def check_versions(ctx: Context):
    info = machine_info(ctx.device.type)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if ctx.cuda else None
    data = {"python": info["python"], "torch": info["torch"], "cuda": torch.version.cuda, "nccl": nccl,
            "megatron_core": info["megatron_core"], "transformer_engine": info["transformer_engine"],
            "apex": package_version("apex")}
    value = ", ".join(f"{k} {v if v is not None else '-'}" for k, v in data.items())
    return value, data


def check_device(ctx: Context):
    info = machine_info(ctx.device.type)
    data = {k: info[k] for k in ("device", "cpu_model", "cpu_cores", "cpu_cores_usable", "memory_gb", "gpus")}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        data.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    compute_capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count())
        return f"{props.name}, {data['gpu_memory_gib']} GiB, sm_{props.major}{props.minor} ({data['gpus']})", data
    return (f"CPU only: {info['cpu_model']}, {info['cpu_cores_usable']}/{info['cpu_cores']} cores usable, "
            f"{info['memory_gb']} GiB"), data


def check_bf16(ctx: Context):
    why = bf16_support(ctx.device)
    if why:
        raise Skip(why)
    return f"bf16 matmul runs on {ctx.device.type}", {"bf16": True}


def check_fp8(ctx: Context):
    need_fp8(ctx)
    import transformer_engine.pytorch as te

    # TE >= 2.8 exports is_fp8_available; older releases have fp8.check_fp8_support
    ok, why = (te.is_fp8_available(return_reason=True) if hasattr(te, "is_fp8_available")
               else te.fp8.check_fp8_support())
    if not ok:
        raise RuntimeError(f"Transformer Engine refuses FP8 on this GPU: {why}")
    return "FP8 supported (Transformer Engine)", {"fp8": True}


def check_auto_impl(ctx: Context):
    """Which spec, experts and precision the job's model runs here, and why (model.resolve_impl / impl_reason
    and job_precision: the code the trainer runs). Where Transformer Engine is installed but does not import,
    the reason is its import error (compat.te_status), not a bare "not installed"."""
    from megatron_gspo.runtime.compat import te_status
    from megatron_gspo.model.experts import grouped_mm_available
    from megatron_gspo.model.gpt import impl_reason, job_precision, resolve_dispatcher, resolve_expert_impl, resolve_impl

    cfg = ctx.job("auto_impl").model
    impl = resolve_impl(cfg, ctx.device)
    experts = resolve_expert_impl(cfg, impl)
    precision, precision_why = job_precision(cfg, ctx.device)
    data = {"transformer_impl": impl, "moe_expert_impl": experts,
            "moe_token_dispatcher_type": resolve_dispatcher(cfg, ctx.device), "precision": precision}
    if experts == "batched":
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        data["batched_gemm"] = "torch._grouped_mm" if grouped_mm_available(ctx.device, dtype) else "loop of torch.mm"
    why = impl_reason(cfg, ctx.device)
    data.update(spec_reason=why, precision_reason=precision_why, transformer_engine=te_status()[1])
    shown = ("transformer_impl", "moe_expert_impl", "moe_token_dispatcher_type", "precision", "batched_gemm")
    value = ", ".join(f"{k}={data[k]}" for k in shown if k in data) + f" ({impl} spec: {why})"
    return value, data
