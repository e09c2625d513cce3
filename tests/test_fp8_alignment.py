"""FP8 token alignment (megatron_gspo/model/fp8_alignment.py): the shape arithmetic, and that padding every
forward to it changes no result.

Transformer Engine's FP8 GEMMs refuse token counts not divisible by 8 (16 for grouped GEMMs, 32 for
MXFP8); the project pads the decode batch with filler rows and the micro-batches' width. FP8 itself
cannot run here, so the runs below force the alignment on a CPU job (the one function every caller
goes through, replaced) and check that every forward then has an aligned token count and that
generation, losses, metrics and weights are those of the unpadded run. tests/te/test_te_fp8_alignment.py
checks the arithmetic against TE's own assertion."""

import math

import pytest
import torch

from megatron_gspo.model import fp8_alignment
from megatron_gspo.runtime import parallel
from megatron_gspo.config import ParallelConfig, load_job_config, model_config_from_preset
from megatron_gspo.generation.generator import GenerationConfig, generate
from megatron_gspo.model.gpt import build_model, forward_logits

ALIGN = 16


def te_accepts(tokens: int, hidden: int) -> bool:
    """TE 2.20's assert_dim_for_fp8_exec (pytorch/utils.py:704) on a [tokens, hidden] GEMM input."""
    return tokens % 8 == 0 and hidden % 16 == 0


def test_alignment_per_recipe_is_megatrons():
    assert fp8_alignment.fp8_alignment(None) == 1
    assert fp8_alignment.fp8_alignment("hybrid", "delayed") == fp8_alignment.fp8_alignment("e4m3", "tensorwise") == 16
    assert fp8_alignment.fp8_alignment("e4m3", "blockwise") == 16
    assert fp8_alignment.fp8_alignment("hybrid", "mxfp8") == 32
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    for recipe in ("delayed", "tensorwise", "mxfp8", "blockwise"):
        assert fp8_alignment.fp8_alignment("hybrid", Fp8Recipe(recipe)) == get_fp8_align_size(Fp8Recipe(recipe))
    # the job's model config and megatron's TransformerConfig both answer
    assert fp8_alignment.token_alignment(model_config_from_preset("tiny")) == 1


