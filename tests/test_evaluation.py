"""Evaluation during training: pass@k against the closed form, held-out splits, and a run whose
training is bit-identical with evaluation on and off."""

import json
import math
import os

import pytest
import torch

from megatron_gspo.runtime import parallel
from megatron_gspo.config import ConfigError, DataConfig, load_job_config
from megatron_gspo.data.prompts import PromptDataset, split_holdout
from megatron_gspo.trainer.evaluation import pass_at_k

HERE = os.path.dirname(os.path.abspath(__file__))


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(8, 0, 4) == 0.0
    assert pass_at_k(8, 5, 4) == 1.0  # fewer than k wrong samples: some k-subset always passes
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n


@pytest.mark.parametrize("n", [1, 2, 5, 8, 16])
def test_pass_at_k_is_the_closed_form(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="n=4, c=5, k=1"):
        pass_at_k(4, 5, 1)


def test_holdout_of_a_builtin_task_is_past_its_epoch():
    cfg = DataConfig(task_num_examples=10)
    train, held = split_holdout(PromptDataset.from_config(cfg), 3)
    assert len(train) == 10 and len(held) == 3
    assert [held[i].id for i in range(3)] == [f"arithmetic-1234-{i}" for i in (10, 11, 12)]


def test_holdout_of_a_file_is_its_last_records(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+0=", "answer": str(i)}) + "\n" for i in range(5)))
    train, held = split_holdout(PromptDataset.from_jsonl(str(path)), 2)
    assert [train[i].answer for i in range(3)] == ["0", "1", "2"]
    assert [held[i].answer for i in range(2)] == ["3", "4"]
    with pytest.raises(Exception, match="eval.num_prompts=5 held-out records leave none"):
        split_holdout(PromptDataset.from_jsonl(str(path)), 5)


@pytest.mark.parametrize("override, field", [
    ("eval.interval=-1", "eval.interval"),
    ("eval.num_prompts=0", "eval.num_prompts"),
    ("eval.k=0", "eval.k"),
    ("eval.num_samples=2", "eval.num_samples"),  # < k = 4
    ("eval.temperature=0", "eval.temperature"),
    ("eval.seed=-3", "eval.seed"),
])
def test_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_job_config(None, [override])


JOB = ["parallel.device=cpu", "train.num_steps=3", "train.prompts_per_step=4", "generation.n_samples_per_prompt=4",
       "generation.max_new_tokens=4", "train.micro_batch_size=8", "train.num_minibatches=2",
       f"reward.name={HERE}/reward_plugins.py:digit_fraction", "optimizer.lr=1e-3", "train.tensorboard=false"]


def _run(tmp_path, name, overrides):
    from megatron_gspo.train import Trainer

    t = Trainer(load_job_config(None, JOB + [f"train.output_dir={tmp_path}/{name}"] + overrides))
    try:
        history = t.run()["history"]
        weights = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    finally:
        t.close()
        parallel.destroy()
    return history, weights, [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]


def test_evaluation_leaves_training_bit_identical(tmp_path):
    # deterministic mode: bit-identical on a GPU too, whose default kernels are not (the CPU's are)
    det = ["train.deterministic=true"]
    off, w_off, _ = _run(tmp_path, "off", det)
    on, w_on, rows = _run(tmp_path, "on", det + ["eval.interval=2", "eval.num_prompts=6", "eval.num_samples=4",
                                                 "eval.k=2"])
    for a, b in zip(off, on):
        for k, v in a.items():
            if not k.startswith("perf/"):  # wall times differ
                assert v == b[k] or (math.isnan(v) and math.isnan(b[k])), k
    assert all(torch.equal(w_off[n], w_on[n]) for n in w_off)
    # evaluated after step 2 (interval) and step 3 (the last), not after step 1
    assert ["eval/greedy_accuracy" in r for r in rows] == [False, True, True]
    for r in rows[1:]:
        assert r["eval/num_prompts"] == 6.0 and 1 <= r["eval/response_length_mean"] <= 4
        assert r["eval/dropped_prompts"] == r["eval/truncated_prompts"] == 0.0  # counted like training prompts
        assert 0 <= r["eval/sample_accuracy"] <= r["eval/pass@2"] <= 1
        assert r["eval/greedy_accuracy"] in {i / 6 for i in range(7)}


def test_evaluation_counts_correct_answers(tmp_path, monkeypatch):
    """A reward that marks every response correct: accuracy, pass@k and sample accuracy are all 1."""
    _, _, rows = _run(tmp_path, "ones", [f"reward.name={HERE}/reward_plugins.py:always_one", "train.num_steps=1",
                                         "eval.interval=1", "eval.num_prompts=3", "eval.num_samples=2", "eval.k=1"])
    r = rows[0]
    assert (r["eval/greedy_accuracy"], r["eval/pass@1"], r["eval/sample_accuracy"]) == (1.0, 1.0, 1.0)
