"""The vLLM engine under a trainer layout (run under torchrun, in the vLLM tier's interpreter):

    torchrun --nproc-per-node N vllm_layouts.py --tp T --ep E [--updates 10]

Every rank builds the tiny Qwen3-MoE (fp32, head size 32) in the layout, wraps it for training (megatron's DDP and
optimizer, the trainer's own), and builds its engine shard (rollout/vllm_engine.py: one engine per trainer TP
group, vLLM TP = the trainer's). Then:

1. the engine's log-probs of a fixed batch of tokens equal the Megatron model's (``initial``);
2. ``--updates`` optimizer updates (Adam, lr 1e-2; each DP rank its share of a fixed batch; gradients reduced by
   the trainer's finalize_grads): the engine is stale (``stale``), then synced from the bucket stream (collective
   over TP / EP) and equal again (``synced``);
3. each DP replica samples its own prompts: a replica's TP ranks get the same rows, the replicas different ones
   (``tp_same`` / ``dp_differ``), and the Megatron model's log-probs of the sampled tokens equal the engine's
   (``sampled``).

Prints ``VLLM_LAYOUT {json}`` per rank and exits 0 (the test asserts the numbers)."""

import argparse
import json
import os
import sys


def megatron_logprobs(model, seqs, vocab):
    """log p(seq[t] | seq[:t]) for t >= 1, one forward per sequence (every rank runs the same ones: the forward is a
    collective over TP / EP)."""
    import torch

    from megatron_gspo.model.gpt import forward_logprobs

    out = []
    with torch.no_grad():
        for s in seqs:
            t = torch.tensor([s])
            lp, _ = forward_logprobs(model, t[:, :-1], t[:, 1:], vocab, with_entropy=False)
            out.append(lp[0])
    return out


def max_diff(a, b) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def main():
    import torch
    import torch.distributed as dist

    from megatron_gspo.config import GenerationConfig, OptimizerConfig, ParallelConfig, model_config_from_preset
    from megatron_gspo.model.gpt import build_model, finalize_grads, forward_logprobs, wrap_ddp
    from megatron_gspo.rollout.vllm_engine import VllmEngine
    from megatron_gspo.runtime import parallel
    from megatron_gspo.trainer.optim import build_optimizer, optimizer_step

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--updates", type=int, default=10)
    a = ap.parse_args()
    vocab = 100  # below the padded 128: the mapping's unpadding is on the path
    # moe_ffn_hidden_size 32 (the preset's): 16 per rank at vLLM TP 2, which its CPU MoE kernel pads to 32
    cfg = model_config_from_preset("tiny", vocab_size=vocab, kv_channels=32, moe_aux_loss_coeff=0.0)
    par = ParallelConfig(device="cpu", seed=5, tensor_model_parallel_size=a.tp, expert_model_parallel_size=a.ep)
    st = parallel.initialize(cfg, par)
    model = build_model(cfg, par, st)
    ddp = wrap_ddp(model, st)
    opt = build_optimizer(OptimizerConfig(lr=1e-2, lr_warmup_steps=0, weight_decay=0.0, clip_grad=0.0), ddp, st,
                          bf16=False)
    engine = VllmEngine(ddp, st, cfg, seed=0, engine_args=dict(kv_cache_memory_bytes=32 << 20))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 3, 20)]
    res = {"rank": dist.get_rank(), "tp": st.tp, "ep": st.ep, "dp": st.dp,
           "initial": max_diff(engine.prompt_logprobs(seqs), megatron_logprobs(ddp, seqs, vocab))}

    batch = torch.randint(0, vocab, (8, 16), generator=torch.Generator().manual_seed(3))
    per = batch.shape[0] // st.dp
    mine = batch[st.dp_rank * per:(st.dp_rank + 1) * per]
    for _ in range(a.updates):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        lp, _ = forward_logprobs(ddp, mine[:, :-1], mine[:, 1:], vocab, with_entropy=False)
        (-lp.sum() / batch[:, 1:].numel()).backward()  # the global batch's mean (DDP sums over DP)
        finalize_grads(ddp, st)
        ok, _ = optimizer_step(opt, st.device)
        assert ok
    new = megatron_logprobs(ddp, seqs, vocab)
    res["stale"] = max_diff(engine.prompt_logprobs(seqs), new)
    stats = engine.sync_weights()
    res["synced"] = max_diff(engine.prompt_logprobs(seqs), new)
    res["sync_bytes"], res["sync_buckets"] = stats.bytes, stats.buckets

    # each DP replica its own prompts (same lengths: the Megatron recompute below runs one shape on every rank)
    pg = torch.Generator().manual_seed(100 + st.dp_rank)
    prompts = [torch.randint(0, vocab, (n,), generator=pg).tolist() for n in (5, 9)]
    gc = GenerationConfig(max_new_tokens=6, n_samples_per_prompt=3, temperature=1.0, pad_token_id=0,
                          ignore_eos=True)
    out = engine.generate(prompts, gc, seed=7)
    assert bool((out.response_lengths == 6).all())
    with torch.no_grad():
        ref, _ = forward_logprobs(ddp, out.tokens[:, :-1], out.tokens[:, 1:], vocab, with_entropy=False)
    m = out.response_mask[:, 1:]
    res["sampled"] = (ref - out.logprobs[:, 1:])[m].abs().max().item()
    grid = [torch.zeros_like(out.tokens) for _ in range(dist.get_world_size())]
    dist.all_gather(grid, out.tokens)
    tp_ranks = dist.get_process_group_ranks(st.tp_group) if st.tp > 1 else [dist.get_rank()]
    res["tp_same"] = all(torch.equal(grid[r], out.tokens) for r in tp_ranks)
    res["dp_differ"] = all(not torch.equal(grid[r], out.tokens) for r in range(len(grid)) if r not in tp_ranks)
    # the name of vLLM's CPU shared-memory communicator: this job's, not every torchrun job's "env://"
    res["dist_ident"] = os.environ.get("VLLM_DIST_IDENT")
    from vllm.distributed.parallel_state import get_tp_group

    res["vllm_tp_ranks"] = list(get_tp_group().ranks)  # the engine's TP shards: the trainer's TP group
    # one write (print writes the line and its newline apart: the other rank's line could land between them)
    sys.stdout.write("VLLM_LAYOUT " + json.dumps(res) + "\n")
    sys.stdout.flush()
    engine.close()
    parallel.destroy()


if __name__ == "__main__":
    main()
