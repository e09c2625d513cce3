"""An out-of-memory error in a phase of the RL step names the phase, the shapes, the config knobs and
the memory estimate (megatron_gspo/model/oom.py) and ends the job as a user error (exit 2, one line), not a
CUDA allocator trace. The GPU's error is injected: torch.OutOfMemoryError raised where the phase's
forward runs."""

import os

import pytest
import torch

from megatron_gspo.errors import USER_ERRORS, MemoryBudgetError

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = [
    "parallel.device=cpu",
    "train.num_steps=1", "train.prompts_per_step=2", "generation.n_samples_per_prompt=2",
    "generation.max_new_tokens=4", "train.micro_batch_size=2", "train.num_minibatches=1", "train.tensorboard=false",
    "eval.interval=0", "train.sft_steps=0", f"reward.name={HERE}/reward_plugins.py:digit_fraction",
]
CUDA_OOM = ("CUDA out of memory. Tried to allocate 9.35 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.2 GiB is free. Of the allocated memory 67.4 GiB is allocated by PyTorch")


def _raise_oom(*a, **k):
    raise torch.OutOfMemoryError(CUDA_OOM)


@pytest.mark.parametrize("where,knobs", [
    ("training", ["train.micro_batch_size=2 (lower it)", "train.max_tokens_per_micro_batch=null"]),
    ("generation", ["generation.max_new_tokens=4 (lower it)", "train.prompts_per_step=2"]),
    ("old_logprobs", ["train.micro_batch_size=2 (lower it)"]),
])
def test_oom_names_the_phase_knobs_and_estimate(tmp_path, monkeypatch, capfd, where, knobs):
    import megatron_gspo.rollout.colocated as colocated
    import megatron_gspo.rollout.prepare as prepare
    import megatron_gspo.trainer.loop as trainer_mod
    from megatron_gspo.train import main

    assert MemoryBudgetError in USER_ERRORS
    if where == "training":
        monkeypatch.setattr(trainer_mod, "forward_logprobs", _raise_oom)
    elif where == "generation":
        monkeypatch.setattr(colocated.Generator, "generate", _raise_oom)  # the rollout source's kept generator
    else:
        monkeypatch.setattr(prepare, "forward_logprobs", _raise_oom)
    extra = ["train.old_logprobs=recompute"] if where == "old_logprobs" else []
    rc = main(JOB + extra + [f"train.output_dir={tmp_path}"])
    assert rc == 2
    out = capfd.readouterr()
    text = out.out + out.err
    errors = [line[line.index("error: "):] for line in text.splitlines() if "error: " in line]
    assert len(errors) == 1 and "Traceback" not in text, text
    msg = errors[0]
    phase = {"training": "training forward/backward", "generation": "generation",
             "old_logprobs": "old-log-prob / reference pass"}[where]
    assert msg.startswith(f"error: out of memory in the {phase} ("), msg
    # a job on the CPU: the estimate per rank, against the machine's memory (per GPU on a GPU)
    assert "Tried to allocate 9.35 GiB" in msg and "estimate for this config:" in msg and "GiB per rank" in msg
    for k in knobs:
        assert k in msg, msg
    assert "rows" in msg  # the shapes that were running


def test_describe_survives_a_config_it_cannot_estimate():
    from megatron_gspo.config import load_job_config
    from megatron_gspo.model.oom import describe

    cfg = load_job_config(None, ["train.micro_batch_size=64"])
    msg = describe("training", cfg, 0, "cuda:0", "micro-batch of 64 rows x 575 tokens", torch.OutOfMemoryError(CUDA_OOM))
    assert "no estimate for this config" in msg and "train.micro_batch_size=64" in msg
    msg = describe("generation", cfg, 1, "cuda:0", "8 rows", torch.OutOfMemoryError(CUDA_OOM))
    assert "estimate for this config:" in msg and "generation.max_new_tokens=" in msg


# ----------------------------------------------------------------------------------------------
# Out of memory that is not torch.OutOfMemoryError: the CPU allocator, Python, the kernel
# ----------------------------------------------------------------------------------------------

