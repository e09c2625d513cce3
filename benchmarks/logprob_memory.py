"""Peak memory of output layer + log-probs + backward: logits path against the fused vocabulary chunks.

The training forward ends with the output layer (hidden [N, h] x weight [V, h] -> logits [N, V]),
the per-token log-probs and entropy of the targets, and their backward down to the hidden states
and the weight. Two ways, each measured in a fresh subprocess (so nothing of the other's is
resident) with glibc's mmap threshold lowered (freed buffers leave the RSS):

* ``logits`` (the path before issue 23): ``F.linear(hidden, weight)`` -> [N, V] logits (what
  megatron's ColumnParallelLinear computes), ``logprobs.vocab_parallel_logprobs`` (chunked over
  tokens), backward: the [N, V] logits gradient, then the GEMMs to hidden and weight;
* ``fused``: ``fused_logprobs.output_layer_logprobs(hidden, weight, ...)``: the output layer in
  vocabulary chunks, logits recomputed in backward, no [N, V] tensor.

Peak = VmHWM during one forward + backward minus the RSS before it (hidden, weight and targets
already allocated; their gradients are part of the measured pass on both sides). CPU only: on CUDA
use ``torch.cuda.max_memory_allocated`` (not wired here; benchmarks/run.py measures on CUDA).

    python -m benchmarks.logprob_memory                       # 8192 tokens, vocabulary 151936, fp32
    python -m benchmarks.logprob_memory --dtype bf16 --json benchmarks/results/logprob_memory_bf16.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megatron_gspo.runtime.sysinfo import current_rss, load_avg, machine_info, peak_rss, reset_peak_rss  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def probe(a) -> dict:
    """In this (fresh) process: one forward + backward of ``a.method``; its peak above the inputs."""
    import torch.nn.functional as F

    from megatron_gspo.model.fused_logprobs import output_layer_logprobs
    from megatron_gspo.model.logprobs import vocab_parallel_logprobs

    torch.set_num_threads(a.threads)
    dt = DTYPES[a.dtype]
    g = torch.Generator().manual_seed(0)
    N, V, h = a.tokens, a.vocab, a.hidden
    hidden = (torch.randn(N, h, generator=g) / h ** 0.5).to(dt).requires_grad_()
    weight = torch.randn(V, h, generator=g).to(dt).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    w_lp, w_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def run():
        if a.method == "fused":
            lp, ent = output_layer_logprobs(hidden, weight, target, V, temperature=0.9)
        else:
            lp, ent = vocab_parallel_logprobs(F.linear(hidden, weight), target, V, temperature=0.9)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return lp.detach(), ent.detach()

    import gc

    gc.collect()
    base = current_rss()
    if not reset_peak_rss():
        raise RuntimeError("cannot reset the RSS high-water mark (/proc/self/clear_refs)")
    t0, c0 = time.perf_counter(), time.process_time()
    lp, ent = run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = peak_rss() - base
    return {"method": a.method, "peak_bytes": int(peak), "wall_s": wall, "cpu_s": cpu,
            "logp_sum": float(lp.double().sum()), "entropy_sum": float(ent.double().sum()),
            "grad_hidden_norm": float(hidden.grad.float().norm()), "grad_weight_norm": float(weight.grad.float().norm())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (the peak hardly depends on it; the GEMM time does)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", default="logits,fused")
    ap.add_argument("--json", default=None)
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.probe:
        a.method = a.probe
        print("PROBE " + json.dumps(probe(a)), flush=True)
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONWARNINGS": "ignore"}
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.logprob_memory", *(argv or sys.argv[1:])]),
           "machine": machine_info(), "load_avg_start": load_avg(),
           "config": {k: getattr(a, k) for k in ("tokens", "vocab", "hidden", "dtype", "threads")},
           "logits_bytes": a.tokens * a.vocab * torch.tensor([], dtype=DTYPES[a.dtype]).element_size(), "runs": {}}
    for method in a.methods.split(","):
        cmd = [sys.executable, "-m", "benchmarks.logprob_memory", "--probe", method, "--tokens", str(a.tokens),
               "--vocab", str(a.vocab), "--hidden", str(a.hidden), "--dtype", a.dtype, "--threads", str(a.threads)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=3600)
        line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("PROBE ")), None)
        if line is None:
            raise RuntimeError(f"probe {method} failed (rc={p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        r = json.loads(line[len("PROBE "):])
        res["runs"][method] = r
        print(f"{method:7s} peak {r['peak_bytes'] / 2**20:9.1f} MiB   wall {r['wall_s']:7.2f} s   CPU {r['cpu_s']:7.2f} s",
              flush=True)
    res["load_avg_end"] = load_avg()
    runs = res["runs"]
    if "logits" in runs and "fused" in runs:
        res["peak_ratio"] = runs["logits"]["peak_bytes"] / max(1, runs["fused"]["peak_bytes"])
        print(f"peak logits / fused = {res['peak_ratio']:.1f}x (logits alone: {res['logits_bytes'] / 2**20:.0f} MiB)")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
