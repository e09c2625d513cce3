"""Generation's forwards on this GPU: the CUDA-graph decode step against the eager one, and the decode
paths of the spec that runs (the Transformer Engine spec in the NGC container) on uniform and ragged
prompts.

``decode.cuda_graphs``  the lean decode step captured with torch.cuda.CUDAGraph (``generation.cuda_graphs``)
                        against the eager step on the same tokens: logits, argmax agreement, ms/step at
                        256 rows on ``qwen3-moe-2b-proxy`` (``--quick``: the tiny model, 16 rows).
``decode.te_spec``      ``generate()`` on the TE-spec model (``qwen3-moe-2b-proxy`` cut to 2 layers) with
                        the lean decoder (what ``decode_impl=auto`` picks) and with megatron's static path
                        (TE attention; ragged prompts switch it to TE's "arbitrary" mask), uniform and
                        ragged prompts: decode ms/step, prefill s, peak memory, greedy-token agreement.

The measurements are plain functions of a built model (``measure_*``), so the CPU test suite runs
them on the tiny model (the graph capture through a stand-in with CUDA graphs' contract); the items
need CUDA (and TE), which is what their numbers mean."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

from megatron_gspo.preflight.context import Context, need_bf16, need_cuda, need_te

GRAPHS_FULL = {"model": {"preset": "qwen3-moe-2b-proxy"}, "rows": 256, "prompt": 32, "steps": 32}
GRAPHS_QUICK = {"model": {"preset": "tiny", "precision": "bf16"}, "rows": 16, "prompt": 8, "steps": 8}
TE_FULL = {"model": {"preset": "qwen3-moe-2b-proxy", "num_layers": 2}, "rows": 64, "prompt": 256, "new": 32}
TE_QUICK = {"model": {"preset": "tiny", "precision": "bf16"}, "rows": 8, "prompt": 16, "new": 8}
# the captured step must pick the eager step's token nearly everywhere (bf16: the static step attends
# over every KV slot, later ones masked, so its sums differ from the eager step's by rounding)
MIN_ARGMAX_AGREEMENT = 0.98


def build(ctx: Context, name: str, model: dict, *overrides: str):
    """This check's model (the demo job's section replaced by ``model``, the user's overrides on top)
    on the preflight's device, in eval mode: (model, parallel state, job config)."""
    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model.gpt import build_model

    cfg = ctx.job(name, *overrides, model=model)
    par = ParallelConfig(use_distributed_optimizer=False, device=ctx.device.type, seed=cfg.parallel.seed)
    state = parallel.initialize(cfg.model, par)
    return build_model(cfg.model, par, state).eval(), state, cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def measure_decode_graphs(m, vocab_size: int, rows: int, prompt: int, steps: int,
                          graph_factory: Optional[Callable[[], object]] = None, seed: int = 0) -> dict:
    """The eager lean decode step and the captured one (``graph_factory``: None = torch.cuda.CUDAGraph)
    fed the same tokens (the eager step's greedy choice) for ``steps`` steps after a prefill of
    ``rows`` x ``prompt`` random tokens: logit differences, argmax agreement, median ms/step of each
    (the first step, where the graph is captured, not timed).

    The captured step is the *static* step (it attends over every slot, the ones past the current
    position masked), so it is also compared with that step run eagerly (``static_*``): that pair is
    the same computation, while eager-vs-captured also holds the rounding of a wider attention
    reduction. (The first H100 run, bf16, 2B proxy, 256 rows, compared eager with captured only:
    agreement 0.9785, max |d logit| 0.118; the static pair was added after it and has not run on a GPU.)"""
    from megatron_gspo.generation.lean_decoder import LeanDecoder

    dev = next(m.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (rows, prompt), generator=g, device=dev)
    positions = torch.arange(prompt, device=dev).expand(rows, prompt)
    masked = torch.triu(torch.ones(prompt, prompt, dtype=torch.bool, device=dev), 1)[None, None].expand(rows, 1, -1, -1)
    slots = prompt + steps
    eager = LeanDecoder(m, rows, slots, slots)
    static = LeanDecoder(m, rows, slots, slots, static=True)
    graphed = LeanDecoder(m, rows, slots, slots, graphs=True, graph_factory=graph_factory)
    t_eager, t_graph, agree, max_diff, max_logit = [], [], 0, 0.0, 0.0
    agree_static, max_diff_static = 0, 0.0
    with torch.no_grad(), eager.torch_routers():  # the routers are the model's: one context serves all
        logits = eager.prefill(tokens, positions, masked)[:, :vocab_size]
        static.prefill(tokens, positions, masked)
        graphed.prefill(tokens, positions, masked)
        for j in range(steps):
            nxt = logits.argmax(-1)
            logits, te = _timed(lambda: eager.decode(nxt, prompt + j)[:, :vocab_size], dev)
            ref = static.decode(nxt, prompt + j)[:, :vocab_size]
            got, tg = _timed(lambda: graphed.decode(nxt, prompt + j)[:, :vocab_size], dev)
            if j > 0:
                t_eager.append(te)
                t_graph.append(tg)
            agree += int((got.argmax(-1) == logits.argmax(-1)).sum())
            max_diff = max(max_diff, float((got.float() - logits.float()).abs().max()))
            agree_static += int((got.argmax(-1) == ref.argmax(-1)).sum())
            max_diff_static = max(max_diff_static, float((got.float() - ref.float()).abs().max()))
            max_logit = max(max_logit, float(logits.float().abs().max()))
    ms_eager = 1e3 * statistics.median(t_eager) if t_eager else float("nan")
    ms_graph = 1e3 * statistics.median(t_graph) if t_graph else float("nan")
    return {"rows": rows, "prompt": prompt, "steps": steps, "argmax_agreement": agree / (rows * steps),
            "max_abs_logit_diff": max_diff, "static_argmax_agreement": agree_static / (rows * steps),
            "static_max_abs_logit_diff": max_diff_static, "max_abs_logit": max_logit, "ms_per_step_eager": ms_eager,
            "ms_per_step_graphs": ms_graph, "speedup": ms_eager / ms_graph if ms_graph > 0 else float("nan"),
            "dtype": str(next(m.parameters()).dtype).replace("torch.", "")}


