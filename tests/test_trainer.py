"""The RL trainer end to end on the tiny MoE (CPU, one rank)."""

import json
import logging
import os
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))

from megatron_gspo.runtime import parallel
from megatron_gspo.config import load_job_config
from job_runner import built_trainers
from log_capture import LogLines

TINY_JOB = [
    "parallel.device=cpu",  # the CPU path on any machine (tests/conftest.py: in-process tests state their device)
    "train.num_steps=3", "train.prompts_per_step=4", "generation.n_samples_per_prompt=4",
    "generation.max_new_tokens=4", "train.micro_batch_size=8", "train.num_minibatches=2",
    # a dense reward so a random model already gets non-zero advantages
    f"reward.name={HERE}/reward_plugins.py:digit_fraction", "optimizer.lr=1e-3", "train.tensorboard=true",
]


def run_job(overrides):
    from megatron_gspo.train import Trainer

    cfg = load_job_config(None, TINY_JOB + overrides)
    trainer = Trainer(cfg)
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        result = trainer.run()
        after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()  # gives back checkpoint.save's lock, as train.run_trainer does
        parallel.destroy()
    return before, after, result


def read_tensorboard(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc.Tags()


EXPECTED_SCALARS = [
    "loss/loss", "loss/pg_loss", "loss/clip_frac_low", "loss/clip_frac_high", "loss/clip_frac",
    "loss/approx_kl", "loss/entropy", "loss/seq_ratio/mean", "loss/seq_ratio/min", "loss/seq_ratio/max",
    "loss/advantages/std", "loss/response_length/mean", "train/grad_norm", "train/lr",
    "rollout/reward_mean", "rollout/logprob_diff_max", "routing/routing_change_frac",
    "routing/load_max_over_mean", "routing/aux_loss", "perf/gen_tokens_per_s", "perf/generate_s",
    "perf/old_logprob_s", "perf/train_s", "perf/step_time_s",
]


@pytest.mark.parametrize("variant", [
    ["loss.name=gspo"],
    ["loss.name=grpo", "train.routing_replay=R2"],
    # GSPO's successors; routing replay composes with the per-token-ratio ones
    ["loss.name=sapo", "train.routing_replay=R2"],
    ["loss.name=cispo"],
    ["loss.name=gmpo", "train.routing_replay=R2"],
    ["loss.name=luspo"],
])
def test_short_run_updates_every_parameter_and_logs_metrics(tmp_path, variant):
    out = tmp_path / "run"
    before, after, result = run_job(variant + [f"train.output_dir={out}"])
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"parameters not updated: {unchanged}"
    tags = read_tensorboard(str(out / "tensorboard"))
    missing = [k for k in EXPECTED_SCALARS if k not in tags["scalars"]]
    assert not missing, f"not in tensorboard: {missing}"
    assert "loss/seq_ratio/hist" in tags["histograms"]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # generation ran on the training model itself: sampling and recomputed log-probs agree
        assert r["rollout/logprob_diff_max"] < 1e-4
        if "R2" in " ".join(variant):
            assert r["routing/routing_change_frac"] == 0.0  # replayed routing = recorded routing


def test_resume_is_exact(tmp_path):
    """2N steps straight == N steps, stop, resume for N more: same weights, same logged losses."""
    common = ["train.num_steps=4", "checkpoint.save_interval=2"]
    _, straight, _ = run_job(common + [f"train.output_dir={tmp_path}/a", f"checkpoint.save={tmp_path}/ca"])
    run_job(["train.num_steps=2", "checkpoint.save_interval=2", f"train.output_dir={tmp_path}/b",
             f"checkpoint.save={tmp_path}/cb"])
    _, resumed, _ = run_job(common + [f"train.output_dir={tmp_path}/b", f"checkpoint.save={tmp_path}/cb",
                                      "checkpoint.resume=true"])
    for n in straight:
        assert torch.equal(straight[n], resumed[n]), n
    rows_a = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
    rows_b = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows_a, rows_b):
        for k in ("loss/loss", "rollout/reward_mean", "train/grad_norm", "loss/seq_ratio/max"):
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
    assert os.path.isdir(tmp_path / "cb" / "iter_0000004")


