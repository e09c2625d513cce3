"""Shared-prefix ("cascade") decode attention (megatron_gspo/generation/shared_prefix.py, generation.shared_prefix_attention).

The merged attention against plain attention over each row's concatenated KV (fp32, GQA, padded prefixes and
suffixes, suffix lengths that differ by row, logits far past exp's fp32 range); a merge broken on purpose
(no max subtraction, a wrong normalizer) fails that check; the lean decoder with ``on`` gives the tokens,
stop flags and R3 routes of ``off`` and log-probs within 2e-6 (fp32), with compaction, a refilled batch and
a first turn whose KV is kept for the next, and resumed turns that share their first turn's prompt (rows of
different history lengths, the split rule by hand); the rule of ``auto`` and the config's refusals. Over TP / EP
shards: tests/dist_scripts/lean_layouts.py (its ``sampled-shared`` case) and kv_turns_layouts.py
(``--shared-prefix``), both run by tests/test_decode.py."""

import pytest
import torch

from megatron_gspo.config import ConfigError, ParallelConfig, model_config_from_preset
from megatron_gspo.generation import lean_decoder, shared_prefix
from megatron_gspo.generation.generator import GenerationConfig, Generator, generate
from megatron_gspo.generation.shared_prefix import (
    SHARED_PREFIX_MIN_KEY_BYTES,
    prefix_cells,
    shared_prefix_attention,
    shared_prefix_pays,
)
from megatron_gspo.model.gpt import build_model
from megatron_gspo.runtime import parallel

VOCAB = 100
NEG = torch.finfo(torch.float32).min / 2  # the lean decoder's finite mask


# ----------------------------------------------------------------------------------------------
# The pure functions
# ----------------------------------------------------------------------------------------------


def _case(logit_scale: float = 1.0):
    """7 rows over 3 prefix rows (rows of a prefix not adjacent: a compacted batch), 8 query heads over 2 KV groups,
    a prefix of 10 slots (prefix row 1 left-padded by 3, row 2 by 9), suffixes of 6 slots with 1 to 6 attended."""
    g = torch.Generator().manual_seed(0)
    n, np_, ng, hn, Bp, Lp, Ls = 7, 8, 2, 16, 3, 10, 6
    q = torch.randn(n, np_, hn, generator=g, dtype=torch.float64) * logit_scale
    pk, pv = (torch.randn(Bp, ng, Lp, hn, generator=g, dtype=torch.float64) for _ in range(2))
    sk, sv = (torch.randn(n, ng, Ls, hn, generator=g, dtype=torch.float64) for _ in range(2))
    prefix_row = torch.tensor([2, 0, 1, 0, 2, 1, 0])
    pre_pad = torch.tensor([0, 3, 9])
    suf_len = torch.tensor([1, 6, 3, 2, 5, 4, 6])
    pb = torch.where(torch.arange(Lp)[None, :] < pre_pad[:, None], NEG, 0.0).double()
    sb = torch.where(torch.arange(Ls)[None, :] >= suf_len[:, None], NEG, 0.0).double()
    return q, pk, pv, sk, sv, prefix_row, pb, sb