def check_cuda_graphs(ctx: Context):
    need_cuda(ctx)
    need_bf16(ctx)
    from megatron_gspo.generation.lean_decoder import lean_decode_unsupported
    from megatron_gspo.model.gpt import model_summary

    shape = GRAPHS_QUICK if ctx.quick else GRAPHS_FULL
    m, _, cfg = build(ctx, "decode_graphs", shape["model"])
    why = lean_decode_unsupported(m)
    if why is not None:
        raise RuntimeError(f"the lean decoder cannot run this model ({why}): generation.cuda_graphs would be refused")
    r = measure_decode_graphs(m, cfg.model.vocab_size, shape["rows"], shape["prompt"], shape["steps"])
    r["model"] = model_summary(cfg.model, ctx.device)
    del m
    torch.cuda.empty_cache()
    agreement = (f"argmax agreement {r['static_argmax_agreement']:.4f} with the eager static step (max |d logit| "
                 f"{r['static_max_abs_logit_diff']:.2g}), {r['argmax_agreement']:.4f} with the eager step (max |d logit| "
                 f"{r['max_abs_logit_diff']:.2g}, max |logit| {r['max_abs_logit']:.3g})")
    if not r["static_argmax_agreement"] >= MIN_ARGMAX_AGREEMENT:
        raise RuntimeError(f"the captured decode step picks other tokens than the same (static) step run eagerly: "
                           f"{agreement} < {MIN_ARGMAX_AGREEMENT}; {r['ms_per_step_graphs']:.2f} ms/step captured vs "
                           f"{r['ms_per_step_eager']:.2f} eager")
    return (f"{r['ms_per_step_graphs']:.2f} ms/step captured vs {r['ms_per_step_eager']:.2f} eager "
            f"({r['speedup']:.2f}x) at {r['rows']} rows; {agreement} ({cfg.model.preset}, {r['dtype']})"), r