def test_the_checkpoint_manager_saves_the_tracked_state_when_due_and_at_the_end(tmp_path):
    """CheckpointManager.track is handed the training state once; save_if_due writes it at every
    save_interval-th step, save_final at the end unless that step's periodic save holds it already, and the
    data position and config are read when a save runs (a position taken at track time would resume every
    run at the prompts of its first step). The writer itself: the resume tests above and below."""
    from types import SimpleNamespace

    from megatron_gspo.checkpoint import CheckpointManager
    from megatron_gspo.config import CheckpointConfig

    class Data:
        position = 0

        def state_dict(self):
            return {"position": self.position}

    def schedule(num_steps, interval):
        ck = CheckpointManager(CheckpointConfig(save=str(tmp_path), save_interval=interval),
                               SimpleNamespace(is_main=True, device=torch.device("cpu")))
        written = []
        ck.save = lambda step, model, opt, sched, *, extra, extra_models, during_save, runs: written.append(
            (step, model, opt, sched, extra["data"]["position"], extra["config"]["train"]["num_steps"],
             sorted(extra_models), during_save))
        with pytest.raises(RuntimeError, match=r"save_step before track\(\)"):
            ck.save_step(1)
        data, job = Data(), load_job_config(None, TINY_JOB + [f"train.num_steps={num_steps}"])
        ck.track("ddp", "opt", "sched", job=job, data=data, extra_models={"ref_model": None}, during_save=print)
        for step in range(1, num_steps + 1):
            data.position = 10 * step
            ck.save_if_due(step)
        ck.save_final(num_steps)
        assert all(w[1:4] == ("ddp", "opt", "sched") and w[5] == num_steps and w[6] == ["ref_model"]
                   and w[7] is print for w in written)
        return [(w[0], w[4]) for w in written]

    assert schedule(5, 2) == [(2, 20), (4, 40), (5, 50)]
    assert schedule(4, 2) == [(2, 20), (4, 40)]  # the end is step 4's periodic save
    assert schedule(3, 0) == [(3, 30)]  # no periodic saves: the end only


def test_resume_with_a_changed_config_names_the_change(tmp_path):
    """The checkpoint's job is compared with the resumed one: a key that changes the trajectory
    (dynamic sampling switched on, the learning rate) is refused by name, with the opt-in to accept it;
    keys that may change (the run's length, logging) are accepted and logged; so is an allowed one."""
    from megatron_gspo.config import ConfigError
    from megatron_gspo.trainer.loop import Trainer

    common = [f"checkpoint.save={tmp_path}/ck", "checkpoint.save_interval=1", "train.tensorboard=false"]
    run_job(["train.num_steps=1", f"train.output_dir={tmp_path}/a"] + common)
    resume = TINY_JOB + common + ["checkpoint.resume=true", "train.num_steps=2", "train.log_interval=2",
                                  f"train.output_dir={tmp_path}/b"]
    with pytest.raises(ConfigError) as e:
        Trainer(load_job_config(None, resume + ["train.dynamic_sampling=true", "optimizer.lr=2e-3"]))
    parallel.destroy()
    msg = str(e.value)
    assert "train.dynamic_sampling False -> True" in msg and "optimizer.lr 0.001 -> 0.002" in msg, msg
    assert "checkpoint.allow_config_change=[optimizer.lr,train.dynamic_sampling]" in msg, msg
    assert "train.num_steps" not in msg and "\n" not in msg
    # accepted by name (a key, or its whole section): the run goes on from step 1, and says what changed
    with LogLines(logging.INFO) as lines:
        _, _, result = run_job(resume + ["train.dynamic_sampling=true", "optimizer.lr=2e-3",
                                         "checkpoint.allow_config_change=[train.dynamic_sampling,optimizer]"])
    assert len(result["history"]) == 1  # step 2 only
    said = [m for m in lines.lines if m.startswith("resume: config changed since")]
    assert len(said) == 1, lines.lines
    for change in ("train.num_steps 1 -> 2", "train.log_interval 1 -> 2",
                   "train.dynamic_sampling False -> True (checkpoint.allow_config_change)",
                   "optimizer.lr 0.001 -> 0.002 (checkpoint.allow_config_change)"):
        assert change in said[0], said[0]


