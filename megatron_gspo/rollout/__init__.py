"""Rollouts: where a step's sampled, scored rows come from, and how they become a training batch.

    record.py       RolloutRecord (one step's rows on this rank) and the async wire format: pack / unpack / concat
    source.py       the RolloutSource protocol, build_source (the one run-time reader of rollout.mode)
    colocated.py    ColocatedSource: the training model generates (generation, rewards, dynamic sampling)
    exchange.py     the scored rows as one global batch: every rank's scores gathered, rows moved to their ranks
    remote.py       RemoteSource: the rollout ranks of an async job generate; the trainer pushes weights
    prepare.py      BatchPreparer: RolloutRecord -> TrainBatch (advantages, micro-batches, old / reference log-probs)
    rows.py         which global rows a rank generates and trains (the deal by tokens); token-grid helpers
The rollout ranks' side of an asynchronous job (``rollout.mode=async``):
    layout.py       which rank trains and which generates; the config checks that need the world size
    side.py         each side's own torch.distributed world, the bridge between them, the control plane
    weight_sync.py  the trainer's weights streamed to the rollout layout, bucket by bucket, bit for bit
    worker.py       a rollout rank's loop: wait for permission, generate, score, send; apply weight updates

docs/algorithms.md#asynchronous-rollouts has the protocol, the staleness bound and the fault handling.
The names below are imported on first use, so that ``megatron_gspo.rollout.layout`` stays light.
"""

from megatron_gspo import lazy_exports

_EXPORTS = {
    "RolloutRecord": "record", "pack": "record", "unpack": "record", "concat": "record",
    "RolloutSource": "source", "build_source": "source", "join_side": "source",
    "ColocatedSource": "colocated", "RemoteSource": "remote",
    "BatchPreparer": "prepare", "TrainBatch": "prepare", "rollout_metrics": "prepare",
    "local_rows": "rows", "micro_batch_slices": "rows", "deal_rows": "rows", "karmarkar_karp": "rows",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
