"""The lean decode path (megatron_gspo/decode.py) against megatron's GPTModel forward.

The reference for every check is megatron's own path (``generation.decode_impl=megatron``: the
GPTModel forward with its StaticInferenceContext) or a fresh full forward without any cache, on the
same weights; ragged (left-padded) prompts, sampling and greedy, with and without finished-row
compaction, tied and untied output weights."""

import pytest
import torch

from megatron_gspo import parallel
from megatron_gspo.config import ConfigError, ParallelConfig, model_config_from_preset
from megatron_gspo.decode import LeanDecoder, lean_decode_unsupported
from megatron_gspo.generation import GenerationConfig, generate
from megatron_gspo.logprobs import vocab_parallel_logprobs
from megatron_gspo.model import build_model, forward_logits

VOCAB = 100
PROMPT_LENS = (4, 1, 9, 6)


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=[True, False], ids=["untied", "tied"])
def model(request):
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, moe_aux_loss_coeff=0.0,
                                   untie_embeddings_and_output_weights=request.param)
    par = ParallelConfig(seed=5)
    st = parallel.initialize(cfg, par)
    m = build_model(cfg, par, st)
    yield m, st
    parallel.destroy()


def _gen(model, impl, **kw):
    m, st = model
    base = dict(max_new_tokens=12, temperature=1.0, n_samples_per_prompt=3, seed=7)
    return generate(m, _prompts() * 2, GenerationConfig(**{**base, **kw, "decode_impl": impl}), vocab_size=VOCAB, state=st)


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.0), dict(top_k=5, top_p=0.8)], ids=["sample", "greedy", "topk-topp"])
def test_lean_generation_equals_megatron_path(model, kw):
    ref, got = _gen(model, "megatron", **kw), _gen(model, "lean", **kw)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.response_lengths, ref.response_lengths)
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=2e-6)
    assert got.num_forwards == ref.num_forwards == 12


def test_lean_logprobs_equal_a_fresh_full_forward(model):
    """Every recorded log-prob (prefill's last position and each decode step, left-padded rows
    included) is that of one full causal forward of the finished sequence without a cache."""
    out = _gen(model, "lean")
    m, _ = model
    with torch.no_grad():
        logits = forward_logits(m, out.tokens)
        lp, _ = vocab_parallel_logprobs(logits[:, :-1], out.tokens[:, 1:], VOCAB, temperature=1.0, with_entropy=False)
    mask = out.response_mask[:, 1:]
    assert (lp - out.logprobs[:, 1:])[mask].abs().max().item() < 1e-5


def test_lean_with_finished_row_compaction_equals_static_batch(model):
    free = _gen(model, "lean")
    common = torch.bincount(free.tokens[free.response_mask], minlength=VOCAB).topk(3).indices.tolist()
    static = _gen(model, "megatron", stop_token_ids=common, compact_finished_rows=0.0)
    lean = _gen(model, "lean", stop_token_ids=common, compact_finished_rows=0.25)
    assert static.response_lengths.min() < 4 < static.response_lengths.max()  # ragged indeed
    assert torch.equal(lean.tokens, static.tokens) and torch.equal(lean.stopped, static.stopped)
    torch.testing.assert_close(lean.logprobs, static.logprobs, rtol=0, atol=2e-6)
    assert lean.decode_row_steps < static.decode_row_steps


def test_decode_attention_matches_sdpa():
    """The decode step's grouped-GEMM attention equals torch SDPA with GQA (and a padding mask)."""
    dec = LeanDecoder.__new__(LeanDecoder)
    dec.np, dec.ng, dec.hn, dec.scale = 8, 2, 16, 0.25
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 8, 1, 16, generator=g), torch.randn(3, 2, 7, 16, generator=g), torch.randn(3, 2, 7, 16, generator=g)
    bias = torch.zeros(3, 1, 1, 7)
    bias[1, ..., :3] = torch.finfo(torch.float32).min / 2  # row 1: first three slots are padding
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(dec._attend(q, k, v, bias), want, rtol=1e-5, atol=1e-6)


def test_auto_falls_back_and_lean_refuses_what_it_does_not_support(model):
    m, st = model
    assert lean_decode_unsupported(m) is None
    # a per-forward callback (the R3 routing recorder) runs on the lean path too
    calls = []
    out = generate(m, _prompts(), GenerationConfig(max_new_tokens=3, temperature=0.0, decode_impl="lean"),
                   vocab_size=VOCAB, state=st, on_forward=lambda i, kind, rows: calls.append(kind))
    assert calls == ["prefill", "decode", "decode"] and out.num_forwards == 3
    # Transformer Engine's (or any other) core attention: auto keeps megatron's path, lean refuses by name
    layer = m.decoder.layers[0].self_attention
    core = layer.core_attention
    layer.core_attention = torch.nn.Identity()
    try:
        assert lean_decode_unsupported(m) == "core attention Identity"
        with pytest.raises(ValueError, match="decode_impl=lean does not support core attention Identity"):
            generate(m, _prompts(), GenerationConfig(max_new_tokens=3, decode_impl="lean"), vocab_size=VOCAB, state=st)
    finally:
        layer.core_attention = core
    m.config.sequence_parallel, saved = True, m.config.sequence_parallel
    try:
        assert lean_decode_unsupported(m) == "sequence parallelism"
    finally:
        m.config.sequence_parallel = saved
    with pytest.raises(ConfigError, match="generation.decode_impl"):
        GenerationConfig(decode_impl="vllm")
