"""DAPO dynamic sampling and overlong handling: hand-computed selections, penalties and masks, and
the trainer running them."""

import logging
import os

import pytest
import torch

from megatron_gspo.config import ConfigError, load_job_config
from megatron_gspo.algorithms.dynamic_sampling import informative_groups, pick_groups
from megatron_gspo.algorithms.overlong import loss_mask, overlong_penalty, truncated
from job_runner import built_trainers, run_job_rows
from log_capture import LogLines

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGINS = f"{HERE}/reward_plugins.py"


def test_three_of_eight_constant_groups_are_dropped_and_refilled_from_the_next_round():
    G = 4
    round0 = torch.tensor([
        [1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 0, 1], [1, 1, 1, 1],  # groups 1 and 3 constant
        [0.5, 0.5, 0.5, 0.5], [0, 1, 0, 0], [0.2, 0, 0, 0], [1, 0, 1, 0],  # group 4 constant
    ], dtype=torch.float32).reshape(-1)
    flags0 = informative_groups(round0, G).tolist()
    assert flags0 == [True, False, True, False, False, True, True, True]
    picks, filled = pick_groups([flags0], 8, fill=False)
    assert picks == [(0, 0), (0, 2), (0, 5), (0, 6), (0, 7)] and filled == 0  # 5 kept: another round
    # round 1: group 0 constant, then informative ones; exactly 3 are taken, the rest discarded
    round1 = torch.tensor([[0, 0, 0, 0]] + [[0, 1, 1, 1]] * 7, dtype=torch.float32).reshape(-1)
    flags1 = informative_groups(round1, G).tolist()
    picks, filled = pick_groups([flags0, flags1], 8, fill=False)
    assert picks == [(0, 0), (0, 2), (0, 5), (0, 6), (0, 7), (1, 1), (1, 2), (1, 3)] and filled == 0


def test_past_the_cap_the_step_is_filled_with_the_earliest_constant_groups():
    flags = [[True, False, False], [False, True, False]]
    assert pick_groups(flags, 3, fill=False) == ([(0, 0), (1, 1)], 0)
    assert pick_groups(flags, 3, fill=True) == ([(0, 0), (1, 1), (0, 1)], 1)
    assert pick_groups([[False] * 3], 3, fill=True) == ([(0, 0), (0, 1), (0, 2)], 3)


def test_overlong_penalty_is_dapo_eq_13():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, linear to -1 at 10
    lengths = torch.tensor([1, 6, 7, 8, 9, 10])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4), torch.tensor([0, 0, -0.25, -0.5, -0.75, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, factor=0.5),
                               torch.tensor([0, 0, -0.125, -0.25, -0.375, -0.5]))
    assert torch.equal(overlong_penalty(lengths, 10, 0), torch.zeros(6))


def test_truncated_rows_leave_the_loss_mask():
    stopped = torch.tensor([True, False, False, True])
    lengths = torch.tensor([5, 5, 3, 5])
    cut = truncated(stopped, lengths, 5)
    assert cut.tolist() == [False, True, False, False]  # a stop at the last token is no truncation
    mask = torch.ones(4, 3, dtype=torch.bool)
    assert loss_mask(mask, cut).sum(-1).tolist() == [3, 0, 3, 3]


@pytest.mark.parametrize("override, field", [
    ("train.dynamic_sampling_max_rounds=-1", "train.dynamic_sampling_max_rounds"),
    ("train.dynamic_sampling=maybe", "train.dynamic_sampling"),
    ("train.overlong_filtering=3", "train.overlong_filtering"),
    ("reward.overlong_buffer_len=-2", "reward.overlong_buffer_len"),
    ("reward.overlong_buffer_len=500", "reward.overlong_buffer_len"),
    ("reward.overlong_penalty_factor=-1", "reward.overlong_penalty_factor"),
])
def test_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_job_config(None, [override])