def test_allow_config_change_names_real_keys():
    from megatron_gspo.config import ConfigError

    load_job_config(None, ["checkpoint.allow_config_change=[loss,optimizer.lr]"])
    with pytest.raises(ConfigError, match=r"checkpoint.allow_config_change: unknown config key optimizer.lrr; "
                                          r"did you mean \['optimizer.lr'"):
        load_job_config(None, ["checkpoint.allow_config_change=optimizer.lrr"])
    with pytest.raises(ConfigError, match="checkpoint.allow_config_change: 'optimiser' names no config section"):
        load_job_config(None, ["checkpoint.allow_config_change=optimiser"])


# ----------------------------------------------------------------------------------------------
# Prompts the length policy drops or truncates: counted, logged, in the metrics
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy, per_step, logged_steps", [
    # shuffle off, 2 prompts per step over [ok, long, long, ok, ok] (one epoch = 5 examples):
    # step 1 draws ok0 long1 long2 ok3, step 2 ok4 | ok0, step 3 long1 long2 ok3 ok4
    ("drop", [2, 0, 2], [1, 3]),
    # truncated prompts are kept: step 1 ok0 long1, step 2 long2 ok3, step 3 ok4 | ok0
    ("truncate_left", [1, 1, 0], [1, 2]),
], ids=["drop", "truncate_left"])
def test_overlong_prompts_are_counted_logged_and_in_the_metrics(tmp_path, policy, per_step, logged_steps):
    from megatron_gspo.data.tokenizer import TokenizerConfig, build_tokenizer

    prompts = ["1+2=", "123456789+1=", "987654321+2=", "3+4=", "5+6="]
    tok = build_tokenizer(TokenizerConfig(type="builtin"))
    # as the sampler encodes them (data.add_special_tokens=true): the built-in <bos>, one token per character
    assert [len(tok.encode(p, add_special_tokens=True)) for p in prompts] == [5, 13, 13, 5, 5]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    with LogLines(logging.WARNING) as warnings:
        run_job([f"data.source={data}", "data.shuffle=false", "data.max_prompt_length=8",
                 f"data.overlong_prompt_policy={policy}", "train.prompts_per_step=2", f"train.output_dir={tmp_path}/o",
                 "train.tensorboard=false"])
    rows = [json.loads(line) for line in open(tmp_path / "o" / "metrics.jsonl")]
    kind, other = ("dropped", "truncated") if policy == "drop" else ("truncated", "dropped")
    assert [r[f"data/{kind}_prompts"] for r in rows] == per_step
    assert [r[f"data/{kind}_prompts_total"] for r in rows] == [sum(per_step[:i + 1]) for i in range(3)]
    assert [r[f"data/{other}_prompts"] for r in rows] == [0, 0, 0]
    said = [line for line in warnings.lines if "for exceeding data.max_prompt_length" in line]
    totals = {kind: 0, other: 0}
    expected = []
    for step, n in enumerate(per_step, start=1):  # one line per step with any, none otherwise
        totals[kind] += n
        if n:
            d, t = (n, 0) if kind == "dropped" else (0, n)
            expected.append(f"step {step}: {d} prompt(s) dropped and {t} left-truncated for exceeding "
                            f"data.max_prompt_length=8 tokens (data.overlong_prompt_policy={policy}; "
                            f"{totals['dropped']} dropped, {totals['truncated']} truncated since the start)")
    assert said == expected
    assert [int(line.split()[1].rstrip(":")) for line in said] == logged_steps


