"""The local spec's fast paths equal megatron's own modules on the same weights:

- core attention on torch's SDPA (megatron_gspo.model.attention.SDPAttention) == megatron's unfused
  DotProductAttention: logits and every gradient of a whole model with GQA, padded rows and an
  explicit mask; a query that sees no key (a left-padding slot) gets a finite output; generation
  with left-padded prompts draws the same tokens; megatron's mask-free causal default and a
  cached-prefix (sq < sk) call; the fallbacks (dropout while training) go to megatron's path;
- the batch-first output layer (megatron_gspo.model.output_layer) gives megatron's logits and gradients
  without the [s, b, V] transpose copy (the returned logits are a view of the layer's own output).
The TP / EP / DP layouts run these modules in tests/test_layouts.py (gradient invariance).
"""

import dataclasses

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_gspo.model.attention import SDPAttention
from megatron_gspo.config import ConfigError, ParallelConfig, model_config_from_preset
from megatron_gspo.generation.generator import GenerationConfig, generate
from megatron_gspo.model.gpt import build_model, forward_logits, resolve_attention_impl
from megatron_gspo.model.output_layer import BatchFirstOutputLayer

TOL = 2e-5


def _tiny(**kw):
    # GQA (4 query heads over 2 KV groups) as in Qwen3
    return model_config_from_preset("tiny", vocab_size=100, **kw)


def _core_attentions(model):
    return [m for m in model.modules() if isinstance(m, DotProductAttention)]


def _pair(single_rank, **kw):
    cfg = _tiny(attention_impl="unfused", **kw)
    par = ParallelConfig(device="cpu")
    st = single_rank(cfg, par)
    ref = build_model(cfg, par, st)
    fast = build_model(dataclasses.replace(cfg, attention_impl="sdpa"), par, st)
    fast.load_state_dict(ref.state_dict())
    assert not any(isinstance(m, SDPAttention) for m in _core_attentions(ref))
    assert _core_attentions(fast) and all(isinstance(m, SDPAttention) for m in _core_attentions(fast))
    return cfg, st, ref, fast


def _logits_and_grads(model, tokens, **kw):
    model.zero_grad(set_to_none=True)
    logits = forward_logits(model, tokens, **kw)
    (logits.float().log_softmax(-1)[..., 7].sum() + logits.float().pow(2).mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_sdpa_attention_equals_megatron_unfused_attention(single_rank):
    cfg, st, ref, fast = _pair(single_rank)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (3, 21), generator=g).to(st.device)
    pad = torch.zeros(3, 21, dtype=torch.bool, device=st.device)
    pad[1, 15:] = True  # a right-padded row
    for kw in ({}, {"padding_mask": pad}):
        (l1, g1), (l2, g2) = _logits_and_grads(ref, tokens, **kw), _logits_and_grads(fast, tokens, **kw)
        assert (l1 - l2).abs().max().item() <= TOL
        assert g1.keys() == g2.keys() and len(g1) > 10
        for n in g1:
            assert (g1[n] - g2[n]).abs().max().item() <= TOL * max(1.0, g1[n].abs().max().item()), n


def test_sdpa_masks_fully_masked_queries_and_causal_defaults(single_rank):
    _, st, ref, fast = _pair(single_rank)
    dev = st.device
    a_ref, a_fast = _core_attentions(ref)[0], _core_attentions(fast)[0]
    a_ref.eval(), a_fast.eval()
    g = torch.Generator().manual_seed(1)
    sq, b, heads, groups, hn = 6, 2, 4, 2, 16
    q = torch.randn(sq, b, heads, hn, generator=g).to(dev)
    k, v = torch.randn(sq, b, groups, hn, generator=g).to(dev), torch.randn(sq, b, groups, hn, generator=g).to(dev)
    # left padding: row 1's first two slots are padding keys; its slot 0 query sees no key at all
    mask = torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=dev), 1)[None, None].repeat(b, 1, 1, 1)
    mask[1, :, :, :2] = True
    out_ref, out = a_ref(q, k, v, mask), a_fast(q, k, v, mask)
    assert torch.isfinite(out).all()
    # every query that sees a key agrees (megatron's garbage for the blind one differs, unused)
    seen = ~mask.all(-1)[:, 0]  # [b, sq]
    diff = (out_ref - out).abs().reshape(sq, b, heads, hn).amax((2, 3)).t()  # [b, sq]
    assert diff[seen].max().item() <= TOL and not seen[1, 0] and seen[1, 2]
    # no mask: megatron's causal default (sq == sk), and queries that are the last sq of sk keys
    causal = torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=dev), 1)[None, None]
    assert (a_fast(q, k, v, None, attn_mask_type=AttnMaskType.causal) - a_ref(q, k, v, causal)).abs().max() <= TOL
    q2 = q[-2:]
    causal2 = torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=dev), 1)[None, None, -2:]
    assert (a_fast(q2, k, v, None, attn_mask_type=AttnMaskType.causal) - a_ref(q2, k, v, causal2)).abs().max() <= TOL


