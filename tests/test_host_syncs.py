"""No host synchronisation in the hot loops that a device-side flag or a batched check can replace,
counted on the CPU with tests/host_syncs.py (what would wait for the GPU on CUDA):

- the trainer's minibatch: the non-finite guard is one vote per minibatch (not a ``bool()`` per
  parameter, nor a ``nonzero().tolist()`` per micro-batch);
- the decode loop: finished rows are checked every ``generation.finished_check_interval`` tokens
  (not an ``.item()`` per token), the lean decode step (its MoE layers included) and the R3 route
  recorder make none (no expert-count ``.cpu()`` / ``.tolist()`` per layer as megatron's MoE layer
  makes, no ``.cpu()`` of the rows per step after compaction).
"""

import os

import pytest
import torch

from host_syncs import HostSyncCounter

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_JOB = [
    "parallel.device=cpu",  # host syncs of the CPU path (a CUDA device has its own: test_gpu.py)
    "train.num_steps=1", "train.prompts_per_step=4", "generation.n_samples_per_prompt=4",
    "generation.max_new_tokens=4", "train.micro_batch_size=4", "train.tensorboard=false",
    f"reward.name={HERE}/reward_plugins.py:digit_fraction", "optimizer.lr=1e-3",
]


def test_counter_sees_the_syncs_it_should():
    x = torch.arange(6.0)
    with HostSyncCounter() as c:
        x.sum().item()
        if x[0] == 0:  # bool()
            pass
        x.nonzero()
        x[x > 2]
        x.cpu()
        torch.where(x > 1, x, 0.0)  # not a sync
        x.argsort()
    assert c.total(os.path.basename(__file__)) == 5, c.by_site()


@pytest.mark.parametrize("minibatches", [1, 2])
def test_trainer_minibatch_makes_one_guard_sync(tmp_path, minibatches):
    """train_on: the non-finite guard costs one host sync per minibatch (the collective skip vote in
    comm.py), whatever the number of parameters (33) and micro-batches (4 in all); trainer/loop.py's own
    lines make none."""
    from job_runner import built_trainers

    with built_trainers(TINY_JOB + [f"train.num_minibatches={minibatches}"], tmp_path) as build:
        trainer = build([])
        batch = trainer.prepare(trainer.source.collect(0))
        assert len(batch.micro) == 4 and sum(1 for _ in trainer.ddp.parameters()) > 30
        with HostSyncCounter() as syncs:
            trainer.train_on(batch)
    assert syncs.total("megatron_gspo/trainer/loop.py") == 0, syncs.by_site("megatron_gspo/trainer/loop.py")
    assert syncs.total("megatron_gspo/runtime/comm.py") == minibatches, syncs.by_site("megatron_gspo/runtime/comm.py")


@pytest.fixture(scope="module")
def tiny_model():
    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import ParallelConfig, model_config_from_preset
    from megatron_gspo.model.gpt import build_model

    cfg = model_config_from_preset("tiny", vocab_size=100)
    par = ParallelConfig(device="cpu", seed=5)
    st = parallel.initialize(cfg, par)
    yield build_model(cfg, par, st), st
    parallel.destroy()


@pytest.mark.parametrize("stops", [False, True], ids=["full-length", "stop-tokens-compaction"])
def test_decode_loop_syncs_every_few_tokens_only(tiny_model, stops):
    """generate() on the lean decoder with an R3 route recorder: the marginal host syncs per decode
    step (2 x 4 + ... tokens vs 4) are the finished-row check every 4 tokens and nothing else; the
    decode step (MoE layers included), the sampler and the recorder make none."""
    from megatron_gspo.generation.generator import GenerationConfig, generate
    from megatron_gspo.routing.rollout_routes import RolloutRecorder

    model, st = tiny_model
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    rec = RolloutRecorder(model)
    counts, forwards = {}, {}
    try:
        for n in (4, 20):
            cfg = GenerationConfig(max_new_tokens=n, n_samples_per_prompt=4, finished_check_interval=4,
                                   ignore_eos=not stops, stop_token_ids=[3, 5, 7, 11, 13] if stops else [],
                                   compact_finished_rows=0.25, seed=2)
            with rec.recording(), HostSyncCounter() as syncs:
                out = generate(model, prompts, cfg, vocab_size=100, state=st, on_forward=rec.on_forward)
            rec.finish(out)  # the routes are complete and consistent (checked there)
            counts[n], forwards[n] = syncs, out.num_forwards
    finally:
        rec.close()
    if stops:
        assert out.response_lengths.min() < 8 and out.decode_row_steps < 16 * 19  # rows left the batch
    steps = forwards[20] - forwards[4]
    assert steps >= 8
    per_step = (counts[20].total() - counts[4].total()) / steps
    assert per_step <= 1 / 4, counts[20].by_site()
    for f in ("generation/lean_decoder.py", "generation/decoder.py", "generation/sampling.py",
              "routing/rollout_routes.py"):
        assert counts[20].total(f"megatron_gspo/{f}") == counts[4].total(f"megatron_gspo/{f}"), (f, counts[20].by_site(f))


def test_async_weight_update_poll_rides_on_the_finished_row_vote(tiny_model):
    """An asynchronous rollout rank generates with weight updates (rollout.worker.generate_with_updates)
    in generation lockstep (a state with EP 2: the vote is taken over the world, here one rank): the update
    poll and its agreement ride on the finished-row check, every 4 tokens, one host sync there and none
    per token elsewhere; an update applied mid-generation included."""
    import types

    from megatron_gspo.rollout.worker import generate_with_updates
    from megatron_gspo.generation.generator import GenerationConfig, Generator

    model, st = tiny_model
    import torch.distributed as dist

    lockstep = types.SimpleNamespace(tp=1, ep=2, tp_group=None, device=st.device, lockstep_group=dist.group.WORLD)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    gen = Generator(model, vocab_size=100, state=lockstep)
    counts, forwards, polls = {}, {}, {}
    for n in (4, 20):
        cfg = GenerationConfig(max_new_tokens=n, n_samples_per_prompt=4, finished_check_interval=4,
                               ignore_eos=True, seed=2)
        calls = {"poll": 0, "apply": 0}

        def poll():
            calls["poll"] += 1
            return calls["poll"] == 2, False  # an update is announced once, at the second check

        def apply():
            calls["apply"] += 1
            return calls["apply"]

        with HostSyncCounter() as syncs:
            got = generate_with_updates(model, prompts, cfg, vocab_size=100, state=lockstep, seed=2,
                                        row_keys=list(range(16)), version=0, poll=poll, apply=apply,
                                        policy="finish", generator=gen)
        counts[n], forwards[n], polls[n] = syncs, got.out.num_forwards, dict(calls)
    assert polls[20] == {"poll": 4, "apply": 1}  # checks after tokens 4, 8, 12, 16; the update at the 2nd
    steps = forwards[20] - forwards[4]
    per_step = (counts[20].total() - counts[4].total()) / steps
    assert per_step <= 1 / 4, counts[20].by_site()
    assert counts[20].total("megatron_gspo/rollout/worker.py") == counts[4].total("megatron_gspo/rollout/worker.py")
