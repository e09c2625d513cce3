"""What every preflight check shares: the mode, the device, the user's overrides, a scratch
directory, and the jobs it runs (the demo job plus the check's own settings, then the user's)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_gspo.config import JobConfig, apply_overrides, from_dict, load_job_config, load_yaml, parse_overrides
from megatron_gspo.preflight.runner import Skip
from megatron_gspo.train import DEMO_CONFIG

# Every preflight job: one RL step from scratch (no SFT warm start), nothing written outside the
# scratch directory. digit_match is a dense reward, so a random model already gets non-zero
# advantages and the GSPO update moves weights (exact_match gives all-zero rewards: loss 0).
# One RL step, no held-out evaluation (the demo job evaluates after its last step; here it would only
# add generation time to what the speed items measure).
ONE_STEP = ["train.num_steps=1", "train.sft_steps=0", "train.tensorboard=false", "reward.name=digit_match",
            "eval.interval=0"]
# --quick: a rollout of 4 prompts x 4 samples (16 rows: two minibatches on up to 8 DP ranks).
QUICK_ROLLOUT = ["train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "train.micro_batch_size=8"]

NO_CUDA = "no CUDA"
NO_TE = "Transformer Engine not installed"


@dataclass
class Context:
    quick: bool
    overrides: list[str]  # the command line's section.key=value, applied last to every job
    workdir: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _memo: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def job(self, name: str, *overrides: str, model: Optional[dict] = None) -> JobConfig:
        """The demo job + ONE_STEP (+ QUICK_ROLLOUT) + ``overrides`` + the user's, writing into
        workdir/<name>. ``model`` replaces the demo's model section (a preset and its changes)."""
        data = load_yaml(DEMO_CONFIG)
        if model is not None:
            data["model"] = dict(model)
        ours = ONE_STEP + (QUICK_ROLLOUT if self.quick else []) + list(overrides)
        ours.append(f"train.output_dir={os.path.join(self.workdir, name)}")
        data = apply_overrides(data, parse_overrides(ours))
        data = apply_overrides(data, parse_overrides(list(self.overrides)))
        return from_dict(JobConfig, data)

    def memo(self, key: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` once; later checks reading the same measurement get its result (or its error
        again: a failed measurement fails every check that reports from it)."""
        if key not in self._memo:
            try:
                self._memo[key] = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - replayed to each reader below
                self._memo[key] = ("error", e)
        kind, val = self._memo[key]
        if kind == "error":
            raise val
        return val


def validate_overrides(overrides: list[str]) -> JobConfig:
    """The user's overrides on the demo job, built once up front: an unknown key or a bad value
    raises ConfigError (exit 2) before any check runs."""
    return load_job_config(DEMO_CONFIG, list(overrides))


def need_cuda(ctx: Context) -> None:
    if not ctx.cuda:
        raise Skip(NO_CUDA)


def need_te(ctx: Context) -> None:
    """Skip unless Transformer Engine can run here (CUDA first: that is the reason on a CPU box)."""
    from megatron_gspo.runtime.compat import have_te

    need_cuda(ctx)
    if not have_te():
        raise Skip(NO_TE)


def need_fp8(ctx: Context) -> None:
    need_te(ctx)
    cap = torch.cuda.get_device_capability(ctx.device)
    if cap < (8, 9):  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
        raise Skip(f"GPU compute capability {cap[0]}.{cap[1]} < 8.9: no FP8 tensor cores")


def bf16_support(device: torch.device) -> Optional[str]:
    """None if bf16 matmuls run on ``device``, else why not."""
    if device.type == "cuda":
        return None if torch.cuda.is_bf16_supported() else "this GPU has no bf16 support"
    try:
        a = torch.ones(8, 8, dtype=torch.bfloat16, device=device)
        if float((a @ a)[0, 0]) != 8.0:
            return "bf16 matmul on this CPU gives wrong results"
    except Exception as e:  # noqa: BLE001 - no kernel for this CPU in this torch build
        return f"no bf16 matmul on this CPU ({type(e).__name__}: {e})"
    return None


def need_bf16(ctx: Context) -> None:
    why = bf16_support(ctx.device)
    if why:
        raise Skip(why)
