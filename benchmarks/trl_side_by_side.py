"""One RL step of equal work: megatron-gspo's trainer next to TRL's GRPOTrainer in GSPO mode.

Both trainers get what a new user would give them, on the same work:

* the same model: a random-init Hugging Face ``Qwen3MoeForCausalLM`` of the chosen shape (TRL uses
  it as is; we convert it with ``checkpoints_tools.hf_to_megatron`` and load it, so the weights are
  the same), fp32;
* the same tokenizer (a word-level ``tokenizer.json`` with one token per vocabulary id) and the same
  prompts (``--prompt-len`` tokens each, read in file order on both sides);
* the same RL step: ``--prompts`` prompts x ``--samples`` samples, responses forced to exactly
  ``--new-tokens`` tokens (ours ``generation.ignore_eos``; TRL ``min_new_tokens``), temperature 1,
  two minibatches (two optimizer steps) per rollout, GSPO clipping 3e-4 / 4e-4, no reference model
  (beta / kl_coef 0), AdamW lr 1e-6, gradient clipping 1.0, the same reward function;
* TRL: ``importance_sampling_level="sequence"``, no vLLM, ``steps_per_generation=2`` with one
  micro-batch per optimizer step (so it computes the old log-probs in a separate pass, as the
  second minibatch needs them). Ours: its defaults (old log-probs taken from the rollout, see
  docs/algorithms.md).

Runs alternate (ours, TRL, ours, TRL, ...), each in a fresh process with ``--threads`` torch
threads; each run does ``--warmup`` untimed RL steps then ``--steps`` timed ones. Reported per RL
step: wall seconds and process CPU seconds (medians over every timed step of every run), split into
the rollout phase (generation, rewards and, for TRL, the old-log-prob pass) and the updates, plus
the pure generation time; the load average before and after. TRL is a benchmark-only dependency
(``pip install -e ".[bench]"``), never one of the package.

    python -m benchmarks.trl_side_by_side --shape bench --json benchmarks/results/trl_bench.json
    python -m benchmarks.trl_side_by_side --shape tiny --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Optional

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megatron_gspo.runtime.sysinfo import load_avg, machine_info, package_version  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Model shapes (our ModelConfig field names). "bench" is docs/performance.md's benchmark model.
SHAPES = {
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                 vocab_size=128, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                 max_position_embeddings=512, rotary_base=10000.0),
    "bench": dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2, kv_channels=32,
                  vocab_size=8192, num_moe_experts=16, moe_router_topk=4, moe_ffn_hidden_size=128,
                  max_position_embeddings=1024, rotary_base=1_000_000.0),
}
DEFAULT_NEW_TOKENS = {"tiny": 16, "bench": 64}
SPECIALS = ["<pad>", "<eos>", "<unk>"]


# ----------------------------------------------------------------------------------------------
# The shared task: word-level tokens "w<id>", reward = share of even ids in the response
# ----------------------------------------------------------------------------------------------


def _even_share(text: str) -> float:
    words = [w for w in text.split() if w.startswith("w") and w[1:].isdigit()]
    return sum(int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1)


def even_token_reward(prompt: str, response: str, answer: Optional[str], **_) -> float:
    """Our reward plug-in (``reward.name=benchmarks.trl_side_by_side:even_token_reward``)."""
    return _even_share(response)


def even_token_reward_trl(completions, **_) -> list[float]:
    """The same reward in TRL's signature."""
    return [_even_share(c) for c in completions]


