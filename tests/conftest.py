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


def pytest_collection_modifyitems(config, items):
    """Every test that starts torchrun ranks is in the slow tier (``-m "not slow"`` skips it):
    process start-up and gloo rendezvous dominate their time, not what they check. ``gpu`` tests are
    skipped where torch sees no CUDA device; ``te`` tests (tests/te/) where Transformer Engine does not
    import (tests/test_te_tier.py then runs them in their own venv: te_tier.py)."""
    import torch

    from te_tier import te_in_process

    no_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False here)")
    no_te = pytest.mark.skip(reason="needs Transformer Engine in this interpreter: tests/test_te_tier.py runs "
                                    "tests/te/ in the venv of .ci/setup-te-venv instead")
    for item in items:
        if "run_dist" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if os.sep + os.path.join("tests", "te") + os.sep in str(item.fspath):
            item.add_marker(pytest.mark.te)  # tests/te/ is the tier, whatever its files declare
        if "te" in item.keywords and not te_in_process():
            item.add_marker(no_te)


@pytest.fixture(scope="session")
def run_dist():
    return torchrun


@pytest.fixture
def single_rank():
    """A one-process megatron parallel state for in-process model tests, torn down afterwards."""
    from megatron_gspo import parallel

    created = []

    def make(model_cfg, par_cfg=None):
        from megatron_gspo.config import ParallelConfig

        st = parallel.initialize(model_cfg, par_cfg or ParallelConfig())
        created.append(st)
        return st

    yield make
    parallel.destroy()

