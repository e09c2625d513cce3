"""The FP8 padding arithmetic (megatron_gspo/model/fp8_alignment.py) against Transformer Engine's own rules,
which are plain Python and run on the CPU: ``assert_dim_for_fp8_exec`` (what te.Linear and
te.LayerNormLinear call on their input under FP8), the grouped GEMMs' alignment per recipe
(``get_align_size_for_quantization``) and MXFP8's quantizability."""

import pytest
import torch

from megatron_gspo.model import fp8_alignment

HIDDEN = 2048  # Qwen3-30B-A3B's hidden size (the last dimension TE checks: % 16)


def _te_accepts(tokens: int) -> bool:
    from transformer_engine.pytorch.utils import assert_dim_for_fp8_exec

    try:
        assert_dim_for_fp8_exec(torch.empty(tokens, HIDDEN, device="meta"))
    except ValueError as e:
        assert "FP8 execution requires" in str(e)
        return False
    return True


def test_unaligned_forwards_are_what_te_refuses():
    """Shapes of today's FP8 recipe (micro-batch 2, TP 1, no SP) and of a compacted decode batch: TE
    refuses them; the padded ones pass."""
    assert not _te_accepts(2 * 37)  # 2 rows x 37 tokens (widths rounded to the SP size only)
    assert not _te_accepts(13)  # 13 live rows x 1 token after compaction
    align = fp8_alignment.fp8_alignment("hybrid", "delayed")
    assert _te_accepts(fp8_alignment.padded_rows(13, align))
    for rows in range(1, 9):
        for s in range(1, 40):
            assert _te_accepts(rows * fp8_alignment.padded_length(s, rows, 1, align))
            w = fp8_alignment.width_multiple(1, align) * (1 + s // 16)
            assert _te_accepts(rows * w)


@pytest.mark.parametrize("name, recipe", [("delayed", "DelayedScaling"), ("tensorwise", "Float8CurrentScaling"),
                                          ("blockwise", "Float8BlockScaling"), ("mxfp8", "MXFP8BlockScaling")])
def test_alignment_per_recipe_is_tes_grouped_gemm_alignment(name, recipe):
    import transformer_engine.common.recipe as recipes
    from transformer_engine.pytorch.quantization import get_align_size_for_quantization

    te_align = get_align_size_for_quantization(getattr(recipes, recipe)())
    assert fp8_alignment.fp8_alignment("hybrid", name) == te_align
    assert te_align % 8 == 0  # so it covers assert_dim_for_fp8_exec's token rule too


def test_mxfp8_aligned_inputs_are_quantizable():
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    import transformer_engine_torch as tex

    q = MXFP8Quantizer(tex.DType.kFloat8E4M3)
    align = fp8_alignment.fp8_alignment("hybrid", "mxfp8")
    assert not q.is_quantizable(torch.empty(16, HIDDEN, device="meta"))
    for rows in (1, 3, 5):
        for s in (1, 7, 33):
            n = rows * fp8_alignment.padded_length(s, rows, 1, align)
            assert q.is_quantizable(torch.empty(n, HIDDEN, device="meta"))