# ----------------------------------------------------------------------------------------------
# metrics.jsonl and TensorBoard restart at the first step a run logs
# ----------------------------------------------------------------------------------------------


def test_metrics_restart_at_the_resumed_step(tmp_path):
    """A run killed after logging steps 4-5 but checkpointed at 3 logs 4 and 5 again when resumed:
    each step keeps one row (the new one), in metrics.jsonl and in TensorBoard."""
    from megatron_gspo.runtime.logger import MetricsLogger
    from megatron_gspo.runtime.trackers.tensorboard import TensorBoardTracker

    first = MetricsLogger(str(tmp_path), enabled=True, trackers=[TensorBoardTracker(str(tmp_path))])
    for step in range(1, 6):
        first.log(step, {"x": float(step)})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x": 6.')  # a row cut short by the kill
    # A resumed run starts in a later second than the killed one. Event files are named
    # ...tfevents.<seconds>.<host>.<pid>.<writer counter of the process>, read in name order: two writers
    # of one process in one second sort by the counter as text, and ".10" sorts before ".9".
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.05)
    with LogLines(logging.WARNING) as warnings:
        second = MetricsLogger(str(tmp_path), enabled=True, trackers=[TensorBoardTracker(str(tmp_path))], resumed=True)
        for step in (4, 5, 6):
            second.log(step, {"x": 10.0 * step})
        second.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert any("dropped 3 row(s) of steps >= 4" in line for line in warnings.lines), warnings.lines

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0),
                                                            (6, 60.0)]


def test_a_new_run_keeps_an_earlier_runs_logs(tmp_path):
    """A run that continues no checkpoint, into the output directory of a finished earlier run: the earlier
    run's metrics.jsonl and TensorBoard events are kept whole, renamed aside (said in a warning), and the new
    run writes its own from step 1 (a resumed run's truncation is test_metrics_restart_at_the_resumed_step's)."""
    from jobs_in_process import TINY_JOB, run_main

    out = tmp_path / "out"
    job = TINY_JOB + [f"train.output_dir={out}", "train.tensorboard=true"]
    code, _, lines = run_main(job + ["train.num_steps=2"])
    assert code == 0, lines[-10:]
    earlier = (out / "metrics.jsonl").read_text()
    events = sorted(os.listdir(out / "tensorboard"))
    code, _, lines = run_main(job + ["train.num_steps=1"])
    assert code == 0, lines[-10:]
    assert (out / "metrics.1.jsonl").read_text() == earlier and [json.loads(r)["step"] for r in earlier.splitlines()] == [1, 2]
    assert sorted(os.listdir(out / "tensorboard.1")) == events
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert f"train.output_dir={out} holds the logs of an earlier run and this run continues no checkpoint of it: kept " \
           "as metrics.1.jsonl and tensorboard.1; this run writes a new metrics.jsonl and tensorboard (resume with " \
           "checkpoint.resume=true to continue a run's log instead)" in lines, lines
    assert not any("went past its last checkpoint" in ln for ln in lines)


def test_resume_reads_each_file_once_and_rotation_reads_none(tmp_path, monkeypatch):
    """The checkpoint manager verifies the resume checkpoint once (every file against its manifest,
    once, on rank 0) and rotation trusts manifests: saving never re-reads a kept checkpoint."""
    from megatron_gspo.checkpoint import directory

    reads = []
    real_crc = directory._crc32
    monkeypatch.setattr(directory, "_crc32", lambda path: reads.append(path) or real_crc(path))
    ckpt = f"{tmp_path}/ckpt"
    common = [f"train.output_dir={tmp_path}/out", f"checkpoint.save={ckpt}", "checkpoint.save_interval=1",
              "checkpoint.keep_last=2", "train.tensorboard=false"]
    run_job(["train.num_steps=3"] + common)
    # every save checksummed only the files it wrote (to write its manifest), never a kept checkpoint
    by_ckpt = {os.path.basename(os.path.dirname(p)) for p in reads}
    assert by_ckpt == {"iter_0000001.tmp", "iter_0000002.tmp", "iter_0000003.tmp"}, by_ckpt
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]

    reads.clear()
    run_job(["train.num_steps=4", "checkpoint.resume=true"] + common)
    resumed = [p for p in reads if "/iter_0000003/" in p]
    files = json.load(open(f"{ckpt}/iter_0000004/manifest.json"))["files"]  # the same file set per save
    assert len(resumed) == len(set(resumed)) == len(files)  # each file of the resumed checkpoint read once


