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


# ----------------------------------------------------------------------------------------------
# Sharded over data parallelism (tests/dist_scripts/eval_shard.py: one evaluation of the initial weights)
# ----------------------------------------------------------------------------------------------

STOPS = "[" + ",".join(str(i) for i in range(3, 99, 2)) + "]"  # half the vocabulary ends a response: lengths 1..6
# 5 held-out prompts x 3 samples: odd counts, so the DP shares are uneven (2 + 3 greedy rows, 7 + 8 sampled)
SHARD_JOB = ["train.num_steps=1", "eval.interval=1", "eval.num_prompts=5", "eval.num_samples=3", "eval.k=2",
             "generation.max_new_tokens=6", f"generation.stop_token_ids={STOPS}",
             f"reward.name={HERE}/reward_plugins.py:coin_of_the_text", "train.prompts_per_step=4",
             "generation.n_samples_per_prompt=2", "train.micro_batch_size=8", "train.num_minibatches=1"]
SHARD_LAYOUTS = {  # name: (ranks, overrides, rows each rank generates: [greedy pass, sampled pass])
    "dp2": (2, [], [[2, 7], [3, 8]]),
    "ep2": (2, ["parallel.expert_model_parallel_size=2"], [[2, 7], [3, 8]]),  # a rank steps with its EP peer
    "tp2": (2, ["parallel.tensor_model_parallel_size=2"], [[5, 15], [5, 15]]),  # DP 1: the TP ranks' one share
}


# GuessWithFeedback (env/games.py): most rows of the untrained policy are told "a number, please" and talk on
MULTI_TURN = ["env.name=megatron_gspo.env.games:GuessWithFeedback", "env.max_turns=3", "env.num_workers=1"]
# name -> (ranks, eval_shard.py options, job overrides): every evaluation the tests below read
RUNS = {
    "one": (1, [], []),
    "multi-turn one": (1, [], MULTI_TURN),
    "stop": (2, ["--stop-at", "2"], []),  # first of its torchrun: the runs after it need no collective left waiting
    **{layout: (n, [], extra) for layout, (n, extra, _) in SHARD_LAYOUTS.items()},
    **{f"empty {layout}": (2, [], [*SHARD_LAYOUTS[layout.split()[-1]][1], *(MULTI_TURN if "multi" in layout else []),
                                   "eval.num_prompts=1"]) for layout in ("dp2", "ep2", "multi-turn dp2")},
    **{f"multi-turn {layout}": (2, [], [*MULTI_TURN, *SHARD_LAYOUTS[layout][1]]) for layout in ("dp2", "ep2")},
}


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory, run_dist_jobs):
    """name of RUNS -> each rank's DIR/eval.rank<R>.json (eval_shard.py). Every run of a world size in one torchrun (jobs.py)."""
    root = tmp_path_factory.mktemp("eval_shard")
    out = {name: root / name.replace(" ", "_") for name in RUNS}
    run_dist_jobs({k: (n, ["eval_shard.py", "--out", out[k], *opts, "--", *SHARD_JOB, *extra])
                   for k, (n, opts, extra) in RUNS.items()}, root, job_timeout=300)
    return {k: [json.load(open(out[k] / f"eval.rank{r}.json")) for r in range(RUNS[k][0])] for k in RUNS}


@pytest.mark.parametrize("layout", list(SHARD_LAYOUTS))
def test_evaluation_sharded_over_dp_equals_one_rank(evaluations, layout):
    """Each DP rank generates its share of the held-out prompts (greedy) and of the sampled rows, uneven shares
    included, keyed by their global rows: every sample's tokens are the one-rank run's, and so are the metrics
    (greedy accuracy, pass@k, sample accuracy, response length) on every rank, exactly. The evaluation runs on
    the rollout's generator."""
    one = evaluations["one"][0]
    rows = SHARD_LAYOUTS[layout][2]
    ranks = evaluations[layout]
    assert one["rows"] == [5, 15] and len(one["samples"]) == 20
    assert [r["rows"] for r in ranks] == rows, layout
    assert all(r["shares_rollout_generator"] for r in [one, *ranks])
    m = one["metrics"]
    assert 0 < m["eval/greedy_accuracy"] < 1 and 0 < m["eval/sample_accuracy"] < m["eval/pass@2"] < 1, m  # not trivial
    assert 1 < m["eval/response_length_mean"] < 6, m
    for r in ranks:
        assert r["metrics"] == m, (layout, r["rank"])
        assert all(r["samples"][k] == one["samples"][k] for k in r["samples"]), (layout, r["rank"])
    assert set().union(*(r["samples"] for r in ranks)) == set(one["samples"])  # every row generated by some rank


@pytest.mark.parametrize("layout", ["dp2", "ep2", "multi-turn dp2"])
def test_a_rank_whose_share_is_empty_steps_with_its_peers(evaluations, layout):
    """One held-out prompt on two DP ranks: rank 0 has no greedy row (and one sampled row of the 3), rank 1 the
    rest; under EP rank 0 steps on generate's dummy rows beside its peer; a multi-turn rank talks with no row. The
    rows are the first prompt's rows of the 5-prompt one-rank run (the same prompt, the same global row keys), and
    both ranks report the same metrics."""
    ranks = evaluations[f"empty {layout}"]
    one = evaluations["multi-turn one" if layout.startswith("multi-turn") else "one"][0]
    assert [r["rows"] for r in ranks] == [[0, 1], [1, 2]]
    assert ranks[0]["metrics"] == ranks[1]["metrics"] and ranks[0]["metrics"]["eval/num_prompts"] == 1.0
    got = {**ranks[0]["samples"], **ranks[1]["samples"]}
    assert len(got) == 4 and all(got[k] == one["samples"][k] for k in got), sorted(got)


@pytest.mark.parametrize("layout", ["dp2", "ep2"])
def test_multi_turn_evaluation_sharded_over_dp_equals_one_rank(evaluations, layout):
    """A multi-turn job's evaluation: each DP rank talks its share of the rows through the rollouts' own
    multi-turn rollout (one environment worker pool); every row's stream and the metrics (turns and tool calls
    included) are the one-rank run's."""
    one = evaluations["multi-turn one"][0]
    rows = SHARD_LAYOUTS[layout][2]
    ranks = evaluations[f"multi-turn {layout}"]
    assert one["rows"] == [5, 15] and [r["rows"] for r in ranks] == rows
    assert all(r["shares_rollout_generator"] and r["shares_rollout_multiturn"] for r in [one, *ranks])
    assert one["metrics"]["eval/turns_mean"] > 1.5, one["metrics"]
    for r in ranks:
        assert r["metrics"] == one["metrics"], (layout, r["rank"])
        assert all(r["samples"][k] == one["samples"][k] for k in r["samples"]), (layout, r["rank"])


def test_a_stop_on_one_rank_cuts_a_sharded_evaluation_short_on_every_rank(evaluations):
    """Rank 1 asked to stop in the middle of its share of the greedy pass: both ranks leave the evaluation
    together, in its greedy pass (runtime.stop.Cancelled on both), no collective left waiting (the runs after it
    in the same torchrun go on)."""
    ranks = evaluations["stop"]
    assert all(r["cancelled"].startswith("in its greedy pass") for r in ranks), ranks
    assert all("metrics" not in r and r["rows"] == [[2], [3]][r["rank"]] for r in ranks), ranks
