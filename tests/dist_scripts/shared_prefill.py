"""One prefill per prompt over sharded weights (TP, EP, expert-TP): run under torchrun with 2 ranks.

    torchrun --nproc-per-node 2 shared_prefill.py --layouts tp2,ep2,etp2

Per layout: megatron's groups are initialized for it and the tiny model built; each rank generates its
rows (TP: the same prompts on both ranks; EP / expert-TP: data-parallel ranks with uneven shares, 3
prompts and 1, so the ranks have different numbers of distinct prompts and the lockstep group's prefill
has filler rows) with G = 2 samples per prompt, on the lean decoder and on megatron's path, three ways:
n_samples_per_prompt=2; one row per sample with its own row key (the trainer's way); and with a prefill
per row (``distinct_prompts`` replaced by the identity: the generation before prompts shared their
prefill). The first two must equal the third bit for bit (tokens, log-probs, lengths, stop flags, R3
routes; EP and expert-TP: the log-probs within 1e-6, LAYOUTS), with the prompt tokens prefilled counted once per
distinct prompt (G times for the third).

Prints "SHARED OK <layout> <impl> rank <r>"; exits non-zero on a mismatch.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: shared helpers

import megatron_gspo.generation.generator as generator  # noqa: E402
from megatron_gspo.config import ParallelConfig, model_config_from_preset  # noqa: E402
from megatron_gspo.generation.generator import GenerationConfig, Generator  # noqa: E402
from megatron_gspo.model.gpt import build_model  # noqa: E402
from megatron_gspo.routing.rollout_routes import RolloutRecorder  # noqa: E402
from megatron_gspo.runtime import parallel  # noqa: E402

VOCAB = 100
G = 2
# long enough that every expert gets >= 12 prefill tokens (tests/test_decode.py SHARED_PROMPT_LENS: MKL's
# small GEMMs round a row differently from its large ones)
PROMPT_LENS = (24, 7, 40, 31)
# (tp, ep, etp, log-prob tolerance) of each layout. Expert-TP: the generation before prompts shared their
# prefill gave two rows of one prompt first log-probs up to 5e-7 apart (the expert GEMMs round a token by its
# place in them, measured here: a shared prefill equals one of the two rows). EP: a shared prefill hands each
# expert fewer tokens than a prefill per row, and on a CPU without AVX-512 (AMD EPYC, AVX2) MKL rounds a row of
# the smaller GEMM differently: 4.8e-7 measured on the rank whose one prompt meets filler rows (bit for bit on
# the CPUs of earlier runs). Tokens, lengths, stop flags and routes equal, bit for bit, everywhere.
LAYOUTS = {"tp2": (2, 1, 2, 0.0), "ep2": (1, 2, 1, 1e-6), "etp2": (1, 1, 2, 1e-6)}


def fail(msg):
    print(f"SHARED FAILURE: {msg}", flush=True)
    sys.exit(3)


def my_prompts(st):
    g = torch.Generator().manual_seed(6)
    ps = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    if st.dp == 1:
        return list(range(len(ps))), ps
    idx = [[0, 1, 2], [3]][st.dp_rank]
    return idx, [ps[i] for i in idx]


def run(model, st, prompts, n, keys, impl, stops):
    gen = Generator(model, vocab_size=VOCAB, state=st)
    cfg = GenerationConfig(max_new_tokens=10, n_samples_per_prompt=n, seed=3, decode_impl=impl, stop_token_ids=stops,
                           compact_finished_rows=0.25, finished_check_interval=2)
    rec = RolloutRecorder(model)
    try:
        with rec.recording():
            out = gen.generate(prompts, cfg, row_keys=keys, on_forward=rec.on_forward)
        return out, rec.finish(out).routes
    finally:
        rec.close()


def check(cfg, tag):
    tp, ep, etp, tol = LAYOUTS[tag]
    par = ParallelConfig(device="cpu", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                         expert_tensor_parallel_size=etp, seed=11)
    st = parallel.initialize(cfg, par)
    model = build_model(cfg, par, st)
    idx, ps = my_prompts(st)
    rows = [p for p in ps for _ in range(G)]
    keys = [i * G + j for i in idx for j in range(G)]
    for impl in ("lean", "megatron"):
        stops = [7, 42]  # common enough in the tiny model's samples that rows end apart
        saved = generator.distinct_prompts
        generator.distinct_prompts = lambda ids: (list(range(len(ids))), list(range(len(ids))))
        try:
            want, want_routes = run(model, st, rows, 1, keys, impl, stops)
        finally:
            generator.distinct_prompts = saved
        if want.prefill_tokens != G * sum(len(p) for p in ps):
            fail(f"{tag} {impl}: a prefill per row counted {want.prefill_tokens} prompt tokens")
        for how, (got, routes) in (("n_samples_per_prompt", run(model, st, ps, G, keys, impl, stops)),
                                   ("rows", run(model, st, rows, 1, keys, impl, stops))):
            case = f"{tag} {impl} {how} rank {st.rank}"
            if got.prefill_tokens != sum(len(p) for p in ps):
                fail(f"{case}: {got.prefill_tokens} prompt tokens prefilled, not {sum(len(p) for p in ps)}")
            for name in ("tokens", "logprobs", "response_lengths", "stopped"):
                diff = (getattr(got, name).double() - getattr(want, name).double()).abs().max().item()
                if diff > (tol if name == "logprobs" else 0.0) or (tol == 0 and not torch.equal(getattr(got, name),
                                                                                                 getattr(want, name))):
                    fail(f"{case}: {name} differ from a prefill per row (max abs diff {diff:.3e})")
            if not torch.equal(routes, want_routes):
                fail(f"{case}: R3 routes differ from a prefill per row")
        print(f"[rank {st.rank}] {tag} {impl}: response lengths {want.response_lengths.tolist()}", flush=True)
        print(f"SHARED OK {tag} {impl} rank {st.rank}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True, help=f"comma-separated, of {sorted(LAYOUTS)}")
    a = ap.parse_args()
    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=0.0, vocab_size=VOCAB)
    for tag in a.layouts.split(","):
        check(cfg, tag)
    parallel.destroy()


if __name__ == "__main__":
    main()
