"""The launcher's Python files (launch/*.py: scripts beside launch/pretrain_gspo.sh, not a package),
loaded by path for the tests."""

import importlib.util
from pathlib import Path

LAUNCH = Path(__file__).resolve().parent.parent / "launch"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"gspo_launch_{name}", LAUNCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


supervisor = load("supervisor")