def test_dynamic_sampling_is_refused_with_single_samples():
    with pytest.raises(ConfigError, match="train.dynamic_sampling=true needs generation.n_samples_per_prompt >= 2"):
        load_job_config(None, ["train.dynamic_sampling=true", "generation.n_samples_per_prompt=1",
                               "train.advantage_estimator=dr_grpo"])


# ----------------------------------------------------------------------------------------------
# In the trainer
# ----------------------------------------------------------------------------------------------

JOB = ["parallel.device=cpu", "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "generation.max_new_tokens=4",
       "train.micro_batch_size=8", "train.num_minibatches=2", "train.tensorboard=false", "data.shuffle=false"]


@pytest.fixture
def trainer(tmp_path):
    with built_trainers(JOB, tmp_path) as build:
        yield build


def _batch(t):
    """Step 1's prepared batch of a built trainer."""
    return t.prepare(t.source.collect(0))


def test_rollout_keeps_only_informative_groups(trainer):
    t = trainer(["train.dynamic_sampling=true", f"reward.name={PLUGINS}:constant_for_odd_first_operand"])
    batch = t.prepare(t.source.collect(0))
    groups = batch.rewards[torch.argsort(batch.row_ids)].reshape(4, 4)
    assert bool((groups.amax(1) > groups.amin(1)).all())  # every trained group carries signal
    s = batch.stats
    assert s["dynamic_sampling/filled_groups"] == 0
    rounds = int(s["dynamic_sampling/rounds"])
    assert t.sampler.num_prompts == 4 * rounds  # each round drew P new prompts
    # the dropped share is over every generated group: 4 kept need 4 + dropped informative-or-not
    assert 0 < s["dynamic_sampling/dropped_group_frac"] < 1
    # kept groups' prompts are those with an even first operand
    assert all(int(next(c for c in t.tokenizer.decode(batch.tokens[i].tolist()) if c.isdigit())) % 2 == 0
               for i in range(batch.num_rows))


@pytest.mark.parametrize("routing", [["train.routing_replay=R3", "loss.name=grpo"],
                                     ["train.old_logprobs=rollout"]], ids=["R3", "reference-without-old-pass"])
def test_kept_rows_of_several_rounds_carry_their_own_routes(trainer, routing):
    """The record carries each row's routes from the round that generated it, so R3 replays them (its
    recomputed old log-probs equal the sampling ones, as on the model's own routes: another round's routes
    would move them far beyond float noise), and without an old-log-prob pass they are the routing
    reference (the first minibatch, on-policy, changes no route)."""
    t = trainer(["train.dynamic_sampling=true", f"reward.name={PLUGINS}:constant_for_odd_first_operand", *routing])
    record = t.source.collect(0)
    assert record.stats["dynamic_sampling/rounds"] > 1  # rows of several rounds
    assert record.routes.count.tolist() == (record.seq_lengths - 1).tolist()
    batch = t.prepare(record)
    if t.prepare.recompute_old_logprobs:  # R3: the old-log-prob pass replays the record's routes
        assert float((batch.old_logprobs - batch.sample_logprobs).abs()[batch.mask].max()) < 1e-4
    else:
        from megatron_gspo.runtime.metrics import MetricAccumulator

        t.accumulate_gradients(batch, batch.minibatches[0], MetricAccumulator())
        changed = t.routing.step_metrics()["routing/routing_change_frac"]  # the first minibatch's forwards
        assert changed == 0.0, changed


def test_rollout_past_the_cap_fills_and_says_so(trainer):
    t = trainer(["train.dynamic_sampling=true", "train.dynamic_sampling_max_rounds=2",
                 f"reward.name={PLUGINS}:always_zero"])
    with LogLines(logging.WARNING) as said:
        batch = t.prepare(t.source.collect(0))
    assert batch.stats == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/dropped_group_frac": 1.0,
                           "dynamic_sampling/filled_groups": 4.0, "dynamic_sampling/generated_reward_mean": 0.0}
    assert t.sampler.num_prompts == 12 and batch.num_rows == 16
    assert "dynamic sampling found 0 of 4 informative groups in 3 generation rounds" in "\n".join(said.lines)


