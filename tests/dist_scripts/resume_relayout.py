"""Resume a trainer checkpoint under another layout and save it again at once, with no step in
between: every tensor (weights and Adam moments, both stored under global keys) must come back
bit-identical, whatever TP / EP / DP the saving and the resuming runs used.

usage: torchrun ... resume_relayout.py --src ROOT --dst ROOT [config overrides ...]
"""

import argparse


from megatron_gspo.runtime import parallel
from megatron_gspo.config import load_job_config
from megatron_gspo.train import DEMO_CONFIG, Trainer, configure_logging
from megatron_gspo.trainer.optim import setup_optimizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--src", required=True)
    p.add_argument("--dst", required=True)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    cfg = load_job_config(DEMO_CONFIG, a.overrides + [f"checkpoint.save={a.src}", "checkpoint.resume=true"])
    configure_logging(cfg)
    trainer = Trainer(cfg)
    trainer.optimizer, trainer.scheduler, trainer.step = setup_optimizer(  # loads weights, Adam moments, scheduler and data position
        trainer.cfg, trainer.state, trainer.ddp, trainer.checkpoints, trainer.sampler, trainer.ref_model, trainer.step)
    assert trainer.step > 0, "nothing was resumed"
    try:
        cfg.checkpoint.save = a.dst
        trainer.save()
        st = trainer.state
        print(f"RELAYOUT rank {st.rank} tp={st.tp} ep={st.ep} dp={st.dp} step={trainer.step}", flush=True)
    finally:
        trainer.close()
        parallel.destroy()


if __name__ == "__main__":
    main()
