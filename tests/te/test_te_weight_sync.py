"""Asynchronous rollouts' weight sync (megatron_gspo/rollout/weight_sync.py) with Transformer Engine-spec
models, under torchrun on gloo inside the TE tier's interpreter: trainer and rollout ranks build their
models construct-only on the CPU (tests/dist_scripts/weight_sync.py --te), the trainer streams its weights
across tensor / expert layouts and across specs, and every rank's copy equals the one-rank model's numbers
bit for bit (the same check tests/test_async_rollout.py makes for the local spec)."""

import pytest
import torch

from megatron_gspo.checkpoint import dist_checkpoint_to_tensors

TP2 = "parallel.tensor_model_parallel_size=2"
EP2 = "parallel.expert_model_parallel_size=2"


def weights(path) -> dict:
    return {k: v for k, v in dist_checkpoint_to_tensors(str(path)).items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The trained weights of weight_sync.py (seed 777) on one rank: the local spec, since the seed alone
    decides every number whatever the spec (tests/te/test_te_checkpoints.py)."""
    from megatron_gspo.runtime import parallel
    from megatron_gspo.checkpoint import save_model
    from megatron_gspo.config import ParallelConfig, load_job_config
    from megatron_gspo.model.init_weights import init_weights
    from megatron_gspo.model.gpt import build_model

    cfg = load_job_config(None, ["parallel.device=cpu", "model.transformer_impl=local"])
    st = parallel.initialize(cfg.model, ParallelConfig(device="cpu"))
    m = build_model(cfg.model, ParallelConfig(device="cpu"), st)
    init_weights(m, 777, st, init_method_std=cfg.model.init_method_std, num_layers=cfg.model.num_layers)
    path = tmp_path_factory.mktemp("one_rank") / "w"
    save_model(m, str(path))
    parallel.destroy()
    return weights(path)


def test_weight_sync_between_te_layouts_and_specs(run_dist, tmp_path, one_rank):
    # 2 trainer + 1 rollout ranks: TE TP2 -> TE TP1, TE EP2 -> local TP1, local TP2 -> TE TP1
    pairs = [(f"{TP2}|", "both"), (f"{EP2}|", "trainer"), (f"{TP2}|", "rollout")]
    args = ["--out", str(tmp_path), "--rollout-ranks", "1"]
    for pair, te in pairs:
        args += ["--pair", pair, "--te", te]
    out = run_dist("weight_sync.py", 3, *args, timeout=900).stdout
    assert out.count("SYNCED") == 3 * len(pairs), out
    assert len(one_rank) >= 10
    for i, (pair, te) in enumerate(pairs):
        trainer, rollout = weights(tmp_path / str(i) / "trainer"), weights(tmp_path / str(i) / "rollout")
        assert trainer.keys() == rollout.keys() == one_rank.keys(), (pair, te)
        for k, want in one_rank.items():
            assert torch.equal(trainer[k], want), (pair, te, k)  # the trainer holds the one-rank numbers
            assert torch.equal(rollout[k], want), (pair, te, k)  # and so, bit for bit, does the rollout copy