def _damage(ckpt_dir: str) -> str:
    """Cut a checkpoint's first .distcp file short (a disk or copy gone wrong); returns its name."""
    victim = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".distcp"))[0]
    path = os.path.join(ckpt_dir, victim)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return victim


def test_resume_refuses_a_root_whose_only_checkpoint_is_damaged(tmp_path):
    """checkpoint.resume=true over a root whose one checkpoint is truncated: refused (exit 2 from the entry
    point) naming the directory and what is wrong with it; never a fresh start from step 0 beside it."""
    from megatron_gspo.checkpoint import CheckpointError
    from megatron_gspo.trainer.loop import Trainer

    ckpt = f"{tmp_path}/ckpt"
    common = [f"checkpoint.save={ckpt}", "checkpoint.save_interval=2", "train.tensorboard=false"]
    run_job(["train.num_steps=2", f"train.output_dir={tmp_path}/a"] + common)
    victim = _damage(f"{ckpt}/iter_0000002")
    with pytest.raises(CheckpointError) as e:
        Trainer(load_job_config(None, TINY_JOB + common + ["train.num_steps=4", "checkpoint.resume=true",
                                                           f"train.output_dir={tmp_path}/b"]))
    parallel.destroy()
    msg = str(e.value)
    assert msg.startswith(f"{ckpt}: no complete checkpoint (every iter_* directory failed verification): "
                          f"iter_0000002: file {victim} has "), msg
    assert "checkpoint.resume=true does not start the run over" in msg and "\n" not in msg, msg
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]  # nothing written
    assert not os.path.exists(f"{tmp_path}/b/metrics.jsonl")


def test_a_damaged_newest_checkpoint_is_skipped_named_and_never_costs_the_new_ones(tmp_path):
    """Checkpoints of steps 2 and 4, the newer one damaged: the resume continues step 2 (a warning names
    iter_0000004, the resume line says the steps after 2 are trained again) and, with keep_last=1, its save
    of step 3 is the one kept: rotation neither counts nor deletes the damaged later directory (keeping it
    as "the newest" would delete the checkpoint just written, leaving nothing to resume from)."""
    ckpt = f"{tmp_path}/ckpt"
    common = [f"checkpoint.save={ckpt}", "train.tensorboard=false"]
    run_job(["train.num_steps=4", "checkpoint.save_interval=2", f"train.output_dir={tmp_path}/a"] + common)
    victim = _damage(f"{ckpt}/iter_0000004")
    with LogLines(logging.INFO) as said:
        run_job(["train.num_steps=3", "checkpoint.save_interval=1", "checkpoint.keep_last=1", "checkpoint.resume=true",
                 f"train.output_dir={tmp_path}/a"] + common)
    from megatron_gspo.checkpoint import latest_complete

    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert latest_complete(ckpt) == 3
    warned = [m for m in said.lines if m.startswith(f"checkpoint {ckpt}/iter_0000004 is incomplete or corrupt")]
    assert len(warned) == 1 and f"(file {victim} has " in warned[0], said.lines
    assert warned[0].endswith(f"resuming from {ckpt}/iter_0000002, the newest that verifies"), warned[0]
    assert (f"resumed from {ckpt}/iter_0000002 at step 2 (newer, damaged: iter_0000004; the steps after 2 are "
            "trained again)") in said.lines, said.lines


# ----------------------------------------------------------------------------------------------
# A faster step: micro-batches of rows of similar length, no old-log-prob pass where it is redundant
# ----------------------------------------------------------------------------------------------


