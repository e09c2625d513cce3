"""Rollout generation on the Megatron model (megatron_gspo.generation.generator).

In-process (one rank, tiny Qwen3-MoE GPTModel, fp32 on CPU):
- greedy with megatron's KV cache (StaticInferenceContext) and left-padded ragged prompts gives
  exactly the tokens of a no-cache loop (a full forward_logits per step, one prompt at a time);
- the returned log-probs equal vocab_parallel_logprobs of a fresh full forward of the returned
  tokens (max abs diff < 1e-5), greedy (temperature-1 log-probs) and sampled (T=1, and T=0.7 with
  top-k/top-p: unfiltered temperature-scaled log-probs);
- top-k=1 equals greedy; stop tokens end responses per row (mask, pad, lengths, stopped flag);
  G samples per prompt differ at T=1; seeds reproduce; the model's state is restored.
- ragged prompts under Transformer Engine's mask-type contract (emulated: TE cannot run here) are
  generated like the local spec, and a custom attention class is refused for ragged prompts.
Under torchrun (tests/dist_scripts/generation_parity.py): TP=2 and EP=2 greedy equal TP=1 greedy on
the same checkpointed weights, the TP ranks sample identically, EP ranks stay in lockstep.
"""

import contextlib
import os
import subprocess

import pytest
import torch

import conftest
from megatron_gspo.runtime import parallel
from megatron_gspo.config import ConfigError, ParallelConfig, from_dict, model_config_from_preset
from megatron_gspo.generation.generator import GenerationConfig, generate
from megatron_gspo.model.logprobs import vocab_parallel_logprobs
from megatron_gspo.model.gpt import build_model, forward_logits

VOCAB = 100
PROMPT_LENS = (4, 1, 9, 6)
DIST_SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts")


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def tiny():
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, moe_aux_loss_coeff=0.0)
    par = ParallelConfig(device="cpu", seed=5)
    st = parallel.initialize(cfg, par)
    model = build_model(cfg, par, st)
    yield model, st
    parallel.destroy()


def _fresh_logprobs(model, out, temperature):
    """log-probs of out.tokens[:, 1:] from one full forward (no cache), on the [B, T-1] grid."""
    with torch.no_grad():
        logits = forward_logits(model, out.tokens)
        lp, _ = vocab_parallel_logprobs(logits[:, :-1], out.tokens[:, 1:], VOCAB, temperature=temperature,
                                        with_entropy=False)
    return lp, logits


def _max_lp_diff(model, out, temperature):
    lp, _ = _fresh_logprobs(model, out, temperature)
    m = out.response_mask[:, 1:]
    assert m.sum() == out.response_lengths.sum()
    return (lp - out.logprobs[:, 1:])[m].abs().max().item()


# ----------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", 0), ("temperature", -0.5), ("temperature", float("inf")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -1), ("n_samples_per_prompt", 0), ("seed", -3), ("stop_token_ids", [1, -2]),
    ("pad_token_id", -1),
])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"generation.{field}"):
        GenerationConfig(**{field: value})


def test_config_from_yaml_style_dict():
    c = from_dict(GenerationConfig, {"max_new_tokens": "32", "temperature": 0, "stop_token_ids": "5,9",
                                     "n_samples_per_prompt": 8})
    assert (c.max_new_tokens, c.greedy, c.stop_token_ids, c.n_samples_per_prompt, c.pad_id) == (32, True, [5, 9], 8, 5)
    assert GenerationConfig(pad_token_id=3, stop_token_ids=[5]).pad_id == 3


# ----------------------------------------------------------------------------------------------
# on the model
# ----------------------------------------------------------------------------------------------


