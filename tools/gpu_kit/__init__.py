"""The GPU kit: Transformer Engine and the project's missing wheels for the lent GPU machine, in one directory
small enough to travel with the working tree (docs/gpu_kit.md).

    bash .ci/setup-te-venv                        # here, once: the TE venv the build and verify-cpu use
    python -m tools.gpu_kit build --out DIR       # here, from PyPI (cached): TE's library cut to Hopper code
    python -m tools.gpu_kit check DIR             # anywhere: the manifest and every file's size and sha256
    python -m tools.gpu_kit verify-cpu DIR        # here: the TE tier against the kit's library
    python -m tools.gpu_kit install DIR           # there (Python 3.12): pip --no-index, the torch extension

The lent machine (Python 3.12, torch 2.11+cu130, no network) takes at most 64 MiB with the working tree;
Transformer Engine's core wheel is 276 MB, almost all of it device code for ten GPU architectures. The kit
keeps the Hopper images (sm_90, sm_90a) of TE's library, byte for byte, and nothing else of its device code
(fatbin.py), and carries everything else TE and the project need that the GPU image lacks.
"""


class KitError(ValueError):
    """A kit, its manifest or what a command needs is missing or damaged; the message names the file and
    the command that makes it. ``python -m tools.gpu_kit`` prints it as one line and exits 2."""
