"""Throughput of megatron_gspo's model against transformers' Qwen3MoeForCausalLM, same config, same
weights, same run. Prints a table and writes JSON (machine, versions, config, date, load).
From the repository root, with the package installed (``pip install -e .``), as a script or as
``python -m benchmarks.run``:

    python benchmarks/run.py                          # the issue's CPU config, fp32 (a few minutes)
    python benchmarks/run.py --smoke --json out.json  # tiny config, 1 iteration (the test)
    python benchmarks/run.py --device cuda --precision bf16 [--impl transformer_engine] [--fp8 e4m3]
    python benchmarks/run.py --device cuda --shape 2b-proxy --no-hf --expert-impls auto   # GPU-sized
    python benchmarks/run.py --device cuda --shape 30b-cut --layers 2 --expert-impls auto  # 30B at full width

Measured, for our model (megatron-core GPTModel, local spec; every --expert-impls variant, default
"batched" = megatron_gspo.model.experts and megatron's "sequential") and for transformers (its defaults:
sdpa attention, grouped_mm experts), interleaved iteration by iteration so both see the same load:

* train_step     forward + backward + optimizer step on [batch, seq] tokens. Ours: forward_logits,
                 vocab_parallel_logprobs, loss -mean(logp) (+ megatron's MoE aux loss), DDP grads
                 finalized, megatron's Adam with grad clipping 1.0. Theirs: logits, cross-entropy
                 (= -mean(logp)) + router aux loss (output_router_logits=True), AdamW, clip 1.0;
* logprob_pass   the RL old-policy pass: no grad, per-token log-probs of [batch, seq] targets. Ours:
                 forward_logits + chunked vocab_parallel_logprobs (rollout.compute_logprobs' work
                 per micro-batch; one micro-batch of the whole batch here). Theirs: logits,
                 log_softmax(float) + gather. Its peak memory (above the model) is measured in a
                 fresh subprocess per side (CPU: VmHWM with glibc's mmap threshold lowered so freed
                 buffers leave the RSS; CUDA: max_memory_allocated; --smoke: in this process);
* generation     KV-cache greedy generation, same prompts: megatron_gspo.generation.generator.generate vs
                 transformers generate(use_cache=True, min_new_tokens=max_new_tokens); both produce
                 batch x gen_new tokens; tokens/s counts generated tokens (prefill time included).

* decode step     our sampled generation at a rollout-sized batch (--decode-rows x --decode-new, no stop
                 token), per decode step without the prefill, against its weight-read floor: the bytes a
                 step must read (flops.decode_bytes_per_step) at the device's measured copy bandwidth;
                 --cuda-graphs captures the step (generation.cuda_graphs).

Shapes (--shape): "cpu" (the default, the issue's CPU benchmark model), "2b-proxy" (qwen3-moe-2b-proxy,
vocabulary 151936) and "30b-cut" (Qwen3-30B-A3B at full width, --layers layers); the GPU shapes
default to 16 x 576-token training rows and 256 decode rows x 64 new tokens (the H100 run of issue
23), no sweep, no profile; --no-hf measures ours alone (the two models may not fit one device).

Plus (full runs): the log-prob memory benchmark (chunked vocab-parallel log-probs vs the naive fp32
log_softmax of bf16 logits, vocab 151936 x 8192 tokens, peak RSS in subprocesses) and a scaling
sweep (tokens/s vs batch size and vs sequence length, both implementations) that benchmarks/plot.py
draws into docs/perf_scaling.png.

FLOPs: megatron_gspo.model.flops (a log-prob pass is a third of a training step; generation counts the
prefill and each decode step with its context). Achieved FLOP/s are reported on every device; MFU
where the GPU's peak is known (--device cuda: TFLOP/s per GPU and MFU, bf16 or FP8 peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Optional

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex|TE).*")
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402

from megatron_gspo.runtime.sysinfo import current_rss, load_avg, machine_info, peak_rss, reset_peak_rss  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The issue's benchmark model: hidden 256, 4 layers, 16 experts top-4 of FFN 128, 8 q / 2 kv heads
# of 32, vocab 8192; batch 4 x 256 tokens.
DEFAULT_MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                     kv_channels=32, vocab_size=8192, num_moe_experts=16, moe_router_topk=4,
                     moe_ffn_hidden_size=128, max_position_embeddings=1024, rotary_base=1_000_000.0)
SMOKE_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   kv_channels=16, vocab_size=128, num_moe_experts=4, moe_router_topk=2,
                   moe_ffn_hidden_size=32, max_position_embeddings=128, rotary_base=10_000.0)
# GPU-sized shapes (--shape): the 2B proxy of Qwen3-30B-A3B, or the 30B itself at full width cut to
# --layers layers (its output layer and vocabulary 151936 included)
GPU_SHAPES = {"2b-proxy": ("qwen3-moe-2b-proxy", {}), "30b-cut": ("qwen3-30b-a3b", {})}
SWEEP_BATCH = [1, 2, 4, 8]      # at the default sequence length
SWEEP_SEQ = [64, 128, 256, 512]  # at the default batch size
LPMEM_VOCAB, LPMEM_TOKENS = 151936, 8192


# ----------------------------------------------------------------------------------------------
# Timing helpers
# ----------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_interleaved(fns: dict[str, Callable[[], object]], warmup: int, iters: int, device: str) -> dict[str, list[tuple[float, float]]]:
    """(wall seconds, process CPU seconds) of each call, the candidates alternating iteration by
    iteration so that they share the machine's load. CPU seconds (all threads of this process) are
    less sensitive than wall time to other processes competing for the cores."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            sync(device)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            times[k].append((time.perf_counter() - t0, time.process_time() - c0))
    return times


