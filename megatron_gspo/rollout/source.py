"""Where a step's rollouts come from: the ``RolloutSource`` protocol and ``build_source``.

Two implementations, no common base: ``ColocatedSource`` (colocated.py: the training model generates)
and ``RemoteSource`` (remote.py: the rollout ranks of an async job generate, the trainer pushes weights).
``rollout.mode`` is read here at run time (``join_side``, ``build_source``) and nowhere else in the
trainer; ``train.main`` decides a rank's role with layout.role_of.
"""

from __future__ import annotations

from typing import Optional, Protocol

from megatron_gspo.rollout.record import RolloutRecord


class RolloutSource(Protocol):
    def collect(self, step: int) -> RolloutRecord:
        """This rank's rows of step ``step`` (0-based); collective over the trainer's ranks."""

    def hooks(self) -> list:
        """TrainerHooks the source needs (the remote source's async/trainer_idle_frac)."""

    def peer_stop_request(self) -> Optional[str]:
        """A stop signal another side of the job asked for, named for the stop line (None: none)."""

    def stop_if_ranks_lost(self, signal_name: str) -> None:
        """As the job stops for a stop signal: raise StoppedFor on every rank if ranks the source
        depends on are gone (the remote source's rollout ranks), so that the stop line names them."""

    def close(self) -> None:
        ...


def join_side(cfg):
    """rollout.mode=async: this trainer rank's side of the job (rollout.side.Side), joined before the process
    groups exist (the trainer's ranks are a world of their own). None for a colocated job."""
    if not cfg.rollout.is_async:
        return None
    from megatron_gspo.rollout.side import join

    return join(cfg, "trainer")


def build_source(cfg, state, model, sampler, tokenizer, reward_fn, gen_cfg, routing, timer, *, side, stop) -> RolloutSource:
    """The job's RolloutSource: remote when the trainer joined an async job's side (``join_side``), else
    colocated. ``stop``: the job's stop flag (``.set``)."""
    if cfg.rollout.is_async:
        from megatron_gspo.rollout.remote import RemoteSource

        return RemoteSource(cfg, state, model, sampler, gen_cfg, side, timer, stop=stop)
    from megatron_gspo.rollout.colocated import ColocatedSource

    return ColocatedSource(cfg, state, model, sampler, tokenizer, reward_fn, gen_cfg, routing, timer, stop=stop)
