"""The lean decoder over sharded weights (TP, EP, TP x EP, expert-TP) against one rank: run under torchrun.

    torchrun --nproc-per-node 2 lean_layouts.py --dir D --layouts tp2,ep2,etp2
    torchrun --nproc-per-node 4 lean_layouts.py --dir D --layouts tp2ep2,tp2ep4etp1 --host-syncs tp2ep2

Phase 1 (reference): every rank forms a TP 1 / EP 1 layout (pure data parallel), builds the tiny model
from one seed, saves its weights (dist_checkpointing) and generates every case on one rank with the
lean decoder (``generation.decode_impl=lean``): uniform and ragged prompts, greedy and sampled (stop
tokens that end rows at different steps, finished-row compaction), with the R3 routes recorded.

Phase 2, per layout: megatron's groups are re-initialized for it, the model is rebuilt and loaded (its
logits on a probe batch equal the reference's), ``decode_impl=auto`` is checked to take the lean decoder,
and each case is generated again with ``decode_impl=lean`` on the sharded weights, eager and with the
graph-ready step (captured once per batch-size bucket and replayed: graph_standin.StandInGraph, CUDA
graphs' contract on the CPU). Ranks
holding different rows (EP, expert-TP: data-parallel ranks) generate an uneven share of the prompts
with their global row keys, so their rows finish apart and the lockstep group must keep stepping. On
every rank: the tokens, lengths and stop flags equal the reference rows', the log-probs within 2e-5
(fp32), the recorded routes (global expert ids) equal the reference's, and the number of forwards is
the same on every rank of the lockstep group.

The ``sampled-shared`` case decodes with shared-prefix attention (generation.shared_prefix_attention=on: each
prompt's KV read once by its rows, eager only) against the one-rank plain decode of ``sampled``.

--gather-tokens N: the MoE dispatch gathers at most N tokens (config.rules.LEAN_MOE_GATHER_TOKENS), so the
prefill's and the decode steps' dispatches go through in chunks.

--host-syncs LAYOUT: at that layout, the host synchronisations of generate() (tests/host_syncs.py) over a
4- and a 20-token generation with ``finished_check_interval=4``: the extra 16 decode steps cost at
most one sync per 4 steps (the finished-row vote), none of them in the decode step's modules.

Prints "LEAN OK <layout> rank <r>" per layout and "LEAN SYNCS <layout> rank <r> per_step=<x>"; exits
non-zero on a mismatch.
"""

import argparse
import contextlib
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: shared helpers

from graph_standin import StandInGraph  # noqa: E402
from host_syncs import HostSyncCounter  # noqa: E402

from megatron_gspo.checkpoint import load_model, save_model  # noqa: E402
from megatron_gspo.config import ParallelConfig, model_config_from_preset  # noqa: E402
from megatron_gspo.generation import lean_decoder  # noqa: E402
from megatron_gspo.generation.generator import GenerationConfig, Generator  # noqa: E402
from megatron_gspo.model.gpt import build_model, forward_logits  # noqa: E402
from megatron_gspo.routing.rollout_routes import RolloutRecorder  # noqa: E402
from megatron_gspo.runtime import parallel  # noqa: E402

VOCAB = 100
G = 2  # samples per prompt
PROMPTS = {"uniform": (6, 6, 6, 6, 6), "ragged": (5, 2, 9, 1, 6)}
# (tp, ep, etp) of each layout
SHARED = "sampled-shared"  # a case whose reference is the one-rank "sampled" (shared_prefix_attention=off)
LAYOUTS = {"tp2": (2, 1, 2), "ep2": (1, 2, 1), "etp2": (1, 1, 2), "tp2ep2": (2, 2, 2), "tp2ep4etp1": (2, 4, 1)}


def fail(msg):
    print(f"LEAN FAILURE: {msg}", flush=True)
    sys.exit(3)


def prompts(kind):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPTS[kind]]


def gen_configs(stops):
    """The cases: greedy (full length) and sampled, with stop tokens (rows end apart) and compaction."""
    common = dict(n_samples_per_prompt=G, decode_impl="lean", seed=3)
    sampled = GenerationConfig(max_new_tokens=12, temperature=1.0, stop_token_ids=stops, compact_finished_rows=0.25,
                               finished_check_interval=2, shared_prefix_attention="off", **common)
    return {"greedy": GenerationConfig(max_new_tokens=8, temperature=0.0, n_samples_per_prompt=1,
                                       decode_impl="lean"),
            "sampled": sampled,
            # shared-prefix decode attention on the shards against the one-rank plain ("sampled") reference
            SHARED: dataclasses.replace(sampled, shared_prefix_attention="on")}