def test_dynamic_sampling_off_is_the_first_round(trainer):
    """Round 0 draws exactly the rollout of dynamic sampling off: same prompts, noise and rewards."""
    reward = f"reward.name={PLUGINS}:response_hash"  # distinct responses score differently
    off = _batch(trainer([reward]))
    on = _batch(trainer([reward, "train.dynamic_sampling=true"]))
    assert on.stats["dynamic_sampling/rounds"] == 1  # every group informative: round 0 is the whole step
    assert torch.equal(off.tokens, on.tokens) and torch.equal(off.rewards, on.rewards)
    assert torch.equal(off.row_ids, on.row_ids) and len(set(off.rewards.tolist())) > 4


def test_overlong_penalty_in_a_step(tmp_path):
    """ignore_eos: every response is cut at max_new_tokens: all truncated, penalty -factor."""
    cfg = load_job_config(None, JOB + [
        f"train.output_dir={tmp_path}", "generation.ignore_eos=true",
        "reward.overlong_buffer_len=2", "reward.overlong_penalty_factor=0.5", "train.num_steps=1",
        f"reward.name={PLUGINS}:always_zero"])
    row = run_job_rows(cfg)[0]
    assert row["rollout/truncated_frac"] == 1.0
    assert row["rollout/reward_mean"] == -0.5  # 0 + DAPO penalty at L_max


@pytest.mark.parametrize("overrides, message", [
    (["generation.ignore_eos=true"], "train.overlong_filtering=true with generation.ignore_eos=true"),
    (["generation.min_new_tokens=4"], "train.overlong_filtering=true with generation.min_new_tokens=4 >= "
                                      "generation.max_new_tokens=4"),
])
def test_overlong_filtering_where_every_response_is_truncated_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_job_config(None, JOB + ["train.overlong_filtering=true"] + overrides)
    load_job_config(None, JOB + overrides)  # each alone is fine


def test_steps_whose_every_response_is_truncated_update_nothing(tmp_path, monkeypatch):
    """Overlong filtering with every response truncated (forced here: the configs that guarantee it are
    refused): no update at all (the MoE aux loss and Adam would still move weights), finite metrics,
    the loss 0 as documented, train/empty_minibatches counts the minibatches, one warning."""
    import json
    import math

    from megatron_gspo.runtime import parallel
    from megatron_gspo.rollout import prepare as rollout
    from megatron_gspo.trainer.loop import Trainer

    monkeypatch.setattr(rollout, "truncated", lambda stopped, lengths, max_len: torch.ones_like(stopped))
    cfg = load_job_config(None, JOB + [f"train.output_dir={tmp_path}", "train.overlong_filtering=true",
                                       "train.num_steps=2", "optimizer.lr=1e-2", f"reward.name={PLUGINS}:digit_fraction"])
    trainer = Trainer(cfg)
    try:
        with LogLines(logging.WARNING) as log:
            before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            trainer.run()
            moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    finally:
        trainer.close()
        parallel.destroy()
    assert not moved, f"an update was applied from an empty batch: {moved}"
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    for row in rows:
        bad = {k: v for k, v in row.items() if not math.isfinite(v)}
        assert not bad, bad
        assert row["loss/loss"] == 0.0 and row["loss/num_sequences"] == 0
        assert row["train/empty_minibatches"] == 2 and row["train/skipped_updates"] == 0
        assert row["rollout/truncated_frac"] == 1.0
    warned = [m for m in log.lines if "overlong filtering" in m]
    assert len(warned) == 1 and "left 2 of 2 minibatch(es) without a response to train on" in warned[0], log.records


