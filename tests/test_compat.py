"""One device decision (parallel.resolve_device) and the megatron-core workarounds keyed on what is
actually missing (compat.py), checked for every machine on this CPU one.

The H100 that first ran the project had CUDA but no Transformer Engine; the workaround megatron's MoE
router needs there (the unbound ``te_general_gemm``) was applied only without CUDA, so the default job
died at the first forward. These tests pin the decision for each combination, and run a CPU job on a
machine whose torch reports a GPU, which is how a CPU path that keys on ``torch.cuda.is_available()``
instead of the job's device shows itself here.
"""

import pytest
import torch

from megatron_gspo.runtime import compat, parallel
from megatron_gspo.config import ConfigError, ParallelConfig, load_job_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
CPU_ONES = ["cuda_current_device_is_cpu", "cuda_synchronize_noop", "cuda_current_stream_is_host", "rng_tracker_without_cuda"]


@pytest.mark.parametrize("device_type,have_te,expected", [
    ("cuda", True, []),
    ("cuda", False, ["te_general_gemm_none"]),  # the H100 without TE
    # a CPU job on a machine with TE (an NGC container asked for parallel.device=cpu): also torch's Adam and
    # megatron's own multi-tensor kernels instead of TE's CUDA ones (found by the TE tier, tests/te/)
    ("cpu", True, CPU_ONES + ["cpu_optimizer_without_te_kernels", "cpu_router_without_te_gemm"]),
    ("cpu", False, CPU_ONES + ["te_general_gemm_none"]),
])
def test_workarounds_are_keyed_on_what_is_missing(device_type, have_te, expected):
    assert compat.needed(compat.Environment(device_type, have_te)) == expected
    assert all(name in compat.WORKAROUNDS for name in expected)  # each names the symptom it prevents