def test_plan_groups_rows_by_length_within_each_minibatch():
    from megatron_gspo.rollout.prepare import plan_micro_batches

    lengths = [5, 9, 3, 9, 4, 12, 6, 2]  # two minibatches of 4 rows
    perm, plan, widths = plan_micro_batches(lengths, 2, 2, None, 1)
    assert perm == [1, 3, 0, 2, 5, 6, 4, 7]  # longest first, never across minibatches, ties keep order
    assert plan == [[slice(0, 2), slice(2, 4)], [slice(4, 6), slice(6, 8)]]
    assert widths == [9, 5, 12, 4]
    # a token budget: as many rows as keep rows x width <= budget (the longest row sets the width)
    perm, plan, widths = plan_micro_batches(lengths, 2, 99, 18, 1)
    assert plan == [[slice(0, 2), slice(2, 4)], [slice(4, 5), slice(5, 8)]] and widths == [9, 5, 12, 6]
    # sequence parallel over 4 ranks: the input (width - 1) splits evenly
    assert plan_micro_batches(lengths, 1, 8, None, 4)[2] == [13]


@pytest.fixture
def trainer_on(tmp_path):
    """A built trainer (tiny job) whose first rollout a test can inspect; torn down afterwards."""
    with built_trainers(TINY_JOB + ["train.tensorboard=false", "model.moe_aux_loss_coeff=0"], tmp_path) as build:
        yield build


def _grads(trainer, batch, mini):
    from megatron_gspo.runtime.metrics import MetricAccumulator

    trainer.accumulate_gradients(batch, mini, MetricAccumulator())
    return torch.cat([p.main_grad.reshape(-1).clone() for p in trainer.ddp.parameters()])


def test_length_grouped_micro_batches_give_the_padded_gradient(trainer_on):
    trainer = trainer_on(["generation.max_new_tokens=12", "train.micro_batch_size=2", "train.num_minibatches=1",
                          "generation.stop_token_ids=[3,7,11]"])
    batch = trainer.prepare(trainer.source.collect(0))
    lengths = batch.seq_lengths.tolist()
    assert max(lengths) - min(lengths) >= 3 and len(set(batch.widths)) > 1  # ragged, so widths differ
    assert lengths == sorted(lengths, reverse=True)  # rows grouped by length
    assert sum(w * (sl.stop - sl.start) for w, sl in zip(batch.widths, batch.micro)) < batch.tokens.numel()
    grouped = _grads(trainer, batch, batch.minibatches[0])
    trainer.routing.monitor.clear()
    trainer.routing.train_pass = lambda mb: __import__("contextlib").nullcontext()  # re-split below
    batch.micro, batch.widths = [slice(0, batch.num_rows)], [batch.tokens.shape[1]]  # one padded micro-batch
    padded = _grads(trainer, batch, [0])
    assert grouped.norm() > 0
    assert (grouped - padded).norm() / padded.norm() < 1e-5


def _training_forwards(trainer):
    """Counts the policy's forwards that are not generation (no inference context)."""
    count = [0]
    trainer.model.register_forward_pre_hook(
        lambda m, args, kwargs: count.__setitem__(0, count[0] + (kwargs.get("inference_context") is None)),
        with_kwargs=True)
    return count


