"""Multi-turn rollouts on the tiny model (rollout/multiturn.py): the token stream, its loss mask, the losses over
sampled tokens only, routes for every token, the record on the wire, the dump, the metrics, resume."""

import json
import math
import os

import pytest
import torch

from job_runner import built_trainers, run_job_rows, stop_when_ready

pytest.importorskip("simpleeval")

# Turns end at a stop token half of the time: 1-3 sampled tokens per turn from the untrained model; the Echo
# environment answers every turn, so rows talk until env.max_turns (or a turn cut at its cap).
STOPS = "[" + ",".join(str(i) for i in range(3, 99, 2)) + "]"
BASE = ["parallel.device=cpu", "train.sft_steps=0", "train.prompts_per_step=4", "generation.n_samples_per_prompt=2",
        "train.num_minibatches=1", "train.micro_batch_size=8", "generation.max_new_tokens=4",
        f"generation.stop_token_ids={STOPS}", "env.name=multiturn_envs:Echo", "env.max_turns=3",
        "env.num_workers=2", "eval.interval=0", "train.tensorboard=false", "train.num_steps=1"]


class Keep:
    """A hook that keeps the step's TrainBatch."""

    def __init__(self):
        self.batches = []

    def after_rollout(self, trainer, batch):
        self.batches.append(batch)

    def __getattr__(self, name):  # every other hook method: nothing
        return lambda *a, **k: None


def _record(trainer):
    return trainer.source.collect(0)


def test_a_row_is_its_prompt_then_sampled_turns_and_observations_appended_once(tmp_path):
    from megatron_gspo.env.chat import PlainFormat

    with built_trainers(BASE, tmp_path) as build:
        t = build([])
        position = t.sampler.state_dict()
        rec = _record(t)
        fmt = PlainFormat(t.tokenizer)
        assert rec.trajectories and len(rec.trajectories) == rec.num_rows == 8
        turns_seen = set()
        for r in range(rec.num_rows):
            traj, n = rec.trajectories[r], int(rec.seq_lengths[r])
            ids, mask = rec.tokens[r, :n].tolist(), rec.loss_mask[r, :n].tolist()
            plen = int(rec.prompt_lengths[r])
            assert not any(mask[:plen]) and not any(rec.loss_mask[r, n:].tolist())
            spans = traj["turns"]
            assert spans[0]["start"] == plen and spans[-1]["end"] == n and spans[-1]["role"] == "assistant"
            for a, b in zip(spans, spans[1:]):
                assert a["end"] == b["start"] and a["role"] != b["role"]  # contiguous, alternating
            for s in spans:
                sampled = s["role"] == "assistant"
                assert mask[s["start"]:s["end"]] == [sampled] * (s["end"] - s["start"])
                lp = rec.sample_logprobs[r, s["start"]:s["end"]]
                assert bool((lp < 0).all()) if sampled else bool((lp == 0).all())
                if not sampled:  # the plain format's observation, after the turn's stop token, once
                    assert ids[s["start"]:s["end"]] == fmt.observation_ids([{"role": "user", "content": "ok"}], None)
                    assert ids[s["start"] - 1] in t.prepare.gen_cfg.stop_token_ids
            assert traj["num_turns"] == sum(s["role"] == "assistant" for s in spans)
            assert traj["observation_tokens"] == sum(s["end"] - s["start"] for s in spans if s["role"] == "user")
            # three turns, or fewer when a turn reached its cap without a stop token (then truncated)
            assert traj["num_turns"] == 3 or not bool(rec.stopped[r])
            assert traj["max_turns_reached"] == (traj["num_turns"] == 3 and bool(rec.stopped[r]))
            turns_seen.add(traj["num_turns"])
        assert 3 in turns_seen
        # the same prompts again, the same record: the noise is keyed by row, turn and position
        t.sampler.load_state_dict(position)
        again = _record(t)
        assert torch.equal(again.tokens, rec.tokens) and torch.equal(again.loss_mask, rec.loss_mask)