def make_tokenizer(directory: str, vocab: int) -> None:
    """A word-level HF tokenizer with exactly ``vocab`` ids: the specials, then "w3" ... "w<vocab-1>"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {tok: i for i, tok in enumerate(SPECIALS)}
    ids.update({f"w{i}": i for i in range(len(SPECIALS), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(directory)


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIALS), vocab, (n, length), generator=g)
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


def prepare(workdir: str, args) -> dict:
    """Tokenizer, prompts (JSONL), HF model and its megatron conversion under ``workdir``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from checkpoints_tools import hf_to_megatron
    from checkpoints_tools.qwen3_moe import Qwen3MoeMapping
    from megatron_gspo.config import model_config_from_preset

    shape = SHAPES[args.shape]
    cfg = model_config_from_preset("tiny", **shape)
    paths = {k: os.path.join(workdir, k) for k in ("tokenizer", "hf", "mcore")}
    paths["data"] = os.path.join(workdir, "prompts.jsonl")
    make_tokenizer(paths["tokenizer"], shape["vocab_size"])
    n_prompts = args.prompts * (args.warmup + args.steps)
    with open(paths["data"], "w", encoding="utf-8") as f:
        for p in make_prompts(n_prompts, args.prompt_len, shape["vocab_size"], args.seed):
            f.write(json.dumps({"prompt": p}) + "\n")
    torch.manual_seed(args.seed)
    hf_cfg = Qwen3MoeConfig.from_dict(Qwen3MoeMapping(cfg).hf_config(None, torch.float32))
    model = Qwen3MoeForCausalLM(hf_cfg)
    model.save_pretrained(paths["hf"])
    hf_to_megatron.convert(paths["hf"], paths["mcore"], force=True, dtype="fp32", quiet=True)
    return paths


# ----------------------------------------------------------------------------------------------
# Workers (one process per run)
# ----------------------------------------------------------------------------------------------


def _step_record(t0: float, c0: float, tr: float, cr: float, t1: float, c1: float, gen_s: float,
                 gen_tokens: int) -> dict:
    """One RL step's times, and the response tokens it sampled (the work both sides must do alike)."""
    return {"wall_s": t1 - t0, "cpu_s": c1 - c0, "rollout_wall_s": tr - t0, "rollout_cpu_s": cr - c0,
            "update_wall_s": t1 - tr, "update_cpu_s": c1 - cr, "generate_wall_s": gen_s, "gen_tokens": gen_tokens}


def worker_ours(args, paths: dict) -> list[dict]:
    from megatron_gspo.config import load_job_config
    from megatron_gspo.runtime.logger import setup_logging
    from megatron_gspo.trainer.hooks import TrainerHook
    from megatron_gspo.train import DEMO_CONFIG
    from megatron_gspo.trainer.loop import Trainer

    shape = SHAPES[args.shape]
    over = [f"model.{k}={v}" for k, v in shape.items()] + [
        "tokenizer.type=hf", f"tokenizer.path={paths['tokenizer']}",
        f"data.source={paths['data']}", "data.answer_key=null", "data.shuffle=false", "data.add_special_tokens=false",
        f"data.max_prompt_length={args.prompt_len}",
        "reward.name=benchmarks.trl_side_by_side:even_token_reward",
        f"checkpoint.load={paths['mcore']}",
        "loss.name=gspo", "loss.kl_coef=0.0",
        f"generation.n_samples_per_prompt={args.samples}", f"generation.max_new_tokens={args.new_tokens}",
        "generation.ignore_eos=true", "generation.temperature=1.0",
        f"train.prompts_per_step={args.prompts}", "train.num_minibatches=2",
        f"train.micro_batch_size={args.prompts * args.samples // 2}", "train.sft_steps=0",
        f"train.num_steps={args.warmup + args.steps}", f"train.output_dir={paths['out']}",
        "optimizer.lr=1e-6", "optimizer.lr_warmup_steps=0", "optimizer.lr_decay_style=constant",
        "optimizer.weight_decay=0.0", "optimizer.clip_grad=1.0",
        "eval.interval=0",  # TRL evaluates nothing either
    ] + list(args.ours_override)
    records: list[dict] = []

    class Clock(TrainerHook):
        def at_step_start(self, trainer) -> None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def after_rollout(self, trainer, batch) -> None:
            self.tr, self.cr = time.perf_counter(), time.process_time()

        def after_step(self, trainer, metrics: dict) -> None:
            t1, c1 = time.perf_counter(), time.process_time()
            records.append(_step_record(self.t0, self.c0, self.tr, self.cr, t1, c1, float(metrics["perf/generate_s"]),
                                        int(metrics["perf/gen_tokens"])))

    setup_logging(0)  # the trainer's progress lines, as megatron_gspo.train prints them
    trainer = Trainer(load_job_config(DEMO_CONFIG, over), hooks=[Clock()])
    try:
        trainer.run()
    finally:
        trainer.close()
    return records[args.warmup:]