@pytest.mark.parametrize("sp", [1, 2, 4])
@pytest.mark.parametrize("align", [1, 16, 32])
def test_padded_length_is_the_shortest_aligned_length(sp, align):
    for rows in range(1, 41):
        for s in range(1, 70):
            n = fp8_alignment.padded_length(s, rows, sp, align)
            assert n >= s and n % sp == 0 and (rows * n // sp) % align == 0, (s, rows, sp, align, n)
            shorter = [m for m in range(s, n) if m % sp == 0 and (rows * m // sp) % align == 0]
            assert not shorter, (s, rows, sp, align, n, shorter)


def test_decode_rows_and_micro_batch_widths():
    # decode: any live count rounds up to the alignment, never past the rows there are
    assert [fp8_alignment.padded_rows(n, ALIGN) for n in (1, 15, 16, 17, 33)] == [16, 16, 16, 32, 48]
    assert fp8_alignment.padded_rows(17, ALIGN, cap=32) == 32 and fp8_alignment.padded_rows(3, 1) == 3
    # micro-batches: a width multiple of sp x align makes rows x width / sp aligned for any rows
    for sp in (1, 2, 8):
        w = fp8_alignment.width_multiple(sp, ALIGN)
        assert all(te_accepts(rows * k * w // sp, 2048) for rows in range(1, 9) for k in range(1, 5))
    # the FP8 recipe (launch/recipes/gspo_qwen3_30b_a3b_fp8_16xh100.yaml): micro-batch 2, TP 1, no SP.
    # Before: widths rounded to the SP size only, so 2 rows x 37 tokens reached TE's GEMM.
    assert not te_accepts(2 * 37, 2048)
    from megatron_gspo.rollout.prepare import plan_micro_batches

    _, _, widths = plan_micro_batches([38, 20, 7, 3], 1, 2, None, fp8_alignment.width_multiple(1, ALIGN))
    assert widths == [49, 17] and all((w - 1) % ALIGN == 0 for w in widths)


# ----------------------------------------------------------------------------------------------
# Forced alignment on a CPU job: every forward aligned, every result unchanged
# ----------------------------------------------------------------------------------------------


class ForwardShapes:
    """Records [rows, tokens] of every forward of every GPTModel (the embedding's input)."""

    def __init__(self, mp):
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

        self.shapes = []
        forward = LanguageModelEmbedding.forward

        def recording(emb, input_ids, *a, **kw):
            self.shapes.append(tuple(input_ids.shape))
            return forward(emb, input_ids, *a, **kw)

        mp.setattr(LanguageModelEmbedding, "forward", recording)

    def unaligned(self, align: int) -> list:
        return [s for s in self.shapes if math.prod(s) % align]


def force_alignment(mp, align: int = ALIGN) -> None:
    mp.setattr(fp8_alignment, "token_alignment", lambda config: align)


VOCAB = 100


@pytest.fixture(scope="module")
def tiny():
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, moe_aux_loss_coeff=0.0)
    par = ParallelConfig(seed=3, device="cpu")  # what is compared is arithmetic, bitwise on the CPU
    st = parallel.initialize(cfg, par)
    m = build_model(cfg, par, st)
    yield m, st
    parallel.destroy()


def _prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 9, 4, 7, 2)]


@pytest.mark.parametrize("impl", ["lean", "megatron"])
def test_generation_padded_to_the_alignment_changes_nothing(tiny, monkeypatch, impl):
    """18 rows (6 ragged prompts x 3 samples) padded to 32 (the prefill: the 6 prompts, padded to 16),
    compaction kept at multiples of 16: every forward's rows x tokens divides by 16, and tokens,
    log-probs, lengths and stop flags are those of the unpadded batch."""
    m, st = tiny
    base = dict(max_new_tokens=10, n_samples_per_prompt=3, seed=11, decode_impl=impl, compact_finished_rows=0.5)
    free = generate(m, _prompts(), GenerationConfig(**base), vocab_size=VOCAB, state=st)
    stops = torch.bincount(free.tokens[free.response_mask], minlength=VOCAB).topk(4).indices.tolist()
    cfg = GenerationConfig(**base, stop_token_ids=stops)
    want = generate(m, _prompts(), cfg, vocab_size=VOCAB, state=st)
    with monkeypatch.context() as mp:
        shapes = ForwardShapes(mp)
        force_alignment(mp)
        got = generate(m, _prompts(), cfg, vocab_size=VOCAB, state=st)
    assert want.response_lengths.min() < want.response_lengths.max()  # rows finish apart: compaction ran
    assert shapes.shapes[0] == (16, 9) and not shapes.unaligned(ALIGN), shapes.shapes
    assert got.tokens.shape == want.tokens.shape and torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.response_lengths, want.response_lengths) and torch.equal(got.stopped, want.stopped)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=2e-6)
    assert got.decode_row_steps % ALIGN == 0


def test_forward_logits_pads_any_input_to_the_alignment(tiny, monkeypatch):
    m, _ = tiny
    tokens = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = forward_logits(m, tokens)
        with monkeypatch.context() as mp:
            shapes = ForwardShapes(mp)
            force_alignment(mp)
            got = forward_logits(m, tokens)
    assert shapes.shapes == [(3, 16)] and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


JOB = [
    "train.num_steps=3", "train.prompts_per_step=4", "generation.n_samples_per_prompt=3",
    "generation.max_new_tokens=6", "train.micro_batch_size=2", "train.num_minibatches=2",
    "reward.name=digit_match", "optimizer.lr=1e-3", "train.tensorboard=false", "loss.kl_coef=0.05",
    "train.sft_steps=2", "train.sft_batch_size=6", "eval.interval=2", "eval.num_prompts=3", "eval.num_samples=2",
    "eval.k=2", "train.old_logprobs=recompute", "generation.compact_finished_rows=0.5", "parallel.device=cpu",
]
VARIANTS = {"gspo": ["loss.name=gspo"], "grpo-R3": ["loss.name=grpo", "train.routing_replay=R3"]}