def test_greedy_kv_cache_equals_no_cache_loop(tiny):
    model, st = tiny
    prompts, new = _prompts(), 10
    calls = []
    out = generate(model, prompts, GenerationConfig(max_new_tokens=new, temperature=0.0, n_samples_per_prompt=2),
                   vocab_size=VOCAB, state=st, on_forward=lambda i, k, rows: calls.append((i, k)))

    # reference: no cache, one prompt at a time, a full forward per generated token
    model.eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(new):
                seq.append(int(forward_logits(model, torch.tensor([seq], device=st.device))[0, -1, :VOCAB].argmax()))
            want.append(seq[len(p):])
    model.train()
    assert out.responses() == [w for w in want for _ in range(2)]

    B = 2 * len(prompts)
    lens = torch.tensor(PROMPT_LENS, device=st.device).repeat_interleave(2)
    assert out.tokens.shape == (B, max(PROMPT_LENS) + new)
    assert out.tokens.device == st.device  # the outputs live on the state's device
    assert torch.equal(out.prompt_lengths, lens)
    assert torch.equal(out.response_lengths, torch.full((B,), new, device=st.device))
    assert torch.equal(out.prompt_index, torch.arange(len(prompts), device=st.device).repeat_interleave(2))
    for r in range(B):
        L = int(lens[r])
        assert out.tokens[r, :L].tolist() == prompts[r // 2]
        assert (out.tokens[r, L + new:] == 0).all()  # pad_id: 0 without stop tokens
        assert out.response_mask[r].nonzero().squeeze(1).tolist() == list(range(L, L + new))
    assert not out.stopped.any()
    assert (out.logprobs[~out.response_mask] == 0).all() and (out.logprobs[out.response_mask] < 0).all()
    # one prefill + a decode per further token: the last sampled token is never fed
    assert calls == [(0, "prefill")] + [(i, "decode") for i in range(1, new)] and out.num_forwards == new
    assert out.num_generated_tokens == B * new and out.tokens_per_s > 0 and 0 < out.prefill_s < out.elapsed_s

    # greedy records temperature-1 log-probs: those of a fresh full forward
    assert _max_lp_diff(model, out, temperature=1.0) < 1e-5


class TEDotProductAttention(torch.nn.Module):
    """Transformer Engine's mask-type contract around megatron's local attention (TE cannot run on
    a CPU): the mask tensor is applied only for the "arbitrary" type, "causal" means a top-left
    causal mask built from the shapes and "no_mask" none at all, whatever mask is passed.
    generation finds TE attentions by this class name, as it does for megatron's TE wrapper."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, query, key, value, attention_mask, attn_mask_type, **kwargs):
        from megatron.core.transformer.enums import AttnMaskType

        sq, sk = query.shape[0], key.shape[0]  # [s, b, h, d] (sbhd)
        if attn_mask_type == AttnMaskType.arbitrary:
            mask = attention_mask
        elif attn_mask_type == AttnMaskType.causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1)[None, None]
        elif attn_mask_type == AttnMaskType.no_mask:
            mask = torch.zeros(1, 1, sq, sk, dtype=torch.bool, device=query.device)
        else:
            raise AssertionError(attn_mask_type)
        return self.inner(query, key, value, mask, attn_mask_type=attn_mask_type, **kwargs)


@pytest.mark.parametrize("remap", [True, False])
def test_te_attention_gets_the_padding_mask_of_ragged_prompts(tiny, monkeypatch, remap):
    """Under the TE spec a left-padded batch must reach TE as an "arbitrary" mask (TE ignores the
    mask for megatron's causal / no_mask inference types). With TE's contract in place of local
    attention, ragged greedy generation equals the local spec's, and it does not without the
    remapping (the check can fail)."""
    import megatron_gspo.generation.decoder as decode_backends

    model, st = tiny
    # megatron's path: the one that calls TE's attention (the lean decoder computes attention itself)
    cfg = GenerationConfig(max_new_tokens=6, temperature=0.0, decode_impl="megatron")
    want = generate(model, _prompts(), cfg, vocab_size=VOCAB, state=st)
    if not remap:
        monkeypatch.setattr(decode_backends, "_padding_mask_honored", lambda m: contextlib.nullcontext())
    owners = [mod for mod in model.modules() if hasattr(mod, "core_attention")]
    originals = [mod.core_attention for mod in owners]
    try:
        for mod, core in zip(owners, originals):
            mod.core_attention = TEDotProductAttention(core)
        got = generate(model, _prompts(), cfg, vocab_size=VOCAB, state=st)
        assert all(mod.core_attention.forward.__func__ is TEDotProductAttention.forward for mod in owners)
    finally:
        for mod, core in zip(owners, originals):
            mod.core_attention = core
    lp_diff = (got.logprobs - want.logprobs).abs().max().item() if got.logprobs.shape == want.logprobs.shape else 1.0
    if remap:
        assert got.responses() == want.responses() and lp_diff < 1e-5
    else:  # padding attended: the padded prompts' log-probs move
        assert lp_diff > 1e-3, lp_diff


def test_unknown_attention_refused_for_ragged_prompts(tiny):
    model, st = tiny
    owner = next(mod for mod in model.modules() if hasattr(mod, "core_attention"))
    core = owner.core_attention
    owner.core_attention = torch.nn.Identity()
    try:
        with pytest.raises(NotImplementedError, match="torch.nn.modules.linear.Identity"):
            generate(model, _prompts(), GenerationConfig(max_new_tokens=2), vocab_size=VOCAB, state=st)
    finally:
        owner.core_attention = core


def test_sampling_logprobs_equal_fresh_forward(tiny):
    model, st = tiny
    prompts = _prompts()
    cfg = GenerationConfig(max_new_tokens=12, temperature=1.0, top_p=1.0, n_samples_per_prompt=4, seed=7)
    out = generate(model, prompts, cfg, vocab_size=VOCAB, state=st)
    assert _max_lp_diff(model, out, temperature=1.0) < 1e-5
    resp = out.responses()
    for i in range(len(prompts)):
        assert len({tuple(r) for r in resp[4 * i:4 * i + 4]}) > 1, f"prompt {i}: all 4 samples identical"
    # seeds: same seed -> same samples; another seed (or the per-call override) -> different ones
    again = generate(model, prompts, cfg, vocab_size=VOCAB, state=st)
    assert torch.equal(again.tokens, out.tokens) and torch.equal(again.logprobs, out.logprobs)
    other = generate(model, prompts, cfg, vocab_size=VOCAB, state=st, seed=8)
    assert not torch.equal(other.tokens, out.tokens)


def test_filtered_sampling_records_unfiltered_tempered_logprobs(tiny):
    model, st = tiny
    T, k, top_p = 0.7, 20, 0.9
    cfg = GenerationConfig(max_new_tokens=10, temperature=T, top_k=k, top_p=top_p, n_samples_per_prompt=3, seed=2)
    out = generate(model, _prompts(), cfg, vocab_size=VOCAB, state=st)
    lp, logits = _fresh_logprobs(model, out, temperature=T)
    m = out.response_mask[:, 1:]
    assert (lp - out.logprobs[:, 1:])[m].abs().max().item() < 1e-5
    # every drawn token lies inside the top-k and the nucleus of its (tempered) distribution
    x = logits[:, :-1, :VOCAB][m] / T
    tok = out.tokens[:, 1:][m]
    rank = (x > x.gather(1, tok[:, None])).sum(1)
    assert rank.max() < k
    probs = torch.softmax(x, -1)
    mass_before = (probs * (x > x.gather(1, tok[:, None]))).sum(1)
    assert mass_before.max() < top_p


def test_top_k_1_equals_greedy(tiny):
    model, st = tiny
    greedy = generate(model, _prompts(), GenerationConfig(max_new_tokens=8, temperature=0.0, n_samples_per_prompt=1),
                      vocab_size=VOCAB, state=st)
    k1 = generate(model, _prompts(),
                  GenerationConfig(max_new_tokens=8, temperature=1.0, top_k=1, n_samples_per_prompt=3),
                  vocab_size=VOCAB, state=st)
    assert k1.responses() == [r for r in greedy.responses() for _ in range(3)]


def test_stop_tokens_end_each_response(tiny):
    model, st = tiny
    new, pad = 12, 7
    free = generate(model, _prompts(), GenerationConfig(max_new_tokens=new, temperature=0.0, n_samples_per_prompt=1),
                    vocab_size=VOCAB, state=st).responses()
    stop = [free[0][2], free[2][5]]  # row 0 stops by its 3rd token at the latest, row 2 by its 6th
    calls = []
    out = generate(model, _prompts(), GenerationConfig(max_new_tokens=new, temperature=0.0, n_samples_per_prompt=1,
                                                       stop_token_ids=stop, pad_token_id=pad),
                   vocab_size=VOCAB, state=st, on_forward=lambda i, k, rows: calls.append(i))
    got = out.responses()
    n_stopped = 0
    for r, full in enumerate(free):
        cut = next((j + 1 for j, t in enumerate(full) if t in stop), None)
        assert got[r] == full[:cut], f"row {r}"
        assert bool(out.stopped[r]) == (cut is not None)
        n_stopped += cut is not None
        L, n = int(out.prompt_lengths[r]), int(out.response_lengths[r])
        assert n == len(full[:cut])
        assert (out.tokens[r, L + n:] == pad).all()
        assert out.response_mask[r].sum() == n and out.response_mask[r, L:L + n].all()
        assert (out.logprobs[r, L + n:] == 0).all() and (out.logprobs[r, L:L + n] < 0).all()
    assert n_stopped >= 2 and out.response_lengths.min() <= 3
    # the batch stops stepping when its longest response ends
    assert out.num_forwards == len(calls) == int(out.response_lengths.max())
    assert out.tokens.shape[1] == int((out.prompt_lengths + out.response_lengths).max())
    # all rows stopping early ends the loop early
    early = generate(model, _prompts()[:1], GenerationConfig(max_new_tokens=new, temperature=0.0,
                                                             n_samples_per_prompt=2, stop_token_ids=[free[0][0]]),
                     vocab_size=VOCAB, state=st)
    assert early.response_lengths.tolist() == [1, 1] and early.num_forwards == 1 and early.stopped.all()


def test_dropping_finished_rows_changes_no_result_and_saves_decode_work(tiny):
    """Finished rows leave the decode batch and its KV cache (generation.compact_finished_rows): the
    tokens, log-probs and lengths are those of the static batch, for less decode work."""
    model, st = tiny
    prompts = _prompts() * 4  # 16 ragged rows
    base = dict(max_new_tokens=14, temperature=1.0, n_samples_per_prompt=2, seed=4)
    free = generate(model, prompts, GenerationConfig(**base), vocab_size=VOCAB, state=st)
    # frequent tokens as stop tokens: a long-tailed mix of short and full-length responses
    common = torch.bincount(free.tokens[free.response_mask], minlength=VOCAB).topk(3).indices.tolist()
    outs = {c: generate(model, prompts, GenerationConfig(**base, stop_token_ids=common, compact_finished_rows=c),
                        vocab_size=VOCAB, state=st) for c in (0.0, 0.25, 0.5, 0.9)}
    ref = outs[0.0]
    lengths = ref.response_lengths
    assert lengths.min() < 4 and lengths.max() == 14  # long-tailed indeed
    assert ref.decode_row_steps == 32 * 13  # the static batch decodes every row until the longest ends
    for c in (0.25, 0.5, 0.9):  # 0.9: 14 of the 32 rows run to the end, the batch never shrinks that far
        got = outs[c]
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.response_lengths, lengths), c
        assert torch.equal(got.stopped, ref.stopped)
        torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-5)
        assert (got.decode_row_steps < ref.decode_row_steps) == (c < 0.9), c
    # the work left is close to the rows' own lengths (each row decodes until it ends, +fillers)
    assert outs[0.25].decode_row_steps <= 1.5 * int((lengths - 1).sum())
    # and the returned log-probs are still the training forward's
    assert _max_lp_diff(model, outs[0.25], 1.0) < 1e-5


def test_min_new_tokens_and_ignore_eos(tiny):
    model, st = tiny
    cfg = dict(max_new_tokens=10, temperature=1.0, n_samples_per_prompt=4, seed=3)
    free = generate(model, _prompts(), GenerationConfig(**cfg), vocab_size=VOCAB, state=st)
    # the tokens these samples draw most often as stop tokens: several rows would stop early
    stop = torch.bincount(free.tokens[free.response_mask], minlength=VOCAB).topk(4).indices.tolist()
    cfg["stop_token_ids"] = stop
    plain = generate(model, _prompts(), GenerationConfig(**cfg), vocab_size=VOCAB, state=st)
    assert plain.response_lengths.min() < 5
    atleast = generate(model, _prompts(), GenerationConfig(**cfg, min_new_tokens=5), vocab_size=VOCAB, state=st)
    assert atleast.response_lengths.min() >= 5
    for r, resp in enumerate(atleast.responses()):  # no stop token drawn before the 5th token
        assert not set(resp[:4]) & set(stop), r
    # the draw is restricted, the recorded log-probs are not: they match a fresh forward
    assert _max_lp_diff(model, atleast, 1.0) < 1e-5
    full = generate(model, _prompts(), GenerationConfig(**cfg, ignore_eos=True), vocab_size=VOCAB, state=st)
    assert (full.response_lengths == 10).all() and not full.stopped.any()


def test_model_state_restored_and_input_errors(tiny):
    model, st = tiny
    probe = torch.tensor([_prompts()[2]], device=st.device)
    model.train()
    with torch.no_grad():
        before = forward_logits(model, probe)
    generate(model, _prompts(), GenerationConfig(max_new_tokens=4, n_samples_per_prompt=2), vocab_size=VOCAB, state=st)
    assert model.training
    with torch.no_grad():
        assert torch.equal(forward_logits(model, probe), before)
    cfg = GenerationConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], cfg, vocab_size=VOCAB, state=st)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[1, VOCAB]], cfg, vocab_size=VOCAB, state=st)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[1, 2]], GenerationConfig(max_new_tokens=600), vocab_size=VOCAB, state=st)



def test_no_prompts_give_an_empty_output_without_a_forward(tiny):
    """A rank with no rows left (a multi-turn rank whose rows all ended) calls generate with none: alone (or when
    no rank of its lockstep group has a prompt) nothing runs and the output has no rows; beside ranks with rows it
    would step on dummy rows (tests/test_multiturn.py's lockstep layouts)."""
    model, st = tiny
    out = generate(model, [], GenerationConfig(max_new_tokens=4, n_samples_per_prompt=2), vocab_size=VOCAB, state=st,
                   row_keys=[])
    assert out.num_forwards == 0 and out.decode_row_steps == 0
    assert out.tokens.shape == (0, 0) and out.response_lengths.shape == (0,) and out.responses() == []

# ----------------------------------------------------------------------------------------------
# TP / EP under torchrun
# ----------------------------------------------------------------------------------------------


def _torchrun(script: str, nproc: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return conftest.torchrun(script, nproc, *args, timeout=timeout)


@pytest.mark.slow
def test_tp2_and_ep2_generate_like_single_rank(tmp_path):
    # one torchrun call: a TP=1 reference on the same processes, then TP=2, then EP=2 (groups
    # re-initialized in between, weights through a dist_checkpointing checkpoint)
    p = _torchrun("generation_parity.py", 2, "--dir", str(tmp_path), "--layouts", "tp2,ep2")
    for layout in ("tp2", "ep2"):
        for r in range(2):
            assert f"GENERATION OK {layout} rank {r}" in p.stdout, p.stdout
    assert p.stdout.count("T=1 sampling log-prob max abs diff") == 2, p.stdout  # the TP=2 ranks
