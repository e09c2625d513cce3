"""Save -> resume in the spec that runs here (the Transformer Engine spec in the NGC container, the
local spec elsewhere), through the project's checkpoint manager.

``checkpoint.resume`` runs the demo job's one-step shape for two steps straight (saving after each), and
again as one step, a stop, and ``checkpoint.resume=true`` for the second: the resumed second step's
loss, gradient norm and reward must be the uninterrupted run's, to the bit in ``train.deterministic``
mode (megatron's deterministic kernels, seeded data and sampling)."""

from __future__ import annotations

import os

from megatron_gspo.preflight.context import Context

KEYS = ("loss/loss", "train/grad_norm", "rollout/reward_mean", "loss/seq_ratio/max")


def check_resume(ctx: Context):
    from megatron_gspo.model.gpt import model_summary
    from megatron_gspo.preflight.training import run_steps

    ckpt = os.path.join(ctx.workdir, "resume_ckpt")
    common = ["train.deterministic=true", "checkpoint.save_interval=1"]
    straight = ctx.job("resume_straight", "train.num_steps=2", *common,
                       f"checkpoint.save={os.path.join(ctx.workdir, 'straight_ckpt')}")
    want, _ = run_steps(straight)
    run_steps(ctx.job("resume", "train.num_steps=1", *common, f"checkpoint.save={ckpt}"))
    resumed = ctx.job("resume", "train.num_steps=2", *common, f"checkpoint.save={ckpt}", "checkpoint.resume=true")
    got, _ = run_steps(resumed)
    diffs = {k: abs(got[k] - want[k]) for k in KEYS}
    data = {"model": model_summary(resumed.model, ctx.device), "straight": {k: want[k] for k in KEYS},
            "resumed": {k: got[k] for k in KEYS}, "abs_diff": diffs}
    if any(d != 0 for d in diffs.values()):
        raise RuntimeError("the resumed step differs from the uninterrupted one: "
                           + ", ".join(f"{k} {got[k]:.6g} vs {want[k]:.6g}" for k in KEYS if diffs[k]))
    return f"step 2 after save -> resume equals the uninterrupted step 2 bit for bit ({data['model']})", data
