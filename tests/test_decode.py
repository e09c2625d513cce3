"""The lean decode path (megatron_gspo/generation/lean_decoder.py) against megatron's GPTModel forward.

The reference for every check is megatron's own path (``generation.decode_impl=megatron``: the
GPTModel forward with its StaticInferenceContext) or a fresh full forward without any cache, on the
same weights; ragged (left-padded) prompts, sampling and greedy, with and without finished-row
compaction, tied and untied output weights. Over TP / EP / expert-TP shards (torchrun, gloo) the
reference is the one-rank lean decoder on the same weights (tests/dist_scripts/lean_layouts.py)."""

import pytest
import torch

from megatron_gspo.runtime import parallel
from megatron_gspo.config import ConfigError, ParallelConfig, model_config_from_preset
from megatron_gspo.generation.lean_decoder import LeanDecoder, lean_decode_unsupported
from megatron_gspo.generation.generator import GenerationConfig, generate
from megatron_gspo.model.logprobs import vocab_parallel_logprobs
from megatron_gspo.model.gpt import build_model, forward_logits
from graph_standin import StandInGraph

VOCAB = 100
PROMPT_LENS = (4, 1, 9, 6)


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=[True, False], ids=["untied", "tied"])
def model(request):
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, moe_aux_loss_coeff=0.0,
                                   untie_embeddings_and_output_weights=request.param)
    par = ParallelConfig(device="cpu", seed=5)
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
    m.config.pipeline_model_parallel_size, saved = 2, m.config.pipeline_model_parallel_size
    try:
        assert lean_decode_unsupported(m) == "pipeline parallelism"
    finally:
        m.config.pipeline_model_parallel_size = saved
    with pytest.raises(ConfigError, match="generation.decode_impl"):
        GenerationConfig(decode_impl="vllm")


# ----------------------------------------------------------------------------------------------
# Device-side MoE dispatch and the graph-ready decode step
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [(1, 5), (7, 3)], ids=["decode", "prefill"])
def test_device_moe_equals_megatron_moe_layer_bitwise(model, tokens):
    """DeviceMoE (permutation and grouped-GEMM offsets on the device) gives the megatron MoE layer's
    output bit for bit, and the router's own routing map."""
    from megatron_gspo.generation.lean_decoder import DeviceMoE, device_moe_unsupported

    m, _ = model
    g = torch.Generator().manual_seed(3)
    for layer in m.decoder.layers:
        assert device_moe_unsupported(layer.mlp) is None
        h = torch.randn(*tokens, m.config.hidden_size, generator=g).to(next(m.parameters()).device)
        with torch.no_grad():
            want, _ = layer.mlp(h)
            got, rmap = DeviceMoE(layer.mlp)(h)
            _, want_map = layer.mlp.router(h)
        assert torch.equal(got, want) and torch.equal(rmap, want_map)
        assert (rmap.sum(-1) == m.config.moe_router_topk).all()


def _graph_mode(mp):
    """Every LeanDecoder built inside the monkeypatch context ``mp`` runs in graph mode, with
    StandInGraph in place of CUDA graphs."""
    import megatron_gspo.generation.lean_decoder as decode

    init = decode.LeanDecoder.__init__

    def graph_init(self, *a, **kw):
        init(self, *a, **{**kw, "graphs": True, "graph_factory": StandInGraph})

    StandInGraph.captures = []
    mp.setattr(decode.LeanDecoder, "__init__", graph_init)


def _gen_routes(model, **kw):
    """(GenerationOutput, the R3 routes recorded while generating it [L, B, S, k])."""
    from megatron_gspo.routing.rollout_routes import RolloutRecorder

    m, st = model
    rec = RolloutRecorder(m)
    try:
        with rec.recording():
            base = dict(max_new_tokens=12, temperature=1.0, n_samples_per_prompt=3, seed=7, decode_impl="lean")
            out = generate(m, _prompts() * 2, GenerationConfig(**{**base, **kw}), vocab_size=VOCAB, state=st,
                           on_forward=rec.on_forward)
        routes = rec.finish(out).routes
    finally:
        rec.close()
    return out, routes


