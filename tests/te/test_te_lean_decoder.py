"""The lean decoder on the Transformer Engine spec (the NGC container's): it reads TE-spec weights as
they are (``linear_qkv.layer_norm_weight``, TE's q/k / pre-MLP / final RMSNorms, ``TEGroupedMLP``'s
``weight0..N``) and runs its own torch ops, never a TE kernel: on a construct-only TE-spec model (every
TE module's forward raises ConstructOnlyError here, and no GPU could run one anyway) it generates
exactly what it generates on the local-spec model holding the same weights (init_weights draws both
from the seed alone), with uniform and ragged prompts, eagerly and through the graph-ready step."""

import pytest
import torch

from megatron_gspo.config import model_config_from_preset
from megatron_gspo.generation.lean_decoder import LeanDecoder, lean_decode_unsupported
from megatron_gspo.generation.generator import GenerationConfig, generate

VOCAB = 100
PROMPTS = {"uniform": (6, 6, 6), "ragged": (4, 1, 9)}


@pytest.fixture
def both(cpu_models):
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB)
    te_model, st = cpu_models(cfg, "te")
    local, _ = cpu_models(cfg, "local")
    for name, p in local.named_parameters():
        te_name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        if ".local_experts." in te_name:  # ...experts.local_experts.<e>.linear_fc1.weight -> ...experts.linear_fc1.weight<e>
            head, tail = te_name.split(".local_experts.")
            e, fc, _ = tail.split(".")
            te_name = f"{head}.{fc}.weight{e}"
        assert torch.equal(te_model.get_parameter(te_name), p), name
    return te_model, local, st


def _prompts(kind: str):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPTS[kind]]


def _te_calls(m, mp):
    """Calls of Transformer Engine code: TE modules' forwards raise on construct-only models anyway;
    megatron's router calls TE's GEMM (moe_utils.te_general_gemm) whenever TE imported at megatron's
    import: bound here to a recorder that raises, so a router that used it fails the test."""
    from megatron.core.transformer.moe import moe_utils

    calls = []

    def te_general_gemm(*a, **k):
        calls.append("te_general_gemm")
        raise AssertionError("the router ran Transformer Engine's GEMM")

    mp.setattr(moe_utils, "te_general_gemm", te_general_gemm, raising=False)
    return calls


def test_the_te_spec_is_decoded_by_the_lean_path(both):
    te_model, local, _ = both
    assert lean_decode_unsupported(te_model) is None
    layer = te_model.decoder.layers[0]
    assert type(layer.self_attention.core_attention).__name__ == "TEDotProductAttention"
    assert type(layer.mlp.experts).__name__ == "TEGroupedMLP"
    with pytest.raises(RuntimeError, match="construct-only|ConstructOnly"):
        layer.pre_mlp_layernorm(torch.zeros(1, 1, 64))  # the tier's TE modules cannot run: the decoder may not call them


@pytest.mark.parametrize("kind", list(PROMPTS))
@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_k=8), dict(temperature=0.0)], ids=["sample", "greedy"])
def test_lean_generation_on_te_weights_equals_the_local_spec(both, monkeypatch, kind, sampling):
    te_model, local, st = both
    n = 1 if sampling["temperature"] == 0 else 2
    cfg = GenerationConfig(max_new_tokens=8, n_samples_per_prompt=n, seed=9, decode_impl="lean", **sampling)
    want = generate(local, _prompts(kind), cfg, vocab_size=VOCAB, state=st)
    calls = _te_calls(te_model, monkeypatch)
    got = generate(te_model, _prompts(kind), cfg, vocab_size=VOCAB, state=st)
    assert not calls
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.response_lengths, want.response_lengths)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-6)
    assert got.response_mask.any()


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_prefill_and_decode_logits_equal_the_local_spec(both, monkeypatch, kind):
    """The decoder's logits of the prefill and of each decode step, on the two specs, fed the same
    tokens (greedy continuation of the local model)."""
    te_model, local, _ = both
    calls = _te_calls(te_model, monkeypatch)
    prompts = _prompts(kind)
    B, P = len(prompts), max(map(len, prompts))
    tokens = torch.zeros(B, P, dtype=torch.long)
    pad = torch.tensor([P - len(p) for p in prompts])
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):] = torch.tensor(p)
    slots = torch.arange(P)
    positions = (slots[None] - pad[:, None]).clamp(min=0)
    masked = (torch.triu(torch.ones(P, P, dtype=torch.bool), 1)[None] | (slots[None, None] < pad[:, None, None]))[:, None]
    decs = [LeanDecoder(m, B, P + 6, P + 6) for m in (local, te_model)]
    logits = []
    with torch.no_grad(), decs[0].torch_routers(), decs[1].torch_routers():
        for d in decs:
            d.set_left_pad(pad)
        steps = [[d.prefill(tokens, positions, masked) for d in decs]]
        for j in range(6):
            nxt = steps[-1][0].argmax(-1)
            steps.append([d.decode(nxt, P + j) for d in decs])
    assert not calls
    for want, got in steps:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_graph_ready_step_on_te_weights(both, monkeypatch):
    """The TE spec's decode step passes the graph-ready contract (no host sync in a captured step,
    every input read from the decoder's buffers) and replays the eager step's tokens."""
    from test_decode import StandInGraph, _graph_mode

    te_model, _, st = both
    cfg = GenerationConfig(max_new_tokens=8, n_samples_per_prompt=2, seed=9, decode_impl="lean")
    eager = generate(te_model, _prompts("ragged"), cfg, vocab_size=VOCAB, state=st)
    with monkeypatch.context() as mp:
        _graph_mode(mp)
        graphed = generate(te_model, _prompts("ragged"), cfg, vocab_size=VOCAB, state=st)
        assert StandInGraph.captures
    assert torch.equal(graphed.tokens, eager.tokens)
    torch.testing.assert_close(graphed.logprobs, eager.logprobs, rtol=0, atol=1e-6)


def test_te_experts_without_grouped_mm_loop_eagerly_and_refuse_graphs(both, monkeypatch):
    """Where torch._grouped_mm cannot take the weights (CUDA fp32, older torch) TE's experts run as a
    loop of GEMMs over host-side counts: the same tokens, and CUDA graphs refused by name."""
    import megatron_gspo.generation.lean_decoder as decode

    te_model, local, st = both
    cfg = GenerationConfig(max_new_tokens=6, n_samples_per_prompt=2, seed=9, decode_impl="lean")
    want = generate(local, _prompts("ragged"), cfg, vocab_size=VOCAB, state=st)
    monkeypatch.setattr(decode, "_grouped_mm_ok", lambda w1, w2: False)
    got = generate(te_model, _prompts("ragged"), cfg, vocab_size=VOCAB, state=st)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="cannot run without host synchronisation .no torch._grouped_mm"):
        LeanDecoder(te_model, 2, 8, 8, graphs=True, graph_factory=object)


def test_expert_weights_are_read_in_place(both):
    """The decoder's [E, out, in] expert stacks are views of the TE parameters' storage (no copy per
    step), so an in-place update of a parameter (what an optimizer step does) is what the next step reads."""
    te_model, _, _ = both
    dec = LeanDecoder(te_model, 2, 8, 8)
    moe = dec.moe[0]
    assert moe is not None and moe.sync_free and moe.stacks is not None
    fc1 = te_model.decoder.layers[0].mlp.experts.linear_fc1
    with torch.no_grad():
        fc1.weight2.add_(1.0)
    assert torch.equal(moe.stacks[0][2], fc1.weight2)
    assert moe.stacks[0].untyped_storage().data_ptr() == fc1.weight0.untyped_storage().data_ptr()
