"""FP8 forwards at shapes Transformer Engine refuses unpadded (megatron_gspo/model/fp8_alignment.py).

``numerics.fp8_unaligned`` builds the demo's tiny model twice from one seed (same weights), bf16 + FP8
GEMMs and plain bf16, and
  * calls the FP8 model's forward directly on 3 rows x 13 tokens: TE 2.20 raises "FP8 execution
    requires ..." (what happens without the padding; reported, not failed, if a TE accepts it);
  * runs the project's forward (model.forward_logprobs pads it) and a backward at 3 x 13 and 5 x 37
    tokens: finite log-probs and gradients, and the FP8 log-probs beside the bf16 ones;
  * generates from 5 ragged prompts (the decode batch padded to 16 rows, megatron's path: the lean
    decoder does not run FP8) and checks the sampled log-probs are finite.
"""

from __future__ import annotations

import torch

from megatron_gspo.preflight.context import Context, need_fp8

SHAPES = ((3, 13), (5, 37))
# FP8 (E4M3 forward) against bf16 on the same weights: per-token log-prob differences of a 2-layer model
TOLERANCE = {"max": 1.0, "mean": 0.1}


def measure_fp8_unaligned(fp8_model, bf16_model, state, vocab_size: int) -> dict:
    from megatron_gspo.config import GenerationConfig
    from megatron_gspo.generation.generator import generate
    from megatron_gspo.model.gpt import forward_logprobs

    dev = state.device
    g = torch.Generator(device=dev).manual_seed(0)
    out: dict = {"shapes": {}}
    tokens = torch.randint(0, vocab_size, (3, 14), generator=g, device=dev)
    try:
        with torch.no_grad():
            fp8_model(input_ids=tokens[:, :-1], position_ids=torch.arange(13, device=dev).expand(3, 13),
                      attention_mask=None)
        out["unpadded"] = "accepted"
    except Exception as e:  # noqa: BLE001 - TE 2.20 raises ValueError; whatever a TE raises is the finding
        out["unpadded"] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    for rows, width in SHAPES:
        tokens = torch.randint(0, vocab_size, (rows, width + 1), generator=g, device=dev)
        lps = []
        for m in (fp8_model, bf16_model):
            m.zero_grad(set_to_none=True)
            lp, _ = forward_logprobs(m, tokens[:, :-1], tokens[:, 1:], vocab_size, with_entropy=False)
            lp.sum().backward()
            grads = [p.grad for p in m.parameters() if p.grad is not None]
            if not grads or not all(torch.isfinite(gr).all() for gr in grads) or not torch.isfinite(lp).all():
                raise RuntimeError(f"non-finite log-probs or gradients at {rows} x {width} tokens")
            lps.append(lp.detach().float())
        d = (lps[0] - lps[1]).abs()
        out["shapes"][f"{rows}x{width}"] = {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean())}
    prompts = [torch.randint(0, vocab_size, (n,), generator=g, device=dev).tolist() for n in (3, 9, 1, 6, 4)]
    gen = generate(fp8_model, prompts, GenerationConfig(max_new_tokens=8, n_samples_per_prompt=1, seed=1),
                   vocab_size=vocab_size, state=state)
    if not torch.isfinite(gen.logprobs).all():
        raise RuntimeError("non-finite sampling log-probs from the FP8 model")
    out["generation"] = {"rows": len(prompts), "forwards": gen.num_forwards, "tokens": gen.num_generated_tokens}
    out["max_abs_diff"] = max(s["max_abs_diff"] for s in out["shapes"].values())
    out["mean_abs_diff"] = max(s["mean_abs_diff"] for s in out["shapes"].values())
    return out


def check_fp8_unaligned(ctx: Context):
    need_fp8(ctx)
    import dataclasses

    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model.gpt import build_model

    cfg = ctx.job("fp8_unaligned", "model.precision=bf16", "model.fp8=hybrid", "model.transformer_impl=transformer_engine")
    par = ParallelConfig(use_distributed_optimizer=False, device=ctx.device.type, seed=cfg.parallel.seed)
    state = parallel.initialize(cfg.model, par)
    fp8_model = build_model(cfg.model, par, state)
    bf16_model = build_model(dataclasses.replace(cfg.model, fp8=None), par, state)
    r = measure_fp8_unaligned(fp8_model, bf16_model, state, cfg.model.vocab_size)
    del fp8_model, bf16_model
    torch.cuda.empty_cache()
    if r["max_abs_diff"] > TOLERANCE["max"] or r["mean_abs_diff"] > TOLERANCE["mean"]:
        raise RuntimeError(f"FP8 log-probs far from bf16 on the same weights: max |d| {r['max_abs_diff']:.3g} (tol "
                           f"{TOLERANCE['max']}), mean {r['mean_abs_diff']:.3g} (tol {TOLERANCE['mean']})")
    shapes = ", ".join(r["shapes"])
    return (f"forward + backward at {shapes} tokens (padded to 16) finite, FP8 vs bf16 log-prob max |d| "
            f"{r['max_abs_diff']:.2g} mean {r['mean_abs_diff']:.2g}; {r['generation']['rows']} ragged rows generated; "
            f"unpadded 3x13 forward {r['unpadded'].split(':')[0]}"), r