@pytest.mark.parametrize("source", ["rollout", "recompute"])
def test_old_logprobs_from_the_rollout_save_a_pass(trainer_on, source):
    trainer = trainer_on([f"train.old_logprobs={source}", "train.num_minibatches=1"])
    forwards = _training_forwards(trainer)
    batch = trainer.prepare(trainer.source.collect(0))
    n_micro = len(batch.micro)
    assert forwards[0] == (n_micro if source == "recompute" else 0)
    # never the same tensor object: writing to one cannot change the other
    assert batch.old_logprobs is not batch.sample_logprobs
    assert batch.old_logprobs.data_ptr() != batch.sample_logprobs.data_ptr()
    if source == "rollout":
        assert torch.equal(batch.old_logprobs, batch.sample_logprobs)
    # the sampling log-probs against a training forward on the same weights (a pass of its own here, so
    # the check does not compare a tensor with itself): the same policy up to float noise in fp32
    pads = [batch.micro_batch(i).input_padding_mask() for i in range(n_micro)]
    recomputed = trainer.prepare.logprobs(trainer.model, batch, pads)
    gap = (recomputed - batch.sample_logprobs).abs()[batch.mask]
    assert 0 < gap.max() < 1e-5  # not zero: two different forwards (a KV-cache decode and a full one)
    if source == "recompute":
        assert torch.equal(recomputed, batch.old_logprobs)
    metrics = trainer.train_on(batch)
    assert forwards[0] == (3 if source == "recompute" else 2) * n_micro
    # the gap is measured either way, on the first minibatch's forwards (the sampling weights)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(float(gap.max()), rel=1e-6)
    # on-policy: exactly 1 with the old pass; float noise (far inside the clip range) without
    dev = metrics["loss/onpolicy/seq_ratio_dev_max"]
    assert dev == 0 if source == "recompute" else 0 < dev < 1e-5
    assert metrics["loss/onpolicy/clip_frac"] == 0
    # and the routing change is measured against the rollout's own routes when no pass ran
    routing = trainer.routing.step_metrics()
    assert 0 <= routing["routing/routing_change_frac"] < 0.01  # one minibatch: no update before it


def test_old_logprobs_choice_is_checked():
    from megatron_gspo.config import ConfigError, TrainConfig, old_logprob_source

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)

    def recompute(overrides, device=cpu):
        return old_logprob_source(load_job_config(None, overrides), device)[0]

    # auto: the rollout's log-probs only for fp32 on the CPU (measured to agree); the pass everywhere else
    assert not recompute([]) and not recompute(["loss.name=grpo", "train.routing_replay=R3"])
    assert recompute(["loss.name=grpo", "train.routing_replay=R2"]) and recompute(["train.dynamic_sampling=true"])
    assert recompute(["model.precision=bf16"]) and recompute([], cuda)
    assert recompute(["train.old_logprobs=recompute"]) and not recompute(["train.old_logprobs=rollout",
                                                                          "model.precision=bf16"], cuda)
    with pytest.raises(ConfigError, match="train.old_logprobs='rollout' skips the old-log-prob pass"):
        TrainConfig(old_logprobs="rollout", routing_replay="R2")
    with pytest.raises(ConfigError, match="train.old_logprobs="):
        TrainConfig(old_logprobs="sometimes")
    # a token budget under expert parallelism is planned across the ranks (rollout.agreed_length_profile)
    load_job_config(None, ["train.max_tokens_per_micro_batch=4096", "parallel.expert_model_parallel_size=2"])


def test_the_jobs_first_lines_say_its_numerics_and_spec(tmp_path):
    """The default job's precision is "auto" (the tiny preset): on the CPU fp32, said with the spec and why in
    the job's first log line (on a GPU the same line says bf16 and the TE or local spec:
    config.resolve_precision, tested as a pure function in test_config.py)."""
    with LogLines(logging.INFO) as said, built_trainers(TINY_JOB, tmp_path) as build:
        t = build([])
        assert t.cfg.model.precision == "fp32" and t.model.config.params_dtype == torch.float32
    numerics = [i for i, line in enumerate(said.lines) if line.startswith("numerics:")]
    # first, or second after compat's one-off "Transformer Engine is not installed" of this process
    assert numerics and numerics[0] <= 1, said.lines[:3]
    assert said.lines[numerics[0]] == ("numerics: fp32 on cpu (auto: fp32 on the CPU); local spec (auto: the job "
                                       "runs on cpu (Transformer Engine's kernels need CUDA))")


