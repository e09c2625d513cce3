"""An out-of-memory error in a phase of the RL step names the phase, the shapes, the config knobs and
the memory estimate (megatron_gspo/oom.py) and ends the job as a user error (exit 2, one line), not a
CUDA allocator trace. The GPU's error is injected: torch.OutOfMemoryError raised where the phase's
forward runs."""

import os

import pytest
import torch

from megatron_gspo.errors import USER_ERRORS, MemoryBudgetError

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = [
    "parallel.device=cpu",
    "train.num_steps=1", "train.prompts_per_step=2", "generation.n_samples_per_prompt=2",
    "generation.max_new_tokens=4", "train.micro_batch_size=2", "train.num_minibatches=1", "train.tensorboard=false",
    "eval.interval=0", "train.sft_steps=0", f"reward.name={HERE}/reward_plugins.py:digit_fraction",
]
CUDA_OOM = ("CUDA out of memory. Tried to allocate 9.35 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.2 GiB is free. Of the allocated memory 67.4 GiB is allocated by PyTorch")


def _raise_oom(*a, **k):
    raise torch.OutOfMemoryError(CUDA_OOM)


@pytest.mark.parametrize("where,knobs", [
    ("training", ["train.micro_batch_size=2 (lower it)", "train.max_tokens_per_micro_batch=null"]),
    ("generation", ["generation.max_new_tokens=4 (lower it)", "train.prompts_per_step=2"]),
    ("old_logprobs", ["train.micro_batch_size=2 (lower it)"]),
])
def test_oom_names_the_phase_knobs_and_estimate(tmp_path, monkeypatch, capfd, where, knobs):
    import megatron_gspo.rollout as rollout
    import megatron_gspo.trainer as trainer_mod
    from megatron_gspo.train import main

    assert MemoryBudgetError in USER_ERRORS
    if where == "training":
        monkeypatch.setattr(trainer_mod, "forward_logprobs", _raise_oom)
    elif where == "generation":
        monkeypatch.setattr(rollout, "generate", _raise_oom)
    else:
        monkeypatch.setattr(rollout, "forward_logprobs", _raise_oom)
    extra = ["train.old_logprobs=recompute"] if where == "old_logprobs" else []
    rc = main(JOB + extra + [f"train.output_dir={tmp_path}"])
    assert rc == 2
    out = capfd.readouterr()
    text = out.out + out.err
    errors = [line[line.index("error: "):] for line in text.splitlines() if "error: " in line]
    assert len(errors) == 1 and "Traceback" not in text, text
    msg = errors[0]
    phase = {"training": "training forward/backward", "generation": "generation",
             "old_logprobs": "old-log-prob / reference pass"}[where]
    assert msg.startswith(f"error: out of memory in the {phase} ("), msg
    assert "Tried to allocate 9.35 GiB" in msg and "estimate for this config:" in msg and "GiB per GPU" in msg
    for k in knobs:
        assert k in msg, msg
    assert "rows" in msg  # the shapes that were running


def test_describe_survives_a_config_it_cannot_estimate():
    from megatron_gspo.config import load_job_config
    from megatron_gspo.oom import describe

    cfg = load_job_config(None, ["train.micro_batch_size=64"])
    msg = describe("training", cfg, 0, "cuda:0", "micro-batch of 64 rows x 575 tokens", torch.OutOfMemoryError(CUDA_OOM))
    assert "no estimate for this config" in msg and "train.micro_batch_size=64" in msg
    msg = describe("generation", cfg, 1, "cuda:0", "8 rows", torch.OutOfMemoryError(CUDA_OOM))
    assert "estimate for this config:" in msg and "generation.max_new_tokens=" in msg