import errno  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

ROOT = os.path.dirname(HERE)
IMPOSSIBLE = 1 << 60  # bytes: no allocator grants it, so the failures below are real ones


def _cpu_allocator_fails(*a, **k):
    torch.empty(IMPOSSIBLE, dtype=torch.uint8)  # RuntimeError: DefaultCPUAllocator: can't allocate memory


def _python_fails(*a, **k):
    bytearray(IMPOSSIBLE)  # MemoryError


def _kernel_fails(*a, **k):
    raise OSError(errno.ENOMEM, "Cannot allocate memory")


@pytest.mark.parametrize("phase, title, knob", [
    ("generation", "generation", "generation.max_new_tokens=4 (lower it)"),
    ("old_logprobs", "old-log-prob / reference pass", "train.micro_batch_size=2 (lower it)"),
    ("training", "training forward/backward", "train.micro_batch_size=2 (lower it)"),
    ("sft", "SFT warm start", "model.recompute_granularity=null (full: recompute activations)"),
    ("model", "model build", "model.preset=tiny (a smaller model)"),
    ("optimizer", "optimizer step", "parallel.expert_model_parallel_size=1 (experts over more ranks)"),
])
@pytest.mark.parametrize("fail", [_cpu_allocator_fails, _python_fails, _kernel_fails])
def test_every_allocation_failure_in_every_phase_is_explained(phase, title, knob, fail):
    from megatron_gspo.config import load_job_config
    from megatron_gspo.model.oom import explain_oom

    cfg = load_job_config(None, JOB)
    state = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    with pytest.raises(MemoryBudgetError) as info:
        with explain_oom(phase, cfg, state, "the shapes"):
            fail()
    msg = str(info.value)
    assert msg.startswith(f"out of memory in the {title} (the shapes) on cpu: "), msg
    assert knob in msg and "estimate for this config:" in msg and "GiB per rank" in msg, msg
    assert "this process may use (" in msg, msg  # the machine's limit and what sets it
    if fail is _cpu_allocator_fails:  # the allocator's own words, without its source-line prefix
        assert "on cpu: DefaultCPUAllocator: can't allocate memory: you tried to allocate" in msg, msg


def test_other_errors_pass_through_and_an_explanation_is_not_explained_twice():
    from megatron_gspo.config import load_job_config
    from megatron_gspo.model.oom import explain_oom, is_out_of_memory

    cfg = load_job_config(None, JOB)
    state = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    for error in (RuntimeError("shape mismatch"), OSError(errno.ENOSPC, "No space left on device"), ValueError("x")):
        assert not is_out_of_memory(error)
        with pytest.raises(type(error)):
            with explain_oom("training", cfg, state, "s"):
                raise error
    with pytest.raises(MemoryBudgetError, match=r"^out of memory in the generation \(inner\)"):
        with explain_oom("training", cfg, state, "outer"):
            with explain_oom("generation", cfg, state, "inner"):
                _cpu_allocator_fails()


@pytest.mark.parametrize("where", ["sft", "model", "optimizer", "training"])
def test_a_cpu_allocation_failure_ends_the_job_in_one_line(tmp_path, monkeypatch, capfd, where):
    """The trainer's phases, each failing with the CPU allocator's own RuntimeError: exit 2, one line."""
    import megatron_gspo.trainer.sft as sft
    import megatron_gspo.trainer.loop as trainer_mod
    import megatron_gspo.trainer.components as components
    from megatron_gspo.train import main

    target = {"sft": (sft, "forward_logprobs"), "model": (components, "build_model"),
              "optimizer": (trainer_mod, "optimizer_step"), "training": (trainer_mod, "forward_logprobs")}[where]
    monkeypatch.setattr(*target, _cpu_allocator_fails)
    extra = ["train.sft_steps=1", "train.sft_batch_size=4"] if where == "sft" else []
    rc = main(JOB + extra + [f"train.output_dir={tmp_path}"])
    text = "".join(capfd.readouterr())
    errors = [line[line.index("error: "):] for line in text.splitlines() if "error: " in line]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in text, text
    title = {"sft": "SFT warm start", "model": "model build", "optimizer": "optimizer step",
             "training": "training forward/backward"}[where]
    assert errors[0].startswith(f"error: out of memory in the {title} ("), errors[0]
    assert "DefaultCPUAllocator: can't allocate memory" in errors[0], errors[0]


