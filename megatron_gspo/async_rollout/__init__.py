"""Asynchronous rollouts: generation and training on separate ranks of one job (``rollout.mode=async``).

    layout.py       which rank trains and which generates; the config checks that need the world size
    side.py         each side's own torch.distributed world, the bridge between them, the control plane
    weight_sync.py  the trainer's weights streamed to the rollout layout, bucket by bucket, bit for bit
    worker.py       a rollout rank's loop: wait for permission, generate, score, send; apply weight updates
    source.py       the trainer's end: push the weights, receive a step's batch, build its RolloutBatch

docs/algorithms.md#asynchronous-rollouts has the protocol, the staleness bound and the fault handling.
"""
