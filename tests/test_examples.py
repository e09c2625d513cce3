"""The shipped real-format example (examples/math): its data, template and reward fit, and its job runs."""

import json
import math
import os
import re

import pytest

from megatron_gspo.config import load_job_config
from megatron_gspo.data.prompts import PromptDataset, build_eval_prompts
from megatron_gspo.data.rewards import math_reward
from megatron_gspo.data.tokenizer import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "math", "gspo_math_tiny.yaml")


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the job's paths are relative to the repository root


def _final(answer: str) -> str:
    """The reference's final answer, read by hand: the #### line or the \\boxed{} content."""
    m = re.search(r"#### (-?\d+)$", answer) or re.search(r"\\boxed\{(-?\d+)\}", answer)
    return m.group(1)


def test_every_reference_is_read_by_the_math_checker(in_root):
    for split, n in (("train", 40), ("test", 10)):
        rows = [json.loads(line) for line in open(f"examples/math/{split}.jsonl")]
        assert len(rows) == n and all(set(r) == {"id", "question", "answer"} for r in rows)
        boxed = sum("\\boxed{" in r["answer"] for r in rows)
        assert 0 < boxed < n  # both layouts: "#### N" and a \boxed{} solution
        for r in rows:
            right = _final(r["answer"])
            assert math_reward(r["question"], f"So the answer is \\boxed{{{right}}}.", r["answer"]) == 1.0
            assert math_reward(r["question"], f"\\boxed{{{int(right) + 1}}}", r["answer"]) == 0.0
    # a hand-checked record: 35 + 11 - 6
    first = json.loads(open("examples/math/train.jsonl").readline())
    assert first["question"].startswith("Kofi has 35 stamps. Kofi gets 11 more and then gives 6")
    assert _final(first["answer"]) == "40"


def test_the_chat_template_renders_the_question(in_root):
    cfg = load_job_config(CONFIG)
    tok = build_tokenizer(cfg.tokenizer)
    held = build_eval_prompts(cfg.data, cfg.eval.source, cfg.eval.num_prompts, tok)
    prompts = held.prompts
    assert len(prompts) == 10 and held.num_dropped == held.num_truncated == 0
    q = PromptDataset.from_jsonl("examples/math/test.jsonl", "question", "answer")[0].prompt
    assert prompts[0].text == ("<|system|>\nSolve the problem. Put the final answer in \\boxed{}.\n"
                               f"<|user|>\n{q}\n<|assistant|>\n")
    assert len(prompts[0].ids) == len(prompts[0].text)  # one token per character


def test_the_example_job_runs_and_evaluates(in_root, tmp_path):
    from megatron_gspo.runtime import parallel
    from megatron_gspo.trainer.hooks import TrainerHook
    from megatron_gspo.algorithms.overlong import overlong_penalty
    from megatron_gspo.trainer.loop import Trainer

    class Batches(TrainerHook):
        def __init__(self):
            self.seen = []

        def after_rollout(self, trainer, batch):
            self.seen.append(batch)

    cfg = load_job_config(CONFIG, ["parallel.device=cpu", f"train.output_dir={tmp_path}", "train.num_steps=1", "train.prompts_per_step=2",
                                   "generation.n_samples_per_prompt=2", "generation.max_new_tokens=8",
                                   "reward.overlong_buffer_len=4", "eval.num_prompts=2", "eval.num_samples=2",
                                   "eval.k=1", "train.tensorboard=false"])
    batches = Batches()
    trainer = Trainer(cfg, hooks=[batches])
    try:
        row = trainer.run()["history"][0]
    finally:
        trainer.close()
        parallel.destroy()
    assert row["eval/num_prompts"] == 2.0 and "eval/pass@1" in row
    # each reward is the math checker's 0 or 1 plus DAPO's penalty of its length (buffer 4 before 8 tokens)
    (batch,) = batches.seen
    lengths = batch.mask.sum(-1)
    penalty = overlong_penalty(lengths, 8, 4, cfg.reward.overlong_penalty_factor)
    assert ((batch.rewards - penalty) == 0).logical_or((batch.rewards - penalty) == 1).all(), (batch.rewards, penalty)
    assert row["rollout/reward_mean"] == pytest.approx(batch.rewards.mean().item(), abs=1e-6)
    # truncated: the responses cut at 8 tokens (never a shorter one), as the metric counts them
    assert not batch.truncated[lengths < 8].any()
    assert row["rollout/truncated_frac"] == pytest.approx(batch.truncated.double().mean().item())
    # overlong filtering may leave a minibatch (or the step) with nothing to train: no NaN is logged
    assert all(math.isfinite(v) for v in row.values()), {k: v for k, v in row.items() if not math.isfinite(v)}