def _write_cgroup(tmp_path, v1_limit=None, v2_limit=None):
    """A fake /proc/self/cgroup and /sys/fs/cgroup: the process in /job/step, limits set on /job."""
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/job/step\n0::/job/step\n")
    mount = tmp_path / "sys"
    for d in (mount / "memory" / "job" / "step", mount / "job" / "step"):
        d.mkdir(parents=True)
    (mount / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (mount / "job" / "step" / "memory.max").write_text("max\n")  # v2's
    if v1_limit is not None:
        (mount / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{v1_limit}\n")
    if v2_limit is not None:
        (mount / "job" / "memory.max").write_text(f"{v2_limit}\n")
    return str(mount), str(proc)


@pytest.mark.parametrize("version", [1, 2])
def test_the_cgroup_limit_of_an_ancestor_counts(tmp_path, version):
    from megatron_gspo.runtime.sysinfo import memory_limits

    mount, proc = _write_cgroup(tmp_path, **{f"v{version}_limit": 6 << 30})
    limits = memory_limits(mount, proc)
    cgroup = [(v, what, per) for v, what, per in limits if "cgroup" in what]
    name = "memory.limit_in_bytes" if version == 1 else "memory.max"
    assert cgroup == [(6 << 30, f"cgroup memory limit ({os.path.join(mount, *(['memory'] if version == 1 else []), 'job', name)})", False)]
    assert limits[0][1] == "physical memory"
    (tmp_path / "none").mkdir()
    mount, proc = _write_cgroup(tmp_path / "none")
    assert [w for _, w, _ in memory_limits(mount, proc) if "cgroup" in w] == []  # "max" and v1's huge value


def test_a_model_that_cannot_fit_is_refused_before_it_is_built(monkeypatch):
    import megatron_gspo.runtime.sysinfo as sysinfo
    from megatron_gspo.config import load_job_config
    from megatron_gspo.model.oom import check_model_fits

    cfg = load_job_config(None, ["model.preset=qwen3-moe-2b-proxy"])  # 2.03B params: 36 GiB of weights, grads, Adam
    cpu = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    # what this process holds already counts against the budget: pinned, so that the figures below do not
    # depend on how much the test process has grown (a CUDA build of torch alone holds ~0.5 GiB more)
    monkeypatch.setattr(sysinfo, "current_rss", lambda: 1 << 29)
    monkeypatch.setattr(sysinfo, "memory_limits", lambda: [(256 << 30, "physical memory", False),
                                                            (16 << 30, "cgroup memory limit (/job)", False)])
    with pytest.raises(MemoryBudgetError) as info:
        check_model_fits(cfg, cpu)
    msg = str(info.value)
    assert re.match(r"out of memory in the model build \(qwen3-moe-2b-proxy: 1\.98B parameters, bf16\) on cpu: its "
                    r"weights, grads and optimizer states alone need 33\.2 GiB per rank \(weights 3\.7, grads 7\.4, "
                    r"optimizer 22\.1 GiB\), more than the 15\.5 GiB left to this process -- ", msg), msg
    assert "of the 16.0 GiB this process may use (cgroup memory limit (/job))" in msg, msg
    assert "model.preset=qwen3-moe-2b-proxy (a smaller model)" in msg
    monkeypatch.setattr(sysinfo, "memory_limits", lambda: [(64 << 30, "physical memory", False)])
    check_model_fits(cfg, cpu)  # fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks share the machine's 64 GiB
    with pytest.raises(MemoryBudgetError, match=r"physical memory, shared by 4 ranks"):
        check_model_fits(cfg, cpu)
    monkeypatch.setattr(sysinfo, "memory_limits", lambda: [(64 << 30, "physical memory", False),
                                                            (8 << 30, "address-space limit (ulimit -v)", True)])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(MemoryBudgetError, match=r"address-space limit \(ulimit -v\)\)"):
        check_model_fits(cfg, cpu)


def test_a_model_that_cannot_fit_the_gpu_is_refused_before_it_is_built():
    from megatron_gspo.config import load_job_config
    from megatron_gspo.model.oom import check_model_fits

    gpu = SimpleNamespace(world_size=1, device=torch.device("cuda", 0))
    h100 = 81559 << 20
    with pytest.raises(MemoryBudgetError, match=r"^out of memory in the model build \(qwen3-30b-a3b: 30.5B parameters, "
                                                r"bf16\) on cuda:0: its weights, grads and optimizer states alone need "
                                                r".* of the memory of cuda:0"):
        check_model_fits(load_job_config(None, ["model.preset=qwen3-30b-a3b"]), gpu, device_bytes=h100)
    recipe = os.path.join(ROOT, "launch", "recipes", "gspo_qwen3_30b_a3b_8xh100.yaml")
    check_model_fits(load_job_config(recipe), SimpleNamespace(world_size=8, device=gpu.device), device_bytes=h100)


def _limited(gib: float):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (int(gib * 2**30), int(gib * 2**30)))
    return limit


def _address_space_at_import(env: dict) -> int:
    """Bytes of address space a fresh interpreter holds once the trainer is imported: a CUDA build of torch
    maps ~3 GiB of libraries at import (the CPU build ~0.6 GiB), before the job allocates anything."""
    code = ("import megatron_gspo.train, megatron_gspo.trainer.loop\n"
            "print([int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmPeak')][0] * 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def _run_limited(args, headroom_gib, tmp_path):
    """The job in a process whose address space is limited (RLIMIT_AS, as prlimit --as) to what the import
    takes plus ``headroom_gib``: the same room for the job whichever torch build is installed."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    gib = _address_space_at_import(env) / 2**30 + headroom_gib
    p = subprocess.run([sys.executable, "-m", "megatron_gspo.train", *args, f"train.output_dir={tmp_path}"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                       preexec_fn=_limited(gib), timeout=600)
    errors = [ln[ln.index("error: "):] for ln in p.stdout.splitlines() if "error: " in ln]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stdout, p.stdout[-3000:]
    return errors[0]


@pytest.mark.slow
def test_under_a_real_memory_limit_a_model_too_big_is_refused_before_building(tmp_path):
    """Qwen3-30B-A3B on a CPU process limited to its import plus 7.4 GiB (RLIMIT_AS, as prlimit --as; 8 GiB in
    all with the CPU build of torch): refused before the build, one line (it was minutes of building, then four
    chained tracebacks)."""
    error = _run_limited(["model.preset=qwen3-30b-a3b", "train.sft_steps=0", "eval.interval=0"], 7.4, tmp_path)
    assert error.startswith("error: out of memory in the model build (qwen3-30b-a3b: 30.5B parameters, bf16) on "
                                "cpu: its weights, grads and optimizer states alone need "), error
    assert "address-space limit (ulimit -v)" in error, error


@pytest.mark.slow
def test_under_a_real_memory_limit_generation_that_does_not_fit_is_one_line(tmp_path):
    """The tiny model, its rollout's KV cache (2048 rows x 4064 slots: 4.3 GiB estimated) in a process
    limited to its import plus 2.4 GiB (3 GiB in all with the CPU build of torch): the CPU allocator's
    failure, named as the generation's with its knobs."""
    error = _run_limited(["train.num_steps=1", "train.prompts_per_step=256", "model.max_position_embeddings=4096",
                          "generation.max_new_tokens=4000", "train.sft_steps=0", "eval.interval=0",
                          "train.tensorboard=false"], 2.4, tmp_path)
    assert error.startswith("error: out of memory in the generation (2048 rows, prompts up to "), error
    for what in ("DefaultCPUAllocator: can't allocate memory", "generation 4.3 GiB", "generation.max_new_tokens=4000 "
                 "(lower it)", "train.prompts_per_step=256", "address-space limit (ulimit -v)"):
        assert what in error, (what, error)
