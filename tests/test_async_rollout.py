"""Asynchronous rollouts (megatron_gspo/async_rollout/): generation and training on separate ranks of one
torchrun world, weights streamed after every step, bounded staleness, faults.

Multi-rank tests run torchrun on the CPU with gloo (tests/conftest.py run_dist, slow tier); the config
checks and the generation-with-updates logic run in one process (fast tier)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_gspo.checkpoint import dist_checkpoint_to_tensors, iter_dir, latest_complete
from megatron_gspo.config import ConfigError, ParallelConfig, load_job_config

HERE = os.path.dirname(os.path.abspath(__file__))
ASYNC = ["rollout.mode=async", "rollout.world_size=1"]


def tensors(path):
    return {k: v for k, v in dist_checkpoint_to_tensors(path).items() if isinstance(v, torch.Tensor)}


# ----------------------------------------------------------------------------------------------
# config (fast)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["rollout.world_size=2"], "rollout.world_size=2 is only used with rollout.mode=async"),
    (["rollout.mode=async"], "rollout.mode=async needs rollout.world_size >= 1"),
    (["rollout.mode=sync"], "rollout.mode='sync' is not one of ['colocated', 'async']"),
    (ASYNC + ["rollout.partial_rollouts=keep"], "rollout.partial_rollouts='keep' is not one of ['finish', 'drop']"),
    (ASYNC + ["rollout.max_staleness=-1"], "rollout.max_staleness must be an integer >= 0"),
    (ASYNC, "rollout.max_staleness=1 trains on rollouts of older weights"),
    (ASYNC + ["rollout.max_staleness=0", "train.old_logprobs=rollout"], "train.old_logprobs=rollout with rollout.mode=async"),
    (ASYNC + ["rollout.max_staleness=0", "loss.name=grpo", "train.routing_replay=R3"],
     "train.routing_replay=R3 with rollout.mode=async"),
    (ASYNC + ["rollout.max_staleness=0", "train.dynamic_sampling=true"], "train.dynamic_sampling=true with rollout.mode=async"),
])
def test_config_refuses_what_async_cannot_do(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_job_config(None, overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("world, overrides, message", [
    (1, [], "needs more ranks than that (the trainer gets the rest), but the job has 1"),
    (4, ["parallel.tensor_model_parallel_size=2"], "world size 3 is not a multiple of tensor_model_parallel_size"),
    (3, ["rollout.tensor_model_parallel_size=2"], "rollout.tensor_model_parallel_size"),
    (4, ["rollout.world_size=2", "rollout.expert_model_parallel_size=3"], "rollout.expert_model_parallel_size"),
    (5, ["rollout.world_size=3", "train.prompts_per_step=4", "generation.n_samples_per_prompt=2"],
     "8 rollout rows are not divisible by the rollout ranks' data-parallel size 3"),
])
def test_world_size_checks_name_the_keys(world, overrides, message):
    from megatron_gspo.async_rollout.layout import check_world

    cfg = load_job_config(None, ASYNC + ["rollout.max_staleness=0"] + overrides)
    with pytest.raises(ConfigError) as e:
        check_world(cfg, world)
    assert message in str(e.value)


def test_split_of_a_world():
    from megatron_gspo.async_rollout.layout import check_world

    cfg = load_job_config(None, ["rollout.mode=async", "rollout.world_size=4", "rollout.max_staleness=0",
                                 "rollout.tensor_model_parallel_size=2", "parallel.tensor_model_parallel_size=2"])
    s = check_world(cfg, 8)
    assert (s.trainer_size, s.rollout_size, s.trainer_dp, s.rollout_dp) == (4, 4, 2, 2)
    assert [s.role(r) for r in range(8)] == ["trainer"] * 4 + ["rollout"] * 4
    assert [s.side_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert s.rollout_leaders == [0, 2]


def test_colocated_is_the_default_and_keeps_the_old_logprob_decision():
    from megatron_gspo.config import old_logprob_source

    cfg = load_job_config(None, [])
    assert cfg.rollout.mode == "colocated" and cfg.rollout.world_size == 0
    assert old_logprob_source(cfg, "cpu")[0] is False  # fp32 on the CPU: the rollout's, as before
    cfg = load_job_config(None, ASYNC + ["rollout.max_staleness=0"])
    assert old_logprob_source(cfg, "cpu")[0] is True


# ----------------------------------------------------------------------------------------------
# weight sync (slow)
# ----------------------------------------------------------------------------------------------

TP2 = "parallel.tensor_model_parallel_size=2"
EP2 = "parallel.expert_model_parallel_size=2"


@pytest.fixture(scope="module")
def one_rank_weights(tmp_path_factory):
    """The trained weights of the sync test (seed 777) on one rank, fp32 and bf16."""
    from megatron_gspo import parallel
    from megatron_gspo.checkpoint import save_model
    from megatron_gspo.init_weights import init_weights
    from megatron_gspo.model import build_model

    out = {}
    for precision in ("fp32", "bf16"):
        cfg = load_job_config(None, [f"model.precision={precision}"])
        st = parallel.initialize(cfg.model, ParallelConfig())
        m = build_model(cfg.model, ParallelConfig(), st)
        init_weights(m, 777, st, init_method_std=cfg.model.init_method_std, num_layers=cfg.model.num_layers)
        path = str(tmp_path_factory.mktemp("one_rank") / precision)
        save_model(m, path)
        out[precision] = tensors(path)
        parallel.destroy()
    return out


@pytest.mark.parametrize("nproc, rollout_ranks, pairs", [
    # trainer TP2 -> rollout TP1, EP2 -> 1, DP2 -> 1 (1 rollout rank)
    (3, 1, [f"{TP2}|", f"{EP2}|", "|"]),
    # 2 + 2 ranks: TP2 -> DP2, EP2 -> TP2, TP2 x EP2 (expert-TP 1) -> EP2, DP2 -> TP2 x EP2, and bf16 TP2 -> TP2
    (4, 2, [f"{TP2}|", f"{EP2}|tensor_model_parallel_size=2",
            f"{TP2},{EP2},parallel.expert_tensor_parallel_size=1|expert_model_parallel_size=2",
            "|tensor_model_parallel_size=2,expert_model_parallel_size=2,expert_tensor_parallel_size=1",
            f"model.precision=bf16,{TP2}|tensor_model_parallel_size=2"]),
])
def test_rollout_weights_bit_identical_after_sync(run_dist, tmp_path, one_rank_weights, nproc, rollout_ranks, pairs):
    args = ["--out", str(tmp_path), "--rollout-ranks", str(rollout_ranks)]
    for p in pairs:
        args += ["--pair", p]
    out = run_dist("weight_sync.py", nproc, *args, timeout=600).stdout
    assert out.count("SYNCED") == nproc * len(pairs), out
    for i, pair in enumerate(pairs):
        want = one_rank_weights["bf16" if "bf16" in pair else "fp32"]
        trainer, rollout = tensors(tmp_path / str(i) / "trainer"), tensors(tmp_path / str(i) / "rollout")
        assert trainer.keys() == rollout.keys() == want.keys(), pair
        assert len(want) >= 10
        for k in want:
            assert rollout[k].dtype == want[k].dtype, (pair, k)
            assert torch.equal(trainer[k], want[k]), (pair, k)  # the trainer holds the one-rank model's numbers
            assert torch.equal(rollout[k], want[k]), (pair, k)  # and so, bit for bit, does the rollout copy