def test_sdpa_falls_back_to_megatron_for_training_dropout(single_rank, monkeypatch):
    _, st, _, fast = _pair(single_rank)
    att = _core_attentions(fast)[0]
    called = []
    monkeypatch.setattr(DotProductAttention, "forward", lambda self, *a, **k: called.append(1) or a[0].flatten(2))
    q = torch.randn(4, 1, 4, 16, device=st.device)
    k = v = torch.randn(4, 1, 2, 16, device=st.device)
    att.attention_dropout.p = 0.1
    att.train()
    att(q, k, v, None)
    assert called == [1]
    att.eval()  # dropout is off in eval: SDPA again
    att(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert called == [1]


def test_generation_with_left_padded_prompts_is_unchanged(single_rank):
    cfg, st, ref, fast = _pair(single_rank)
    prompts = [[5, 9, 3, 7, 11, 2], [4, 8], [13, 1, 6]]  # unequal lengths: left padding + masks
    gc = GenerationConfig(max_new_tokens=6, n_samples_per_prompt=2, temperature=1.0, stop_token_ids=[],
                          pad_token_id=0, seed=3)
    a = generate(ref, prompts, gc, vocab_size=cfg.vocab_size, state=st)
    b = generate(fast, prompts, gc, vocab_size=cfg.vocab_size, state=st)
    assert torch.equal(a.tokens, b.tokens)
    assert (a.logprobs - b.logprobs).abs().max().item() <= TOL


def test_attention_impl_resolution():
    assert resolve_attention_impl(_tiny(), "local") == "sdpa"
    assert resolve_attention_impl(_tiny(attention_impl="unfused"), "local") == "unfused"
    assert resolve_attention_impl(_tiny(), "transformer_engine") == "te"
    with pytest.raises(ConfigError, match="attention_impl='sdpa' is a local-spec choice"):
        resolve_attention_impl(_tiny(attention_impl="sdpa"), "transformer_engine")
    with pytest.raises(ConfigError, match="model.attention_impl"):
        _tiny(attention_impl="flash")


def test_batch_first_output_layer_skips_the_transpose_copy(single_rank):
    cfg = _tiny()
    par = ParallelConfig(device="cpu")
    st = single_rank(cfg, par)
    model = build_model(cfg, par, st)
    assert type(model.output_layer) is BatchFirstOutputLayer
    tokens = torch.randint(0, cfg.vocab_size, (3, 10), generator=torch.Generator().manual_seed(4)).to(st.device)
    logits, grads = _logits_and_grads(model, tokens)
    # no copy: the logits megatron returns are a view of the output layer's own [b, s, V] result
    assert forward_logits(model, tokens)._base is not None
    model.output_layer.__class__ = ColumnParallelLinear  # megatron's layer: [s, b, V] + a transpose copy
    assert forward_logits(model, tokens)._base is None
    ref_logits, ref_grads = _logits_and_grads(model, tokens)
    assert torch.equal(logits, ref_logits)
    for n in ref_grads:
        assert (grads[n] - ref_grads[n]).abs().max().item() <= 1e-6 * max(1.0, ref_grads[n].abs().max().item()), n