def _plain(q, pk, pv, sk, sv, prefix_row, pb, sb, scale):
    """Attention of each row over its prefix row's KV then its own suffix, concatenated (the reference), in fp64."""
    n, np_, hn = q.shape
    ng = pk.shape[1]
    k = torch.cat([pk[prefix_row], sk], dim=2).repeat_interleave(np_ // ng, dim=1)  # [n, np, L, hn]
    v = torch.cat([pv[prefix_row], sv], dim=2).repeat_interleave(np_ // ng, dim=1)
    bias = torch.cat([pb[prefix_row], sb], dim=1)[:, None, :]  # [n, 1, L]
    s = torch.einsum("nhd,nhld->nhl", q, k) * scale + bias
    return torch.einsum("nhl,nhld->nhd", s.softmax(-1), v)


def _merged_error(logit_scale: float = 1.0) -> float:
    """Max abs difference of shared_prefix_attention (fp32) from the fp64 reference, over the bound it must meet:
    1e-6 plus twice the error of plain fp32 attention (its own rounding: logits of ~1e3 are rounded to ~6e-5 in
    fp32 before any softmax, whichever way it is computed). A result within the bound gives a ratio below 1."""
    q, pk, pv, sk, sv, row, pb, sb = _case(logit_scale)
    want = _plain(q, pk, pv, sk, sv, row, pb, sb, scale=0.25)
    f = [t.float() for t in (q, pk, pv, sk, sv)]
    plain32 = _plain(*f, row, pb.float(), sb.float(), scale=0.25)
    got = shared_prefix_attention(*f, row, prefix_cells(row), 3, scale=0.25, prefix_bias=pb.float(),
                                  suffix_bias=sb.float())
    err = (got.double() - want).abs().max().item()
    bound = 1e-6 + 2 * (plain32.double() - want).abs().max().item()
    return err / bound if err == err else float("inf")  # NaN: as wrong as it gets


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash-prefix", "gemm-prefix"])
@pytest.mark.parametrize("logit_scale", [1.0, 40.0], ids=["unit-logits", "logits-past-exp-range"])
def test_merged_attention_equals_attention_over_the_concatenated_kv(monkeypatch, logit_scale, fused):
    """GQA (4 query heads per KV group), each row's prefix row (rows of one prefix apart), padded prefixes (one
    prefix row with only one slot attended), suffixes masked past 1 to 6 slots, and logits up to ~1e3 (exp
    overflows fp32 past 88): the fp32 result is the fp64 reference's to 1e-6 (plus fp32's own rounding of the
    large logits: within twice plain fp32 attention's error). The prefix's partial by torch's CPU flash kernel (its
    log-sum-exp) and by the GEMMs of other devices."""
    assert shared_prefix._CPU_FLASH is not None  # this torch has it: the CPU path is the fused one
    if not fused:
        monkeypatch.setattr(shared_prefix, "_CPU_FLASH", None)
    assert _merged_error(logit_scale) < 1


def _merge_without_max(o1, lse1, o2, lse2):
    w1, w2 = torch.exp(lse1), torch.exp(lse2)
    return (o1 * (w1 / (w1 + w2)).unsqueeze(-1) + o2 * (w2 / (w1 + w2)).unsqueeze(-1)), torch.log(w1 + w2)


def _merge_wrong_normalizer(o1, lse1, o2, lse2):
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / 2, m  # the weights' sum is not 2


@pytest.mark.parametrize("broken, logit_scale", [(_merge_without_max, 40.0), (_merge_wrong_normalizer, 1.0)],
                         ids=["no-max-subtraction", "wrong-normalizer"])
def test_a_broken_merge_fails_the_parity_check(monkeypatch, broken, logit_scale):
    """The check above catches a merge without the max subtraction (large logits overflow) and one with a wrong
    normalizer: the error is far past the bound the right merge meets on the same case."""
    assert _merged_error(logit_scale) < 1
    monkeypatch.setattr(shared_prefix, "merge_attention_states", broken)
    assert _merged_error(logit_scale) > 100


def test_prefix_cells_number_the_rows_of_each_prefix_row_in_order():
    assert prefix_cells(torch.tensor([2, 0, 1, 0, 2, 1, 0])).tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert prefix_cells(torch.tensor([3, 3, 3])).tolist() == [0, 1, 2]


def test_the_rule_of_auto():
    """on: whenever a prompt has two rows in the batch; auto: from SHARED_PREFIX_MIN_KEY_BYTES of the rows' prompt
    keys per layer; off, one row per prompt and a captured step: never."""
    big = SHARED_PREFIX_MIN_KEY_BYTES
    assert shared_prefix_pays("on", 1, 2) and not shared_prefix_pays("on", big, 1)
    assert shared_prefix_pays("auto", big, 8) and not shared_prefix_pays("auto", big - 1, 8)
    assert not shared_prefix_pays("off", big, 8) and not shared_prefix_pays("auto", big, 8, graphs=True)
    # the benchmark model (2 KV groups of 32, fp32) at 64 rows: a 512-token prompt block shares, 16 tokens not
    assert shared_prefix_pays("auto", 64 * 2 * 512 * 32 * 4, 8) and not shared_prefix_pays("auto", 64 * 2 * 16 * 32 * 4, 8)


def test_the_config_refuses_what_cannot_run():
    with pytest.raises(ConfigError, match="generation.shared_prefix_attention"):
        GenerationConfig(shared_prefix_attention="yes")
    with pytest.raises(ConfigError, match="shared_prefix_attention=on with generation.cuda_graphs=true"):
        GenerationConfig(shared_prefix_attention="on", cuda_graphs=True)
    with pytest.raises(ConfigError, match="shared_prefix_attention=on is the lean decoder's"):
        GenerationConfig(shared_prefix_attention="on", decode_impl="megatron")


# ----------------------------------------------------------------------------------------------
# The lean decoder: on against off
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, moe_aux_loss_coeff=0.0)
    par = ParallelConfig(device="cpu", seed=5)
    st = parallel.initialize(cfg, par)
    yield build_model(cfg, par, st), st
    parallel.destroy()


def _prompts(lens=(4, 1, 9, 6, 12)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def _counted(monkeypatch) -> list:
    """The lean decoder's calls of shared_prefix_attention, from now on (one entry each)."""
    calls, real = [], shared_prefix_attention
    monkeypatch.setattr(lean_decoder, "shared_prefix_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _gen(model, setting, monkeypatch, **kw):
    """(output, R3 routes, how many decode attentions shared the prefix) of a lean generation."""
    from megatron_gspo.routing.rollout_routes import RolloutRecorder

    m, st = model
    calls = _counted(monkeypatch)
    rec = RolloutRecorder(m)
    try:
        with rec.recording():
            base = dict(max_new_tokens=12, temperature=1.0, n_samples_per_prompt=4, seed=7, decode_impl="lean")
            cfg = GenerationConfig(**{**base, **kw, "shared_prefix_attention": setting})
            out = generate(m, _prompts(), cfg, vocab_size=VOCAB, state=st, on_forward=rec.on_forward)
        routes = rec.finish(out).routes
    finally:
        rec.close()
    return out, routes, len(calls)


def _stops(model, monkeypatch):
    free, _, _ = _gen(model, "off", monkeypatch)
    return torch.bincount(free.tokens[free.response_mask], minlength=VOCAB).topk(3).indices.tolist()


ON_OFF = {"sampled": dict(), "greedy": dict(temperature=0.0), "stops-compaction": dict(stops=True),
          "refilled": dict(stops=True, max_batch_rows=6), "no-compaction": dict(stops=True, compact_finished_rows=0.0)}


@pytest.mark.parametrize("kw", list(ON_OFF.values()), ids=list(ON_OFF))
def test_on_gives_the_tokens_logprobs_and_routes_of_off(model, monkeypatch, kw):
    """5 ragged prompts x 4 samples: tokens, lengths, stop flags and R3 routes identical, log-probs within 2e-6
    (fp32; 4.8e-7, refilled 9.5e-7 measured: the two partial softmaxes round differently from one), with rows ending apart and
    compaction (rows of one prompt no longer adjacent) and a refilled batch of 6 cache rows (rows of a prompt
    join and leave); ``on`` runs the shared attention at every decode step's every layer, ``off`` never, and
    ``auto`` on these 9-token prompt blocks not (the rows' prompt keys are far below the threshold)."""
    kw = dict(kw)
    if kw.pop("stops", False):
        kw["stop_token_ids"] = _stops(model, monkeypatch)
    want, want_routes, n_off = _gen(model, "off", monkeypatch, **kw)
    got, got_routes, n_on = _gen(model, "on", monkeypatch, **kw)
    _, _, n_auto = _gen(model, "auto", monkeypatch, **kw)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.response_lengths, want.response_lengths)
    assert torch.equal(got.stopped, want.stopped)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=2e-6)
    assert torch.equal(got_routes, want_routes)
    layers = len(model[0].decoder.layers)
    assert n_off == n_auto == 0 and n_on == (got.num_forwards - 1) * layers
    print(f"log-prob max abs diff on/off: {(got.logprobs - want.logprobs).abs().max().item():.2e}")
    if "stop_token_ids" in kw:
        assert want.response_lengths.min() < want.response_lengths.max()
    if "stop_token_ids" in kw and kw.get("compact_finished_rows", 0.25) > 0:
        assert got.decode_row_steps < got.response_lengths.numel() * (got.num_forwards - 1)  # compacted or refilled


def _splits(out, prompt_len: torch.Tensor) -> bool:
    """The split rule of a resumed call by hand: its rows' contexts right-aligned (out.prompt_lengths), the split slot
    is the leftmost end of a row's first-turn prompt (``prompt_len`` [rows]); it shares where every prompt fits left of it."""
    lens = out.prompt_lengths
    return int((lens.max() - lens + prompt_len).min()) >= int(prompt_len.max())


def test_a_first_turn_with_its_kv_kept_continues_as_with_off(model, monkeypatch):
    """Three turns, the first of 4 rows per prompt with shared-prefix attention and the KV kept (the rows also get
    their prompt's KV copied: the next turns resume on it): the streams and routes of ``off``, log-probs within
    2e-6. Prompts of 4, 1 and 9 tokens: the resumed turns share where the split rule holds (here both, by hand)."""
    from kv_turns import talk

    m, st = model
    ps = _prompts((4, 1, 9)) * 4
    keys = list(range(len(ps)))
    base = dict(max_new_tokens=5, n_samples_per_prompt=1, seed=3, decode_impl="lean",
                stop_token_ids=list(range(3, 99, 3)), compact_finished_rows=0.25)
    outs, calls = {}, _counted(monkeypatch)
    for setting in ("off", "on"):
        cfg = GenerationConfig(**base, shared_prefix_attention=setting)
        outs[setting] = talk(Generator(m, vocab_size=VOCAB, state=st), m, ps, cfg, keys, keep=True)
        if setting == "off":
            assert not calls
    got, want = outs["on"], outs["off"]
    # the first turn's decode steps, and a resumed turn's only where its split slot has room for every prompt
    shared = [True] + [_splits(o, torch.tensor([4, 1, 9] * 4)) for o in got[4][1:]]
    assert shared == [True, True, True]
    assert len(calls) == sum(o.num_forwards - 1 for o, on in zip(got[4], shared) if on) * len(m.decoder.layers)
    assert got[0] == want[0] and len({len(c) for c in got[0]}) > 2
    assert max(abs(a - b) for x, y in zip(got[1], want[1]) for a, b in zip(x, y)) < 2e-6
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))