def test_dynamic_sampling_rounds_are_capped_at_config_time():
    from megatron_gspo.config.sections import DYNAMIC_SAMPLING_ROUNDS_LIMIT

    load_job_config(None, [f"train.dynamic_sampling_max_rounds={DYNAMIC_SAMPLING_ROUNDS_LIMIT}"])
    with pytest.raises(ConfigError, match=r"train\.dynamic_sampling_max_rounds must be an integer in \[0, 32\]"):
        load_job_config(None, ["train.dynamic_sampling_max_rounds=1000000"])


def test_dynamic_sampling_logs_each_round_and_keeps_only_what_it_can_pick(trainer, monkeypatch):
    """A step without an informative group: every extra round is logged, and a round's generated rows
    are freed once it is over (only up to P groups that can still be picked are kept, copied out):
    memory does not grow with train.dynamic_sampling_max_rounds."""
    import weakref

    t = trainer(["train.dynamic_sampling=true", "train.dynamic_sampling_max_rounds=4",
                 f"reward.name={PLUGINS}:always_zero"])
    alive, seen = [], []
    generate_round = t.source._generate_round

    def counting(*args, **kwargs):
        seen.append(sum(r() is not None for r in alive))  # earlier rounds' outputs still held
        result = generate_round(*args, **kwargs)
        alive.append(weakref.ref(result[1].tokens))
        return result

    monkeypatch.setattr(t.source, "_generate_round", counting)
    with LogLines(logging.INFO) as log:
        batch = t.prepare(t.source.collect(0))
    assert len(seen) == 5 and batch.num_rows == 16 and batch.stats["dynamic_sampling/rounds"] == 5.0
    assert max(seen) <= 1, seen  # only the round just finished (the loop's local) while the next one runs
    rounds = [m for lvl, m in log.records if lvl == logging.INFO and "dynamic sampling: 0 of 4 informative" in m]
    assert len(rounds) == 4, log.records  # before each extra round
    assert "after 1 generation round(s); round 2 of at most 5" in rounds[0]
    assert any("dynamic sampling found 0 of 4 informative groups in 5 generation rounds" in m for m in log.lines)


def test_pruned_groups_are_the_ones_pick_groups_would_pick():
    from megatron_gspo.algorithms.dynamic_sampling import prune_groups

    rounds = [[False, True, False, False], [False, False, True, False], [True, True, True, True]]
    for needed in (1, 2, 3, 4):
        for upto in range(1, 4):
            flat = [(ok, (r, g)) for r, flags in enumerate(rounds[:upto]) for g, ok in enumerate(flags)]
            kept = []
            for r in range(upto):  # pruned round by round, as the rollout does
                kept = prune_groups(kept + [x for x in flat if x[1][0] == r], needed)
            assert len(kept) <= needed
            picks, _ = pick_groups([list(f) for f in rounds[:upto]], needed, fill=True)
            assert [x[1] for x in kept] == picks


@pytest.mark.parametrize("truncated_on, kept_on, empty", [("0,1", "", True), ("0", "1", False)],
                         ids=["both-ranks", "one-rank"])
def test_an_empty_minibatch_is_decided_alike_on_every_data_parallel_rank(tmp_path, run_dist, truncated_on, kept_on,
                                                                          empty):
    """DP=2: a minibatch is empty only if it is empty on every rank (a vote); then no rank updates.
    If one rank still has responses, both update, and the replicas stay bit-identical either way."""
    import json

    out = tmp_path / "result.json"
    run_dist("overlong_empty.py", 2, "--out", str(out), "--truncated-on", truncated_on, "--kept-on", kept_on, "--",
             *JOB, "train.sft_steps=0", "eval.interval=0", f"train.output_dir={tmp_path}/run",
             "optimizer.lr=1e-2", f"reward.name={PLUGINS}:digit_fraction")
    r = json.loads(out.read_text())
    assert r["replica_spread"] == 0.0 and r["finite"], r
    assert r["moved"] is not empty and r["empty_minibatches"] == (2 if empty else 0), r
    if empty:
        assert r["loss"] == 0.0 and r["num_sequences"] == 0
    else:
        assert r["num_sequences"] > 0
