"""The KV kept across turns over sharded weights (TP, EP, expert-TP): run under torchrun with 2 ranks.

    torchrun --nproc-per-node 2 kv_turns_layouts.py --layouts tp2,ep2,etp2

Per layout: megatron's groups are initialized for it and the tiny model built; each rank talks three turns
with its rows (tests/kv_turns.py: TP: the same rows on both ranks; EP / expert-TP: data-parallel ranks with
uneven shares, 4 rows and 2, the second rank's rows ending after the first turn, so it steps the resumed turns
on dummy rows alone) on the lean decoder, once with each row's KV kept from turn to turn and once with every
turn's whole context prefilled again. The streams and R3 routes must be equal, the log-probs within 1e-6, and
the tokens prefilled the prompts plus each turn's new tokens.

``--shared-prefix``: the rows are three 7-token prompts twice each (a, b, a, b, c, c: each rank's rows hold two
rows of a prompt), the kept-KV conversation decodes with shared-prefix attention (generation.shared_prefix_attention
=on: the resumed turns read each prompt's KV once from the rows' kept caches) against the reference's plain
attention, log-probs within 2e-6 (the two partial softmaxes round apart, tests/test_shared_prefix.py); a rank
whose rows go on past the first turn must have shared in a resumed turn.

Prints "KVTURNS OK <layout> rank <r>"; exits non-zero on a mismatch.
"""

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: shared helpers

from kv_turns import talk  # noqa: E402
from megatron_gspo.config import ParallelConfig, model_config_from_preset  # noqa: E402
from megatron_gspo.generation import lean_decoder  # noqa: E402
from megatron_gspo.generation.generator import GenerationConfig, Generator  # noqa: E402
from megatron_gspo.model.gpt import build_model  # noqa: E402
from megatron_gspo.runtime import parallel  # noqa: E402

VOCAB = 100
LAYOUTS = {"tp2": (2, 1, 2), "ep2": (1, 2, 1), "etp2": (1, 1, 2)}


def fail(msg):
    print(f"KVTURNS FAILURE: {msg}", flush=True)
    sys.exit(3)


def my_rows(st, shared: bool):
    g = torch.Generator().manual_seed(6)
    ps = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in ((7, 7, 7) if shared else (5, 1, 9, 6, 7, 3))]
    if shared:
        ps = [ps[i] for i in (0, 1, 0, 1, 2, 2)]
    if st.dp == 1:
        return list(range(6)), ps, {}
    idx = [[0, 1, 2, 3], [4, 5]][st.dp_rank]
    return idx, [ps[i] for i in idx], ({} if st.dp_rank == 0 else {0: 0, 1: 0})


def check(cfg, tag, shared: bool):
    tp, ep, etp = LAYOUTS[tag]
    par = ParallelConfig(device="cpu", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                         expert_tensor_parallel_size=etp, seed=11)
    st = parallel.initialize(cfg, par)
    model = build_model(cfg, par, st)
    keys, ps, end_after = my_rows(st, shared)
    gcfg = GenerationConfig(max_new_tokens=6, n_samples_per_prompt=1, seed=3, decode_impl="lean",
                            stop_token_ids=list(range(3, 99, 3)), compact_finished_rows=0.25)
    want = talk(Generator(model, vocab_size=VOCAB, state=st), model, ps, gcfg, keys, keep=False, end_after=end_after)
    calls, real = [], lean_decoder.shared_prefix_attention
    lean_decoder.shared_prefix_attention = lambda *args, **kw: calls.append(1) or real(*args, **kw)
    try:
        kept_cfg = dataclasses.replace(gcfg, shared_prefix_attention="on" if shared else "off")
        got = talk(Generator(model, vocab_size=VOCAB, state=st), model, ps, kept_cfg, keys, keep=True,
                   end_after=end_after)
    finally:
        lean_decoder.shared_prefix_attention = real
    case = f"{tag} rank {st.rank}"
    if got[0] != want[0]:
        fail(f"{case}: the streams differ")
    first_turn = (got[4][0].num_forwards - 1) * len(model.decoder.layers)
    if shared and not end_after and len(calls) <= first_turn:
        fail(f"{case}: the resumed turns did not share the prompt's KV ({len(calls)} shared attentions, "
             f"{first_turn} in the first turn)")
    gap = max((abs(a - b) for x, y in zip(got[1], want[1]) for a, b in zip(x, y)), default=0.0)
    if gap > (2e-6 if shared else 1e-6):
        fail(f"{case}: log-probs {gap:.3e} apart")
    if not all(torch.equal(a, b) for a, b in zip(got[2], want[2])):
        fail(f"{case}: R3 routes differ")
    if got[3] > want[3] or (not end_after and got[3] >= want[3]):  # (rows that ended at once: turn 0's prefill)
        fail(f"{case}: {got[3]} tokens prefilled with the KV kept, {want[3]} without")
    print(f"[rank {st.rank}] {tag}: streams {[len(c) for c in got[0]]}, log-probs within {gap:.1e}, prefilled "
          f"{got[3]} (again each turn: {want[3]}), shared attentions {len(calls)}", flush=True)
    print(f"KVTURNS OK {tag} rank {st.rank}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True, help=f"comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--shared-prefix", action="store_true", help="repeated prompts, shared-prefix attention on")
    a = ap.parse_args()
    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=0.0, vocab_size=VOCAB)
    for tag in a.layouts.split(","):
        check(cfg, tag, a.shared_prefix)
    parallel.destroy()


if __name__ == "__main__":
    main()