# ----------------------------------------------------------------------------------------------
# Models: same config, same weights (HF init -> save_pretrained -> checkpoints_tools -> load_model)
# ----------------------------------------------------------------------------------------------


def model_config(args):
    from megatron_gspo.config import ModelConfig, model_config_from_preset

    longest = max([args.seq + 1, args.gen_prompt + max(args.gen_new, args.decode_new)]
                  + ([max(SWEEP_SEQ) + 1] if args.scaling else []))
    if args.shape != "cpu":
        preset, extra = GPU_SHAPES[args.shape]
        kw = dict(extra, precision=args.precision, transformer_impl=args.impl, fp8=args.fp8)
        if args.layers:
            kw["num_layers"] = args.layers
        cfg = model_config_from_preset(preset, **kw)
        return dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, longest))
    base = SMOKE_MODEL if args.smoke else DEFAULT_MODEL
    kw = dict(base, precision=args.precision, transformer_impl=args.impl, fp8=args.fp8)
    kw["max_position_embeddings"] = max(kw["max_position_embeddings"], longest)
    return ModelConfig(**kw)


def hf_config(cfg):
    from transformers import Qwen3MoeConfig

    from checkpoints_tools.qwen3_moe import Qwen3MoeMapping

    d = Qwen3MoeMapping(cfg).hf_config(None, torch.float32)
    return Qwen3MoeConfig.from_dict(d)


def build_hf(cfg, seed: int):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_config(cfg))
    if cfg.precision == "bf16":  # weights exactly representable in bf16 (ours hold bf16 params)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    return model


def convert_weights(hf_model, cfg, workdir: str) -> str:
    """HF weights -> megatron torch_dist checkpoint with the project's converter."""
    from checkpoints_tools import hf_to_megatron

    hf_dir, out = os.path.join(workdir, "hf"), os.path.join(workdir, "mcore")
    hf_model.save_pretrained(hf_dir)
    hf_to_megatron.convert(hf_dir, out, force=True, dtype="bf16" if cfg.precision == "bf16" else "fp32", quiet=True)
    return out


def build_ours(cfg, state, ckpt: Optional[str], expert_impl: str):
    from megatron_gspo.checkpoint import load_model
    from megatron_gspo.model.gpt import build_model

    c = dataclasses.replace(cfg, moe_expert_impl=expert_impl)
    model = build_model(c, _parallel_config(state.device.type), state)
    if ckpt is not None:
        load_model(model, ckpt)
    return model


def _parallel_config(device: str):
    """Our side's layout on ``--device``: the job's device decision (parallel.device), so ``--device cpu``
    builds the CPU model on a GPU machine too."""
    from megatron_gspo.config import ParallelConfig

    return ParallelConfig(use_distributed_optimizer=False, device=device)


# ----------------------------------------------------------------------------------------------
# The three passes, each side
# ----------------------------------------------------------------------------------------------


def ours_logprob_fn(model, tokens, vocab_size: int):
    """The trainer's old-policy pass on one micro-batch (what BatchPreparer.logprobs runs: the log-probs
    from the final hidden states, output layer fused in)."""
    from megatron_gspo.model.gpt import forward_logprobs

    @torch.no_grad()
    def fn():
        return forward_logprobs(model, tokens[:, :-1], tokens[:, 1:], vocab_size, with_entropy=False)[0]

    return fn


def hf_logprob_fn(model, tokens, autocast: bool):
    @torch.no_grad()
    def fn():
        with _autocast(tokens.device.type, autocast):
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    return fn


def _autocast(device_type: str, on: bool):
    import contextlib

    return torch.autocast(device_type, dtype=torch.bfloat16) if on else contextlib.nullcontext()


def ours_trainer(model, state, cfg):
    """A step function tokens -> None over one DDP wrapper and one megatron optimizer."""
    from megatron_gspo.model.gpt import finalize_grads, forward_logprobs, wrap_ddp
    from megatron_gspo.trainer.optim import OptimizerConfig, build_optimizer, optimizer_step

    ddp = wrap_ddp(model, state)
    opt = build_optimizer(OptimizerConfig(lr=1e-6, clip_grad=1.0), ddp, state, bf16=cfg.precision == "bf16")

    def step(tokens):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        lp, _ = forward_logprobs(ddp, tokens[:, :-1], tokens[:, 1:], cfg.vocab_size, with_entropy=False)
        (-lp.mean()).backward()
        finalize_grads(ddp, state)
        return optimizer_step(opt, state.device)

    return step


def hf_trainer(model, autocast: bool):
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    coef = model.config.router_aux_loss_coef

    def step(tokens):
        opt.zero_grad(set_to_none=True)
        with _autocast(tokens.device.type, autocast):
            out = model(input_ids=tokens[:, :-1], use_cache=False, output_router_logits=True)
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), tokens[:, 1:].flatten()) + coef * out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    return step


def ours_generate_fn(model, prompts, new_tokens: int, vocab_size: int, out: dict):
    from megatron_gspo.generation.generator import GenerationConfig, generate

    gcfg = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0, n_samples_per_prompt=1,
                            stop_token_ids=[], pad_token_id=0)

    def fn():
        res = generate(model, list(prompts), gcfg, vocab_size=vocab_size)
        out["tokens"] = res.tokens[:, prompts.shape[1]:]
        out["generated"] = res.num_generated_tokens
        return res

    return fn


def hf_generate_fn(model, prompts, new_tokens: int, out: dict, autocast: bool):
    @torch.no_grad()
    def fn():
        with _autocast(prompts.device.type, autocast):
            seq = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 use_cache=True, pad_token_id=0)
        out["tokens"] = seq[:, prompts.shape[1]:]
        out["generated"] = int(out["tokens"].numel())
        return seq

    return fn


