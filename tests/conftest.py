import os
import subprocess
import sys
import warnings

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DIST_SCRIPTS = os.path.join(HERE, "dist_scripts")

# megatron-core warns at import that apex/TE are absent: expected on CPU, noise in test output.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def torchrun(script: str, nproc: int, *args: str, timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run tests/dist_scripts/<script> under torchrun on gloo; returns the completed process."""
    # --standalone: a local rendezvous on a free port, so parallel test runs never collide
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(DIST_SCRIPTS, script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"torchrun {script} {' '.join(args)} failed (rc={p.returncode}):\n"
                             f"{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return p


def pytest_collection_modifyitems(config, items):
    """Every test that starts torchrun ranks is in the slow tier (``-m "not slow"`` skips it):
    process start-up and gloo rendezvous dominate their time, not what they check."""
    for item in items:
        if "run_dist" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


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

