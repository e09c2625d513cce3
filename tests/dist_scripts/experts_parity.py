"""Batched experts == megatron's SequentialMLP under a parallel layout (run under torchrun).

For each layout given (``--layouts ep2,etp2``): build the model with moe_expert_impl="batched" and
with "sequential", give both the same weights through megatron_gspo.checkpoint (the first layout's
batched model saves them with save_model, every other model loads them with load_model: the
state-dict compatibility, across layouts too), then run the same forward + backward (DDP, grads
finalized) through both and compare logits and every parameter's gradient on every rank (fp32).
Prints one "PARITY <layout> rank <r> logits <err> grads <err>" line per rank and layout."""

import argparse
import dataclasses
import os
import sys

# torch and the package are imported inside the functions: dist_checkpointing's writer starts a
# multiprocessing manager with "spawn", which re-imports this module; a light module top keeps
# that start from re-importing megatron (tens of seconds on a loaded 2-core machine).

LAYOUTS = {
    "ep2": dict(expert_model_parallel_size=2),
    "etp2": dict(expert_tensor_parallel_size=2),
    "tp2": dict(tensor_model_parallel_size=2),
}
TOL = 1e-5


def run(cfg, par, st, impl, ckpt, save):
    import torch

    from megatron_gspo.checkpoint import load_model, save_model
    from megatron_gspo.model.experts import BatchedSequentialMLP, _packed_view
    from megatron_gspo.model.logprobs import vocab_parallel_logprobs
    from megatron_gspo.model.gpt import build_model, finalize_grads, forward_logits, wrap_ddp

    model = build_model(dataclasses.replace(cfg, moe_expert_impl=impl), par, st)
    if save:
        save_model(model, ckpt)
    else:
        load_model(model, ckpt)
    experts = [m for m in model.modules() if isinstance(m, BatchedSequentialMLP)]
    assert bool(experts) == (impl == "batched"), (impl, len(experts))
    for e in experts:  # the zero-copy weight layout survives the load
        assert _packed_view([x.linear_fc1.weight for x in e.local_experts]) is not None
    ddp = wrap_ddp(model, st)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (4, 20), generator=g)
    w = torch.randn(4, 19, generator=g)
    per = tokens.shape[0] // st.dp
    sl = slice(st.dp_rank * per, (st.dp_rank + 1) * per)
    ddp.zero_grad_buffer()
    logits = forward_logits(ddp, tokens[sl])
    lp, _ = vocab_parallel_logprobs(logits[:, :-1], tokens[sl, 1:], cfg.vocab_size, st.tp_group, with_entropy=False)
    (lp * w[sl]).sum().backward()
    finalize_grads(ddp, st)
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


def main():
    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import ParallelConfig, model_config_from_preset

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layouts", default="ep2")
    a = ap.parse_args()
    cfg = model_config_from_preset("tiny", vocab_size=100, num_moe_experts=8, moe_router_topk=2)
    failed = False
    ckpt = os.path.join(a.dir, "weights")
    for i, name in enumerate(a.layouts.split(",")):
        par = ParallelConfig(seed=5, use_distributed_optimizer=False, **LAYOUTS[name])
        st = parallel.initialize(cfg, par)
        # the first layout's batched model writes the weights (tests/test_experts.py covers the
        # other direction: a sequential model's checkpoint loaded into the batched one)
        got_logits, got_grads = run(cfg, par, st, "batched", ckpt, save=i == 0)
        ref_logits, ref_grads = run(cfg, par, st, "sequential", ckpt, save=False)
        assert set(ref_grads) == set(got_grads)
        err_l = (ref_logits - got_logits).abs().max().item()
        err_g = 0.0
        for k, ref in ref_grads.items():
            assert ref.shape == got_grads[k].shape, k
            err_g = max(err_g, (ref - got_grads[k]).abs().max().item() / max(1.0, ref.abs().max().item()))
        n_exp = sum(1 for k in ref_grads if "local_experts" in k)
        print(f"PARITY {name} rank {st.rank} logits {err_l:.3e} grads {err_g:.3e} expert_params {n_exp}", flush=True)
        if err_l > TOL or err_g > TOL or n_exp == 0:
            failed = True
    # (layouts share the process group: initialize() rebuilds megatron's groups in place)
    parallel.destroy()
    sys.exit(3 if failed else 0)


if __name__ == "__main__":
    main()