def _three_turns(model, monkeypatch, setting, ps):
    """``talk`` over three turns with the KV kept (rows 1 and 5 end after turns 1 and 2) -> (its result, how many
    decode attentions shared the prefix)."""
    from kv_turns import talk

    m, st = model
    base = dict(max_new_tokens=5, n_samples_per_prompt=1, seed=3, decode_impl="lean",
                stop_token_ids=list(range(3, 99, 3)), compact_finished_rows=0.25)
    calls = _counted(monkeypatch)
    cfg = GenerationConfig(**base, shared_prefix_attention=setting)
    out = talk(Generator(m, vocab_size=VOCAB, state=st), m, ps, cfg, list(range(len(ps))), keep=True,
               end_after={1: 0, 5: 1})
    return out, len(calls)


@pytest.mark.parametrize("lens, shared", [((7, 7, 7), [True, True]), ((8, 7, 8), [True, False])],
                         ids=["equal-prompts", "unequal-prompts"])
def test_resumed_turns_share_their_first_turns_prompt_as_with_off(model, monkeypatch, lens, shared):
    """Three turns with the KV kept, 3 prompts x 4 rows: the resumed turns read each prompt's KV once from a store
    taken from the rows' kept caches (rows of different history lengths: the prompt right-aligned at the split
    slot, each row's prompt tail masked in its own keys), with compaction and rows leaving the conversation:
    streams, stop flags and R3 routes identical to ``off``, log-probs within 2e-6 (9.5e-7 measured). ``on``
    shares in every decode step and layer of turn 1 and of each resumed turn whose split has room for every
    prompt (equal prompt lengths: always; 8/7/8 tokens: turn 2, not turn 3, by the rule by hand), ``auto``
    (these small prompts) in none."""
    ps = _prompts(lens) * 4
    (got, n_on), (want, n_off) = (_three_turns(model, monkeypatch, s, ps) for s in ("on", "off"))
    _, n_auto = _three_turns(model, monkeypatch, "auto", ps)
    assert got[0] == want[0] and len({len(c) for c in got[0]}) > 5
    assert all(torch.equal(a.stopped, b.stopped) for a, b in zip(got[4], want[4]))
    assert max(abs(a - b) for x, y in zip(got[1], want[1]) for a, b in zip(x, y)) < 2e-6
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    outs, layers = got[4], len(model[0].decoder.layers)
    assert [o.tokens.shape[0] for o in outs] == [12, 11, 10]
    assert [_splits(o, o_prev.kept.prompt_len[live]) for o, o_prev, live in
            zip(outs[1:], outs, ([0] + list(range(2, 12)), [i for i in range(11) if i != 4]))] == shared
    assert n_off == n_auto == 0
    assert n_on == sum(o.num_forwards - 1 for o, on in zip(outs, [True] + shared) if on) * layers
    assert any(o.decode_row_steps < o.tokens.shape[0] * (o.num_forwards - 1) for o in outs[1:])  # compacted
    assert outs[1].kept.group.unique().numel() == 3
    assert torch.equal(outs[2].kept.prompt_len, torch.tensor([lens[i % 3] for i in range(12) if i not in (1, 5)]))