def test_cuda_without_te_binds_the_router_gemm_and_leaves_torch_cuda_alone(monkeypatch):
    """apply() for a CUDA job on a machine without TE (what the H100 had), here with CUDA stood in:
    megatron's router finds te_general_gemm (None: its plain GEMM), torch.cuda is untouched."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(compat, "have_te", lambda: False)
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    original = compat._ORIGINAL.get("torch.cuda.current_device", torch.cuda.current_device)
    try:
        assert compat.apply(CUDA) == ["te_general_gemm_none"]
        assert moe_utils.te_general_gemm is None
        assert torch.cuda.current_device is original  # a CUDA job gets the real torch.cuda back
        assert type(mrandom._CUDA_RNG_STATE_TRACKER).__name__ != "InferenceCudaRNGStatesTracker"
        # and a CPU job after it in the same process gets the CPU workarounds again
        assert compat.apply(CPU)[:4] == CPU_ONES and torch.cuda.current_device() == "cpu"
        assert type(mrandom._CUDA_RNG_STATE_TRACKER).__name__ == "InferenceCudaRNGStatesTracker"
    finally:
        compat.apply(parallel.resolve_device(ParallelConfig()))


def test_one_device_decision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parallel.resolve_device(ParallelConfig()) == CPU
    assert parallel.resolve_device(ParallelConfig(device="cpu")) == CPU
    with pytest.raises(ConfigError, match="parallel.device=cuda but CUDA is not available on this machine"):
        parallel.resolve_device(ParallelConfig(device="cuda"))
    # a machine with one GPU, as torch would report it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert parallel.resolve_device(ParallelConfig(), local_rank=0) == CUDA
    assert parallel.resolve_device(ParallelConfig(device="cpu"), local_rank=3) == CPU
    with pytest.raises(ConfigError, match=r"local rank 1 has no GPU: this node has 1 visible GPU\(s\).*parallel.device=cpu"):
        parallel.resolve_device(ParallelConfig(), local_rank=1)
    with pytest.raises(ConfigError, match=r"parallel.device='gpu' is not one of \['auto', 'cuda', 'cpu'\]"):
        load_job_config(None, ["parallel.device=gpu"])


def test_machine_dependent_choices_follow_the_job_device():
    from megatron_gspo.model.gpt import build_transformer_config, resolve_dispatcher, resolve_impl

    cfg = load_job_config(None, []).model
    assert resolve_dispatcher(cfg, CPU) == "allgather" and resolve_dispatcher(cfg, CUDA) == "alltoall"
    assert resolve_impl(cfg, CPU) == "local"
    tcfg = build_transformer_config(cfg, ParallelConfig(), CPU)
    assert tcfg.use_cpu_initialization and not tcfg.bias_activation_fusion and not tcfg.deterministic_mode
    assert build_transformer_config(cfg, ParallelConfig(), CPU, deterministic=True).deterministic_mode


def test_the_device_is_decided_in_one_place():
    """No module but parallel.py asks torch whether CUDA is available (sysinfo.py reports what the
    machine has): everything else reads ParallelState.device, so a CPU job on a GPU machine builds and
    feeds the CPU model (benchmarks/run.py --device cpu on the H100 built the model on cuda)."""
    import ast
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    allowed = {os.path.join("megatron_gspo", "runtime", "parallel.py"), os.path.join("megatron_gspo", "runtime", "sysinfo.py")}
    offenders = []
    for top in ("megatron_gspo", "checkpoints_tools", "benchmarks", "experiments"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                if not name.endswith(".py") or rel in allowed:
                    continue
                tree = ast.parse(open(os.path.join(root, rel), encoding="utf-8").read())
                offenders += [f"{rel}:{n.lineno}" for n in ast.walk(tree)
                              if isinstance(n, ast.Attribute) and n.attr == "is_available"
                              and ast.unparse(n.value).endswith("cuda")]
    assert not offenders, f"device decisions outside parallel.resolve_device: {offenders}"


# ----------------------------------------------------------------------------------------------
# Whether Transformer Engine serves megatron here, and why not: said once, never swallowed
# ----------------------------------------------------------------------------------------------


class _BrokenTE:
    """A meta-path finder standing in for a Transformer Engine that is installed but does not import: a
    ``transformer_engine`` package whose ``.pytorch`` fails the way a TE built for another torch does."""

    def __init__(self, monkeypatch):
        import sys
        import types

        te = types.ModuleType("transformer_engine")
        te.__version__ = "2.99.0"
        te.__path__ = []
        monkeypatch.setitem(sys.modules, "transformer_engine", te)
        for name in ("transformer_engine.pytorch", "megatron.core.extensions.transformer_engine"):
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setattr(sys, "meta_path", [self] + sys.meta_path)

    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine.pytorch":
            raise OSError("transformer_engine_torch.so: undefined symbol: _ZN3c104cuda9SetDevice")
        return None


@pytest.fixture
def fresh_te_status():
    compat.te_status.cache_clear()
    yield
    compat.te_status.cache_clear()


def test_a_broken_transformer_engine_is_reported_with_its_import_error_once(monkeypatch, fresh_te_status):
    import logging

    from log_capture import LogLines

    _BrokenTE(monkeypatch)
    with LogLines(logging.WARNING) as said:
        ok, why = compat.te_status()
        assert compat.have_te() is False and compat.te_status() == (ok, why)
    assert not ok
    assert why == ("Transformer Engine 2.99.0 is installed but `import transformer_engine.pytorch` failed: OSError: "
                   "transformer_engine_torch.so: undefined symbol: _ZN3c104cuda9SetDevice")
    assert said.lines == [f"Transformer Engine unusable, the local spec runs: {why}"]  # once, with the reason


def test_transformer_engine_absent_is_said_as_such(monkeypatch, fresh_te_status):
    import sys

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # what an uninstalled package looks like to import
    assert compat.te_status() == (False, "Transformer Engine is not installed (no module transformer_engine)")


def test_te_modules_on_cpu_stands_in_for_cuda_only_inside_and_undoes_it():
    """model.build_model(construct_only=True)'s one stand-in: torch.cuda.is_available answers True while TE's
    modules are built, and the real answer is back afterwards, also when construction fails."""
    real = torch.cuda.is_available
    with compat.te_modules_on_cpu():
        assert torch.cuda.is_available() is True
    assert torch.cuda.is_available is real
    with pytest.raises(ZeroDivisionError):
        with compat.te_modules_on_cpu():
            1 / 0
    assert torch.cuda.is_available is real and "torch.cuda.is_available" not in compat._ORIGINAL


def test_a_cpu_job_on_a_gpu_machine_leaves_torch_compiles_device_checks_working(monkeypatch):
    """Found by benchmarks/gpu_checks.sh on an H100 (torch 2.11): every in-process MoE test (pinned to the CPU)
    and `parallel.device=cpu` jobs failed in megatron's torch.compile'd router (`_apply_expert_bias`) with
    "InternalTorchDynamoError: TypeError: list indices must be integers or slices, not str": dynamo's Triton
    check (torch.utils._triton.has_triton) indexes the GPU list with torch.cuda.current_device(), which the CPU
    workaround answers "cpu". Reproduced here by making this machine look like one with a GPU and Triton to
    that check, with the same call dynamo makes."""
    import types

    from torch._dynamo import device_interface
    from torch.utils import _triton

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(major=9, index=i))
    monkeypatch.setattr(_triton, "has_triton_package", lambda: True)
    monkeypatch.setattr(device_interface, "caching_worker_current_devices", {})
    monkeypatch.setattr(device_interface, "caching_worker_device_properties", {})
    _triton.has_triton.cache_clear()
    try:
        compat.apply(torch.device("cpu"))
        assert torch.cuda.current_device() == "cpu"  # what megatron's tensor factories still get
        assert _triton.has_triton() is True  # was: TypeError: list indices must be integers or slices, not str
        assert device_interface.CudaInterface.Worker.get_device_properties().index == 0
    finally:
        _triton.has_triton.cache_clear()
        compat._restore_dynamo_device()


def test_a_cpu_job_answers_the_current_stream_with_the_host_and_restore_gives_cuda_back():
    """megatron-core 0.19's DDP asks torch.cuda.current_stream() at every gradient sync (for CUDA-graph
    gradient events): a CPU job gets the host's stream, on which waiting is already done; restore() puts
    torch's back (a CUDA job in the same process waits on real streams)."""
    original = compat._ORIGINAL.get("torch.cuda.current_stream", torch.cuda.current_stream)
    try:
        compat.apply(CPU)
        stream = torch.cuda.current_stream()
        assert stream is compat._HOST_STREAM
        assert stream.wait_event(object()) is None and stream.wait_stream(stream) is None
        compat.restore()
        assert torch.cuda.current_stream is original
    finally:
        compat.apply(parallel.resolve_device(ParallelConfig()))


