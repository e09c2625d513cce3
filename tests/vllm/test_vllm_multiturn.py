"""Multi-turn rows and the evaluation on vLLM (rollout.engine=vllm with env.name), in the vLLM tier's interpreter:
the tiny model with head size 32 in fp32 on the CPU, built as a Trainer in this process.

Token in, token out: every turn's context goes to the engine as the row's ids so far (rollout/multiturn.py builds
the stream, the engine only samples), so a row is its prompt, then its sampled turns and the environment's
observations appended once, with the loss mask on the sampled tokens only, exactly as with the megatron engine;
the engine's log-probs of the sampled tokens are the Megatron model's of the same stream (measured 1e-6, asserted
< 1e-5 in fp32). The engine's prefix cache serves the shared preamble to a prompt's G samples and a conversation to
its next turn: ``rollout/prefix_cache_hit_rate`` > 0. The evaluation samples on the engine, with the weights of
the step's updates (synced first)."""

import os

import pytest
import torch

from job_runner import built_trainers

TOL = 1e-5  # fp32
STOPS = "[" + ",".join(str(i) for i in range(3, 99, 2)) + "]"  # half of the ids end a turn: 1-4 tokens per turn
BASE = ["parallel.device=cpu", "model.kv_channels=32", "rollout.engine=vllm", "train.sft_steps=0",
        "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "train.num_minibatches=1",
        "train.micro_batch_size=16", "generation.max_new_tokens=4", "generation.temperature=1.0",
        f"generation.stop_token_ids={STOPS}", "env.name=multiturn_envs:Preamble", "env.max_turns=3",
        "env.num_workers=1", "data.max_prompt_length=128", "eval.interval=1", "eval.num_prompts=8",
        "eval.num_samples=0", "train.tensorboard=false", "train.num_steps=1"]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with built_trainers(BASE, tmp_path_factory.mktemp("mt")) as build:
        yield build([])


def test_a_multi_turn_row_on_vllm_is_the_megatron_engines_stream_with_the_models_log_probs(trainer):
    from multiturn_envs import Preamble, check_turn_spans

    from megatron_gspo.env.chat import PlainFormat
    from megatron_gspo.model.gpt import forward_logprobs, unwrap
    from megatron_gspo.rollout.vllm_engine import EngineGenerator

    t = trainer
    assert isinstance(t.source.generator, EngineGenerator) and t.source.multiturn.generator is t.source.generator
    rec = t.source.collect(0)
    fmt, stops = PlainFormat(t.tokenizer), set(t.prepare.gen_cfg.stop_token_ids)
    preamble = fmt.prompt_ids(Preamble().preamble, None)
    assert len(preamble) >= 64  # two of the CPU engine's 32-token KV blocks
    model = unwrap(t.ddp)
    turns, worst = [], 0.0
    for r in range(rec.num_rows):
        traj, n = rec.trajectories[r], int(rec.seq_lengths[r])
        ids, mask, spans = check_turn_spans(rec, r, fmt, stops)
        assert ids[:len(preamble) - 1] == preamble[:-1]
        turns.append(traj["num_turns"])
        # the engine's log-prob of every sampled token = the Megatron model's over the whole stream
        with torch.no_grad():
            x = torch.tensor([ids])
            lp, _ = forward_logprobs(model, x[:, :-1], x[:, 1:], t.cfg.model.vocab_size, with_entropy=False)
        m = torch.tensor(mask[1:], dtype=torch.bool)
        got = rec.sample_logprobs[r, 1:n].cpu()
        assert bool((got[m] < 0).all()) and bool((got[~m] == 0).all())
        worst = max(worst, (lp[0][m] - got[m]).abs().max().item())
    print(f"turns per row {sum(turns) / len(turns):.2f}, max |engine - megatron| log-prob {worst:.3g}, "
          f"prefix cache hit rate {rec.stats['rollout/prefix_cache_hit_rate']:.3f}")
    assert 3 in turns and sum(turns) / len(turns) > 1.5
    assert worst < TOL
    # the preamble's blocks computed once for a prompt's 4 samples, the conversations' for their next turns
    assert rec.stats["rollout/prefix_cache_hit_rate"] > 0.3


def test_the_evaluation_samples_on_the_engine_with_the_weights_of_the_steps_updates(trainer):
    """After the step's updates (here: a perturbed weight) the evaluation's first generation syncs the engine:
    its greedy responses are the megatron engine's of the new weights, not the old ones'."""
    from megatron_gspo.generation.generator import Generator
    from megatron_gspo.model.gpt import unwrap

    t = trainer
    gen = t.source.generator
    assert t.evaluator.generator is gen and t.evaluator.multiturn is t.source.multiturn
    prompts = [p.ids for p in t.evaluator.prompts[:4]]
    cfg = t.evaluator.greedy_cfg
    megatron = Generator(t.ddp, vocab_size=t.cfg.model.vocab_size, state=t.state, slots=256)
    before = gen.generate(prompts, cfg, seed=0, row_keys=list(range(4)))
    with torch.no_grad():
        unwrap(t.ddp).embedding.word_embeddings.weight.mul_(3.0)
    gen.stale = True  # what the rollout source says after its step's generation
    after = gen.generate(prompts, cfg, seed=0, row_keys=list(range(4)))
    assert not gen.stale
    want = megatron.generate(prompts, cfg, seed=0, row_keys=list(range(4)))
    assert after.responses() == want.responses()
    assert before.responses() != after.responses()
    metrics = t.evaluator.run(1)
    assert metrics["eval/num_prompts"] == 8 and metrics["eval/turns_mean"] >= 1 and "eval/tool_calls_mean" in metrics
