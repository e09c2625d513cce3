"""Generation across layouts: run under torchrun with 2 (or more) ranks.

One torchrun call checks several layouts (--layouts tp2,ep2) on the same processes.
Phase 1 (reference): the ranks first form a TP=1 / EP=1 layout (pure data parallel), build the
tiny model from one seed, save its weights (dist_checkpointing), and each computes the logits of a
fixed batch and the single-rank greedy generations (with and without a stop token) of a fixed set
of ragged prompts. Phase 2, per layout (check): megatron's groups are re-initialized for the
layout (TP=2 or EP=2), the model is rebuilt and loaded from that checkpoint, its logits are
checked against the reference (so the weights are equal), then it generates and compares:
- greedy tokens equal the single-rank ones (TP: every rank generates every prompt; EP: each DP rank
  generates its own, uneven share, so the ranks finish at different steps and must stay in
  lockstep: the number of forwards is checked equal on all ranks);
- at temperature 1, every TP rank holds identical samples and their log-probs equal a fresh
  forward's (vocab-parallel, 1e-5);
- the model's training mode and sequence-parallel attributes are restored (same logits after).
Prints "GENERATION OK <tag> rank <r>" on success; exits non-zero on a mismatch.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from megatron_gspo.runtime import parallel
from megatron_gspo.checkpoint import load_model, save_model
from megatron_gspo.config import ParallelConfig, model_config_from_preset
from megatron_gspo.generation.generator import GenerationConfig, generate
from megatron_gspo.model.logprobs import vocab_parallel_logprobs
from megatron_gspo.model.gpt import build_model, forward_logits

VOCAB = 100
PROMPT_LENS = (5, 2, 9, 1, 6)
MAX_NEW = 12


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def probe_batch():
    g = torch.Generator().manual_seed(9)
    return torch.randint(0, VOCAB, (2, 16), generator=g)


def full_logits(logits, st):
    if st.tp > 1:
        parts = [torch.empty_like(logits) for _ in range(st.tp)]
        dist.all_gather(parts, logits.contiguous(), group=st.tp_group)
        logits = torch.cat(parts, dim=-1)
    return logits[..., :VOCAB]


def fail(msg):
    print(f"GENERATION FAILURE: {msg}", flush=True)
    sys.exit(3)


def build(cfg, tp, ep):
    par = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, seed=11)
    st = parallel.initialize(cfg, par)
    return build_model(cfg, par, st), st


def reference(cfg, ckpt):
    """TP=1 / EP=1 on every rank: save the weights, return the reference outputs."""
    model, st = build(cfg, 1, 1)
    save_model(model, ckpt)
    with torch.no_grad():
        logits = full_logits(forward_logits(model, probe_batch()), st)
    ps = prompts()
    greedy = GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.0, n_samples_per_prompt=1)
    out = generate(model, ps, greedy, vocab_size=VOCAB, state=st)
    stop_tok = out.responses()[0][2]  # ends prompt 0's response by its 3rd token
    out_stop = generate(model, ps, GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.0,
                                                    n_samples_per_prompt=1, stop_token_ids=[stop_tok]),
                        vocab_size=VOCAB, state=st)
    if st.rank == 0:
        print(f"reference greedy {out.responses()} stop {stop_tok} -> {out_stop.responses()}", flush=True)
    return {"logits": logits, "greedy": out.responses(), "stop_tok": stop_tok, "greedy_stop": out_stop.responses()}


LAYOUTS = {"tp2": (2, 1), "ep2": (1, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layouts", default="tp2,ep2", help=f"comma-separated, of {sorted(LAYOUTS)}")
    a = ap.parse_args()

    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=0.0, vocab_size=VOCAB)
    ckpt = os.path.join(a.dir, "weights")
    ref = reference(cfg, ckpt)
    for tag in a.layouts.split(","):
        tp, ep = LAYOUTS[tag]
        check(cfg, ckpt, ref, tp, ep, tag)
    parallel.destroy()


def check(cfg, ckpt, ref, tp, ep, tag):
    model, st = build(cfg, tp, ep)
    load_model(model, ckpt)
    probe = probe_batch()
    with torch.no_grad():
        logits_before = full_logits(forward_logits(model, probe), st)
    ps = prompts()
    greedy = GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.0, n_samples_per_prompt=1)

    err = (logits_before - ref["logits"]).abs().max().item()
    print(f"[rank {st.rank}] {tag} weights check: logits max abs diff {err:.3e}", flush=True)
    if err > 1e-5:
        fail(f"loaded weights do not reproduce the reference logits ({err})")

    # data parallel: under EP each DP rank takes an uneven share (2 vs 3 prompts; with the reference
    # weights, rank 0's rows all hit the stop token within 1 token while rank 1's run 12 steps)
    if st.dp == 1:
        mine = list(range(len(ps)))
    else:
        assert st.dp == 2
        mine = [0, 2] if st.dp_rank == 0 else [1, 3, 4]
    my_prompts = [ps[i] for i in mine]

    for name, gcfg, key in (
        ("greedy", greedy, "greedy"),
        ("greedy+stop", GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.0, n_samples_per_prompt=1,
                                         stop_token_ids=[ref["stop_tok"]]), "greedy_stop"),
    ):
        calls = []
        out = generate(model, my_prompts, gcfg, vocab_size=VOCAB, state=st,
                       on_forward=lambda i, k, rows: calls.append((i, k)))
        want = [ref[key][i] for i in mine]
        got = out.responses()
        print(f"[rank {st.rank}] {tag} {name}: {got} forwards={out.num_forwards} "
              f"tokens/s={out.tokens_per_s:.1f}", flush=True)
        if got != want:
            fail(f"{name} differs from the single-rank generation: {got} != {want}")
        if len(calls) != out.num_forwards or calls[0] != (0, "prefill"):
            fail(f"on_forward calls {calls} vs num_forwards {out.num_forwards}")
        n = torch.tensor([out.num_forwards, -out.num_forwards])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        if n[0].item() != -n[1].item():
            fail(f"{name}: ranks ran different numbers of forwards (lockstep broken)")
        # the group's slowest row decides the number of forwards on every rank
        if name == "greedy+stop" and st.dp > 1:
            longest = max(len(r) for r in ref[key])
            if out.num_forwards != longest:
                fail(f"{name}: {out.num_forwards} forwards, expected {longest} (slowest rank)")

    # temperature 1 sampling: identical samples on the TP ranks; log-probs = fresh forward
    samp = GenerationConfig(max_new_tokens=MAX_NEW, temperature=1.0, n_samples_per_prompt=3, seed=3)
    out = generate(model, my_prompts, samp, vocab_size=VOCAB, state=st)
    if st.tp > 1:
        for name, t in (("tokens", out.tokens), ("logprobs", out.logprobs), ("lengths", out.response_lengths)):
            parts = [torch.empty_like(t) for _ in range(st.tp)]
            dist.all_gather(parts, t.contiguous(), group=st.tp_group)
            if not all(torch.equal(p, parts[0]) for p in parts):
                fail(f"TP ranks sampled different {name}")
        # sequence parallel splits the sequence over the TP ranks: right-pad to a multiple of TP
        T = out.tokens.shape[1]
        toks = torch.nn.functional.pad(out.tokens, (0, -T % st.tp), value=0)
        with torch.no_grad():
            lg = forward_logits(model, toks)[:, :T]
            lp, _ = vocab_parallel_logprobs(lg[:, :-1], out.tokens[:, 1:], VOCAB, st.tp_group,
                                            temperature=1.0, with_entropy=False)
        m = out.response_mask[:, 1:]
        diff = (lp - out.logprobs[:, 1:])[m].abs().max().item()
        print(f"[rank {st.rank}] {tag} T=1 sampling log-prob max abs diff {diff:.3e}", flush=True)
        if diff > 1e-5:
            fail(f"sampling log-probs differ from a fresh forward by {diff}")
        if len({tuple(r) for r in out.responses()}) < 2:
            fail("all temperature-1 samples are identical")

    if not model.training:
        fail("generate() left the model in eval mode")
    with torch.no_grad():
        logits_after = full_logits(forward_logits(model, probe), st)
    err = (logits_after - logits_before).abs().max().item()
    if err > 0:
        fail(f"the model computes different logits after generate() ({err}): state not restored")
    print(f"GENERATION OK {tag} rank {st.rank}", flush=True)


if __name__ == "__main__":
    main()