def _prompts(rows: int, prompt: int, ragged: bool, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``rows`` prompts of ``prompt`` tokens, or (ragged) of lengths spread over prompt/8 .. prompt."""
    g = torch.Generator().manual_seed(seed)
    lens = [prompt] * rows if not ragged else [max(1, prompt // 8 + (prompt - prompt // 8) * i // max(rows - 1, 1))
                                               for i in range(rows)]
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lens]


def measure_decode_paths(m, state, vocab_size: int, rows: int, prompt: int, new: int,
                         impls=("lean", "megatron")) -> dict:
    """``generate()`` (greedy, ``new`` tokens, no early stop) with each decode path on uniform and ragged
    prompts: decode ms/step, prefill seconds, peak memory (CUDA), and how often the paths' greedy tokens
    agree (bf16 rounding differs between them, so a near-tie may go either way)."""
    from megatron_gspo.config import GenerationConfig
    from megatron_gspo.generation.generator import generate

    dev = state.device
    out: dict = {"rows": rows, "prompt": prompt, "new": new}
    for kind in ("uniform", "ragged"):
        prompts = _prompts(rows, prompt, kind == "ragged", vocab_size)
        tokens = {}
        for impl in impls:
            cfg = GenerationConfig(max_new_tokens=new, temperature=0.0, n_samples_per_prompt=1, decode_impl=impl,
                                   ignore_eos=True)
            generate(m, prompts[:2], cfg, vocab_size=vocab_size, state=state)  # warm-up (kernels, allocator)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            g = generate(m, prompts, cfg, vocab_size=vocab_size, state=state)
            peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**30 if dev.type == "cuda" else None
            steps = max(g.num_forwards - 1, 1)
            out[f"{impl}_{kind}"] = {"ms_per_step": 1e3 * (g.elapsed_s - g.prefill_s) / steps,
                                     "prefill_s": g.prefill_s, "peak_gib": peak, "forwards": g.num_forwards}
            tokens[impl] = g.tokens[g.response_mask]
        if len(tokens) == 2:
            a, b = tokens.values()
            out[f"agreement_{kind}"] = float((a == b).float().mean()) if a.shape == b.shape else 0.0
    return out


def check_te_decode(ctx: Context):
    need_te(ctx)
    need_bf16(ctx)
    from megatron_gspo.generation.lean_decoder import lean_decode_unsupported
    from megatron_gspo.model.gpt import model_summary

    shape = TE_QUICK if ctx.quick else TE_FULL
    m, state, cfg = build(ctx, "decode_te", {**shape["model"], "transformer_impl": "transformer_engine"})
    why = lean_decode_unsupported(m)
    if why is not None:
        raise RuntimeError(f"the lean decoder refuses the Transformer Engine spec here ({why}): generation would fall "
                           "back to megatron's static path")
    r = measure_decode_paths(m, state, cfg.model.vocab_size, shape["rows"], shape["prompt"], shape["new"])
    r["model"] = model_summary(cfg.model, ctx.device)
    del m
    torch.cuda.empty_cache()

    def part(key: str) -> str:
        x = r[key]
        return f"{x['ms_per_step']:.2f} ms/step, {x['peak_gib']:.2f} GiB"

    return (f"lean: uniform {part('lean_uniform')}, ragged {part('lean_ragged')}; megatron+TE: uniform "
            f"{part('megatron_uniform')}, ragged {part('megatron_ragged')}; greedy tokens agree "
            f"{100 * r['agreement_uniform']:.1f}% / {100 * r['agreement_ragged']:.1f}% ({r['rows']} rows x "
            f"{r['prompt']} + {r['new']}, {cfg.model.preset})"), r
