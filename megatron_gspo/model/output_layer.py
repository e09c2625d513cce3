"""The output layer (LM head) computing batch-first logits, so that no [s, b, V] copy is made.

megatron's GPTModel runs its decoder sequence-first ([s, b, h]) and, without labels, returns
``logits.transpose(0, 1).contiguous()``: a full copy of the [s, b, V] logits, and one more of their
gradient in the backward. At a vocabulary of 8192 to 152k these are the largest tensors of a step
(one micro-batch of 32 x 68 tokens: 71 MB per copy; 0.3 s of a 3.9 s training step on 1 CPU thread).

``BatchFirstOutputLayer`` *is* megatron's ColumnParallelLinear (same parameters, attributes and
``sharded_state_dict``; checkpoints do not change). Its forward transposes the small hidden states
instead ([s, b, h] -> [b, s, h], h << V), computes [b, s, V] logits and returns them as the
[s, b, V] view megatron expects, so megatron's ``.transpose(0, 1).contiguous()`` gets a tensor that
is already contiguous and copies nothing. The math is the same matmul over the same rows.

Under sequence parallelism the layer all-gathers its input along the sequence (dim 0) first, so
it keeps megatron's layout there; single-position inputs (decode steps) gain nothing and pass
straight through.

Hidden-state mode (``returning_hidden``): for the fused log-prob path (fused_logprobs.py,
model.forward_logprobs) the layer returns its *input* as the output layer itself would use it
(all-gathered along the sequence under sequence parallelism, with megatron's reduce-scatter of the
gradient; under tensor parallelism without it, copied with an all-reduced gradient), so GPTModel's
forward hands back the final hidden states [b, s, h] instead of [b, s, V] logits.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear

__all__ = ["BatchFirstOutputLayer", "use_batch_first_output", "returning_hidden"]


class BatchFirstOutputLayer(ColumnParallelLinear):
    """ColumnParallelLinear whose [s, b, V] output is a view of a contiguous [b, s, V] tensor."""

    return_hidden = False  # set per call by returning_hidden()

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        if self.return_hidden:
            return self._hidden(input_), None
        if self.sequence_parallel or input_.dim() != 3 or input_.shape[0] == 1:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        out, bias = super().forward(input_.transpose(0, 1).contiguous(), weight=weight,
                                    runtime_gather_output=runtime_gather_output)
        return out.transpose(0, 1), bias

    def _hidden(self, input_: torch.Tensor) -> torch.Tensor:
        """[s, b, h] (this rank's sequence chunk under SP) -> the full [s, b, h] the GEMM would see,
        as a view of a contiguous [b, s, h] tensor (GPTModel's transpose then copies nothing)."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        if self.bias is not None:
            raise NotImplementedError("fused output-layer log-probs: the output layer has a bias")
        tp = self.tp_group.size() if self.tp_group is not None else 1
        if self.sequence_parallel:
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=self.tp_group)
        elif tp > 1:
            input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        return input_.transpose(0, 1).contiguous().transpose(0, 1)


@contextlib.contextmanager
def returning_hidden(model) -> Iterator[None]:
    """For the duration of the block the (unwrapped) GPTModel's forward returns the final hidden
    states [b, s, h] (see the module doc) instead of logits."""
    layer = getattr(model, "output_layer", None)
    if not isinstance(layer, BatchFirstOutputLayer):
        raise TypeError(f"fused log-probs need the model's output layer to be a BatchFirstOutputLayer, "
                        f"got {type(layer).__name__}")
    layer.return_hidden = True
    try:
        yield
    finally:
        layer.return_hidden = False


def use_batch_first_output(model) -> None:
    """Make a GPTModel's output layer a BatchFirstOutputLayer (in place; no-op without one)."""
    layer = getattr(model, "output_layer", None)
    if type(layer) is ColumnParallelLinear:
        layer.__class__ = BatchFirstOutputLayer