CASES = {
    "sample": dict(),
    "greedy": dict(temperature=0.0),
    "topk-topp": dict(top_k=5, top_p=0.8, temperature=0.7),
    "min-new-tokens": dict(min_new_tokens=6),
    "check-every-3": dict(finished_check_interval=3),
    "no-compaction": dict(compact_finished_rows=0.0),
}


@pytest.mark.parametrize("kw", list(CASES.values()), ids=list(CASES))
def test_graph_ready_step_is_token_identical_to_the_eager_step(model, monkeypatch, kw):
    """The decode step captured once per batch-size bucket (KV length static, filler rows past the
    live ones, every input read from the decoder's buffers, no host sync inside) and replayed, against
    the eager lean step, with stop tokens that make rows finish at different steps (compaction shrinks
    the batch through the buckets): same tokens, lengths and stop flags, log-probs equal, and the same
    R3 routes recorded (the replayed step writes them; no router hook runs in it)."""
    free = _gen(model, "lean", **kw)
    stops = torch.bincount(free.tokens[free.response_mask], minlength=VOCAB).topk(3).indices.tolist()
    run = dict(kw, stop_token_ids=stops)
    want, want_routes = _gen_routes(model, **run)  # eager (today's lean step)
    with monkeypatch.context() as mp:
        _graph_mode(mp)
        got, got_routes = _gen_routes(model, **run)
        captured = list(StandInGraph.captures)
    assert want.response_lengths.min() < want.response_lengths.max()  # ragged: rows finish apart
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.response_lengths, want.response_lengths)
    assert torch.equal(got.stopped, want.stopped)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=2e-6)
    assert torch.equal(got_routes, want_routes)
    assert captured and len(captured) == len(set(captured)) and set(captured) <= {1, 2, 4, 8, 16, 24}
    if not kw:
        assert len(captured) > 1  # compaction took the batch through several buckets


def test_graph_mode_refuses_what_it_cannot_capture(model):
    m, st = model
    with pytest.raises(ValueError, match="generation.cuda_graphs=true needs a CUDA device"):
        generate(m, _prompts(), GenerationConfig(max_new_tokens=3, cuda_graphs=True), vocab_size=VOCAB, state=st)
    with pytest.raises(ConfigError, match="generation.cuda_graphs=true captures the lean decode step"):
        GenerationConfig(cuda_graphs=True, decode_impl="megatron")


# ----------------------------------------------------------------------------------------------
# One decoder per job (generation.Generator): built once, graphs captured once, weights read fresh
# ----------------------------------------------------------------------------------------------


def _counting(mp):
    """Counts of LeanDecoder constructions and KV-cache allocations (``_allocate``) inside ``mp``."""
    import megatron_gspo.generation.lean_decoder as decode

    n = {"decoders": 0, "kv": 0}
    init, alloc = decode.LeanDecoder.__init__, decode.LeanDecoder._allocate

    def counted_init(self, *a, **kw):
        n["decoders"] += 1
        init(self, *a, **kw)

    def counted_alloc(self, *a, **kw):
        n["kv"] += 1
        alloc(self, *a, **kw)

    mp.setattr(decode.LeanDecoder, "__init__", counted_init)
    mp.setattr(decode.LeanDecoder, "_allocate", counted_alloc)
    return n