def test_spec_helpers_read_and_swap_both_spec_forms():
    """megatron-core 0.16's ModuleSpec(module, submodules) and 0.19's functools.partial(cls, submodules=...)
    (its MoE layer and experts): the submodules read the same way, and the built class swapped with the
    submodules and arguments kept."""
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    class A:
        def __init__(self, *args, submodules=None, **kwargs):
            self.args, self.submodules, self.kwargs = args, submodules, kwargs

    class B(A):
        pass

    subs = object()
    as_spec, as_partial = ModuleSpec(module=A, submodules=subs), functools.partial(A, 7, submodules=subs, x=1)
    assert compat.spec_submodules(as_spec) is subs and compat.spec_submodules(as_partial) is subs
    swapped = compat.with_module(as_spec, B)
    assert swapped is as_spec and swapped.module is B and swapped.submodules is subs
    built = compat.with_module(as_partial, B)(2)
    assert type(built) is B and built.args == (7, 2) and built.submodules is subs and built.kwargs == {"x": 1}
    assert as_partial.func is A  # the original spec is left as it was


def test_a_cpu_job_where_te_is_installed_routes_with_torchs_gemm_and_a_cuda_job_gets_tes_back(monkeypatch):
    """megatron-core 0.19 binds moe_utils.te_general_gemm (TE's CUDA GEMM) wherever TE imports, and its router
    takes it for a CPU job too ('Found no NVIDIA driver', the TE tier under 0.19.2): a CPU job gets None
    (megatron's torch GEMM), restore() gives the CUDA job TE's back. Here with TE stood in."""
    from megatron.core.transformer.moe import moe_utils

    te_gemm = object()
    monkeypatch.setattr(compat, "have_te", lambda: True)
    monkeypatch.setattr(moe_utils, "te_general_gemm", te_gemm, raising=False)
    try:
        assert "cpu_router_without_te_gemm" in compat.apply(CPU)
        assert moe_utils.te_general_gemm is None
        compat.restore()
        assert moe_utils.te_general_gemm is te_gemm
    finally:
        compat.restore()
        monkeypatch.undo()
        compat.apply(parallel.resolve_device(ParallelConfig()))


def test_loaded_param_groups_take_the_schedule_of_the_group_they_are(monkeypatch):
    """megatron-core 0.19 finds saved param groups by their settings, max_lr among them: a resume allowed to
    change optimizer.lr gets each loaded group the current lr of the group with the same other settings (by
    those, not by position); a group that matches none is left for megatron to name."""
    from megatron.core.optimizer import optimizer as mopt

    monkeypatch.setattr(mopt, "param_group_identifier_keys",
                        ("wd_mult", "lr_mult", "is_expert_parallel", "max_lr", "min_lr"), raising=False)

    class Opt:
        param_groups = [{"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "max_lr": 2e-3, "min_lr": 0.0},
                        {"wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False, "max_lr": 2e-3, "min_lr": 0.0}]

    saved = {"optimizer": {"param_groups": [
        {"wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False, "max_lr": 1e-3, "min_lr": 0.0, "params": [1]},
        {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "max_lr": 1e-3, "min_lr": 0.0, "params": [0]},
        {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": True, "max_lr": 1e-3, "min_lr": 0.0, "params": [2]}]}}
    compat.align_param_groups(Opt(), saved)
    groups = saved["optimizer"]["param_groups"]
    assert [g["max_lr"] for g in groups] == [2e-3, 2e-3, 1e-3]  # the expert group matches none: left as saved
    assert [g["params"] for g in groups] == [[1], [0], [2]] and groups[0]["wd_mult"] == 0.0
    # megatron-core 0.16: nothing a resume may change identifies a group; nothing is touched
    monkeypatch.setattr(mopt, "param_group_identifier_keys", ("wd_mult", "lr_mult"), raising=False)
    saved = {"param_groups": [{"wd_mult": 1.0, "lr_mult": 1.0, "max_lr": 1e-3}]}
    compat.align_param_groups(Opt(), saved)
    assert saved["param_groups"][0]["max_lr"] == 1e-3