def worker_trl(args, paths: dict) -> list[dict]:
    import datasets
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    with open(paths["data"], encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    model = Qwen3MoeForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir=paths["out"], use_cpu=True, bf16=False, fp16=False, seed=args.seed, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        per_device_train_batch_size=args.prompts * args.samples // 2, gradient_accumulation_steps=1,
        steps_per_generation=2, num_iterations=1, num_generations=args.samples,
        max_completion_length=args.new_tokens, generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=1.0, top_p=1.0, importance_sampling_level="sequence", loss_type="grpo",
        epsilon=3e-4, epsilon_high=4e-4, beta=0.0, learning_rate=1e-6, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=2 * (args.warmup + args.steps),
        shuffle_dataset=False, use_vllm=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=even_token_reward_trl, args=cfg,
                          train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in prompts]),
                          processing_class=tok)
    marks: dict[str, float] = {}
    gen_s: list[float] = []

    def timed(fn, key: Optional[str]):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if key is None:
                gen_s.append(time.perf_counter() - t)
            else:
                marks["tr"], marks["cr"] = time.perf_counter(), time.process_time()
                marks["tokens"] = int(out["completion_mask"].sum())  # the step's whole generation batch
            return out
        return wrapper

    trainer._generate_single_turn = timed(trainer._generate_single_turn, None)
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "rollout")
    records: list[dict] = []

    class Clock(TrainerCallback):  # an RL step = the two optimizer steps of one generation batch
        def on_step_begin(self, a, state, control, **kw):
            if state.global_step % 2 == 0:
                marks["t0"], marks["c0"] = time.perf_counter(), time.process_time()
                gen_s.clear()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step % 2 == 0:
                records.append(_step_record(marks["t0"], marks["c0"], marks["tr"], marks["cr"], time.perf_counter(),
                                            time.process_time(), sum(gen_s), marks["tokens"]))

    trainer.add_callback(Clock())
    trainer.train()
    return records[args.warmup:]


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def _median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def summarize(records: list[dict]) -> dict:
    keys = ("wall_s", "cpu_s", "rollout_wall_s", "rollout_cpu_s", "update_wall_s", "update_cpu_s", "generate_wall_s")
    return {"steps": len(records), **{k: round(_median(records, k), 4) for k in keys}}