@pytest.mark.parametrize("variant", list(VARIANTS.values()), ids=list(VARIANTS))
def test_aligned_micro_batches_give_the_same_rollout_losses_and_gradient(tmp_path, monkeypatch, variant):
    """One rollout (generation, old and reference log-probs, R3 routes) and the first minibatch's
    forward + backward, with and without the alignment: the same rows and log-probs on the response
    tokens, every micro-batch width aligned, and the minibatch's losses, metrics and gradient equal."""
    from megatron_gspo.runtime.metrics import MetricAccumulator
    from job_runner import built_trainers

    def first_minibatch(build, force: bool):
        with monkeypatch.context() as mp:
            shapes = ForwardShapes(mp)
            if force:
                force_alignment(mp)
            trainer = build(variant + ["train.sft_steps=0"])
            batch = trainer.prepare(trainer.source.collect(0))
            acc = MetricAccumulator()
            trainer.accumulate_gradients(batch, batch.minibatches[0], acc)
        grad = torch.cat([p.main_grad.reshape(-1).clone() for p in trainer.ddp.parameters()])
        return batch, acc.reduce(trainer.state.dp_group), grad, shapes

    with built_trainers(JOB, tmp_path) as build:
        want, want_m, want_g, _ = first_minibatch(build, False)
        got, got_m, got_g, shapes = first_minibatch(build, True)
    assert not shapes.unaligned(ALIGN) and all((w - 1) % ALIGN == 0 for w in got.widths), got.widths
    assert any((w - 1) % ALIGN for w in want.widths)  # the plain plan was not aligned by chance
    T = want.tokens.shape[1]
    assert torch.equal(got.tokens[:, :T], want.tokens) and torch.equal(got.mask[:, :T - 1], want.mask)
    assert not got.mask[:, T - 1:].any()  # the extra columns are padding
    for name in ("sample_logprobs", "old_logprobs", "ref_logprobs"):
        a, b = getattr(got, name)[:, :T - 1][want.mask], getattr(want, name)[want.mask]
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=name)
    assert set(got_m) == set(want_m)
    for k, v in want_m.items():
        assert got_m[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (k, got_m[k], v)
    assert want_g.norm() > 0 and ((got_g - want_g).norm() / want_g.norm()) < 1e-5


def _run(tmp_path, name, overrides):
    from megatron_gspo.trainer.loop import Trainer

    cfg = load_job_config(None, JOB + overrides + [f"train.output_dir={tmp_path}/{name}"])
    trainer = Trainer(cfg)
    try:
        history = trainer.run()["history"]
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
        parallel.destroy()
    return history, weights


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS.values()), ids=list(VARIANTS))
def test_a_job_padded_to_the_alignment_trains_like_the_unpadded_one(tmp_path, monkeypatch, variant):
    """The whole tiny job (SFT warm start, 3 RL steps of generation, old and reference log-probs and
    two updates, held-out evaluation) with the alignment forced on: every forward of it aligned, and
    its metrics and final weights those of the job without it. Gradients agree to ~1e-7 (the test
    above); Adam turns float noise on near-zero gradient entries into updates of up to lr each, so
    three steps later metrics agree to ~1e-4 relative and weights to ~lr."""
    want, want_w = _run(tmp_path, "plain", variant)
    with monkeypatch.context() as mp:
        shapes = ForwardShapes(mp)
        force_alignment(mp)
        got, got_w = _run(tmp_path, "aligned", variant)
    assert len(shapes.shapes) > 50 and not shapes.unaligned(ALIGN), shapes.unaligned(ALIGN)[:5]
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        keys = sorted(k for k in b if not k.startswith("perf/"))
        assert sorted(k for k in a if not k.startswith("perf/")) == keys
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=2e-3, abs=1e-5), (k, a[k], b[k])
    assert any(k.startswith("eval/") for k in want[-1]), "the evaluation ran"
    for n, w in want_w.items():
        torch.testing.assert_close(got_w[n], w, rtol=0, atol=5e-3, msg=n)