# ----------------------------------------------------------------------------------------------
# Memory probes (fresh subprocesses)
# ----------------------------------------------------------------------------------------------


def _probe_env() -> dict:
    # glibc returns buffers >= 64 KiB to the OS when freed, so the RSS follows live memory and the
    # high-water mark of the measured pass is not hidden by memory freed before it.
    # The probe is a process group of its own: drop the rendezvous variables this process set.
    dist_vars = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"}
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    return {**env, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONWARNINGS": "ignore"}


def run_probe(args_list: list[str], threads: int, timeout: int = 900) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(threads), *args_list]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_probe_env(), timeout=timeout, cwd=REPO)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE "):])
    raise RuntimeError(f"memory probe {' '.join(args_list)} failed (rc={p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def probe_logprob_memory(args) -> dict:
    """In this (fresh) process: build one side, one warm-up pass, then the peak of one pass."""
    from megatron_gspo.runtime import parallel

    cfg = model_config(args)
    device = args.device
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
    if args.probe_side == "ours":
        state = parallel.initialize(cfg, _parallel_config(device))
        model = build_ours(cfg, state, None, args.probe_expert_impl)
        fn = ours_logprob_fn(model, tokens, cfg.vocab_size)
    else:
        model = build_hf(cfg, args.seed).to(device)
        if cfg.precision == "bf16":
            model = model.to(torch.bfloat16)
        fn = hf_logprob_fn(model, tokens, autocast=False)
    fn()
    return _measure_peak(fn, device)


def _measure_peak(fn, device: str) -> dict:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return {"peak_bytes": int(torch.cuda.max_memory_allocated() - base), "seconds": dt, "method": "cuda max_memory_allocated"}
    base = current_rss()
    if not reset_peak_rss():  # the peak would include everything before this pass
        raise RuntimeError("cannot reset the RSS high-water mark (/proc/self/clear_refs): no CPU peak memory")
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return {"peak_bytes": int(peak_rss() - base), "seconds": dt, "method": "VmHWM - RSS before (MALLOC_MMAP_THRESHOLD_=65536)"}


def probe_lpmem(args) -> dict:
    """Log-prob memory of bf16 logits [T, V]: chunked vocab-parallel vs naive fp32 log_softmax."""
    from megatron_gspo.model.logprobs import vocab_parallel_logprobs

    T, V = args.lpmem_tokens, args.lpmem_vocab
    g = torch.Generator().manual_seed(0)
    logits = torch.empty(T, V, dtype=torch.bfloat16)
    for s in range(0, T, 512):  # fill in slices: no fp32 [T, V] temporary
        logits[s:s + 512] = torch.randn(min(512, T - s), V, generator=g).to(torch.bfloat16)
    target = torch.randint(0, V, (T,), generator=g)
    if args.probe_method == "chunked":
        def fn():
            with torch.no_grad():
                return vocab_parallel_logprobs(logits, target, V, None, with_entropy=False)[0]
    else:
        def fn():
            with torch.no_grad():
                return torch.log_softmax(logits.float(), dim=-1).gather(-1, target[:, None]).squeeze(-1)
    out = _measure_peak(fn, "cpu")
    out.update(tokens=T, vocab=V, logits_bytes=logits.numel() * logits.element_size())
    return out


# ----------------------------------------------------------------------------------------------
# Main benchmark
# ----------------------------------------------------------------------------------------------


def summarize(times: list[tuple[float, float]], tokens: int, flops: float, peak: Optional[float]) -> dict:
    """Median-based rates of one side (one device: per-GPU numbers on CUDA)."""
    from megatron_gspo.model.flops import mfu

    wall = [w for w, _ in times]
    cpu = [c for _, c in times]
    med = statistics.median(wall)
    tps = tokens / med
    return {"tokens": tokens, "seconds_median": med, "seconds_min": min(wall), "seconds_all": wall,
            "tokens_per_s": tps, "tflops_per_device": flops / med / 1e12, "mfu": mfu(tps, flops / tokens, peak),
            "cpu_seconds_median": statistics.median(cpu), "tokens_per_cpu_s": tokens / max(1e-9, statistics.median(cpu))}


def peak_for(args) -> Optional[float]:
    from megatron_gspo.model.flops import peak_flops

    if args.device != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(), "fp8" if args.fp8 else ("bf16" if args.precision == "bf16" else "fp32"))


