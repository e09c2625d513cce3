"""A CPU job where Transformer Engine is installed (an NGC container asked for parallel.device=cpu, this
tier's venv): the local spec on the CPU trains. megatron's optimizer takes TE's FusedAdam and multi-tensor
kernels whenever TE imports, CUDA kernels that failed the first optimizer step of such a job ("CUDA driver
version is insufficient"); compat.optimizer_context gives CPU jobs torch's Adam and megatron's own kernels
(found by this tier)."""

import math

import torch

from job_runner import run_job_rows
from megatron_gspo.config import load_job_config

JOB = ["parallel.device=cpu", "train.num_steps=2", "train.sft_steps=1", "train.sft_batch_size=8", "eval.interval=0",
       "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "generation.max_new_tokens=4",
       "train.micro_batch_size=8", "train.tensorboard=false", "reward.name=digit_match"]


def test_a_cpu_job_trains_where_transformer_engine_is_installed(tmp_path):
    import transformer_engine.pytorch  # noqa: F401  (this tier: TE imports here)

    from megatron_gspo.runtime import compat

    assert compat.have_te() and "cpu_optimizer_without_te_kernels" in compat.needed(compat.environment(torch.device("cpu")))
    rows = run_job_rows(load_job_config(None, JOB + [f"train.output_dir={tmp_path}"]))
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss/loss"]) and r["train/grad_norm"] > 0 and not r["train/skipped_updates"]