def _rollout_prompts(seed: int, n: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_a_second_rollout_captures_nothing_new_and_allocates_no_kv_cache(model, monkeypatch, caplog):
    """A job's Generator (cuda_graphs=true, the CPU stand-in for CUDA graphs): the first rollout builds
    the decoder, allocates its KV cache and captures its decode step; a second rollout of other prompts
    (within the configured prompt length) builds, allocates and captures nothing, and gives what a
    fresh decoder gives. A rollout of more rows grows the decoder once, and says so."""
    from megatron_gspo.generation.generator import Generator

    m, st = model
    cfg = GenerationConfig(max_new_tokens=6, n_samples_per_prompt=1, seed=7, decode_impl="lean", cuda_graphs=True,
                           ignore_eos=True)
    StandInGraph.captures = []
    with monkeypatch.context() as mp:
        n = _counting(mp)
        gen = Generator(m, vocab_size=VOCAB, state=st, slots=10 + 6 - 1, graph_factory=StandInGraph)
        gen.generate(_rollout_prompts(1), cfg)
        dec, kv = gen._dec, list(gen._dec.k)
        after_first = (dict(n), list(StandInGraph.captures))
        second = gen.generate(_rollout_prompts(2), cfg)
        assert (dict(n), StandInGraph.captures) == after_first == ({"decoders": 1, "kv": 1}, [8])
        assert gen._dec is dec and all(a is b for a, b in zip(gen._dec.k, kv))
        fresh = Generator(m, vocab_size=VOCAB, state=st, graph_factory=StandInGraph).generate(_rollout_prompts(2), cfg)
        with caplog.at_level("INFO", logger="megatron_gspo"):
            gen.generate(_rollout_prompts(3, 12), cfg)
        assert gen._dec is dec and n["kv"] == 3 and "KV cache grows from 8 rows x 15 slots to 12 x 15" in caplog.text
    assert torch.equal(second.tokens, fresh.tokens) and torch.equal(second.logprobs, fresh.logprobs)


def _optimizer_step(m) -> None:
    """One SGD step on a next-token loss: the parameters change in place, as in training."""
    tokens = torch.tensor([_rollout_prompts(5, 1)[0] + [1, 2, 3]])
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m.train()
    logits = forward_logits(m, tokens)
    torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    m.eval()


def _rebind_experts(m) -> list:
    """Every expert weight moved to new storage (``p.data = ...``: what a checkpoint load or a wrapper's
    buffer may do): views taken before read the old values. Returns the old storages, which the caller
    keeps alive: freed, the allocator may hand their addresses to the decoder's next packing of the
    experts (DeviceMoE.bind), and a graph reading the same addresses rightly needs no new capture."""
    old = []
    with torch.no_grad():
        for layer in m.decoder.layers:
            for p in layer.mlp.experts.parameters():
                old.append(p.data)
                p.data = p.data.clone() * 1.5
    return old


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("change", [_optimizer_step, _rebind_experts], ids=["optimizer-step", "rebound-weights"])
def test_a_kept_decoder_reads_the_weights_of_each_rollout(model, graphs, change):
    """Two rollouts through one Generator with a weight change between them (an optimizer step, or the
    expert weights moved to new storage): the second rollout is bitwise what a fresh decoder gives on
    the new weights. A captured step reads the weights' addresses: it is kept across an in-place update
    and captured again when they moved."""
    from megatron_gspo.generation.generator import Generator

    st = model[1]  # a model of its own (its weights change), in the fixture's parallel state
    m = build_model(model_config_from_preset("tiny", vocab_size=VOCAB, moe_aux_loss_coeff=0.0),
                    ParallelConfig(device="cpu", seed=11), st).eval()
    gcfg = GenerationConfig(max_new_tokens=8, n_samples_per_prompt=2, seed=3, decode_impl="lean", cuda_graphs=graphs)
    factory = StandInGraph if graphs else None
    StandInGraph.captures = []
    gen = Generator(m, vocab_size=VOCAB, state=st, graph_factory=factory)
    before = gen.generate(_rollout_prompts(4), gcfg)
    captured = len(StandInGraph.captures)
    kept = change(m)  # the old storages stay allocated meanwhile: their addresses cannot come back
    got = gen.generate(_rollout_prompts(4), gcfg)
    del kept
    recaptured = len(StandInGraph.captures) - captured
    want = Generator(m, vocab_size=VOCAB, state=st, graph_factory=factory).generate(_rollout_prompts(4), gcfg)
    assert not torch.equal(want.logprobs, before.logprobs)  # the change changed the policy
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
    if graphs:
        assert recaptured == (captured if change is _rebind_experts else 0)


def test_cuda_graphs_are_captured_thread_local(model, monkeypatch):
    """The capture is torch.cuda.graph(..., capture_error_mode="thread_local"): a CUDA call from another
    thread during it (the async ranks' heartbeat, NCCL's watchdog) does not invalidate it. Recorded
    with stand-ins for torch.cuda's graph and stream API."""
    import contextlib

    m, _ = model
    seen = []

    class Graph:
        def pool(self):
            return "pool"

        def replay(self):
            pass

    class Stream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g, pool=None, **kw):
        seen.append(kw)
        yield

    mp = monkeypatch
    mp.setattr(torch.cuda, "CUDAGraph", Graph)
    mp.setattr(torch.cuda, "Stream", Stream)
    mp.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    mp.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    mp.setattr(torch.cuda, "graph", graph)
    dec = LeanDecoder(m, 2, 8, 8, graphs=True, graph_factory=torch.cuda.CUDAGraph)
    with torch.no_grad():
        dec.begin(2, 8, torch.zeros(2, dtype=torch.long))
        dec.prefill(torch.tensor([[1, 2], [3, 4]]), torch.tensor([[0, 1], [0, 1]]),
                    torch.triu(torch.ones(2, 2, dtype=torch.bool), 1)[None, None].expand(2, 1, 2, 2))
        dec.decode(torch.tensor([5, 6]), 2)
    assert seen == [{"capture_error_mode": "thread_local"}]


