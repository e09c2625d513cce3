"""Several jobs in one process (the preflight, notebooks, experiments, this test session): a job leaves
nothing of itself in megatron-core's process-wide state, so the next one may differ in depth, width,
expert count and device.

Seen on an H100: megatron's aux-loss tracker kept the first job's layer count, and the preflight's
second job (a deeper model) died with ``IndexError`` in ``save_to_aux_losses_tracker``.
"""

import json
import os

import pytest
import torch

from megatron_gspo.runtime import parallel
from megatron_gspo.config import load_job_config

# short jobs of the demo's task; three shapes, shallow first (a stale tracker is too short for the next)
BASE = ["parallel.device=cpu", "train.num_steps=2", "train.sft_steps=0", "train.tensorboard=false", "eval.interval=0",
        "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "generation.max_new_tokens=8",
        "train.micro_batch_size=8",
        "reward.name=digit_match"]
SHAPES = {
    "tiny": [],
    "deeper_wider_more_experts": ["model.num_layers=4", "model.hidden_size=96", "model.num_moe_experts=8",
                                  "model.moe_ffn_hidden_size=48", "model.moe_router_topk=2"],
    "grpo_r2_replay": ["model.num_layers=3", "model.num_moe_experts=6", "loss.name=grpo", "train.routing_replay=R2"],
}


def megatron_globals() -> dict:
    """What megatron-core keeps per process that a job fills."""
    from megatron.core import parallel_state as mps
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return {
        "aux_loss_tracker": sorted(moe_utils.get_moe_layer_wise_logging_tracker()),
        "router_replay_instances": len(RouterReplay.global_router_replay_instances),
        "aux_loss_scale": moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale,
        "model_parallel": mps.model_parallel_is_initialized(),
        "memory_buffer": mps._GLOBAL_MEMORY_BUFFER,
        "process_group": torch.distributed.is_initialized(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO")},
    }


CLEAN = {"aux_loss_tracker": [], "router_replay_instances": 0, "aux_loss_scale": None, "model_parallel": False,
         "memory_buffer": None, "process_group": False, "deterministic": False,
         "env": {"CUBLAS_WORKSPACE_CONFIG": None, "NCCL_ALGO": None, "NVTE_ALLOW_NONDETERMINISTIC_ALGO": None}}


def _run(overrides, out_dir):
    from megatron_gspo.trainer.loop import Trainer

    t = Trainer(load_job_config(None, BASE + overrides + [f"train.output_dir={out_dir}"]))
    try:
        history = t.run()["history"]
    finally:
        t.close()
    return t, history


def test_jobs_of_different_shapes_run_one_after_another(tmp_path, monkeypatch):
    for k in CLEAN["env"]:
        monkeypatch.delenv(k, raising=False)
    assert megatron_globals() == CLEAN
    try:
        for name, overrides in SHAPES.items():
            trainer, history = _run(overrides + (["train.deterministic=true"] if name == "tiny" else []),
                                    tmp_path / name)
            cfg = trainer.cfg.model
            assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["loss/loss"])) for h in history), name
            # closed: megatron's per-model state is gone, the process groups are still up (the caller's)
            left = megatron_globals()
            assert left["aux_loss_tracker"] == [] and left["router_replay_instances"] == 0, (name, left)
            assert left["aux_loss_scale"] is None and left["deterministic"] is False, (name, left)
            assert left["env"] == CLEAN["env"], (name, left)
            assert left["process_group"] and cfg.num_layers == len(trainer.model.decoder.layers)
    finally:
        parallel.destroy()
    assert megatron_globals() == CLEAN


@pytest.mark.slow  # the whole preflight --quick in-process: about a minute on 2 cores
def test_the_preflight_runs_after_other_jobs_in_the_same_process(tmp_path):
    """The preflight's own order of jobs (numerics, RL step, speed, memory; --quick), in a process that
    already ran a deeper model, then a shallower one: every item ok or skipped for a stated reason."""
    from megatron_gspo.preflight import cli

    _run(SHAPES["deeper_wider_more_experts"], tmp_path / "before")
    parallel.destroy()
    code = cli.main(["--quick", "--json", str(tmp_path / "pf.json"), "parallel.device=cpu"])
    report = json.loads((tmp_path / "pf.json").read_text())
    failed = {k: v.get("error") for k, v in report["checks"].items() if v["status"] == "failed"}
    assert code == 0 and not failed, failed
    ran = [k for k, v in report["checks"].items() if v["status"] == "ok"]
    assert {"rl_step", "speed.train_bf16", "speed.generation", "numerics.experts"} <= set(ran), report["checks"]
    assert megatron_globals() == CLEAN