def test_the_training_forward_scores_the_sampled_tokens_as_the_rollout_did_and_routes_match(tmp_path):
    """Token in, token out: the training forward over a whole multi-turn row gives every sampled token the
    rollout's log-prob (fp32 float noise), and, with the rollout's routes as the reference (no old-log-prob
    pass), every token of the row routes as it did in the rollout: routing change 0."""
    rows = run_job_rows(__import__("megatron_gspo.config", fromlist=["x"]).load_job_config(None, BASE + [
        f"train.output_dir={tmp_path}/off", "train.old_logprobs=rollout"]))
    r = rows[0]
    assert r["rollout/turns_mean"] > 1.5 and r["rollout/observation_tokens_mean"] > 0
    assert r["rollout/logprob_diff_max"] < 1e-5, r["rollout/logprob_diff_max"]
    assert r["routing/routing_change_frac"] == 0.0


def test_r3_replays_every_token_of_a_three_turn_row(tmp_path):
    from megatron_gspo.config import load_job_config

    rows = run_job_rows(load_job_config(None, BASE + [
        f"train.output_dir={tmp_path}/r3", "loss.name=grpo", "train.routing_replay=R3", "train.old_logprobs=recompute"]))
    r = rows[0]
    assert r["rollout/turns_mean"] > 1.5
    assert r["routing/routing_change_frac"] == 0.0 and r["loss/onpolicy/seq_ratio_dev_max"] < 1e-5


def test_observation_tokens_get_no_gradient_hand_sized():
    """A row of 8 targets: prompt, turn 1 (2 tokens), an observation (2), turn 2 (2): the loss's gradient with
    respect to every log-prob off the sampled tokens is exactly 0, and GSPO's length is 4, not the span's 7."""
    from megatron_gspo.algorithms.losses import compute_policy_loss
    from megatron_gspo.config import LossConfig

    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    logp = torch.tensor([[-1.0, -0.5, -0.25, -3.0, -2.0, -0.75, -0.125, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.55, -0.2, -1.0, -1.0, -0.7, -0.1, -1.0]])
    loss, metrics = compute_policy_loss(LossConfig(name="gspo", clip_ratio_low=0.5, clip_ratio_high=0.5), logp, old,
                                        torch.tensor([2.0]), mask)
    loss.backward()
    assert logp.grad[~mask].abs().max().item() == 0.0 and logp.grad[mask].abs().min().item() > 0
    # by hand: s = exp(mean over the 4 sampled tokens of logp - old); loss = -s * A; ds/dlogp_t = s / 4
    d = (0.05 + -0.05 + -0.05 + -0.025) / 4
    s = math.exp(d)
    assert loss.item() == pytest.approx(-2.0 * s, rel=1e-6)
    assert logp.grad[mask].tolist() == pytest.approx([-2.0 * s / 4] * 4, rel=1e-6)


def test_gspo_sequence_ratio_of_a_two_turn_row_through_the_batch_is_the_hand_computation(tmp_path):
    """A two-turn row through BatchPreparer (the record's loss mask becomes the batch's) and the objective:
    GSPO's ratio is the geometric mean over the sampled tokens only."""
    from megatron_gspo.algorithms.objective import objective

    with built_trainers(BASE + ["env.max_turns=2"], tmp_path) as build:
        t = build([])
        rec = _record(t)
        batch = t.prepare(rec)
        row = next(i for i, tr in enumerate(batch.trajectories) if tr["num_turns"] == 2)
        micro = batch.rows(torch.tensor([row]))
        n = int(micro.seq_lengths[0])
        assert micro.mask[0, :n - 1].tolist() == [bool(x) for x in rec.loss_mask[
            int((rec.row_ids == micro.row_ids[0]).nonzero()), 1:n].tolist()]
        gen = torch.Generator().manual_seed(0)
        logp = micro.old_logprobs + 0.01 * torch.randn(micro.old_logprobs.shape, generator=gen)
        micro.advantages = torch.tensor([1.5])
        loss, metrics = objective(t.objective_cfg, micro, logp, None, torch.tensor(1.0))
        m = micro.mask[0]
        s = math.exp(float((logp[0] - micro.old_logprobs[0])[m].sum()) / int(m.sum()))
        lo, hi = 3e-4, 4e-4
        want = -min(s * 1.5, min(max(s, 1 - lo), 1 + hi) * 1.5)
        assert loss.item() == pytest.approx(want, rel=1e-6)
        assert int(m.sum()) < n - 1 - int(rec.prompt_lengths.min())  # fewer than the tokens after the prompt


