"""One run of the comparison, in this process: ``python -m experiments.compare _worker [...] config [overrides]``.

The orchestrator (run.py) starts it once to build the shared initial model (``--save-init DIR``)
and once per variant and seed; under torchrun every rank runs it. A variant's run is exactly
``megatron_gspo.train``'s: the packaged ``Trainer`` and ``run_trainer``, with the routing probe
attached as a hook (``--probe PATH``).
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger("megatron_gspo")


def worker_main(argv: list[str]) -> int:
    from megatron_gspo.config import load_job_config
    from megatron_gspo.train import Trainer, configure_logging, run_trainer

    p = argparse.ArgumentParser(prog="python -m experiments.compare _worker")
    p.add_argument("--probe", default=None, help="write the routing probe's rows (probe.jsonl) to this path")
    p.add_argument("--probe-rows", type=int, default=64)
    p.add_argument("--save-init", default=None, metavar="DIR",
                   help="build the initial model (SFT warm start when train.sft_steps > 0), save it to DIR, stop")
    p.add_argument("config")
    args, overrides = p.parse_known_args(argv)
    cfg = load_job_config(args.config, overrides)
    configure_logging(cfg)  # a run's log, as megatron_gspo.train's (the library configures no logging)
    if args.save_init:
        return save_initial_model(cfg, args.save_init)
    from experiments.compare.probe import RoutingProbe

    hooks = [RoutingProbe(args.probe, args.probe_rows)] if args.probe else []
    return run_trainer(Trainer(cfg, hooks=hooks))


def save_initial_model(cfg, path: str) -> int:
    """The model every variant starts from: the job's weights (seeded init or checkpoint.load), then
    the SFT warm start when ``train.sft_steps > 0``, saved with ``checkpoint.save_model``."""
    from megatron_gspo.runtime import parallel
    from megatron_gspo.checkpoint import save_model
    from megatron_gspo.trainer.sft import sft_warm_start
    from megatron_gspo.train import Trainer

    trainer = Trainer(cfg)
    try:
        if cfg.train.sft_steps > 0:
            sft_warm_start(trainer.ddp, trainer.state, cfg, trainer.sampler.dataset, trainer.tokenizer,
                           trainer.prepare.gen_cfg.pad_id)
        save_model(trainer.ddp, path)
        log.info("initial model saved to %s (SFT steps: %d)", path, cfg.train.sft_steps)
    finally:
        trainer.close()
        parallel.destroy()
    return 0