# ----------------------------------------------------------------------------------------------
# Over sharded weights (TP, EP, TP x EP, expert-TP) under torchrun: tests/dist_scripts/lean_layouts.py
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_decodes(tmp_path_factory, run_dist_jobs):
    """The 2-rank runs of this file's dist scripts in one torchrun (jobs.py): name -> what their ranks printed."""
    root = tmp_path_factory.mktemp("decode_2ranks")
    runs = {
        "lean": ["lean_layouts.py", "--dir", root / "lean", "--layouts", "tp2,ep2,etp2", "--gather-tokens", "6"],
        "shared_prefill": ["shared_prefill.py", "--layouts", "tp2,ep2,etp2"],
        "refill": ["refill_layouts.py", "--dir", root / "refill", "--layouts", "ep2,tp2"],
        "kv_turns plain": ["kv_turns_layouts.py", "--layouts", "tp2,ep2,etp2"],
        "kv_turns shared-prefix": ["kv_turns_layouts.py", "--layouts", "tp2,ep2,etp2", "--shared-prefix"],
    }
    for d in ("lean", "refill"):
        (root / d).mkdir()
    return run_dist_jobs({k: (2, job) for k, job in runs.items()}, root, job_timeout=450)


@pytest.mark.parametrize("nproc, layouts", [(2, "tp2,ep2,etp2"), (4, "tp2ep2,tp2ep4etp1,ep2")],
                         ids=["2-ranks-chunked-dispatch", "4-ranks"])