def test_the_record_travels_the_wire_with_its_loss_mask_and_conversations(tmp_path):
    from megatron_gspo.rollout.record import WIRE_VERSION, WireFormatError, check_header, pack, unpack

    with built_trainers(BASE, tmp_path) as build:
        t = build([])
        rec = _record(t)
        rec.routes = None
        back = unpack(*pack(rec))
        for name in ("tokens", "loss_mask", "sample_logprobs", "prompt_lengths", "response_lengths", "stopped"):
            assert torch.equal(getattr(back, name), getattr(rec, name)), name
        assert back.trajectories == rec.trajectories and back.loss_mask.dtype == torch.bool
        header = pack(rec)[0].clone()
        header[1] = WIRE_VERSION - 1
        with pytest.raises(WireFormatError, match=f"version {WIRE_VERSION - 1}"):
            check_header(header)


def test_dump_rollouts_metrics_and_the_progress_line(tmp_path):
    from megatron_gspo.config import load_job_config
    from megatron_gspo.runtime.logger import progress_line

    out = tmp_path / "dump"
    rows = run_job_rows(load_job_config(None, BASE + [f"train.output_dir={out}", "train.dump_rollouts=true"]))
    m = rows[0]
    for key in ("rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_errors", "rollout/observation_tokens_mean",
                "rollout/max_turns_reached_frac"):
        assert key in m, key
    assert m["rollout/tool_calls_mean"] == 0.0 and m["rollout/tool_errors"] == 0.0
    assert 0 < m["perf/env_s"] < m["perf/generate_s"]  # the environment's share of the turns' time
    line = progress_line(1, 1, m)
    assert f"turns {m['rollout/turns_mean']:.2f} | tools 0.00" in line
    dumped = [json.loads(x) for x in open(out / "rollouts" / "step_000001.jsonl")]
    assert len(dumped) == 8
    for d in dumped:
        assert len(d["token_ids"]) == len(d["loss_mask"]) and d["step"] == 1
        for s in d["turns"]:
            assert d["loss_mask"][s["start"]:s["end"]] == [int(s["role"] == "assistant")] * (s["end"] - s["start"])
        assert sum(d["loss_mask"]) == sum(s["end"] - s["start"] for s in d["turns"] if s["role"] == "assistant")
    assert m["rollout/turns_mean"] == pytest.approx(
        sum(sum(s["role"] == "assistant" for s in d["turns"]) for d in dumped) / 8)


def test_a_multi_turn_run_resumed_in_the_middle_equals_the_uninterrupted_one(tmp_path):
    from megatron_gspo.config import load_job_config

    job = BASE + ["train.num_steps=3", "checkpoint.save_interval=1"]
    straight = run_job_rows(load_job_config(None, job + [f"train.output_dir={tmp_path}/a", f"checkpoint.save={tmp_path}/a/ck"]))
    run_job_rows(load_job_config(None, job + ["train.num_steps=2", f"train.output_dir={tmp_path}/b",
                                              f"checkpoint.save={tmp_path}/b/ck"]))
    resumed = run_job_rows(load_job_config(None, job + [f"train.output_dir={tmp_path}/b", f"checkpoint.save={tmp_path}/b/ck",
                                                        "checkpoint.resume=true"]))
    keys = ("rollout/reward_mean", "rollout/turns_mean", "rollout/observation_tokens_mean", "loss/loss",
            "loss/approx_kl", "train/grad_norm", "rollout/response_length_mean")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(straight, resumed):
        for k in keys:
            assert a[k] == b[k], (a["step"], k, a[k], b[k])


