"""A stop request on one rank stops decoding on every rank of the lockstep group, at the same step.

Run under torchrun with 2 ranks; --layouts tp2,ep2 (megatron's groups re-initialized in between).
Per layout: a full generation (the number of forwards it takes), then the same generation with
``should_stop`` True on rank 1 only, from its 4th read on (before the 4th decode forward). Both
ranks must come back ``abandoned`` after the same number of forwards (prefill + 3 decode), which is
what keeps their collectives matched; rank 0 never saw a stop request of its own. Under TP the
group is the TP group (same prompts on both ranks), under EP the whole world (each rank its own
prompts). Prints "STOP OK <layout> rank <r>".
"""

import argparse
import sys

import torch

from megatron_gspo.runtime import parallel
from megatron_gspo.config import ParallelConfig, model_config_from_preset
from megatron_gspo.generation.generator import GenerationConfig, generate
from megatron_gspo.model.gpt import build_model

VOCAB = 100
MAX_NEW = 20


def fail(msg):
    print(f"STOP FAILURE: {msg}", flush=True)
    sys.exit(3)


def check(layout: str) -> None:
    tp, ep = (2, 1) if layout == "tp2" else (1, 2)
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, moe_aux_loss_coeff=0.0)
    par = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, seed=7)
    st = parallel.initialize(cfg, par)
    model = build_model(cfg, par, st)
    # TP ranks share their prompts; EP ranks (data-parallel) have their own, of other lengths
    prompts = [[1, 2, 3], [4, 5]] if tp > 1 else ([[1, 2, 3], [4, 5]] if st.rank == 0 else [[6, 7, 8, 9, 10]])
    gen = GenerationConfig(max_new_tokens=MAX_NEW, temperature=1.0, n_samples_per_prompt=2, ignore_eos=True)
    full = generate(model, prompts, gen, vocab_size=VOCAB, state=st)
    if full.abandoned or full.num_forwards != MAX_NEW:
        fail(f"{layout} rank {st.rank}: the full generation took {full.num_forwards} forwards")
    reads = []

    def rank1_after_three() -> bool:
        reads.append(1)
        return st.rank == 1 and len(reads) > 3

    cut = generate(model, prompts, gen, vocab_size=VOCAB, state=st, should_stop=rank1_after_three)
    if not cut.abandoned or cut.num_forwards != 4 or len(reads) != 4:
        fail(f"{layout} rank {st.rank}: abandoned={cut.abandoned} after {cut.num_forwards} forwards, "
             f"{len(reads)} reads (expected True, 4, 4)")
    same = all(torch.equal(cut.tokens[r, :n], full.tokens[r, :n]) for r, n in enumerate((cut.prompt_lengths + 4).tolist()))
    if cut.response_lengths.tolist() != [4] * len(cut.response_lengths) or not same:
        fail(f"{layout} rank {st.rank}: the cut generation is not the start of the full one")
    print(f"STOP OK {layout} rank {st.rank}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="tp2,ep2")
    args = ap.parse_args()
    for layout in args.layouts.split(","):
        check(layout)  # megatron's groups are re-initialized for each layout, on the same processes
    parallel.destroy()


if __name__ == "__main__":
    main()
