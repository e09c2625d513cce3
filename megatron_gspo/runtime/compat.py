"""Every workaround megatron-core 0.16 and 0.19 need, each keyed on what is actually missing, in one place.

Two things can be missing, and they are independent:

* **CUDA for this job**: the job runs on the CPU (no GPU, or ``parallel.device=cpu`` on a GPU
  machine). megatron-core asks ``torch.cuda`` for devices, streams and RNG states in many places.
* **Transformer Engine**: absent on any device (a GPU box with a pip-installed torch usually has
  no TE). megatron-core's MoE router references a TE symbol whose import failed.

megatron-core 0.16 and 0.19 are both supported (CI runs the fast tier under each); where 0.19 differs the
helper below says so and keys on what it finds (a spec's form, a function's presence), not on a version
string: ``spec_submodules`` / ``with_module`` (0.19 writes MoE specs as partials), ``align_param_groups``
(0.19 finds saved param groups by their lr), ``reset_moe_metrics_tracker`` (0.19's tracker is an object), and
the CPU job's ``current_stream`` and TE router GEMM (WORKAROUNDS). megatron-core 0.19 imports triton at
``import megatron.core``: setup.py asks for it on Python >= 3.12.

``apply(device)`` decides from the job's device and from what is importable (``environment``) and
applies the workarounds that need applying; ``restore()`` undoes the CPU ones. Their owner is the
parallel state: ``parallel.initialize`` applies them, ``parallel.destroy`` restores them (a test
session or the preflight runs several jobs in one process, CPU and CUDA). ``needed`` is the pure
decision, tested for every combination on the CPU (tests/test_compat.py), including "CUDA present,
TE absent". Nothing else in the package patches megatron-core; the other device choices (no grouped
GEMM, the allgather dispatcher, CPU initialization) are *configuration*, keyed on the same device:

* the alltoall dispatcher creates a torch.cuda.Stream: CPU jobs use allgather (model.resolve_dispatcher);
* grouped GEMM, gradient-accumulation and permute fusions need CUDA kernels, and CPU jobs initialize
  on the CPU (model.build_transformer_config);
* megatron's WrappedTorchNorm refuses sequence parallel: model.RMSNorm on any device;
* the default causal-mask path assumes CUDA: model.forward_logits passes CPU inputs an explicit mask;
* megatron's optimizer creates CUDA tensors, and with TE installed takes TE's CUDA-only Adam and
  multi-tensor kernels: ``optimizer_context`` below scopes a redirect and torch's kernels to its calls;
* its DistributedOptimizer reloads checkpoints only with TE's / apex's fused Adam
  (parallel.distributed_optimizer_support);
* the async checkpoint writer spawns processes: entry points keep a ``__main__`` guard.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

# What each workaround prevents (the symptom without it), by name; ``needed`` returns these names.
WORKAROUNDS = {
    # CPU job ------------------------------------------------------------------------------------
    "cuda_current_device_is_cpu":
        "megatron creates tensors on torch.cuda.current_device() (rotary embeddings, sequence-parallel "
        "gathers, router buffers): 'Torch not compiled with CUDA enabled', or on a GPU machine running a CPU "
        "job, tensors on cuda:0 next to a CPU model",
    "cuda_synchronize_noop":
        "dist_checkpointing's writer calls torch.cuda.synchronize() around saves: 'Torch not compiled with "
        "CUDA enabled' (or a CUDA context on GPU 0 for a CPU job)",
    "cuda_current_stream_is_host":
        "megatron-core 0.19's DDP waits on torch.cuda.current_stream() for CUDA-graph gradient events at "
        "every gradient sync (param_and_grad_buffer.start_grad_sync): 'Torch not compiled with CUDA enabled' "
        "at the first step of a CPU job (0.16 never asks for a stream on that path)",
    "rng_tracker_without_cuda":
        "the RNG tracker's fork() swaps CUDA RNG states (attention forks it even at dropout 0) and "
        "activation recompute saves/restores the CUDA RNG state: 'cuda rng state model-parallel-rng is "
        "not added' / 'Torch not compiled with CUDA enabled'",
    "cpu_optimizer_without_te_kernels":
        "with Transformer Engine installed, megatron's optimizer takes TE's FusedAdam and its multi-tensor "
        "grad-norm / scale / copy kernels, CUDA kernels, for a CPU job too: 'CUDA driver version is "
        "insufficient' at the first step (TE without a GPU), or CPU tensors handed to a CUDA kernel (a CPU job "
        "in an NGC container); found by the Transformer Engine test tier",
    "cpu_router_without_te_gemm":
        "with Transformer Engine installed, megatron-core 0.19's MoE router computes its logits with TE's GEMM "
        "(moe_utils.router_gating_linear -> te_general_gemm), a CUDA kernel, for a CPU job too: 'Found no NVIDIA "
        "driver' at the first forward (0.16 never binds it with TE 2.20: its import of TE's get_workspace fails); "
        "found by the TE tier under 0.19.2",
    # Transformer Engine absent (any device) -----------------------------------------------------
    "te_general_gemm_none":
        "moe_utils.router_gating_linear references te_general_gemm, bound only when TE imports: "
        "NameError at the first MoE forward (seen on an H100 without TE). megatron-core 0.19 binds it to None "
        "itself without TE, so there this one changes nothing (apply() binds it only where it is missing)",
}


@dataclass(frozen=True)
class Environment:
    device_type: str  # "cuda" | "cpu": where this job's model and tensors live
    have_te: bool  # transformer_engine and megatron's TE extension import


@functools.lru_cache(maxsize=1)
def te_status() -> tuple[bool, str]:
    """(whether Transformer Engine can serve megatron-core here, why), decided once per process.

    Two imports must succeed: ``transformer_engine.pytorch`` (TE itself, its CUDA libraries and its
    PyTorch extension built for this torch) and ``megatron.core.extensions.transformer_engine`` (megatron's
    wrappers, which check TE's version). Anything else that fails there (a TE built for another torch,
    a missing libcudnn, a megatron that does not know this TE) means the local spec runs; the reason is
    logged once, with the import that failed and its exception, instead of vanishing: a container
    whose TE silently does not import trains on the slower local spec."""
    import importlib

    try:
        import transformer_engine
    except ModuleNotFoundError as e:
        if e.name != "transformer_engine":  # TE is there but something it needs is not
            why = f"`import transformer_engine` failed: {type(e).__name__}: {e}"
            log.warning("Transformer Engine unusable, the local spec runs: %s", why)
            return False, why
        why = "Transformer Engine is not installed (no module transformer_engine)"
        log.info("%s: the local spec runs", why)
        return False, why
    except Exception as e:  # noqa: BLE001 - any import failure is the reason TE cannot serve
        why = f"`import transformer_engine` failed: {type(e).__name__}: {e}"
        log.warning("Transformer Engine unusable, the local spec runs: %s", why)
        return False, why
    version = getattr(transformer_engine, "__version__", "?")
    for name in ("transformer_engine.pytorch", "megatron.core.extensions.transformer_engine"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - see above
            why = f"Transformer Engine {version} is installed but `import {name}` failed: {type(e).__name__}: {e}"
            log.warning("Transformer Engine unusable, the local spec runs: %s", why)
            return False, why
    return True, f"Transformer Engine {version} imports with megatron-core's TE extension"


def have_te() -> bool:
    """Whether Transformer Engine and megatron's TE extension import (te_status says why not)."""
    return te_status()[0]