@pytest.mark.slow
def test_a_stop_signal_during_a_tool_call_ends_the_job_within_seconds(tmp_path):
    """``python -m megatron_gspo.train`` whose environment step hangs (multiturn_envs:Hanging, in the worker
    pool): a SIGTERM once the step is running stops the job within seconds, the hanging worker killed, exit 79
    (the first step never completed: nothing to save), one stop line that says where."""
    import sys

    from megatron_gspo.runtime import exit_status

    here = os.path.dirname(os.path.abspath(__file__))
    marker, out = tmp_path / "pid", tmp_path / "run"
    job = [a for a in BASE if not a.startswith("env.name=")] + [
        "env.name=multiturn_envs:Hanging", f"env.kwargs={{marker: {marker}}}", "env.tool_timeout_s=600",
        f"train.output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")])}
    rc, said, took = stop_when_ready([sys.executable, "-m", "megatron_gspo.train", *job], env, tmp_path / "log",
                                     ready=lambda: marker.exists() and bool(marker.read_text()))
    worker = int(marker.read_text())
    text = (tmp_path / "log").read_text()
    print(f"SIGTERM during a hanging environment step: the stop line {said} s later, exit {rc} {took:.1f} s later")
    assert rc == exit_status.EXIT_PREEMPTED_NOTHING_SAVED and said is not None and said < 5 and took < 30, \
        (rc, said, took, text[-3000:])
    stop = [ln for ln in text.splitlines() if "preempted by signal" in ln]
    assert len(stop) == 1 and "SIGTERM" in stop[0] and "over turns" in stop[0] and "Traceback" not in text, text[-3000:]
    with pytest.raises(ProcessLookupError):  # the worker that hung is gone
        os.kill(worker, 0)


# ----------------------------------------------------------------------------------------------
# Layouts and the asynchronous source (torchrun, gloo): the multi-turn job equals its one-rank run
# ----------------------------------------------------------------------------------------------

# A multi-turn environment that is not a tool (env/games.py), importable by every rank: an untrained policy
# rarely says a number, so most rows are told "a number, please" and talk until env.max_turns.
DIST_JOB = [a for a in BASE if not a.startswith(("env.name=", "parallel.device=", "train.num_steps="))] + [
    "env.name=megatron_gspo.env.games:GuessWithFeedback", "train.num_steps=2", "train.old_logprobs=recompute",
    "train.dump_rollouts=true"]
DIST_LAYOUTS = {  # name: (ranks, overrides)
    "tp2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "ep2": (2, ["parallel.expert_model_parallel_size=2"]),
    "dp2": (2, []),
    "async": (2, ["rollout.mode=async", "rollout.world_size=1", "rollout.max_staleness=0"]),
}


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory, run_dist):
    root = tmp_path_factory.mktemp("multiturn_layouts")
    run_dist("run_job.py", 1, "--out", str(root / "one"), "--", *DIST_JOB, timeout=600)
    for name, (n, extra) in DIST_LAYOUTS.items():
        run_dist("run_job.py", n, "--out", str(root / name), "--", *DIST_JOB, *extra, timeout=600)
    return root


def _trained_rows(d):
    out = {}
    for name in sorted(os.listdir(d)):
        if name.startswith("rollouts.dp"):
            for line in open(d / name):
                r = json.loads(line)
                assert (r["step"], r["row"]) not in out
                out[(r["step"], r["row"])] = r
    return out