def _command() -> str:
    """This run's command line, to repeat it from the repository root (as a module or a script)."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    how = ["-m", main_spec.name] if main_spec is not None and main_spec.name == "benchmarks.run" \
        else [os.path.relpath(os.path.abspath(sys.argv[0]), REPO)]
    return " ".join(["python", *how, *sys.argv[1:]])


def run_benchmark(args) -> dict:
    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import ConfigError
    from megatron_gspo.model.flops import flops_per_token, generation_flops
    from megatron_gspo.model.gpt import resolve_expert_impl, resolve_impl

    device = args.device
    try:
        parallel.resolve_device(_parallel_config(device))  # --device cuda on a machine without one: refused
    except ConfigError as e:
        raise SystemExit(f"--device {device}: {e}") from None
    cfg = model_config(args)
    impls = [resolve_expert_impl(dataclasses.replace(cfg, moe_expert_impl=i), resolve_impl(cfg, torch.device(device)))
             for i in args.expert_impls]
    peak = peak_for(args)
    autocast = device == "cuda" and cfg.precision == "bf16"
    result = {
        "command": _command(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "torch_threads": torch.get_num_threads(),
        "load_avg_start": load_avg(),
        "config": {"model": dataclasses.asdict(cfg), "shape": args.shape, "batch": args.batch, "seq": args.seq,
                   "gen_prompt": args.gen_prompt, "gen_new": args.gen_new, "decode_rows": args.decode_rows,
                   "decode_new": args.decode_new, "warmup": args.warmup,
                   "iters": args.iters, "smoke": args.smoke, "expert_impls": impls,
                   "transformer_impl": resolve_impl(cfg, torch.device(device)), "precision": cfg.precision,
                   "fp8": cfg.fp8},
        "flops_per_token": {"train": flops_per_token(cfg, args.seq), "logprob": flops_per_token(cfg, args.seq, training=False)},
        "peak_flops": peak,
    }
    state = parallel.initialize(cfg, _parallel_config(device))
    hf = hf_infer = None
    if args.no_hf:  # ours alone, weights drawn from the seed (GPU-sized shapes: both sides may not fit)
        ours = {i: build_ours(cfg, state, None, i) for i in impls}
    else:
        with tempfile.TemporaryDirectory() as work:
            hf = build_hf(cfg, args.seed)
            ckpt = convert_weights(hf, cfg, work)
            ours = {i: build_ours(cfg, state, ckpt, i) for i in impls}
        hf = hf.to(device)
        hf_infer = hf if cfg.precision == "fp32" else _bf16_copy(hf)
        result["hf_impl"] = {"attn_implementation": hf.config._attn_implementation,
                             "experts_implementation": getattr(hf.config, "_experts_implementation", None),
                             "training": "fp32 params + autocast bf16" if autocast else "fp32"}

    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.gen_prompt), generator=g).to(device)
    n_tok = args.batch * args.seq

    # same weights: compare the log-probs of the two implementations
    if hf is not None:
        lp_ref = hf_logprob_fn(hf_infer, tokens, autocast=False)()
        result["weights_check"] = {
            f"logprob_max_abs_diff_{i}_vs_hf": float((ours_logprob_fn(m, tokens, cfg.vocab_size)() - lp_ref).abs().max())
            for i, m in ours.items()}

    sections = {}
    # 0. the expert layer alone (the implementations of megatron_gspo.model.experts)
    result["expert_layer"] = expert_layer_bench(args, cfg, ours, device)

    # 1. log-prob pass
    fns = {f"ours_{i}": ours_logprob_fn(m, tokens, cfg.vocab_size) for i, m in ours.items()}
    if hf is not None:
        fns["hf"] = hf_logprob_fn(hf_infer, tokens, autocast=False)
    t = time_interleaved(fns, args.warmup, args.iters, device)
    f_lp = flops_per_token(cfg, args.seq, training=False) * n_tok
    sections["logprob_pass"] = {k: summarize(v, n_tok, f_lp, peak) for k, v in t.items()}
    if not args.no_memory and args.memory_in_process:
        # (smoke runs) the same measurement on the already built models, in this process
        for k, fn in fns.items():
            sections["logprob_pass"][k]["peak_memory"] = dict(_measure_peak(fn, device), in_process=True)
    elif not args.no_memory:
        common = ["--probe", "logprob", "--batch", str(args.batch), "--seq", str(args.seq), "--device", device,
                  "--precision", args.precision, "--impl", args.impl, "--seed", str(args.seed)]
        if args.smoke:
            common.append("--smoke")
        if args.fp8:
            common += ["--fp8", args.fp8]
        for i in ours:
            sections["logprob_pass"][f"ours_{i}"]["peak_memory"] = run_probe(
                common + ["--probe-side", "ours", "--probe-expert-impl", i], args.threads)
        if hf is not None:
            sections["logprob_pass"]["hf"]["peak_memory"] = run_probe(common + ["--probe-side", "hf"], args.threads)

    # 2. generation
    gen_out: dict[str, dict] = {}
    fns = {}
    for i, m in ours.items():
        gen_out[f"ours_{i}"] = {}
        fns[f"ours_{i}"] = ours_generate_fn(m, prompts, args.gen_new, cfg.vocab_size, gen_out[f"ours_{i}"])
    if hf is not None:
        gen_out["hf"] = {}
        fns["hf"] = hf_generate_fn(hf_infer, prompts, args.gen_new, gen_out["hf"], autocast=False)
    t = time_interleaved(fns, args.warmup, args.iters, device)
    n_gen = args.batch * args.gen_new
    f_gen = generation_flops(cfg, args.gen_prompt, args.gen_new, args.batch)
    sections["generation"] = {k: summarize(v, n_gen, f_gen, peak) for k, v in t.items()}
    for k, o in gen_out.items():
        assert o["generated"] == n_gen, f"{k} generated {o['generated']} tokens, expected {n_gen}"
        if hf is not None:
            sections["generation"][k]["greedy_token_match_vs_hf"] = float((o["tokens"] == gen_out["hf"]["tokens"]).float().mean())

    # 2b. the decode step at a rollout-sized batch against the weight-read floor (ours, sampling)
    result["decode_step"] = decode_step_bench(args, cfg, ours[impls[0]], device)

    # 3. training step (last: it updates the weights)
    steps = {f"ours_{i}": ours_trainer(m, state, cfg) for i, m in ours.items()}
    if hf is not None:
        steps["hf"] = hf_trainer(hf, autocast)
    fns = {k: (lambda st=st: st(tokens)) for k, st in steps.items()}
    t = time_interleaved(fns, args.warmup, args.iters, device)
    f_tr = flops_per_token(cfg, args.seq) * n_tok
    sections["train_step"] = {k: summarize(v, n_tok, f_tr, peak) for k, v in t.items()}

    if args.profile:
        first = f"ours_{impls[0]}"
        prof_fns = {
            f"train_step/{first}": lambda: steps[first](tokens),
            f"logprob_pass/{first}": ours_logprob_fn(ours[impls[0]], tokens, cfg.vocab_size),
            f"generation/{first}": ours_generate_fn(ours[impls[0]], prompts, args.gen_new, cfg.vocab_size, {}),
        }
        if hf is not None:
            prof_fns.update({
                "train_step/hf": lambda: steps["hf"](tokens),
                "logprob_pass/hf": hf_logprob_fn(hf_infer, tokens, autocast=False),
                "generation/hf": hf_generate_fn(hf_infer, prompts, args.gen_new, {}, autocast=False)})
        result["profile"] = profile_passes(prof_fns)

    for sec in sections.values():
        if "hf" not in sec:
            continue
        hf_tps = sec["hf"]["tokens_per_s"]
        sec["ratio_vs_hf"] = {k: v["tokens_per_s"] / hf_tps for k, v in sec.items() if k.startswith("ours_")}
        sec["ratio_vs_hf_cpu_time"] = {k: v["tokens_per_cpu_s"] / sec["hf"]["tokens_per_cpu_s"]
                                       for k, v in sec.items() if k.startswith("ours_")}
        if "peak_memory" in sec["hf"]:
            sec["peak_memory_ratio_vs_hf"] = {k: v["peak_memory"]["peak_bytes"] / max(1, sec["hf"]["peak_memory"]["peak_bytes"])
                                              for k, v in sec.items() if k.startswith("ours_") and "peak_memory" in v}
    result["results"] = sections

    del ours
    # 4. scaling sweep (full runs): tokens/s vs batch and vs sequence length, our default impl vs HF
    if args.scaling:
        result["scaling"] = scaling_sweep(args, cfg, state, impls[0], device, autocast)

    # 5. log-prob memory benchmark (full CPU runs)
    if args.lpmem:
        lp = {m: run_probe(["--probe", "lpmem", "--probe-method", m, "--lpmem-tokens", str(args.lpmem_tokens),
                            "--lpmem-vocab", str(args.lpmem_vocab)], args.threads) for m in ("chunked", "naive")}
        lp["ratio_chunked_vs_naive"] = lp["chunked"]["peak_bytes"] / max(1, lp["naive"]["peak_bytes"])
        result["logprob_memory"] = lp
    result["load_avg_end"] = load_avg()
    parallel.destroy()
    return result


def copy_bandwidth(device: str, nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Measured memory bandwidth of this device, bytes/s: a large tensor copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def decode_step_bench(args, cfg, model, device: str) -> dict:
    """Our decode step at --decode-rows rows x --decode-new sampled tokens (temperature 1, no stop
    token, the default decode path; --cuda-graphs captures it), per step excluding the prefill,
    against the weight-read floor: the bytes a step must read (flops.decode_bytes_per_step: every dense
    weight, the experts any row routes to, the KV cache) at the device's measured copy bandwidth."""
    from megatron_gspo.model.flops import decode_bytes_per_step
    from megatron_gspo.generation.generator import GenerationConfig, generate

    g = torch.Generator().manual_seed(args.seed + 2)
    prompts = torch.randint(0, cfg.vocab_size, (args.decode_rows, args.gen_prompt), generator=g).tolist()
    gcfg = GenerationConfig(max_new_tokens=args.decode_new, temperature=1.0, n_samples_per_prompt=1, ignore_eos=True,
                            stop_token_ids=[], pad_token_id=0, seed=1, cuda_graphs=args.cuda_graphs)
    steps, wall, cpu = [], [], []
    for i in range(args.warmup + args.iters):
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = generate(model, prompts, gcfg, vocab_size=cfg.vocab_size)
        sync(device)
        if i >= args.warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            steps.append((out.elapsed_s - out.prefill_s) / max(1, out.num_forwards - 1))
    step_s = statistics.median(steps)
    bpp = 2 if cfg.precision == "bf16" else 4
    need = decode_bytes_per_step(cfg, args.decode_rows, args.gen_prompt + args.decode_new / 2, bpp)
    bw = copy_bandwidth(device)
    floor_s = need["total"] / bw
    return {"rows": args.decode_rows, "prompt": args.gen_prompt, "new_tokens": args.decode_new,
            "cuda_graphs": args.cuda_graphs, "step_ms_median": 1e3 * step_s, "step_ms_all": [1e3 * x for x in steps],
            "call_s_median": statistics.median(wall), "call_cpu_s_median": statistics.median(cpu),
            "tokens_per_s": args.decode_rows / step_s, "bytes_per_step": need, "copy_bandwidth_gb_s": bw / 1e9,
            "floor_ms": 1e3 * floor_s, "step_over_floor": step_s / floor_s}


