"""The preflight: run it first on a new node. ``python -m megatron_gspo.preflight [--quick]
[--json out.json] [section.key=value ...]``, one process or under torchrun.

Each item is reported ok / failed (with the error) / skipped (with the reason); exit 0 when nothing
failed, 1 when something did, 2 for a bad command line or config override.

    runner.py       the checks' runner and report (pure: no torch)
    context.py      what the checks share: device, mode, the jobs (demo job + overrides), skip rules
    environment.py  versions, device, bf16 / FP8, what ``auto`` picks
    numerics.py     TE spec vs local spec; the fast expert path vs megatron's loop; fused log-probs
    fp8.py          FP8 forwards and backwards at shapes TE refuses unpadded
    training.py     one RL step (and in FP8) through the Trainer; tokens/s, TFLOP/s, MFU
    resume.py       save -> resume in the spec that runs, bit for bit
    decoding.py     the CUDA-graph decode step vs the eager one; the TE spec's decode paths
    memory.py       peak memory of a cut Qwen3-30B-A3B beside launch/memory_estimate.py
    collectives.py  all-reduce / all-to-all bandwidth on the EP group (under torchrun)
    cli.py          the command line
"""
