"""Every workaround megatron-core 0.16 needs to run on a machine without CUDA, in one place.

``apply()`` is idempotent and does nothing when CUDA is available: on a GPU the real code paths
run untouched. Nothing else in the package patches megatron-core; the other CPU choices (no
grouped GEMM, allgather dispatcher, CPU initialization) are *configuration* and live in
``model.build_transformer_config`` as "no CUDA -> this setting".
Each item names the symptom it prevents (what breaks on a CPU-only machine without it).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply() -> bool:
    """Patch megatron-core for CPU-only execution. Returns True if patches were applied."""
    global _APPLIED
    if cuda_available():
        return False
    if _APPLIED:
        return True

    # 1. RotaryEmbedding moves inv_freq to torch.cuda.current_device() at first forward
    #    -> "Torch not compiled with CUDA enabled". Answer "cpu" instead: `.to("cpu")` is a no-op.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    # 2. dist_checkpointing's filesystem writer calls torch.cuda.synchronize() around saves
    #    -> same error. There is nothing to synchronize without CUDA.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    # 3. The default causal mask path assumes CUDA; model.causal_attention_mask() builds the
    #    explicit boolean [1, 1, s, s] mask instead (a forward argument, nothing to patch here).

    # 4. The RNG tracker's fork() swaps CUDA RNG states (dropout in attention forks it even at
    #    p=0) -> "cuda rng state model-parallel-rng is not added". Megatron's own inference tracker
    #    has a no-op fork; CPU seeding is torch.manual_seed per rank (parallel.set_seed).
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # 4b. Activation recompute (CheckpointFunction) saves and restores the CUDA RNG state around
    #     the recomputed forward -> "Torch not compiled with CUDA enabled" in backward. There is no
    #     CUDA RNG to keep in step; the CPU generator needs no restoring (no dropout draws).
    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None

    # 5. moe_utils references te_general_gemm in the fp32 router GEMM even when TE is absent
    #    (its import sits in a try block that fails before the name is bound) -> NameError.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # 6. The alltoall token dispatcher creates a torch.cuda.Stream: model.py picks "allgather"
    #    on CPU (configuration, see resolve_dispatcher). Nothing to patch.
    # 7. WrappedTorchNorm refuses sequence parallel: model.py uses megatron_gspo.model.RMSNorm
    #    in the local spec. Nothing to patch.
    # 8. grouped GEMM / gradient-accumulation fusion / permute fusion need CUDA kernels and
    #    use_cpu_initialization must be on: set in build_transformer_config. Nothing to patch.
    # 9. The async checkpoint writer spawns processes: entry points keep a __main__ guard.
    # 10. megatron's optimizer and grad clipping create device='cuda' tensors and assert
    #     param.grad.type() == 'torch.cuda.FloatTensor': see optimizer_context() below.
    # 11. megatron's DistributedOptimizer trains with that context but cannot reload its checkpoints
    #     without TE's / apex's fused Adam: parallel.resolve_distributed_optimizer() picks the
    #     replicated optimizer on the CPU (configuration, nothing to patch).

    _APPLIED = True
    return True


class _CudaTensorsOnCPU(TorchFunctionMode):
    """Redirect ``device='cuda'`` factory calls to the CPU and report CPU float tensors with their
    CUDA type name. Scoped to megatron's optimizer calls (a global mode would tax every op)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and str(dev).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def optimizer_context():
    """Context for building and stepping megatron-core's optimizer (workaround 10).

    Without it on CPU: FP32Optimizer.__init__ and clip_grads raise "Torch not compiled with CUDA
    enabled" (``torch.tensor(..., device='cuda')``) and clip_grad_by_total_norm_fp32 asserts on
    the grad's type name. On GPU it is a no-op context.
    """
    return _CudaTensorsOnCPU() if not cuda_available() else contextlib.nullcontext()