def test_lean_decoding_over_sharded_weights_gives_the_single_rank_rollouts(run_dist, request, tmp_path, nproc, layouts):
    """The lean decoder on TP / EP / TP x EP / expert-TP shards (and the 30B recipes' shape in small: TP 2 x
    EP 4 with expert-TP 1, the EP group spanning TP and data-parallel ranks) against one rank on the same
    weights: uniform and ragged prompts, greedy and sampled with rows ending apart and compaction, eager and
    the graph-ready step, and the sampled case with shared-prefix decode attention (eager; against the plain
    one-rank decode); the same tokens, log-probs (2e-5) and R3 routes (global expert ids), every rank
    of a lockstep group stepping together (EP 2 on 4 ranks: two groups of 2, not the world), and at TP 2 x
    EP 2 one host sync per finished_check_interval decode steps. On 2 ranks the MoE dispatch gathers at
    most 6 tokens: the prefill and the decode steps go through the expert group in chunks."""
    if nproc == 2:
        printed = request.getfixturevalue("two_rank_decodes")["lean"]
    else:
        printed = run_dist("lean_layouts.py", nproc, "--dir", str(tmp_path), "--layouts", layouts, "--host-syncs",
                           "tp2ep2", timeout=900).stdout
    for tag in layouts.split(","):
        for r in range(nproc):
            assert f"LEAN OK {tag} rank {r}" in printed, printed[-3000:]
    if nproc == 4:
        assert printed.count("LEAN SYNCS tp2ep2") == 4 and "per_step=0.250 steps=16" in printed, printed[-3000:]
        assert "ep2: dp 4, prompts [0], lockstep ranks [0, 1]," in printed, printed[-3000:]


# ----------------------------------------------------------------------------------------------
# One prefill per prompt: the G samples of a prompt share its prefill's KV
# ----------------------------------------------------------------------------------------------


def _one_prefill_per_row(mp):
    """Inside ``mp``: every row gets a prefill of its own (no two prompts are taken for one): the
    generation of a prefill per row, as before prompts shared theirs."""
    import megatron_gspo.generation.generator as gen

    mp.setattr(gen, "distinct_prompts", lambda ids: (list(range(len(ids))), list(range(len(ids)))))


# Long enough that every expert gets >= 12 of the prefill's tokens: the CPU BLAS (MKL) gives a GEMM row the
# same bits whatever the row count from 12 rows on (and at 4, 8); smaller GEMMs take other kernels, so a
# prefill of fewer rows would round an expert of few tokens differently (the first logits by ~1e-6)
SHARED_PROMPT_LENS = (24, 7, 40, 31)


@pytest.mark.parametrize("impl", ["lean", "megatron"])
def test_one_prefill_per_prompt_gives_the_tokens_logprobs_and_routes_of_a_prefill_per_row(model, monkeypatch, impl):
    """A prompt's G samples, asked for with n_samples_per_prompt=G or as G rows of equal ids (the trainer's
    way: one row per sample, its own row key), are prefilled once: perf/prefill_tokens counts each distinct
    prompt's tokens once; tokens, log-probs, stop flags and R3 routes are bit for bit those of a prefill per
    row (ragged prompts, stop tokens ending rows apart, compaction), on the lean and on megatron's path."""
    from megatron_gspo.routing.rollout_routes import RolloutRecorder

    m, st = model
    g = torch.Generator().manual_seed(4)
    ps, G = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in SHARED_PROMPT_LENS], 3
    rows = [p for p in ps for _ in range(G)]
    keys = list(range(len(rows)))

    def run(prompts, n, **kw):
        rec = RolloutRecorder(m)
        try:
            with rec.recording():
                cfg = GenerationConfig(max_new_tokens=10, n_samples_per_prompt=n, seed=7, decode_impl=impl,
                                       compact_finished_rows=0.25, **kw)
                out = generate(m, prompts, cfg, vocab_size=VOCAB, state=st, row_keys=keys, on_forward=rec.on_forward)
            return out, rec.finish(out).routes
        finally:
            rec.close()

    free, _ = run(ps, G)
    stops = torch.bincount(free.tokens[free.response_mask], minlength=VOCAB).topk(3).indices.tolist()
    with monkeypatch.context() as mp:
        _one_prefill_per_row(mp)
        want, want_routes = run(rows, 1, stop_token_ids=stops)
    assert want.response_lengths.min() < want.response_lengths.max()  # rows end apart
    assert want.prefill_tokens == G * sum(SHARED_PROMPT_LENS)
    for got, got_routes in (run(ps, G, stop_token_ids=stops), run(rows, 1, stop_token_ids=stops)):
        assert got.prefill_tokens == sum(SHARED_PROMPT_LENS)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
        assert torch.equal(got.response_lengths, want.response_lengths) and torch.equal(got.stopped, want.stopped)
        assert torch.equal(got_routes, want_routes)
        assert got.decode_row_steps == want.decode_row_steps < 12 * 9  # compaction shrank the batch