def test_a_trainer_leaves_the_host_programs_logging_and_warnings_alone(tmp_path, monkeypatch):
    """A program with logging and warning filters of its own builds a Trainer and runs a step: its root
    logger (handlers, level) and the other loggers' levels are as it set them, its warning filters are all
    still there, in order, and no code of the package added one (imports of third-party modules do, as in
    any program that imports them); the trainer's lines reach the program's handler through the
    ``megatron_gspo`` logger. Only the command-line entry points configure the process
    (runtime/logger.setup_logging)."""
    import io
    import sys
    import warnings

    import megatron_gspo
    from megatron_gspo.train import Trainer

    package = os.path.dirname(os.path.abspath(megatron_gspo.__file__))
    root, megatron, ours = logging.getLogger(), logging.getLogger("megatron"), logging.getLogger("megatron_gspo")
    calls = []

    def recorded(fn):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if os.path.abspath(caller).startswith(package + os.sep):
                calls.append(f"{fn.__name__}{args} from {os.path.relpath(caller, package)}")
            return fn(*args, **kwargs)
        return call

    for name in ("filterwarnings", "simplefilter", "resetwarnings"):
        monkeypatch.setattr(warnings, name, recorded(getattr(warnings, name)))
    monkeypatch.setattr(logging, "basicConfig", recorded(logging.basicConfig))

    def loggers():
        return list(root.handlers), root.level, megatron.level, ours.level, list(ours.handlers), ours.propagate

    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("HOST %(name)s %(levelname)s %(message)s"))
    with warnings.catch_warnings():
        try:
            root.handlers[:] = [handler]
            root.setLevel(logging.INFO)
            warnings.simplefilter("default")
            warnings.filterwarnings("always", category=FutureWarning)  # a program that wants to see them
            before, host_filters = loggers(), list(warnings.filters)
            trainer = Trainer(load_job_config(None, TINY_JOB + ["train.num_steps=1", f"train.output_dir={tmp_path}"]))
            try:
                trainer.run()
            finally:
                trainer.close()
                parallel.destroy()
            after, filters = loggers(), list(warnings.filters)
        finally:
            root.handlers[:] = saved[0]
            root.setLevel(saved[1])
    assert after == before
    assert calls == []
    assert [f for f in filters if f in host_filters] == host_filters  # none removed, none reordered
    said = stream.getvalue().splitlines()
    assert any(line.startswith("HOST megatron_gspo INFO numerics: fp32 on cpu") for line in said), said[:5]
    assert any(line.startswith("HOST megatron_gspo INFO step 1/1 | reward ") for line in said), said


def _gloo_threads() -> int:
    """Threads of this process that gloo started (a process group's loop and workers: 3 per group)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum(n.startswith(("gloo", "pt_gloo")) for n in names)


def test_a_closed_job_frees_its_model_and_its_process_groups_threads(tmp_path):
    """A process that runs several jobs (tests, notebooks, the preflight, experiments) gets back each job's
    model and the threads of its process groups: megatron's DDP hooks each parameter's grad accumulator
    and keeps no handle, a cycle through C++ that outlived every job (48 gloo threads a job, each waking up
    forever: the full test suite's process ended with ~5000 of them and spent most of its time in the
    kernel), and RotaryEmbedding's cache kept the last 32 jobs' rotary modules and their groups."""
    import gc
    import weakref

    from megatron_gspo.train import Trainer

    job = TINY_JOB + ["train.num_steps=1", "train.tensorboard=false"]
    counts, ddps = [], []
    for i in range(3):
        trainer = Trainer(load_job_config(None, job + [f"train.output_dir={tmp_path / str(i)}"]))
        try:
            trainer.run()  # a backward pass: the hooks' cycle exists only after one
            ddps.append(weakref.ref(trainer.ddp))
        finally:
            trainer.close()
            parallel.destroy()
        del trainer
        gc.collect()
        counts.append(_gloo_threads())
    assert counts[2] == counts[0], f"gloo threads after each job: {counts}"
    assert [d() for d in ddps] == [None, None, None], "a closed job's DDP (and its model) is still alive"