def expert_layer_bench(args, cfg, ours: dict, device: str) -> dict:
    """The routed-experts module alone, one layer, on the token counts the model sees: megatron's
    SequentialMLP vs BatchedSequentialMLP with each grouped-GEMM variant. "train": forward +
    backward of all batch x seq x top-k routed rows; "decode": a no-grad forward of batch x top-k
    rows (one generation step). Tokens are spread over experts by a fixed random routing."""
    from megatron_gspo.model.experts import BatchedSequentialMLP

    def experts_of(model):
        return next(m for m in model.modules() if hasattr(m, "local_experts"))

    mods = {}
    if "sequential" in ours:
        mods["sequential"] = (experts_of(ours["sequential"]), None)
    if "batched" in ours:
        b = experts_of(ours["batched"])
        for impl in ("grouped_mm", "loop", "bmm"):
            mods[f"batched_{impl}"] = (b, impl)
    if not mods:
        return {}
    E, k, H = cfg.num_moe_experts, cfg.moe_router_topk, cfg.hidden_size
    dtype = next(iter(mods.values()))[0].local_experts[0].linear_fc1.weight.dtype
    g = torch.Generator().manual_seed(args.seed + 3)
    out = {}
    for shape, n_rows, grad in (("train", args.batch * args.seq * k, True), ("decode", args.batch * k, False)):
        ids = torch.randint(0, E, (n_rows,), generator=g)
        counts = torch.bincount(ids, minlength=E)
        x = torch.randn(n_rows, H, generator=g).to(device, dtype)
        probs = torch.rand(n_rows, generator=g).to(device)
        fns = {}
        for name, (mod, impl) in mods.items():
            def fn(mod=mod, impl=impl):
                saved = BatchedSequentialMLP.gemm_impl
                if impl is not None:
                    BatchedSequentialMLP.gemm_impl = impl
                try:
                    if grad:
                        xi = x.detach().requires_grad_()
                        y, _ = mod(xi, counts, probs)
                        y.backward(torch.ones_like(y))
                    else:
                        with torch.no_grad():
                            mod(x, counts, probs)
                finally:
                    BatchedSequentialMLP.gemm_impl = saved
            fns[name] = fn
        reps = 1 if grad else 20
        t = time_interleaved({n: (lambda f=f: [f() for _ in range(reps)]) for n, f in fns.items()},
                             args.warmup, max(3, args.iters), device)
        out[shape] = {"rows": n_rows, **{n: {"ms_median": 1e3 * statistics.median([w for w, _ in v]) / reps,
                                             "cpu_ms_median": 1e3 * statistics.median([c for _, c in v]) / reps}
                                         for n, v in t.items()}}
        for mod, _ in mods.values():
            mod.zero_grad(set_to_none=True)
    return out


