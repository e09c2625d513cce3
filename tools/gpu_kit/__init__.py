"""The GPU kit: Transformer Engine and the project's missing wheels for the lent GPU machine, in one directory
small enough to travel with the working tree (docs/gpu_kit.md).

    python -m tools.gpu_kit build --out DIR       # here, from PyPI (cached): TE's library cut to Hopper code
    python -m tools.gpu_kit verify-cpu DIR        # here: the TE tier against the kit's library
    python -m tools.gpu_kit install DIR           # there (Python 3.12): pip --no-index, the torch extension

The lent machine (Python 3.12, torch 2.11+cu130, no network) takes at most 64 MiB with the working tree;
Transformer Engine's core wheel is 276 MB, almost all of it device code for ten GPU architectures. The kit
keeps the Hopper images (sm_90, sm_90a) of TE's library, byte for byte, and nothing else of its device code
(fatbin.py), and carries everything else TE and the project need that the GPU image lacks.
"""