@pytest.mark.parametrize("impl", ["lean", "megatron"])
def test_the_prefill_runs_once_per_distinct_prompt_and_counts_its_tokens(model, monkeypatch, impl):
    """The prefill forward runs on the distinct prompts (4 prompts, 3 distinct, G = 2: 3 rows, not 8);
    perf/prefill_tokens counts their tokens once (no padding); the decode batch's fill is the rows still
    generating over the rows fed, summed over the decode steps."""
    from megatron_gspo.generation import decoder

    seen = []
    backend = decoder.LeanBackend if impl == "lean" else decoder.MegatronBackend
    prefill = backend.prefill
    monkeypatch.setattr(backend, "prefill", lambda self, tokens, *a: seen.append(tuple(tokens.shape))
                        or prefill(self, tokens, *a))
    m, st = model
    ps = [[5, 6, 7], [8], [5, 6, 7], [9, 10]]  # 3 distinct prompts, 6 tokens
    gcfg = dict(max_new_tokens=6, n_samples_per_prompt=2, seed=1, decode_impl=impl)
    out = generate(m, ps, GenerationConfig(**gcfg, ignore_eos=True), vocab_size=VOCAB, state=st)
    assert seen == [(3, 3)]
    assert out.prefill_tokens == 6
    assert out.decode_row_steps == out.decode_live_row_steps == 8 * 5  # every row generates to the end
    # rows end apart: a finished row fed until compaction (off here) is not live
    stop = torch.bincount(out.tokens[out.response_mask], minlength=VOCAB).argmax().item()
    out = generate(m, ps, GenerationConfig(**gcfg, stop_token_ids=[stop], compact_finished_rows=0.0),
                   vocab_size=VOCAB, state=st)
    assert out.decode_row_steps == 8 * (int(out.response_lengths.max()) - 1)
    assert out.decode_live_row_steps == int((out.response_lengths - 1).sum()) < out.decode_row_steps
    from megatron_gspo.generation.generator import distinct_prompts

    assert distinct_prompts([[1, 2], [3], [1, 2], [3], [4]]) == ([0, 1, 4], [0, 1, 0, 1, 2])


def test_one_prefill_per_prompt_over_sharded_weights(two_rank_decodes):
    """TP 2, EP 2 (ranks with different numbers of distinct prompts: the lockstep group's prefill has filler
    rows) and expert-TP 2, lean and megatron's path: a prompt's samples prefilled once give the rollouts of a
    prefill per row, bit for bit (EP and expert-TP: the log-probs within 1e-6, the expert GEMMs' rounding of
    a row depending on their size; tests/dist_scripts/shared_prefill.py)."""
    printed = two_rank_decodes["shared_prefill"]
    for tag in ("tp2", "ep2", "etp2"):
        for impl in ("lean", "megatron"):
            for r in range(2):
                assert f"SHARED OK {tag} {impl} rank {r}" in printed, printed[-3000:]


# ----------------------------------------------------------------------------------------------
# Finished rows refilled (generation.max_batch_rows): a row that ends hands its cache row to a waiting one
# ----------------------------------------------------------------------------------------------


REFILL_CASES = {"sample": (dict(), False), "graph-ready": (dict(), True),
                "no-compaction-check-every-3": (dict(compact_finished_rows=0.0, finished_check_interval=3), False),
                "min-new-tokens": (dict(min_new_tokens=3), False), "greedy": (dict(temperature=0.0), False)}


