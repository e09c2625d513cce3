"""One held-out evaluation of a job's initial weights, and the rows each rank generated for it.

    torchrun --nproc-per-node N eval_shard.py --out DIR -- overrides...

Builds the job's Trainer (no step is trained: the initial weights are the same under every layout), runs
``trainer.evaluator.run(1)`` and writes DIR/eval.rank<R>.json: the eval/* metrics this rank returned, and
the prompts of every call the evaluation made (``generate`` of a single-turn job, the multi-turn rollout's
``run``), in order: its greedy pass's share, then its sampled pass's; and the tokens of every row it generated,
by pass seed and row key. With --stop-at N, rank 1 (or 0 on one
rank) is asked to stop at its N-th stop-flag read and the script writes the Cancelled's text instead.
"""

import argparse
import json
import os
import sys

from megatron_gspo.runtime import parallel
from megatron_gspo.runtime.stop import Cancelled
from megatron_gspo.config import load_job_config
from megatron_gspo.train import DEMO_CONFIG, Trainer


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-at", type=int, default=0)
    a = ap.parse_args(argv[:split])
    cfg = load_job_config(DEMO_CONFIG, argv[split + 1:] + [f"train.output_dir={a.out}", "train.tensorboard=false"])
    os.makedirs(a.out, exist_ok=True)
    trainer = Trainer(cfg)
    try:
        ev, st = trainer.evaluator, trainer.state
        calls = []
        owner, name = (ev.multiturn, "run") if ev.multiturn is not None else (ev.generator, "generate")
        real = getattr(owner, name)

        samples = {}  # "pass seed/row key" -> the row's tokens (prompt and response; a multi-turn row's whole stream)

        def counted(prompts, *args, **kw):
            calls.append(len(prompts))
            out = real(prompts, *args, **kw)
            seed, keys = (args[1], args[0]) if name == "run" else (kw["seed"], kw["row_keys"])
            for key, row, n in zip(keys, out.tokens.tolist(), (out.prompt_lengths + out.response_lengths).tolist()):
                samples[f"{seed}/{key}"] = row[:n]
            return out

        setattr(owner, name, counted)
        reads = []

        def should_stop():
            reads.append(1)
            return st.rank == min(1, st.world_size - 1) and len(reads) >= a.stop_at > 0

        result = {"rank": st.rank, "dp_rank": st.dp_rank, "tp_rank": st.tp_rank,
                  "shares_rollout_generator": ev.generator is getattr(trainer.source, "generator", None),
                  "shares_rollout_multiturn": ev.multiturn is getattr(trainer.source, "multiturn", None)}
        try:
            result["metrics"] = ev.run(1, should_stop=should_stop)
        except Cancelled as e:
            result["cancelled"] = str(e)
        result["rows"], result["samples"] = calls, samples
        with open(os.path.join(a.out, f"eval.rank{st.rank}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
    finally:
        trainer.close()
        parallel.destroy()


if __name__ == "__main__":
    main()