_CATEGORIES = (
    ("gemm", ("aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm", "aten::addbmm", "aten::_grouped_mm",
              "aten::linear", "aten::matmul")),
    ("attention kernels", ("aten::_scaled_dot_product", "aten::_softmax", "aten::_softmax_backward_data",
                           "aten::masked_fill", "aten::_safe_softmax")),
    ("copies / indexing", ("aten::copy_", "aten::cat", "aten::index", "aten::_index_put_impl_", "aten::scatter",
                           "aten::gather", "aten::masked_select", "aten::clone", "aten::contiguous",
                           "aten::repeat_interleave", "aten::fill_", "aten::zero_", "aten::empty", "aten::_to_copy",
                           "aten::embedding", "aten::stack", "aten::where", "aten::nonzero")),
)


def _categorize(name: str) -> str:
    for cat, prefixes in _CATEGORIES:
        if any(name == p or name.startswith(p) for p in prefixes):
            return cat
    return "elementwise / other ops" if name.startswith("aten::") else "autograd / python-side ops"


def profile_passes(fns: dict[str, Callable[[], object]]) -> dict:
    """One call of each pass under torch.profiler: wall time, the ops' self CPU time by category,
    the rest (wall - op time: Python / framework overhead between ops, single-threaded), top ops."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, fn in fns.items():
        fn()  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
        cats: dict[str, float] = {}
        ops = []
        for e in prof.key_averages():
            self_s = e.self_cpu_time_total / 1e6
            if e.key.startswith("aten::") or self_s > 0:
                cats[_categorize(e.key)] = cats.get(_categorize(e.key), 0.0) + self_s
                ops.append((self_s, e.key, e.count))
        op_time = sum(cats.values())
        cats["outside ops (python / framework)"] = max(0.0, wall - op_time)
        ops.sort(reverse=True)
        out[name] = {"wall_s": wall, "by_category_s": cats,
                     "top_ops": [{"op": k, "self_s": t, "calls": c} for t, k, c in ops[:12]]}
    return out


def _bf16_copy(model):
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)


def scaling_sweep(args, cfg, state, impl: str, device: str, autocast: bool) -> list[dict]:
    points = [("batch", b, args.seq) for b in SWEEP_BATCH] + [("seq", args.batch, s) for s in SWEEP_SEQ]
    model = build_ours(cfg, state, None, impl)
    hf = build_hf(cfg, args.seed).to(device)
    hf_infer = hf if cfg.precision == "fp32" else _bf16_copy(hf)
    train = {"ours": ours_trainer(model, state, cfg), "hf": hf_trainer(hf, autocast)}
    rows = []
    g = torch.Generator().manual_seed(args.seed + 2)
    for axis, b, s in points:
        tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g).to(device)
        fns = {"ours": ours_logprob_fn(model, tokens, cfg.vocab_size), "hf": hf_logprob_fn(hf_infer, tokens, autocast=False)}
        t = time_interleaved(fns, 1, args.sweep_iters, device)
        for side, ts in t.items():
            rows.append({"axis": axis, "batch": b, "seq": s, "kind": "logprob_pass", "side": side,
                         "tokens_per_s": b * s / statistics.median([w for w, _ in ts])})
        fns = {k: (lambda st=st: st(tokens)) for k, st in train.items()}
        t = time_interleaved(fns, 1, args.sweep_iters, device)
        for side, ts in t.items():
            rows.append({"axis": axis, "batch": b, "seq": s, "kind": "train_step", "side": side,
                         "tokens_per_s": b * s / statistics.median([w for w, _ in ts])})
    return rows


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def format_table(res: dict) -> str:
    secs = res["results"]
    has_hf = "hf" in secs["train_step"]
    sides = [k for k in secs["train_step"] if k.startswith("ours_")] + (["hf"] if has_hf else [])
    names = {k: (k.replace("ours_", "ours (") + ")" if k.startswith("ours_") else "transformers") for k in sides}
    rate = "TFLOP/s per GPU" if res["machine"]["device"] == "cuda" else "GFLOP/s"
    scale = 1.0 if res["machine"]["device"] == "cuda" else 1e3
    head = f"{'metric':<28}" + "".join(f"{names[s]:>22}" for s in sides)
    lines = [head, "-" * len(head)]
    for sec, label in (("train_step", "train step"), ("logprob_pass", "log-prob pass"), ("generation", "generation")):
        d = secs[sec]
        lines.append(f"{label + ' tokens/s':<28}" + "".join(f"{d[s]['tokens_per_s']:>22.1f}" for s in sides))
        if has_hf:
            lines.append(f"{'  ratio vs transformers':<28}" + "".join(
                f"{(d['ratio_vs_hf'][s] if s != 'hf' else 1.0):>21.2f}x" for s in sides))
            lines.append(f"{'  ratio, by CPU time':<28}" + "".join(
                f"{(d['ratio_vs_hf_cpu_time'][s] if s != 'hf' else 1.0):>21.2f}x" for s in sides))
        lines.append(f"{'  ' + rate:<28}" + "".join(f"{d[s]['tflops_per_device'] * scale:>22.2f}" for s in sides))
        if d[sides[0]].get("mfu") is not None:
            lines.append(f"{'  MFU':<28}" + "".join(f"{100 * d[s]['mfu']:>21.1f}%" for s in sides))
        if "peak_memory" in d[sides[0]]:
            lines.append(f"{'  peak memory (above model)':<28}" + "".join(
                f"{_fmt_bytes(d[s]['peak_memory']['peak_bytes']):>22}" for s in sides))
        if sec == "generation" and has_hf:
            lines.append(f"{'  greedy tokens = HF':<28}" + "".join(
                f"{100 * d[s]['greedy_token_match_vs_hf']:>21.1f}%" for s in sides))
    if res.get("decode_step"):
        d = res["decode_step"]
        lines.append("")
        lines.append(f"decode step, {d['rows']} rows (prompt {d['prompt']}, {d['new_tokens']} sampled tokens, cuda graphs "
                     f"{'on' if d['cuda_graphs'] else 'off'}): {d['step_ms_median']:.2f} ms/step, {d['tokens_per_s']:.0f} "
                     f"tok/s; weight-read floor {d['floor_ms']:.3f} ms ({_fmt_bytes(d['bytes_per_step']['total'])} at "
                     f"{d['copy_bandwidth_gb_s']:.1f} GB/s measured copy bandwidth): {d['step_over_floor']:.1f}x the floor")
    if res.get("expert_layer"):
        lines.append("")
        for shape, d in res["expert_layer"].items():
            lines.append(f"expert layer alone, {shape} ({d['rows']} routed rows): " + ", ".join(
                f"{k} {v['ms_median']:.2f} ms" for k, v in d.items() if k != "rows"))
    if res.get("profile"):
        lines.append("")
        lines.append("profile (one call each, torch.profiler; seconds by category):")
        for name, p in res["profile"].items():
            cats = ", ".join(f"{k} {v:.3f}" for k, v in sorted(p["by_category_s"].items(), key=lambda kv: -kv[1]))
            lines.append(f"  {name:<30} wall {p['wall_s']:.3f}: {cats}")
    if "logprob_memory" in res:
        m = res["logprob_memory"]
        lines.append("")
        lines.append(f"log-prob memory, bf16 logits {m['chunked']['tokens']} x {m['chunked']['vocab']} "
                     f"({_fmt_bytes(m['chunked']['logits_bytes'])}): chunked vocab-parallel "
                     f"{_fmt_bytes(m['chunked']['peak_bytes'])} ({m['chunked']['seconds']:.2f} s), naive fp32 log_softmax "
                     f"{_fmt_bytes(m['naive']['peak_bytes'])} ({m['naive']['seconds']:.2f} s): ratio {m['ratio_chunked_vs_naive']:.4f}")
    lines.append("")
    if "weights_check" in res:
        lines.append(f"weights check (max |logp ours - logp HF|): " + ", ".join(f"{k}: {v:.2e}" for k, v in res["weights_check"].items()))
    lines.append(f"threads {res['torch_threads']}, load average start {res['load_avg_start']} end {res['load_avg_end']}")
    return "\n".join(lines)


def format_markdown(res: dict) -> str:
    """The result as the Markdown tables of docs/performance.md."""
    secs = res["results"]
    has_hf = "hf" in secs["train_step"]
    sides = [k for k in secs["train_step"] if k.startswith("ours_")] + (["hf"] if has_hf else [])
    names = {k: (f"ours, {k[5:]} experts" if k.startswith("ours_") else "transformers") for k in sides}
    cuda = res["machine"]["device"] == "cuda"
    out = ["| pass | " + " | ".join(names[s] for s in sides) + " |", "|---" * (len(sides) + 1) + "|"]
    labels = {"train_step": "training step", "logprob_pass": "log-prob pass", "generation": "generation"}
    for sec in ("train_step", "logprob_pass", "generation"):
        d = secs[sec]
        cells = []
        for s in sides:
            c = f"{d[s]['tokens_per_s']:.0f} tok/s"
            if s != "hf" and has_hf:
                c += f" (**{d['ratio_vs_hf'][s]:.2f}x**; CPU time {d['ratio_vs_hf_cpu_time'][s]:.2f}x)" if not cuda else \
                     f" (**{d['ratio_vs_hf'][s]:.2f}x**)"
            if cuda:
                c += f", {d[s]['tflops_per_device']:.1f} TFLOP/s" + (f", MFU {100 * d[s]['mfu']:.1f}%" if d[s]['mfu'] else "")
            else:
                c += f", {1e3 * d[s]['tflops_per_device']:.1f} GFLOP/s"
            cells.append(c)
        out.append(f"| {labels[sec]} | " + " | ".join(cells) + " |")
    d = secs["logprob_pass"]
    if "peak_memory" in d[sides[0]]:
        out.append("| log-prob pass peak memory | " + " | ".join(_fmt_bytes(d[s]["peak_memory"]["peak_bytes"]) for s in sides) + " |")
    return "\n".join(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny config, 1 iteration, no sweep / memory benchmark")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--impl", choices=["auto", "local", "transformer_engine"], default="local",
                    help="our transformer implementation (model.transformer_impl)")
    ap.add_argument("--fp8", choices=["e4m3", "hybrid"], default=None, help="FP8 (Transformer Engine only)")
    ap.add_argument("--expert-impls", default="auto,sequential",
                    help="our expert implementations to compare, comma separated (auto = batched on the local spec)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all usable cores)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--gen-prompt", type=int, default=None)
    ap.add_argument("--gen-new", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--sweep-iters", type=int, default=2)
    ap.add_argument("--no-scaling", dest="scaling", action="store_false", default=None)
    ap.add_argument("--no-lpmem", dest="lpmem", action="store_false", default=None)
    ap.add_argument("--no-memory", action="store_true", help="skip the log-prob pass peak-memory probes")
    ap.add_argument("--profile", dest="profile", action="store_true", default=None,
                    help="torch.profiler breakdown of each pass (default: on in full runs)")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--memory-in-process", action="store_true", default=None,
                    help="measure the log-prob pass peak memory in this process (default for --smoke; full runs "
                         "use a fresh subprocess per side)")
    ap.add_argument("--lpmem-tokens", type=int, default=LPMEM_TOKENS)
    ap.add_argument("--lpmem-vocab", type=int, default=LPMEM_VOCAB)
    ap.add_argument("--shape", choices=["cpu", *GPU_SHAPES], default="cpu",
                    help="model shape: the CPU benchmark model (default), the 2B proxy, or Qwen3-30B-A3B at full width "
                         "cut to --layers layers")
    ap.add_argument("--layers", type=int, default=None, help="--shape 30b-cut / 2b-proxy: number of layers (30b-cut default 2)")
    ap.add_argument("--no-hf", action="store_true",
                    help="ours alone (weights from the seed): for shapes where both models do not fit on one device")
    ap.add_argument("--decode-rows", type=int, default=None, help="rows of the decode-step measurement")
    ap.add_argument("--decode-new", type=int, default=None, help="sampled tokens of the decode-step measurement")
    ap.add_argument("--cuda-graphs", action="store_true", help="generation.cuda_graphs for the decode-step measurement")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--markdown", default=None, metavar="RESULT_JSON",
                    help="print the Markdown tables of an earlier run's JSON and exit")
    ap.add_argument("--json", default=None, help="output JSON (default benchmarks/results/<device>_latest.json; smoke: none)")
    # internal: memory probes run in subprocesses
    ap.add_argument("--probe", choices=["logprob", "lpmem"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-side", choices=["ours", "hf"], default="ours", help=argparse.SUPPRESS)
    ap.add_argument("--probe-expert-impl", default="batched", help=argparse.SUPPRESS)
    ap.add_argument("--probe-method", choices=["chunked", "naive"], default="chunked", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.precision is None:
        a.precision = "bf16" if a.device == "cuda" else "fp32"
    if a.smoke and a.shape != "cpu":
        ap.error("--smoke runs the tiny CPU shape; drop --shape")
    if a.fp8 and a.impl == "local":
        a.impl = "transformer_engine"
    if a.smoke:
        d = dict(batch=2, seq=16, gen_prompt=8, gen_new=4, warmup=0, iters=1, decode_rows=4, decode_new=4)
    elif a.shape == "cpu":
        d = dict(batch=4, seq=256, gen_prompt=128, gen_new=128, warmup=1, iters=5, decode_rows=64, decode_new=32)
    else:  # the H100 run of issue 23: 256 rollout rows x 64 new tokens; 576-token training rows
        d = dict(batch=16, seq=576, gen_prompt=64, gen_new=64, warmup=1, iters=3, decode_rows=256, decode_new=64)
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.profile is None:
        a.profile = not a.smoke and a.shape == "cpu"
    if a.memory_in_process is None:
        a.memory_in_process = a.smoke
    if a.scaling is None:
        a.scaling = not a.smoke and a.shape == "cpu"
    if a.lpmem is None:
        a.lpmem = not a.smoke and a.device == "cpu"
    a.expert_impls = [s.strip() for s in a.expert_impls.split(",") if s.strip()]
    if a.shape == "30b-cut" and a.layers is None:
        a.layers = 2
    if a.threads is None:
        a.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.markdown:
        with open(args.markdown, encoding="utf-8") as f:
            print(format_markdown(json.load(f)))
        return 0
    torch.set_num_threads(args.threads)
    if args.probe == "logprob":
        print("PROBE " + json.dumps(probe_logprob_memory(args)), flush=True)
        return 0
    if args.probe == "lpmem":
        print("PROBE " + json.dumps(probe_lpmem(args)), flush=True)
        return 0
    res = run_benchmark(args)
    print(format_table(res))
    path = args.json or (None if args.smoke else os.path.join(REPO, "benchmarks", "results", f"{args.device}_latest.json"))
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