def build(cfg, tp, ep, etp):
    par = ParallelConfig(device="cpu", tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                         expert_tensor_parallel_size=etp, seed=11)
    st = parallel.initialize(cfg, par)
    return build_model(cfg, par, st), st


def probe_logits(model, st):
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits = forward_logits(model, tokens)
    if st.tp > 1:
        parts = [torch.empty_like(logits) for _ in range(st.tp)]
        dist.all_gather(parts, logits.contiguous(), group=st.tp_group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :VOCAB]


def run(model, st, ps, gcfg, rows, graphs=False, syncs=None):
    """generate() of prompts ``rows`` of ``ps`` (global row keys) with the R3 recorder on:
    (output, routes [L, B, len, k] sorted along k). ``syncs``: a HostSyncCounter around generate()."""
    StandInGraph.captures = []
    gen = Generator(model, vocab_size=VOCAB, state=st, graph_factory=StandInGraph if graphs else None)
    g = gcfg.n_samples_per_prompt
    keys = [i * g + j for i in rows for j in range(g)]
    rec = RolloutRecorder(model)
    try:
        with rec.recording(), syncs or contextlib.nullcontext():
            cfg = dataclasses.replace(gcfg, cuda_graphs=graphs)
            out = gen.generate([ps[i] for i in rows], cfg, row_keys=keys, on_forward=rec.on_forward)
        routes = rec.finish(out).routes.sort(dim=-1).values
    finally:
        rec.close()
    if gen._dec is None:
        fail("generate() did not run the lean decoder")
    return out, routes


def reference(cfg, ckpt):
    model, st = build(cfg, 1, 1, 1)
    save_model(model, ckpt)
    ref = {"logits": probe_logits(model, st)}
    free, _ = run(model, st, prompts("ragged"), gen_configs([])["sampled"], range(5))
    # frequent tokens as stop tokens: rows of one batch end at different steps
    ref["stops"] = torch.bincount(free.tokens[free.response_mask], minlength=VOCAB).topk(2).indices.tolist()
    for kind in PROMPTS:
        for name, gcfg in gen_configs(ref["stops"]).items():
            if name != SHARED:
                ref[kind, name] = run(model, st, prompts(kind), gcfg, range(5))
        ref[kind, SHARED] = ref[kind, "sampled"]
    lengths = ref["ragged", "sampled"][0].response_lengths
    if not (lengths.min() < lengths.max()):
        fail(f"the reference's rows all end together ({lengths.tolist()}): pick other stop tokens")
    return ref


def my_rows(st):
    """The prompts this rank generates: all of them on TP ranks of one data-parallel replica, an uneven
    share where the rank's lockstep group spans data-parallel ranks (rank 0 of 2: 2 prompts, rank 1: 3)."""
    if st.dp == 1:
        return list(range(5))
    shares = [[0, 2], [1, 3, 4]] if st.dp == 2 else [[0], [1, 2], [3], [4]]
    return shares[st.dp_rank]


def compare(tag, got, want, rows, g):
    out, routes = got
    ref, ref_routes = want
    idx = torch.tensor([i * g + j for i in rows for j in range(g)])
    for name in ("response_lengths", "stopped", "prompt_lengths"):
        if not torch.equal(getattr(out, name), getattr(ref, name)[idx]):
            fail(f"{tag}: {name} {getattr(out, name).tolist()} != {getattr(ref, name)[idx].tolist()}")
    T = out.tokens.shape[1]  # the longest of these rows (equal lengths: the reference's rows end by T too)
    if not torch.equal(out.tokens, ref.tokens[idx, :T]):
        fail(f"{tag}: tokens differ from the single-rank decode\n{out.tokens}\n{ref.tokens[idx]}")
    diff = (out.logprobs - ref.logprobs[idx, :T]).abs().max().item()
    if diff > 2e-5:
        fail(f"{tag}: log-probs differ from the single-rank decode by {diff:.3e}")
    for r, row in enumerate(idx.tolist()):
        k = int(out.prompt_lengths[r] + out.response_lengths[r]) - 1  # routed positions: the fed tokens
        if not torch.equal(routes[:, r, :k], ref_routes[:, row, :k]):
            fail(f"{tag}: the routes of row {row} differ from the single-rank decode")
    return diff


shared_calls: list = []  # the lean decoder's calls of shared_prefix_attention (counted: main)