@pytest.mark.parametrize("kw, graphs", list(REFILL_CASES.values()), ids=list(REFILL_CASES))
def test_a_refilled_batch_gives_each_row_the_tokens_logprobs_and_routes_of_one_batch(model, monkeypatch, kw, graphs):
    """16 rows (8 ragged prompts x 2), stop tokens ending them apart: max_batch_rows=3 (3 cache rows, the others
    wait and take a finished row's place) gives every row the tokens, lengths, stop flags and R3 routes of the
    one-batch generation (max_batch_rows=0) and log-probs within 1e-6 (fp32: a row's GEMMs and attention run
    beside other rows, over other KV lengths); the batch never holds more than 3 rows and stays fuller, in the
    eager and the graph-ready step (captured buckets 1, 2, 3 only)."""
    free = _gen(model, "lean")
    stops = torch.bincount(free.tokens[free.response_mask], minlength=VOCAB).topk(3).indices.tolist()
    run = dict(kw, n_samples_per_prompt=2, stop_token_ids=stops)
    want, want_routes = _gen_routes(model, **run)
    with monkeypatch.context() as mp:
        if graphs:
            _graph_mode(mp)
        got, got_routes = _gen_routes(model, **run, max_batch_rows=3)
        captured = list(StandInGraph.captures) if graphs else None
    if "temperature" not in kw:
        assert want.response_lengths.min() + 4 < want.response_lengths.max()  # rows end far apart
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.response_lengths, want.response_lengths)
    assert torch.equal(got.stopped, want.stopped)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-6)
    assert torch.equal(got_routes, want_routes)
    decode_steps = got.num_forwards - 1
    assert got.decode_row_steps <= 3 * decode_steps
    fill = got.decode_live_row_steps / got.decode_row_steps
    assert got.decode_live_row_steps == want.decode_live_row_steps == int((want.response_lengths - 1).sum())
    if "temperature" not in kw:
        assert fill > want.decode_live_row_steps / want.decode_row_steps
    if graphs:
        assert captured and set(captured) <= {1, 2, 3}


def test_max_batch_rows_is_refused_where_it_cannot_run(model):
    """A negative value, megatron's decode path and a layout the lean decoder does not run are refused by key; a call with fewer rows than max_batch_rows is one batch, as with 0."""
    from megatron_gspo.config import load_job_config

    with pytest.raises(ConfigError, match="generation.max_batch_rows"):
        GenerationConfig(max_batch_rows=-1)
    with pytest.raises(ConfigError, match="generation.max_batch_rows=4 refills the lean decoder"):
        GenerationConfig(max_batch_rows=4, decode_impl="megatron")
    # (asynchronous rollouts: tests/test_async_rollout.py) a layout the lean decoder cannot run, by key
    with pytest.raises(ConfigError, match="generation.max_batch_rows=8 needs the lean decoder, which does not run"):
        load_job_config(None, ["generation.max_batch_rows=8", "model.fp8=hybrid", "model.precision=bf16"])
    # a multi-turn row keeps its KV cache rows across turns: a refilled batch would hand them on
    with pytest.raises(ConfigError, match="generation.max_batch_rows=8 with env.name: a multi-turn row keeps its KV"):
        load_job_config(None, ["generation.max_batch_rows=8", "env.tools=[calculator]"])
    one = _gen(model, "lean", max_batch_rows=0)
    big = _gen(model, "lean", max_batch_rows=64)  # 24 rows: one batch
    assert torch.equal(one.tokens, big.tokens) and torch.equal(one.logprobs, big.logprobs)
    assert one.decode_row_steps == big.decode_row_steps


def test_a_refilled_batch_over_sharded_weights_gives_the_single_rank_rollouts(two_rank_decodes):
    """EP 2 (data-parallel ranks of 4 and 6 rows: queues of different lengths, one lockstep group) and TP 2,
    max_batch_rows=3, eager and graph-ready: the tokens, log-probs (2e-5) and routes of one rank's one-batch
    generation (tests/dist_scripts/refill_layouts.py)."""
    printed = two_rank_decodes["refill"]
    for tag in ("ep2", "tp2"):
        for mode in ("eager", "graph-ready"):
            for r in range(2):
                assert f"REFILL OK {tag} {mode} rank {r}" in printed, printed[-3000:]