def environment(device: torch.device) -> Environment:
    return Environment(device_type=torch.device(device).type, have_te=have_te())


def needed(env: Environment) -> list[str]:
    """The workarounds this environment needs (names of WORKAROUNDS), in application order."""
    out = []
    if env.device_type != "cuda":
        out += ["cuda_current_device_is_cpu", "cuda_synchronize_noop", "cuda_current_stream_is_host",
                "rng_tracker_without_cuda"]
        if env.have_te:
            out.append("cpu_optimizer_without_te_kernels")  # applied by optimizer_context, scoped
            out.append("cpu_router_without_te_gemm")
    if not env.have_te:
        out.append("te_general_gemm_none")
    return out


# The originals of what the CPU workarounds replace, to put back for a CUDA job in the same process.
_ORIGINAL: dict[str, object] = {}


def _patch(obj, name: str, value, key: str) -> None:
    _ORIGINAL.setdefault(key, getattr(obj, name))
    setattr(obj, name, value)


def _restore(obj, name: str, key: str) -> None:
    if key in _ORIGINAL:
        setattr(obj, name, _ORIGINAL.pop(key))


def apply(device: torch.device) -> list[str]:
    """Make megatron-core runnable for a job on ``device``; returns the workarounds now in effect.

    Idempotent; a CUDA job after a CPU job in one process gets torch.cuda and megatron's CUDA RNG
    tracker back."""
    from megatron.core.tensor_parallel import random as mrandom

    want = needed(environment(device))
    cpu = "cuda_current_device_is_cpu" in want
    if cpu:
        # `.to("cpu")` / device="cpu" where megatron asks for the current CUDA device
        _dynamo_keeps_the_real_cuda_device()
        _patch(torch.cuda, "current_device", lambda: "cpu", "torch.cuda.current_device")
        _patch(torch.cuda, "synchronize", lambda *a, **k: None, "torch.cuda.synchronize")
        _patch(torch.cuda, "current_stream", lambda *a, **k: _HOST_STREAM, "torch.cuda.current_stream")
        if not _inference_tracker(mrandom):
            # megatron's inference tracker has a no-op fork(); CPU seeding is torch.manual_seed per
            # rank (parallel.set_seed); recompute's RNG save/restore has no CUDA state to keep.
            mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        _patch(mrandom, "_get_cuda_rng_state", lambda *a, **k: None, "mrandom._get_cuda_rng_state")
        _patch(mrandom, "_set_cuda_rng_state", lambda *a, **k: None, "mrandom._set_cuda_rng_state")
    else:
        restore()
        if _inference_tracker(mrandom):
            # a CPU job installed the no-op tracker: megatron's CUDA tracker again (seeded by
            # parallel.set_seed through model_parallel_cuda_manual_seed)
            mrandom.initialize_rng_tracker(force_reset=True)
    if "cpu_router_without_te_gemm" in want:
        from megatron.core.transformer.moe import moe_utils

        if getattr(moe_utils, "te_general_gemm", None) is not None:  # 0.19 binds it; None: torch's GEMM
            _patch(moe_utils, "te_general_gemm", None, "moe_utils.te_general_gemm")
    if "te_general_gemm_none" in want:
        # its import sits in a try block that fails before the name is bound; None makes megatron
        # take its plain torch GEMM. Process-wide on purpose (restore() leaves it): it binds a name
        # megatron's import failed to bind, and TE stays absent for the life of the process.
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    return want


