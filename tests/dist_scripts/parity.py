"""Layout parity: run under torchrun. `ref` (1 rank) builds the tiny model, saves its weights and
reference outputs/gradients; `check` (N ranks, any TP/EP) loads the same weights, compares logits,
log-probs and entropy with the reference, and saves its gradients as a torch_dist checkpoint that
the test compares tensor by tensor with the reference gradients (global keys, any layout).
``--logprobs fused``: the log-probs and entropy come from the final hidden states with the output
layer fused in (model.forward_logprobs) instead of from the logits; the reference stays the logits
path on one rank."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from megatron_gspo.runtime import parallel
from megatron_gspo.checkpoint import load_model, save_model
from megatron_gspo.config import ParallelConfig, model_config_from_preset
from megatron_gspo.model.logprobs import vocab_parallel_logprobs
from megatron_gspo.model.gpt import (aux_loss_scales, build_model, finalize_grads, forward_logits, forward_logprobs,
                                    set_aux_loss_scale, wrap_ddp)


def batch(vocab):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (4, 24), generator=g)
    w_lp = torch.randn(4, 23, generator=g)
    w_h = torch.randn(4, 23, generator=g)
    return tokens, w_lp, w_h


def save_grads(ddp, path):
    # Put each gradient where its parameter lives, then let dist_checkpointing write the global
    # tensors: keys and shapes are then layout independent.
    m = ddp.module
    for p in m.parameters():
        p.data.copy_(p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)
    save_model(m, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ref", "check"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--tag", default="ref")
    ap.add_argument("--logprobs", choices=["logits", "fused"], default="logits")
    a = ap.parse_args()

    # the default MoE load-balancing loss (per sequence), with a coefficient large enough for its gradient
    # to weigh in the comparison: it does not depend on how rows and tokens are split over ranks either
    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=1.0, vocab_size=100)
    par = ParallelConfig(tensor_model_parallel_size=a.tp, expert_model_parallel_size=a.ep,
                         expert_tensor_parallel_size=a.etp, seed=11,
                         use_distributed_optimizer=False)  # gradients read whole from the DDP buffers
    st = parallel.initialize(cfg, par)
    model = build_model(cfg, par, st)
    ckpt = os.path.join(a.dir, "weights")
    if a.mode == "ref":
        save_model(model, ckpt)
    else:
        # the weights this layout drew from the same seed: the test compares them with the
        # one-rank model's, bit for bit (init_weights.py), then the run goes on from the saved ones
        save_model(model, os.path.join(a.dir, f"init_{a.tag}"))
        load_model(model, ckpt)
    ddp = wrap_ddp(model, st)

    tokens, w_lp, w_h = batch(cfg.vocab_size)
    # data parallel: each DP rank takes its contiguous slice of the global batch
    per = tokens.shape[0] // st.dp
    sl = slice(st.dp_rank * per, (st.dp_rank + 1) * per)
    tok = tokens[sl]
    ddp.zero_grad_buffer()
    # the aux loss's weight: coeff / the sequences of the global batch. The last token predicts nothing: not
    # an input of the fused path, padding for the logits path (as in the trainer), so both count 23 tokens
    pad = torch.zeros_like(tok, dtype=torch.bool)
    pad[:, -1] = True
    set_aux_loss_scale(aux_loss_scales([pad], st, cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff)[0],
                       st.device)
    if a.logprobs == "fused":  # 23 input tokens: odd, so sequence parallel (TP=2) pads them too
        lp, ent = forward_logprobs(ddp, tok[:, :-1], tok[:, 1:], cfg.vocab_size, padding_mask=pad[:, :-1])
        with torch.no_grad():
            logits = forward_logits(ddp, tok)
    else:
        logits = forward_logits(ddp, tok, padding_mask=pad)
        lp, ent = vocab_parallel_logprobs(logits[:, :-1], tok[:, 1:], cfg.vocab_size, st.tp_group, chunk_tokens=16)
    # a global-sum loss: DDP sums gradients over DP ranks (calculate_per_token_loss)
    loss = (lp * w_lp[sl]).sum() + (ent * w_h[sl]).sum()
    loss.backward()
    finalize_grads(ddp, st)

    def gather_vocab(x):
        x = x.detach()
        if st.tp > 1:
            parts = [torch.empty_like(x) for _ in range(st.tp)]
            dist.all_gather(parts, x.contiguous(), group=st.tp_group)
            x = torch.cat(parts, dim=-1)
        return x[..., : cfg.vocab_size]

    full = gather_vocab(logits)
    # an odd length under sequence parallel (TP=2): forward_logits pads and cuts; causal attention
    # makes the 23-token prefix's logits those of the full 24-token forward
    with torch.no_grad():
        odd = gather_vocab(forward_logits(ddp, tok[:, :23]))
    out = {"logits": full, "lp": lp.detach(), "ent": ent.detach(), "odd_length_logits": odd}
    if a.mode == "ref":
        torch.save(out, os.path.join(a.dir, "ref_out.pt"))
    else:
        ref = torch.load(os.path.join(a.dir, "ref_out.pt"))
        ref["odd_length_logits"] = ref["logits"][:, :23]
        for k, v in out.items():
            err = (v - ref[k][sl]).abs().max().item()
            print(f"[rank {st.rank}] {a.tag} {k} max abs diff {err:.3e}", flush=True)
            if err > 1e-5:
                print(f"PARITY FAILURE {k}: {err}", flush=True)
                sys.exit(3)
    save_grads(ddp, os.path.join(a.dir, f"grads_{a.tag}"))
    parallel.destroy()


if __name__ == "__main__":
    main()