@pytest.mark.parametrize("mode", ["lean", "graphs", "megatron"])
def test_a_turn_on_its_kept_kv_gives_the_tokens_logprobs_and_routes_of_a_prefill_of_its_whole_context(
        model, monkeypatch, mode):
    """Three turns over ragged rows (new suffixes of 1 to 4 tokens, stop tokens ending rows apart, compaction, two
    rows of equal contexts, which a prefill of whole contexts runs once):
    with each row's KV kept, a turn prefills only its new tokens (the last sampled token and the observation),
    and the streams, the sampled log-probs (fp32: within 1e-6; 4.8e-7 measured, a decode step's KV against a
    prefill's) and every token's R3 route are those of a prefill of every turn's whole context. In graph mode
    (the kept cache, grown between turns) the same; megatron's path keeps nothing and prefills it all again."""
    from kv_turns import talk

    from megatron_gspo.generation.generator import Generator

    m, st = model
    if mode == "graphs":
        _graph_mode(monkeypatch)
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 1, 9, 6, 7, 3)]
    ps, keys = ps + [ps[0]], list(range(len(ps))) + [0]  # row 6 talks as row 0: equal contexts every turn
    cfg = GenerationConfig(max_new_tokens=6, n_samples_per_prompt=1, seed=3,
                           decode_impl="megatron" if mode == "megatron" else "lean",
                           stop_token_ids=list(range(3, 99, 3)), compact_finished_rows=0.25)
    want = talk(Generator(m, vocab_size=VOCAB, state=st), m, ps, cfg, keys, keep=False, end_after={1: 0})
    got = talk(Generator(m, vocab_size=VOCAB, state=st), m, ps, cfg, keys, keep=True, end_after={1: 0})
    assert got[0] == want[0] and len({len(c) for c in got[0]}) > 3  # the streams, ragged
    assert max(abs(a - b) for x, y in zip(got[1], want[1]) for a, b in zip(x, y)) < 1e-6
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    assert all(r.shape[1] == len(c) - 1 for r, c in zip(got[2], got[0]))  # one route per fed token
    if mode == "megatron":
        assert got[3] == want[3] and all(o.kept is None for o in got[4])
        return
    # every token fed once: the prompts, then per turn each row's new tokens (its last sampled and the observation)
    news = sum(int(o.prompt_lengths.sum()) - int(k.cached.sum()) for o, k in zip(got[4][1:], _resumed(got[4])))
    assert got[3] == sum(len(p) for p in ps[:-1]) + news < want[3]  # (row 6 shares row 0's first prefill)
    assert any(o.decode_row_steps < o.response_lengths.numel() * (int(o.response_lengths.max()) - 1)
               for o in got[4])  # compaction ran on a kept cache


def _resumed(outs):
    """The KeptRows each turn after the first continued (the rows that went on: every row but row 1 after turn 0)."""
    return [o.kept.select([j for j in range(o.kept.cached.numel()) if not (t == 0 and j == 1)]) for t, o in
            enumerate(outs[:-1])]


@pytest.mark.parametrize("attention", ["plain", "shared-prefix"])
def test_turns_on_their_kept_kv_over_sharded_weights(two_rank_decodes, attention):
    """TP 2, EP 2 and expert-TP 2 on the lean decoder (EP / expert-TP: a rank whose rows all ended steps the
    resumed turns on dummy rows): three turns with each row's KV kept give the streams, log-probs (within 1e-6;
    2e-6 with shared-prefix attention, whose resumed turns must share) and R3 routes of a prefill of every turn's
    whole context (tests/dist_scripts/kv_turns_layouts.py)."""
    printed = two_rank_decodes[f"kv_turns {attention}"]
    for tag in ("tp2", "ep2", "etp2"):
        for r in range(2):
            assert f"KVTURNS OK {tag} rank {r}" in printed, printed[-3000:]