def restore() -> None:
    """Put back what ``apply`` replaced for a CPU job (torch.cuda's current_device / synchronize /
    current_stream, megatron's CUDA RNG-state accessors and TE router GEMM, dynamo's device cache): the parallel
    state that applied them
    calls this when it is torn down (parallel.destroy). megatron's RNG tracker is not swapped back
    here: every job's ``apply`` installs the one its device needs (and parallel.set_seed seeds it)."""
    from megatron.core.tensor_parallel import random as mrandom

    _restore(torch.cuda, "current_device", "torch.cuda.current_device")
    _restore_dynamo_device()
    _restore(torch.cuda, "synchronize", "torch.cuda.synchronize")
    _restore(torch.cuda, "current_stream", "torch.cuda.current_stream")
    if "moe_utils.te_general_gemm" in _ORIGINAL:
        from megatron.core.transformer.moe import moe_utils

        _restore(moe_utils, "te_general_gemm", "moe_utils.te_general_gemm")
    _restore(mrandom, "_get_cuda_rng_state", "mrandom._get_cuda_rng_state")
    _restore(mrandom, "_set_cuda_rng_state", "mrandom._set_cuda_rng_state")


class _HostStream:
    """What torch.cuda.current_stream() answers in a CPU job: the host's one stream of work, in which every
    operation has finished when the next starts, so waiting on it (or on an event) is already done."""

    def wait_event(self, event=None) -> None:
        pass

    def wait_stream(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _dynamo_keeps_the_real_cuda_device() -> None:
    """A CPU job on a machine with a GPU (the tests in the NGC container, ``parallel.device=cpu`` there):
    megatron's ``jit_fuser`` is torch.compile (the router's ``_apply_expert_bias``), and dynamo asks whether
    Triton can use the GPU through ``torch.cuda.current_device()``, which the workaround above answers
    "cpu"; dynamo then indexes its device list with it ("TypeError: list indices must be integers or
    slices, not str", every in-process MoE test on an H100 with torch 2.11). Dynamo reads its own cache of
    the current device first: give it the real one (the device CUDA calls would use; 0 before CUDA is
    initialized), taken out again by _restore_dynamo_device."""
    if torch.cuda.device_count() == 0 or "dynamo.current_device" in _ORIGINAL:  # no GPU: dynamo never asks
        return
    try:
        from torch._dynamo import device_interface
    except ImportError:  # an older torch without the cache reads torch.cuda directly
        return
    cache = getattr(device_interface, "caching_worker_current_devices", None)
    if not isinstance(cache, dict) or "cuda" in cache:
        return
    index = _ORIGINAL.get("torch.cuda.current_device", torch.cuda.current_device)() if torch.cuda.is_initialized() else 0
    cache["cuda"] = index
    _ORIGINAL["dynamo.current_device"] = cache


def _restore_dynamo_device() -> None:
    cache = _ORIGINAL.pop("dynamo.current_device", None)
    if cache is not None:
        cache.pop("cuda", None)


def _inference_tracker(mrandom) -> bool:
    """Whether megatron's RNG tracker is its inference tracker (no-op fork), the CPU workaround's."""
    tracker = getattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    return tracker is not None and type(tracker).__name__ == "InferenceCudaRNGStatesTracker"



# ---- megatron-core's release lines (0.16 and 0.19 are tested; each helper keys on what it finds) ------


def spec_submodules(spec):
    """The submodules of one of megatron's module specs.

    megatron-core 0.16 writes every spec as ``ModuleSpec(module=cls, submodules=...)``; 0.19 writes some
    as ``functools.partial(cls, submodules=...)`` (the MoE layer and its experts,
    ``moe_module_specs.get_moe_module_spec_for_backend``): ``spec.submodules`` there is "AttributeError:
    'functools.partial' object has no attribute 'submodules'"."""
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    return spec.submodules


def with_module(spec, module: type):
    """``spec`` building ``module`` instead of its own class, with the same submodules and arguments
    (a ModuleSpec, changed in place, or a functools.partial, replaced: see spec_submodules)."""
    if isinstance(spec, functools.partial):
        return functools.partial(module, *spec.args, **spec.keywords)
    spec.module = module
    return spec


# What a resume may have been allowed to change in a param group (checkpoint.allow_config_change: optimizer.lr,
# min_lr, weight_decay): the learning-rate and weight-decay schedule's ends.
_SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")


def align_param_groups(optimizer, state: dict) -> None:
    """Give each loaded param group the schedule settings of the current group it is (the same by every other
    identifying setting), so that megatron-core 0.19 finds it.

    0.19 matches saved param groups to the optimizer's by ``param_group_identifier_keys``, which there include
    max_lr / min_lr / start_wd / end_wd (0.16's are wd_mult, lr_mult and two flags only): a resume that was
    allowed to change the learning rate failed with "Could not find parameter group with key ...". A loaded
    group that matches no current group, or several, is left as it is (megatron's own error then names it)."""
    from megatron.core.optimizer import optimizer as mopt

    keys = [k for k in getattr(mopt, "param_group_identifier_keys", ()) if k not in _SCHEDULE_KEYS]
    if len(keys) == len(getattr(mopt, "param_group_identifier_keys", ())):
        return  # 0.16: nothing a resume may change identifies a group
    current = list(getattr(optimizer, "param_groups", []))
    def ident(g):
        return tuple(g.get(k, g.get(f"pre_{k}")) for k in keys)
    stack = [state]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for loaded in node.get("param_groups") or []:
            same = [g for g in current if ident(g) == ident(loaded)]
            if len(same) == 1:
                loaded.update({k: same[0][k] for k in _SCHEDULE_KEYS if k in same[0]})
        stack.extend(v for k, v in node.items() if k != "param_groups")


def reset_moe_metrics_tracker() -> None:
    """Drop megatron's MoE aux-loss logging tracker (sized by the first model built, kept on its device).

    megatron-core 0.16 keeps it as the dict ``get_moe_layer_wise_logging_tracker()`` returns; 0.19 keeps a
    MoEMetricsTracker object (moe_logging.py) of which that function returns a fresh dict, so clearing the dict
    left the tracker as it was (the next job of another depth in the process found the last one's entries)."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:  # 0.16
        moe_logging = None
    if moe_logging is not None and hasattr(moe_logging, "destroy_moe_metrics_tracker"):
        moe_logging.destroy_moe_metrics_tracker()
        return
    from megatron.core.transformer.moe import moe_utils

    moe_utils.get_moe_layer_wise_logging_tracker().clear()


@contextlib.contextmanager
def te_modules_on_cpu():
    """Scope in which Transformer Engine's modules *construct* with their parameters on the CPU, for
    model.build_model(construct_only=True) (tests of the TE spec's names, checkpoints and conversions
    on a machine without a GPU); undone on exit.

    TE's linear, grouped-linear and attention modules refuse to be built unless
    ``torch.cuda.is_available()`` (transformer_engine/pytorch/module/base.py: "TransformerEngine needs
    CUDA."), although with megatron's ``use_cpu_initialization`` they allocate nothing on a GPU. That one
    answer is the only thing faked, and only while the modules are built; nothing here can make a TE
    kernel run (the model's forward is refused: model.build_model). Everything else a CPU job needs is
    ``apply(cpu)``'s, as for any CPU job."""
    _patch(torch.cuda, "is_available", lambda: True, "torch.cuda.is_available")
    try:
        yield
    finally:
        _restore(torch.cuda, "is_available", "torch.cuda.is_available")


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


def optimizer_context(device: torch.device):
    """Context for building, stepping, saving and loading megatron-core's optimizer of a job on ``device``.

    On a CPU job: FP32Optimizer.__init__ and clip_grads create ``torch.tensor(..., device='cuda')``
    ("Torch not compiled with CUDA enabled", or a CUDA tensor beside CPU gradients on a GPU machine)
    and clip_grad_by_total_norm_fp32 asserts on the grad's CUDA type name; where Transformer Engine is
    installed, megatron also picks TE's CUDA-only Adam and multi-tensor kernels (WORKAROUNDS
    "cpu_optimizer_without_te_kernels"): torch's Adam and megatron's own multi-tensor functions instead,
    for the calls inside this context only (a CUDA job in the same process keeps TE's). On CUDA it does
    nothing."""
    if torch.device(device).type == "cuda":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    if "cpu_optimizer_without_te_kernels" in needed(environment(device)):
        stack.enter_context(_torch_optimizer_kernels())
    stack.enter_context(_CudaTensorsOnCPU())
    return stack


@contextlib.contextmanager
def _torch_optimizer_kernels():
    """megatron's optimizer as it is built without TE / apex: torch's Adam(W) (USING_PYTORCH_OPTIMIZER) and
    megatron.core.utils' multi-tensor applier, l2 norm and scale, which run on any device."""
    from megatron.core import optimizer as mopt
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer as mopt_optimizer

    swaps = [(mopt, "USING_PYTORCH_OPTIMIZER", True),
             (clip_grads, "multi_tensor_applier", mutils.local_multi_tensor_applier),
             (clip_grads, "l2_norm_impl", mutils.local_multi_tensor_l2_norm),
             (clip_grads, "multi_tensor_scale_impl", mutils.local_multi_tensor_scale),
             (mopt_optimizer, "multi_tensor_applier", mutils.local_multi_tensor_applier),
             (mopt_optimizer, "multi_tensor_scale_impl", mutils.local_multi_tensor_scale)]
    if hasattr(clip_grads, "multi_tensor_scale_tensor_impl"):
        # megatron-core 0.19: TE's scale-by-a-tensor kernel where TE imports ("CUDA driver version is
        # insufficient" in clip_grad_by_total_norm_fp32); None is its own choice without TE / apex (a float norm)
        swaps.append((clip_grads, "multi_tensor_scale_tensor_impl", None))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in swaps]
    for obj, name, value in swaps:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