def run_side(side: str, args, paths: dict, run_idx: int) -> list[dict]:
    """One run of a side in a fresh process. "baseline" is our side from the checkout --baseline-repo
    (another commit of this repository: before / after a change in the same run)."""
    out = os.path.join(paths["work"], f"{side}_{run_idx}.json")
    repo = os.path.abspath(args.baseline_repo) if side == "baseline" else REPO
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "benchmarks.trl_side_by_side", "--worker", "ours" if side == "baseline" else side,
           "--workdir", paths["work"], "--result", out] + args.passthrough
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{side} run {run_idx} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def format_markdown(res: dict) -> str:
    o, t = res["ours"], res["trl"]
    rows = [("RL step", "wall_s", "cpu_s"), ("rollout phase (generation, rewards, TRL: old log-probs)", "rollout_wall_s",
             "rollout_cpu_s"), ("updates (2 minibatches)", "update_wall_s", "update_cpu_s"),
            ("of which pure generation", "generate_wall_s", None)]
    lines = ["| per RL step (median) | megatron-gspo | TRL GRPOTrainer (GSPO) | speedup |", "|---|---|---|---|"]
    for name, wk, ck in rows:
        cpu = lambda s: f", CPU {s[ck]:.3f} s" if ck else ""  # noqa: E731
        lines.append(f"| {name} | {o[wk]:.3f} s{cpu(o)} | {t[wk]:.3f} s{cpu(t)} | **{t[wk] / o[wk]:.2f}x**"
                     + (f" (CPU {t[ck] / o[ck]:.2f}x)" if ck else "") + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=None, help="forced response length (default: tiny 16, bench 64)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed RL steps per run")
    p.add_argument("--rounds", type=int, default=2, help="alternating (ours, TRL) pairs of runs")
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sides", default="ours,trl", help="comma list of sides to run (ours, trl)")
    p.add_argument("--ours-override", nargs="*", default=[], help="extra key=value overrides for our trainer")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--baseline-repo", default=None,
                   help="a checkout of another commit: its trainer runs as side 'baseline' (add it to --sides)")
    p.add_argument("--worker", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.new_tokens is None:
        args.new_tokens = DEFAULT_NEW_TOKENS[args.shape]
    if args.prompts * args.samples % 2:
        p.error("--prompts x --samples must be even (two minibatches)")
    raw = list(sys.argv[1:] if argv is None else argv)
    args.passthrough = [a for a in raw if a not in ("--json", "--baseline-repo")]
    for v in (args.json, args.baseline_repo):
        if v and v in args.passthrough:
            args.passthrough.remove(v)
    if not args.worker and ("baseline" in args.sides) != bool(args.baseline_repo):
        p.error("--sides ...,baseline and --baseline-repo go together")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        paths = json.load(open(os.path.join(args.workdir, "paths.json"), encoding="utf-8"))
        paths["out"] = os.path.join(args.workdir, f"out_{args.worker}_{os.getpid()}")
        records = (worker_ours if args.worker == "ours" else worker_trl)(args, paths)
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(records, f)
        return 0
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if "trl" in sides and package_version("trl") is None:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]' (a benchmark-only extra)")
    with tempfile.TemporaryDirectory(prefix="trl_side_by_side_") as work:
        paths = prepare(work, args)
        paths["work"] = work
        with open(os.path.join(work, "paths.json"), "w", encoding="utf-8") as f:
            json.dump(paths, f)
        res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "machine": machine_info("cpu"), "threads": args.threads, "load_avg_start": load_avg(),
                     "versions": {k: package_version(k) for k in ("torch", "trl", "transformers", "megatron-core")},
                     "config": {k: getattr(args, k) for k in ("shape", "prompts", "samples", "prompt_len", "new_tokens",
                                                              "warmup", "steps", "rounds", "seed")},
                     "model": SHAPES[args.shape], "runs": {s: [] for s in sides}}
        for r in range(args.rounds):
            for side in sides:  # alternate: both sides see the same stretch of machine load
                t = time.perf_counter()
                recs = run_side(side, args, paths, r)
                res["runs"][side].append(recs)
                print(f"round {r + 1}/{args.rounds} {side}: median RL step {summarize(recs)['wall_s']:.3f} s "
                      f"({time.perf_counter() - t:.0f} s for the run, load {load_avg()})", flush=True)
        res["load_avg_end"] = load_avg()
        for s in sides:
            res[s] = summarize([rec for run in res["runs"][s] for rec in run])
    if {"ours", "trl"} <= set(sides):
        res["speedup"] = round(res["trl"]["wall_s"] / res["ours"]["wall_s"], 3)
        res["speedup_cpu"] = round(res["trl"]["cpu_s"] / res["ours"]["cpu_s"], 3)
        print(format_markdown(res))
    if "baseline" in sides:
        res["baseline_repo"] = os.path.abspath(args.baseline_repo)
        res["ours_vs_baseline"] = {k: round(res["baseline"][k] / res["ours"][k], 3)
                                   for k in ("wall_s", "cpu_s", "rollout_cpu_s", "update_cpu_s")}
        print(f"ours vs baseline ({res['baseline_repo']}): {res['ours_vs_baseline']}")
    print(json.dumps({s: res[s] for s in sides}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
