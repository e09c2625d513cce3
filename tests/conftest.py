import os
import subprocess
import sys
import warnings

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DIST_SCRIPTS = os.path.join(HERE, "dist_scripts")

# megatron-core warns at import that apex/TE are absent: expected on CPU, noise in test output.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def multi_rank_env(**extra: str) -> dict:
    """The environment of a test's 2-4 rank run: the ranks run the CPU path on gloo, with GPUs hidden.

    These tests check layouts (TP / EP / DP parity, replicas, resume), which the CPU path shares with
    CUDA, and they must run on any machine: one GPU cannot give each of 2-4 ranks its own, and a rank
    without one is refused (parallel.resolve_device). NCCL on several GPUs is what the preflight checks
    under torchrun on a GPU node."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": "", **extra}


def torchrun(script: str, nproc: int, *args: str, timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run tests/dist_scripts/<script> under torchrun (``multi_rank_env``: CPU, gloo) from the repository
    root; returns the completed process."""
    # --standalone: a local rendezvous on a free port, so parallel test runs never collide ("--master-port
    # 0" hands the workers MASTER_PORT=0 with torch 2.13, and init_process_group then waits forever)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(DIST_SCRIPTS, script), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=multi_rank_env(),
                       cwd=os.path.dirname(HERE))
    if check and p.returncode != 0:
        raise AssertionError(f"torchrun {script} {' '.join(args)} failed (rc={p.returncode}):\n"
                             f"{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return p


def torchrun_jobs(runs: dict, where, job_timeout: int = 120) -> dict:
    """Dist-script runs, ``{name: (ranks, [script, arg, ...])}``, those of one world size one after another in one
    torchrun of that many ranks (tests/dist_scripts/jobs.py: one start-up and one rendezvous for them all), in the
    dict's order, the world sizes in ascending order. ``where``: the directory of the job lists (``jobs<ranks>.json``).
    Returns ``{name: what the run printed}``, its ranks' output one after another in rank order."""
    import json

    out = {}
    for nproc in sorted({n for n, _ in runs.values()}):
        names = [k for k, (n, _) in runs.items() if n == nproc]
        jobs = [list(map(str, runs[k][1])) for k in names]
        spec = os.path.join(str(where), f"jobs{nproc}.json")
        with open(spec, "w", encoding="utf-8") as f:
            json.dump(jobs, f)

        def printed(i):
            paths = [f"{spec}.{i}.rank{r}.out" for r in range(nproc)]
            return "".join(open(p, encoding="utf-8").read() for p in paths if os.path.exists(p))

        p = torchrun("jobs.py", nproc, spec, timeout=300 + job_timeout * len(jobs), check=False)
        if p.returncode != 0:
            last = max((i for i in range(len(jobs)) if os.path.exists(f"{spec}.{i}.rank0.out")), default=0)
            raise AssertionError(f"torchrun jobs.py {spec} failed (rc={p.returncode}) in job {last} {names[last]!r} "
                                 f"{jobs[last][:1]}:\n{printed(last)[-4000:]}\n{p.stdout[-2000:]}\n{p.stderr[-6000:]}")
        out.update((k, printed(i)) for i, k in enumerate(names))
    return out


# Test files whose subject does not depend on the megatron-core release installed: the launcher and the GPU
# kit's shell, docs and text, rewards, tasks, data, tokenizers, environments, and the losses' pure math. They
# carry the ``mcore_agnostic`` marker, which the fast tier under megatron-core 0.19.2 in .ci/run deselects
# (it runs everything else a second time under that release); a new test file runs there unless named here.
MCORE_AGNOSTIC_FILES = frozenset({
    "test_launch.py", "test_gpu_checks.py", "test_gpu_kit.py", "test_writable.py", "test_doc_figures.py",
    "test_docs.py", "test_text_files.py", "test_code_shape.py", "test_rewards.py", "test_math_verify.py",
    "test_tasks.py", "test_tokenizer.py", "test_data.py", "test_env.py", "test_losses.py", "test_advantages.py",
    "test_loss_references.py", "test_peer_loss_references.py", "test_sampling.py", "test_rollout_masks.py",
    "test_sysinfo_plotting.py",
})


def pytest_collection_modifyitems(config, items):
    """Every test that starts torchrun ranks is in the slow tier (``-m "not slow"`` skips it):
    process start-up and gloo rendezvous dominate their time, not what they check; the files of
    MCORE_AGNOSTIC_FILES are marked ``mcore_agnostic``. ``gpu`` tests are
    skipped where torch sees no CUDA device; ``te`` tests (tests/te/) where Transformer Engine does not
    import (tests/test_te_tier.py then runs them in their own venv: te_tier.py); ``vllm`` tests (tests/vllm/)
    where vLLM is not installed (tests/test_vllm_tier.py runs them in theirs: vllm_tier.py)."""
    import torch

    from te_tier import te_in_process
    from vllm_tier import vllm_in_process

    no_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False here)")
    no_te = pytest.mark.skip(reason="needs Transformer Engine in this interpreter: tests/test_te_tier.py runs "
                                    "tests/te/ in the venv of .ci/setup-te-venv instead")
    no_vllm = pytest.mark.skip(reason="needs vLLM in this interpreter: tests/test_vllm_tier.py runs tests/vllm/ in the "
                                      "venv of .ci/setup-vllm-venv instead")
    for item in items:
        if {"run_dist", "run_dist_jobs"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if os.path.basename(str(item.fspath)) in MCORE_AGNOSTIC_FILES:
            item.add_marker(pytest.mark.mcore_agnostic)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if os.sep + os.path.join("tests", "te") + os.sep in str(item.fspath):
            item.add_marker(pytest.mark.te)  # tests/te/ is the tier, whatever its files declare
        if "te" in item.keywords and not te_in_process():
            item.add_marker(no_te)
        if os.sep + os.path.join("tests", "vllm") + os.sep in str(item.fspath):
            item.add_marker(pytest.mark.vllm)  # tests/vllm/ is the tier
        # the marker, not the keyword: a checkout in a directory named vllm has that keyword on every test
        if item.get_closest_marker("vllm") is not None and not vllm_in_process():
            item.add_marker(no_vllm)


# The test running now (its setup included, where module fixtures build their models): read by the
# device guard below.
_RUNNING: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _RUNNING["item"] = item


def _device_guard_message(nodeid: str) -> str:
    return (f"{nodeid}: parallel.initialize with parallel.device=auto in an in-process test. Every in-process test "
            "states the device it means (ParallelConfig(device='cpu'), 'parallel.device=cpu'), or is marked gpu: on a "
            "GPU machine with Transformer Engine (the NGC container) auto is CUDA and the TE spec, which a test written "
            "for the CPU's local spec (lean decoder, batched experts, fp32 numbers) does not mean")


@pytest.fixture(scope="session", autouse=True)
def in_process_tests_state_their_device():
    """Fails any in-process test (not marked ``gpu`` or ``any_device``) that initializes a job with
    ``parallel.device=auto``.

    ``ParallelConfig()`` means "this machine's GPU and, where Transformer Engine imports, the TE spec"; on the
    CPU machines that is the CPU and the local spec, so a test that forgot to say which it means passes here and
    fails by construction in the container. The CPU device also fixes the spec: model.resolve_impl
    never picks Transformer Engine for a CPU job. Session-scoped, so module fixtures' models are checked too;
    torchrun ranks are pinned by multi_rank_env (no GPU visible)."""
    from megatron_gspo.runtime import parallel

    real = parallel.initialize

    def initialize(model, par, side=None):
        item = _RUNNING.get("item")
        allowed = item is not None and (item.get_closest_marker("gpu") or item.get_closest_marker("any_device"))
        if par.device == "auto" and not allowed:
            pytest.fail(_device_guard_message(item.nodeid if item is not None else "?"), pytrace=False)
        return real(model, par, side=side)

    parallel.initialize = initialize
    yield initialize
    parallel.initialize = real


@pytest.fixture(scope="session")
def run_dist():
    return torchrun


@pytest.fixture(scope="session")
def run_dist_jobs():
    return torchrun_jobs


@pytest.fixture
def single_rank():
    """A one-process megatron parallel state for in-process model tests, torn down afterwards: one CPU rank
    (so megatron's local spec) unless the test passes another ParallelConfig, stating its device."""
    from megatron_gspo.runtime import parallel

    created = []

    def make(model_cfg, par_cfg=None):
        from megatron_gspo.config import ParallelConfig

        st = parallel.initialize(model_cfg, par_cfg or ParallelConfig(device="cpu"))
        created.append(st)
        return st

    yield make
    parallel.destroy()


# ``cpu_models`` lives here rather than in a conftest.py of tests/te/: a second conftest module would shadow this one for
# the tests that ``import conftest`` (a directory without __init__.py imports its conftest as "conftest").
@pytest.fixture
def cpu_models():
    """The Transformer Engine tier's models (tests/te/): make(cfg, spec, seed=3) -> (model, state) of one rank on
    the CPU, built through the project's own code (parallel.initialize, model.build_model, init_weights); spec "te"
    (construct-only: parameters on the CPU, forward refused) or "local". Every model of one test shares the first
    call's parallel state (its layout); torn down afterwards."""
    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model.gpt import build_model

    states = {}

    def make(cfg, spec: str, seed: int = 3, **par_kw):
        import dataclasses

        impl = {"te": "transformer_engine", "local": "local"}[spec]
        cfg = dataclasses.replace(cfg, transformer_impl=impl)
        par = ParallelConfig(device="cpu", seed=seed, **par_kw)
        if "state" not in states:
            states["state"] = parallel.initialize(cfg, par)
        st = states["state"]
        return build_model(cfg, par, st, construct_only=spec == "te"), st

    yield make
    parallel.destroy()