@pytest.mark.parametrize("layout", list(DIST_LAYOUTS))
def test_the_multi_turn_job_under_a_layout_or_async_equals_one_rank(dist_runs, layout):
    """TP 2 (the environments on the first rank of the TP group, their replies broadcast), EP 2 (the turns in
    MoE lockstep), DP 2 (rows dealt by tokens: conversations and loss masks move with them), and an async job
    (one trainer + one rollout rank, staleness 0: the record over the wire): every row of every step, its
    tokens, its loss mask, its reward and advantage are the one-rank run's, the turn metrics equal, the losses
    and the final weights equal to float noise."""
    from megatron_gspo.checkpoint import dist_checkpoint_to_tensors

    ref, got = _trained_rows(dist_runs / "one"), _trained_rows(dist_runs / layout)
    assert len(ref) == 2 * 8 and ref.keys() == got.keys()
    for k in ref:
        for field in ("tokens", "mask", "reward", "advantage"):
            assert ref[k][field] == got[k][field], (layout, k, field)
    assert any(0 < sum(r["mask"]) < len(r["mask"]) - 3 for r in ref.values())  # observations in the rows
    for step in (1, 2):  # train.dump_rollouts: every DP rank's rows in rank 0's file, their conversations with them
        dumped = [{d["sample_id"]: d for d in map(json.loads, open(root / "rollouts" / f"step_{step:06d}.jsonl"))}
                  for root in (dist_runs / "one", dist_runs / layout)]
        assert len(dumped[0]) == 8 and dumped[0] == dumped[1], (layout, step)
    m_ref = [json.loads(x) for x in open(dist_runs / "one" / "metrics.jsonl")]
    m_got = [json.loads(x) for x in open(dist_runs / layout / "metrics.jsonl")]
    assert [r["step"] for r in m_got] == [1, 2] and m_ref[0]["rollout/turns_mean"] > 1.5
    for a, b in zip(m_ref, m_got):
        for key in ("rollout/turns_mean", "rollout/observation_tokens_mean", "rollout/max_turns_reached_frac",
                    "rollout/reward_mean"):
            assert a[key] == b[key], (layout, a["step"], key)
        for key in ("loss/loss", "train/grad_norm", "loss/approx_kl", "loss/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (layout, a["step"], key)
    tensors = lambda d: {k: v for k, v in dist_checkpoint_to_tensors(str(d / "weights")).items()  # noqa: E731
                         if isinstance(v, torch.Tensor)}
    w_ref, w_got = tensors(dist_runs / "one"), tensors(dist_runs / layout)
    assert max((w_got[k] - w_ref[k]).abs().max().item() for k in w_ref) < 5e-5


def test_dynamic_sampling_and_rollout_correction_run_on_multi_turn_rows(tmp_path):
    """Dynamic sampling draws rounds of multi-turn rows (no group is informative here: every row ends unscored by
    Echo, exact_match gives 0) and keeps their conversations with them; rollout correction weighs the sampled
    tokens (TIS, the old log-probs recomputed: the ratio to the rollout's is float noise)."""
    from megatron_gspo.config import load_job_config

    rows = run_job_rows(load_job_config(None, BASE + [
        f"train.output_dir={tmp_path}/ds", "train.dynamic_sampling=true", "train.dynamic_sampling_max_rounds=1",
        "train.old_logprobs=recompute", "rollout_correction.mode=tis", "train.dump_rollouts=true"]))
    m = rows[0]
    assert m["dynamic_sampling/rounds"] == 2.0 and m["rollout/turns_mean"] > 1.5
    correction = {k: v for k, v in m.items() if k.startswith("rollout_correction/")}
    assert correction, sorted(m)
    dumped = [json.loads(x) for x in open(tmp_path / "ds" / "rollouts" / "step_000001.jsonl")]
    assert len(dumped) == 8 and all(d["turns"][-1]["role"] == "assistant" for d in dumped)
    assert m["rollout/logprob_diff_max"] < 1e-5


def test_evaluation_talks_each_held_out_prompt_to_its_end(tmp_path):
    """eval.* of a multi-turn job: each held-out prompt talked over turns with its environment (greedy), the
    turns and tool calls reported beside the accuracy."""
    from megatron_gspo.config import load_job_config

    rows = run_job_rows(load_job_config(None, [a for a in BASE if a != "eval.interval=0"] + [
        f"train.output_dir={tmp_path}/eval", "eval.interval=1", "eval.num_prompts=4", "eval.num_samples=0"]))
    m = rows[0]
    assert m["eval/num_prompts"] == 4.0 and m["eval/turns_mean"] > 1.5 and m["eval/tool_calls_mean"] == 0.0
    assert m["eval/greedy_accuracy"] == 0.0  # Echo never rewards, exact_match on a word of the untrained model
    assert m["eval/response_length_mean"] <= 3 * 4  # sampled tokens only: at most 3 turns of 4
