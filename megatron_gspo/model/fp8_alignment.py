"""Token counts that Transformer Engine's FP8 GEMMs accept, and the padding that gets every forward there.

Why: an FP8 GEMM quantizes its input ``[tokens, in]`` in blocks, and Transformer Engine refuses shapes
that do not tile:

* TE 2.20 ``transformer_engine/pytorch/utils.py:704`` ``assert_dim_for_fp8_exec`` (called by
  ``Linear`` at module/linear.py:472 and ``LayerNormLinear`` at module/layernorm_linear.py:184: the
  QKV, output-projection and dense-MLP GEMMs) raises ``ValueError: FP8 execution requires the product
  of all dimensions except the last to be divisible by 8 and the last dimension to be divisible by 16``;
* MXFP8 quantizes in 1x32 / 32x1 blocks: ``MXFP8Quantizer.is_quantizable`` (tensor/mxfp8_tensor.py:125)
  wants both the token count and the width divisible by 32;
* grouped GEMMs pad every expert's token count to the recipe's alignment: megatron-core 0.16.1
  ``fp8_utils.get_fp8_align_size`` (fp8_utils.py:168: 32 for MXFP8, 16 otherwise), used by
  ``moe_utils.get_align_size_for_quantization`` (moe_utils.py:1263) and TE's ``Fp8Padding``
  (TE quantization.py:262 ``get_align_size_for_quantization``: 32 MXFP8, 16 the other built-in FP8
  recipes). megatron pads the *experts'* tokens itself (``TEGroupedMLP.forward``:
  ``self.quantization_padding``, moe/experts.py:605-651; ``SequentialMLP._pad_tensor_for_quantization``,
  experts.py:862), but not the tokens of a forward: its answer for inference,
  ``fp8_utils.prepare_model_for_fp8_inference`` (fp8_utils.py:760), pads the *sequence* dimension of
  every TE linear to 16, which for a one-token decode step is 16x the work.

The hidden sizes of the models we run are multiples of 32 already; what is not aligned is the number
of tokens in a forward, which this project decides: the decode batch (any size after finished rows
leave it, generation/generator.py), the prefill block (rows x prompt block), the micro-batches of the old /
reference log-prob passes, the training forward and the SFT warm start (rows x width, width
rounded only to the sequence-parallel size so far). So every forward of an FP8 model gets a token
count divisible by the recipe's alignment (16, MXFP8 32: the stricter of TE's two rules):

* decode and prefill: the batch is padded with filler rows to a multiple of the alignment (rows that
  are done from the start, the rows expert-parallel lockstep already adds), and finished-row
  compaction keeps a multiple of it (topped up with finished rows), so rows x 1 and rows x prompt
  block both divide;
* micro-batches (old / reference log-probs, training, SFT): the token-grid width (minus the shifted
  column) is rounded up to ``sequence-parallel size x alignment``, so rows x width / TP divides
  whatever the rows; ``model.forward_logits`` pads any other caller's input the same way.

The padding never counts: filler rows are dropped before generation returns, extra columns are padding
of the rows' token grid (the loss masks, the metrics' masks and megatron's MoE ``padding_mask``, which
keeps them out of the routing statistics and the load-balancing loss, already exclude everything past a
row's length). Without FP8 the alignment is 1 and nothing changes.
"""

from __future__ import annotations

import math
from typing import Optional

__all__ = ["fp8_alignment", "token_alignment", "round_up", "padded_rows", "width_multiple", "padded_length"]


def fp8_alignment(fp8: Optional[str], fp8_recipe: Optional[str] = "delayed") -> int:
    """Tokens per forward must be a multiple of this: 1 without FP8, 32 for MXFP8, 16 for the other
    recipes (megatron-core's get_fp8_align_size; covers TE's divisible-by-8 assertion)."""
    if not fp8:
        return 1
    return 32 if getattr(fp8_recipe, "value", fp8_recipe) == "mxfp8" else 16  # a str or megatron's Fp8Recipe


def token_alignment(config) -> int:
    """The alignment of a model's forwards, from its config (megatron's TransformerConfig or our
    ModelConfig: both have ``fp8`` and ``fp8_recipe``). Every caller goes through this one function
    (generation, the micro-batch plan, SFT, model.forward_logits), so tests can force an alignment on a
    model without FP8 by replacing it and check that the padding changes no result."""
    return fp8_alignment(getattr(config, "fp8", None), getattr(config, "fp8_recipe", "delayed"))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_rows(n: int, align: int, cap: Optional[int] = None) -> int:
    """Rows of a decode batch of ``n`` live rows: n rounded up to ``align`` (at most ``cap``, the rows
    there are; a cap that is itself a multiple of ``align`` keeps the result one)."""
    out = round_up(max(n, 1), align)
    return out if cap is None else min(out, cap)


def width_multiple(sp: int, align: int) -> int:
    """A micro-batch's forward input width (token-grid width - 1) must be a multiple of this so that
    rows x width / sp divides by ``align`` for any number of rows (sp: the sequence-parallel split)."""
    return sp * align


def padded_length(s: int, rows: int, sp: int, align: int) -> int:
    """The shortest sequence length >= s of a [rows, length] forward input with length % sp == 0 and
    rows x length / sp % align == 0 (what ``model.forward_logits`` pads a caller's input to)."""
    step = sp * (align // math.gcd(align, rows))
    return round_up(s, step)
