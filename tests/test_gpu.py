"""Checks that only mean something on a CUDA device (marked ``gpu``: skipped where there is none).

What the first H100 run met, as tests: the default job's first forward on CUDA without Transformer
Engine (NameError in megatron's MoE router), a CPU job on a GPU machine (tools that built the model
on cuda and fed it CPU tokens), bf16 rounding turning an on-policy minibatch into clipping, and GPU
kernels that are not deterministic by default. The CPU suite checks each decision behind these
(tests/test_compat.py, test_on_policy.py, test_jobs_in_one_process.py); these check the GPU itself.
"""

import pytest
import torch

from megatron_gspo.runtime import parallel
from megatron_gspo.config import ON_POLICY_RATIO_TOLERANCE, load_job_config
from job_runner import run_job_rows

pytestmark = pytest.mark.gpu

SHORT = ["train.num_steps=2", "train.sft_steps=0", "eval.interval=0", "train.tensorboard=false",
         "train.prompts_per_step=8", "reward.name=digit_match", "generation.max_new_tokens=8"]


def _trainer_device(cfg):
    from megatron_gspo.trainer.loop import Trainer

    t = Trainer(cfg)
    try:
        return t.state.device, next(t.model.parameters()).device, t.run()["history"]
    finally:
        t.close()
        parallel.destroy()


def test_the_default_job_runs_on_cuda(tmp_path):
    """The README's job (shortened) on the GPU, Transformer Engine or not."""
    state_dev, param_dev, history = _trainer_device(load_job_config(None, SHORT + [f"train.output_dir={tmp_path}"]))
    assert state_dev.type == param_dev.type == "cuda"
    assert all(torch.isfinite(torch.tensor(h["loss/loss"])) and h["train/grad_norm"] > 0 for h in history)


def test_a_cpu_job_on_a_gpu_machine(tmp_path):
    state_dev, param_dev, history = _trainer_device(load_job_config(None, SHORT + ["parallel.device=cpu",
                                                                                   f"train.output_dir={tmp_path}"]))
    assert state_dev.type == param_dev.type == "cpu" and len(history) == 2


def test_bf16_first_minibatch_is_on_policy_on_the_gpu(tmp_path):
    rows = run_job_rows(load_job_config(None, SHORT + ["model.precision=bf16", f"train.output_dir={tmp_path}"]))
    for r in rows:
        assert r["loss/onpolicy/seq_ratio_dev_max"] <= ON_POLICY_RATIO_TOLERANCE and r["loss/onpolicy/clip_frac"] == 0


def test_deterministic_mode_repeats_a_run_bit_for_bit(tmp_path):
    """Two identical bf16 jobs in deterministic mode: the same metrics and weights, to the bit."""
    runs = []
    for name in ("a", "b"):
        cfg = load_job_config(None, SHORT + ["model.precision=bf16", "train.deterministic=true",
                                             f"train.output_dir={tmp_path}/{name}"])
        runs.append([{k: v for k, v in r.items() if not k.startswith("perf/")} for r in run_job_rows(cfg)])
    assert runs[0] == runs[1]
