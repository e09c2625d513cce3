"""The process groups of a generation: what its forwards communicate over, and which ranks step together.

Two kinds of collectives run inside a forward of a sharded model (megatron-core's groups, from the
parallel state):

* the dense tensor-parallel group (``pg.tp``, TP ranks holding the same rows): the attention output
  projection's all-reduce, the vocab-parallel embedding's all-reduce, the vocab-parallel logits'
  all-gather;
* the MoE layers' expert group (``pg.tp_ep``: expert-TP x EP ranks, megatron's token dispatchers'
  domain), whose ranks hold *different* rows under EP or expert-TP (they are data-parallel ranks of
  the dense layers): the token all-gather and the expert outputs' reduce-scatter.

A collective needs every rank of its group at the same call with the same shapes, so the ranks
connected through either kind of group must run the same forwards on batches of one shape: the
*lockstep group*, the smallest set of ranks closed under both. megatron lays both groups out as
aligned blocks of consecutive ranks (tensor-parallel ranks fastest, in the dense and in the expert
rank order), so the lockstep group is the TP group when the expert group's size divides TP, the
expert group when TP divides its size, and otherwise (sizes that do not divide: a layout megatron
allows but nobody runs) the whole world, which is always a superset. The choice depends on the
sizes only, so every rank makes the same one; each rank checks its own groups against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from megatron_gspo.runtime import comm

__all__ = ["DecodeGroups", "lockstep_group"]


def lockstep_group(state):
    """The group whose ranks must decode in lockstep (see the module doc), or None (no collective in a
    forward: one rank of model parallelism). ``state``: a ParallelState, None, or a stand-in without
    process groups (``tp``, ``ep``, ``tp_group``: the whole world steps together under EP)."""
    if state is None:
        return None
    tp, n_exp = state.tp, getattr(state, "ep", 1) * getattr(state, "etp", 1)
    pg = getattr(state, "pg", None)
    if pg is None:  # a stand-in state (tests): the world under EP, the TP group under TP
        return dist.group.WORLD if state.ep > 1 else (state.tp_group if tp > 1 else None)
    if n_exp == 1:
        return pg.tp if tp > 1 else None
    if n_exp % tp == 0:
        group, inner = pg.tp_ep, pg.tp
    elif tp % n_exp == 0:
        group, inner = pg.tp, pg.tp_ep
    else:
        return dist.group.WORLD
    if not set(comm.ranks(inner)) <= set(comm.ranks(group)):
        raise RuntimeError(f"generation: this rank's groups are not nested as megatron lays them out (TP ranks "
                           f"{comm.ranks(pg.tp)}, expert-TP x EP ranks {comm.ranks(pg.tp_ep)}); the lockstep "
                           f"group of a generation cannot be chosen")
    return group


@dataclass(frozen=True)
class DecodeGroups:
    """The groups a lean decode step communicates over (None: one rank of that kind of parallelism).

    tp: the dense tensor-parallel group; expert: the MoE layers' expert-TP x EP group; lockstep: the
    ranks that run every forward together (``lockstep_group``)."""

    tp: Optional[object] = None
    expert: Optional[object] = None
    lockstep: Optional[object] = None

    @classmethod
    def of(cls, state) -> "DecodeGroups":
        """The groups of ``state`` (a ParallelState, or None for one process)."""
        pg = getattr(state, "pg", None)
        if pg is None:
            return cls(lockstep=lockstep_group(state))
        expert = pg.tp_ep if state.ep * state.etp > 1 else None
        return cls(tp=pg.tp if state.tp > 1 else None, expert=expert, lockstep=lockstep_group(state))

    def check(self, model_config) -> None:
        """Refuse groups that do not match the layout the model was built for (sizes)."""
        c = model_config
        want_tp = c.tensor_model_parallel_size or 1
        want_exp = (c.expert_model_parallel_size or 1) * (c.expert_tensor_parallel_size or want_tp)
        got_tp, got_exp = comm.world_size(self.tp), comm.world_size(self.expert)
        if self.tp is None:
            got_tp = 1
        if self.expert is None:
            got_exp = 1
        if (got_tp, got_exp) != (want_tp, want_exp):
            raise ValueError(f"the lean decoder was given process groups of TP {got_tp} and expert-TP x EP "
                             f"{got_exp} for a model built for TP {want_tp} and expert-TP x EP {want_exp}; "
                             f"pass the model's parallel state (generate(..., state=...))")