def check(cfg, ckpt, ref, tag):
    tp, ep, etp = LAYOUTS[tag]
    model, st = build(cfg, tp, ep, etp)
    load_model(model, ckpt)
    err = (probe_logits(model, st) - ref["logits"]).abs().max().item()
    if err > 1e-5:
        fail(f"{tag}: the loaded weights do not reproduce the reference logits ({err})")
    rows = my_rows(st)
    lockstep = st.lockstep_group
    # generation.decode_impl=auto takes the lean decoder at this layout (run() fails otherwise)
    auto = dataclasses.replace(gen_configs(ref["stops"])["greedy"], decode_impl="auto")
    worst = compare(f"{tag} auto", run(model, st, prompts("uniform"), auto, rows), ref["uniform", "greedy"], rows, 1)
    for kind in PROMPTS:
        for name, gcfg in gen_configs(ref["stops"]).items():
            for graphs in (False,) if name == SHARED else (False, True):  # (captured steps do not share: config)
                case = f"{tag} {kind} {name} {'graph-ready' if graphs else 'eager'}"
                shared_calls.clear()
                got = run(model, st, prompts(kind), gcfg, rows, graphs=graphs)
                if (name == SHARED) != bool(shared_calls):
                    fail(f"{case}: {len(shared_calls)} decode attentions shared the prompt's KV")
                worst = max(worst, compare(case, got, ref[kind, name], rows, gcfg.n_samples_per_prompt))
                if graphs and not StandInGraph.captures:
                    fail(f"{case}: no decode step was captured")
                n = torch.tensor([got[0].num_forwards, -got[0].num_forwards])
                dist.all_reduce(n, op=dist.ReduceOp.MAX, group=lockstep)
                if n[0].item() != -n[1].item():
                    fail(f"{case}: ranks ran {n[0].item()} and {-n[1].item()} forwards (lockstep broken)")
    ranks = dist.get_process_group_ranks(lockstep)
    print(f"[rank {st.rank}] {tag}: dp {st.dp}, prompts {rows}, lockstep ranks {ranks}, "
          f"log-prob max abs diff {worst:.2e}", flush=True)
    print(f"LEAN OK {tag} rank {st.rank}", flush=True)
    return model, st


def count_syncs(model, st, tag):
    ps = prompts("ragged")
    rows = my_rows(st)
    counts, forwards = {}, {}
    for n in (4, 20):
        cfg = GenerationConfig(max_new_tokens=n, n_samples_per_prompt=G, finished_check_interval=4, seed=2,
                               ignore_eos=True, decode_impl="lean")
        counts[n] = HostSyncCounter()
        out, _ = run(model, st, ps, cfg, rows, syncs=counts[n])
        forwards[n] = out.num_forwards
    steps = forwards[20] - forwards[4]
    per_step = (counts[20].total() - counts[4].total()) / steps
    print(f"LEAN SYNCS {tag} rank {st.rank} per_step={per_step:.3f} steps={steps}", flush=True)
    if steps != 16 or per_step > 1 / 4:
        fail(f"{tag}: {per_step} host syncs per decode step: {counts[20].by_site()}")
    for f in ("generation/lean_decoder.py", "generation/decoder.py", "generation/sampling.py",
              "generation/groups.py", "runtime/comm.py", "routing/rollout_routes.py"):
        if counts[20].total(f"megatron_gspo/{f}") != counts[4].total(f"megatron_gspo/{f}"):
            fail(f"{tag}: host syncs per decode step in {f}: {counts[20].by_site(f)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layouts", required=True, help=f"comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--host-syncs", default=None, help="a layout of --layouts at which to count host syncs")
    ap.add_argument("--gather-tokens", type=int, default=None,
                    help="LEAN_MOE_GATHER_TOKENS for the layouts: small, the MoE dispatch goes in chunks")
    a = ap.parse_args()
    saved = lean_decoder.LEAN_MOE_GATHER_TOKENS, lean_decoder.shared_prefix_attention
    if a.gather_tokens:
        lean_decoder.LEAN_MOE_GATHER_TOKENS = a.gather_tokens
    real = lean_decoder.shared_prefix_attention
    lean_decoder.shared_prefix_attention = lambda *args, **kw: shared_calls.append(1) or real(*args, **kw)
    try:
        cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=0.0, vocab_size=VOCAB)
        ckpt = os.path.join(a.dir, "weights")
        ref = reference(cfg, ckpt)
        for tag in a.layouts.split(","):
            model, st = check(cfg, ckpt, ref, tag)
            if tag == a.host_syncs:
                count_syncs(model, st, tag)
    finally:  # as they were (tests/dist_scripts/jobs.py may run another script in this process)
        lean_decoder.LEAN_MOE_GATHER_TOKENS, lean_decoder.shared_prefix_attention = saved
    parallel.destroy()


if __name__ == "__main__":
    main()
