"""The process groups of a generation: what its forwards communicate over, and which ranks step together.

Two kinds of collectives run inside a forward of a sharded model (megatron-core's groups, from the
parallel state):

* the dense tensor-parallel group (``pg.tp``, TP ranks holding the same rows): the attention output
  projection's all-reduce, the vocab-parallel embedding's all-reduce, the vocab-parallel logits'
  all-gather;
* the MoE layers' expert group (``pg.tp_ep``: expert-TP x EP ranks, megatron's token dispatchers'
  domain), whose ranks hold *different* rows under EP or expert-TP (they are data-parallel ranks of
  the dense layers): the token all-gather and the expert outputs' reduce-scatter.

A collective needs every rank of its group at the same call with the same shapes: the ranks connected
through either kind of group step together, the parallel state's *lockstep group*
(``ParallelState.lockstep_group``, chosen once by runtime/parallel.py's ``lockstep_group_of``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_gspo.runtime import comm

__all__ = ["DecodeGroups"]


@dataclass(frozen=True)
class DecodeGroups:
    """The groups a lean decode step communicates over (None: one rank of that kind of parallelism).

    tp: the dense tensor-parallel group; expert: the MoE layers' expert-TP x EP group; lockstep: the
    ranks that run every forward together (``ParallelState.lockstep_group``)."""

    tp: Optional[object] = None
    expert: Optional[object] = None
    lockstep: Optional[object] = None

    @classmethod
    def of(cls, state) -> "DecodeGroups":
        """The groups of ``state`` (a ParallelState, None for one process, or a stand-in without process
        groups that names its ``lockstep_group``)."""
        lockstep = getattr(state, "lockstep_group", None)
        pg = getattr(state, "pg", None)
        if pg is None:
            return cls(lockstep=lockstep)
        expert = pg.tp_ep if state.ep * state.etp > 1 else None
        return cls(tp=pg.tp if state.tp > 1 else None, expert=expert, lockstep=lockstep)

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
