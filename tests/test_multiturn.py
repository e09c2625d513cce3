"""Multi-turn rollouts on the tiny model (rollout/multiturn.py): the token stream, its loss mask, the losses over
sampled tokens only, routes for every token, the record on the wire, the dump, the metrics, resume."""

import json
import math
import os

import pytest
import torch

from job_runner import built_trainers, run_job_rows, stop_when_ready
from multiturn_envs import check_turn_spans

import simpleeval  # noqa: E402,F401  (install_requires: missing, it is an error, never a skip)

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
            traj = rec.trajectories[r]
            ids, mask, spans = check_turn_spans(rec, r, fmt, t.prepare.gen_cfg.stop_token_ids)
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


def _nearly_tie_the_routers(model, eps: float) -> None:
    """Every MoE router's expert rows made its first row plus ``eps`` noise: the top-k is decided at rounding level."""
    from megatron_gspo.model.gpt import unwrap
    from megatron_gspo.routing.common import find_routers

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in find_routers(unwrap(model)):
            w = router.weight
            w.copy_(w[:1].expand_as(w) + eps * torch.randn(w.shape, generator=g))


def _replayed_gap(t, rec, rows: list[int]) -> float:
    """The largest |training forward's log-prob - rollout's| over the sampled tokens of record rows ``rows``, the
    training forward (the old-log-prob pass) replaying the record's routes (R3)."""
    batch = t.prepare(rec)
    at = [batch.row_ids.tolist().index(int(rec.row_ids[r])) for r in rows]
    m = batch.mask[at]
    return (batch.old_logprobs[at] - batch.sample_logprobs[at])[m].abs().max().item()


def test_r3_rollout_logprobs_of_a_three_turn_row_are_the_training_forward_s_with_its_routes_replayed(tmp_path):
    """Under R3 the rollout's log-prob of every sampled token of a three-turn row is the training forward's with
    the recorded routes replayed (fp32, to rounding: 4.8e-7 measured): the routes R3 replays are the ones its
    tokens were sampled under. The routers are nearly tied, so rounding decides the top-k: a turn whose tokens were
    sampled over a history prefilled again (routes recomputed, not the recorded ones) is off by 6e-5. With one
    turn's routes shifted by one position (what an off-by-one where turns join would file) it is off by 2e-2."""
    import copy

    with built_trainers(BASE + ["loss.name=grpo", "train.routing_replay=R3", "train.old_logprobs=recompute"],
                        tmp_path) as build:
        t = build([])
        _nearly_tie_the_routers(t.model, 1e-6)
        rec = _record(t)
        three = [r for r, tr in enumerate(rec.trajectories) if tr["num_turns"] == 3]
        assert three
        gap = _replayed_gap(t, rec, three)
        assert gap < 2e-6, gap
        shifted = copy.deepcopy(rec)
        r = three[0]
        turn2 = rec.trajectories[r]["turns"][2]["start"]  # the second sampled turn's first token
        n = int(rec.seq_lengths[r])
        routes = shifted.routes.routes
        routes[:, r, turn2:n - 1] = rec.routes.routes[:, r, turn2 - 1:n - 2].clone()
        assert _replayed_gap(t, shifted, [r]) > 1e-3


def test_a_three_turn_job_prefills_each_token_of_a_row_once(tmp_path):
    """perf/prefill_tokens of a three-turn step: every fed token of a row is run through the model once in all,
    sampled tokens in decode steps (each turn's last, never fed in its turn, in the next turn's prefill), so
    each row prefills its stream less its sampled tokens, plus one per turn that an observation followed (its
    prompt once per distinct prompt: the G samples share its prefill). A prefill of every turn's whole context
    counts the history again at each turn."""
    from megatron_gspo.rollout.prepare import rollout_metrics

    with built_trainers(BASE, tmp_path) as build:
        t = build([])
        rec = _record(t)
        want, seen, again = 0, set(), 0
        for r, tr in enumerate(rec.trajectories):
            plen, n = int(rec.prompt_lengths[r]), int(rec.seq_lengths[r])
            prompt = tuple(rec.tokens[r, :plen].tolist())
            turns = [s for s in tr["turns"] if s["role"] == "assistant"]
            sampled = sum(s["end"] - s["start"] for s in turns)
            want += n - sampled + len(turns) - 1 - (plen if prompt in seen else 0)
            again += sum(s["start"] for s in turns[1:])  # every later turn's context
            seen.add(prompt)
        assert max(tr["num_turns"] for tr in rec.trajectories) == 3
        got = rollout_metrics(t.prepare(rec), t.state)["perf/prefill_tokens"]
        assert got == want and again > 0


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


def run_layouts(root, run_dist, run_dist_jobs, job, layouts):
    """``job`` on one rank (``root/one``) and under each of ``layouts`` (name: (ranks, overrides)): ``root``. The
    synchronous runs of a world size share one torchrun (jobs.py); an asynchronous one has its own."""
    runs = {"one": (1, []), **layouts}
    sync = {k: v for k, v in runs.items() if "rollout.mode=async" not in v[1]}
    run_dist_jobs({k: (n, ["run_job.py", "--out", root / k, "--", *job, *extra]) for k, (n, extra) in sync.items()},
                  root, job_timeout=600)
    for name, (n, extra) in runs.items():
        if name not in sync:
            run_dist("run_job.py", n, "--out", str(root / name), "--", *job, *extra, timeout=600)
    return root


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory, run_dist, run_dist_jobs):
    return run_layouts(tmp_path_factory.mktemp("multiturn_layouts"), run_dist, run_dist_jobs, DIST_JOB, DIST_LAYOUTS)


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
    _equals_one_rank(dist_runs / "one", dist_runs / layout, layout, rows=8)


def _equals_one_rank(one, got_dir, layout, rows):
    """The run in ``got_dir`` (2 steps of ``rows`` rows) equals the one-rank run in ``one`` (see above)."""
    from megatron_gspo.checkpoint import dist_checkpoint_to_tensors

    ref, got = _trained_rows(one), _trained_rows(got_dir)
    assert len(ref) == 2 * rows and ref.keys() == got.keys()
    for k in ref:
        for field in ("tokens", "mask", "reward", "advantage"):
            assert ref[k][field] == got[k][field], (layout, k, field)
    assert any(0 < sum(r["mask"]) < len(r["mask"]) - 3 for r in ref.values())  # observations in the rows
    for step in (1, 2):  # train.dump_rollouts: every DP rank's rows in rank 0's file, their conversations with them
        dumped = [{d["sample_id"]: d for d in map(json.loads, open(root / "rollouts" / f"step_{step:06d}.jsonl"))}
                  for root in (one, got_dir)]
        assert len(dumped[0]) == rows and dumped[0] == dumped[1], (layout, step)
    m_ref = [json.loads(x) for x in open(one / "metrics.jsonl")]
    m_got = [json.loads(x) for x in open(got_dir / "metrics.jsonl")]
    assert [r["step"] for r in m_got] == [1, 2] and m_ref[0]["rollout/turns_mean"] > 1.5
    for a, b in zip(m_ref, m_got):
        for key in ("rollout/turns_mean", "rollout/observation_tokens_mean", "rollout/max_turns_reached_frac",
                    "rollout/reward_mean"):
            assert a[key] == b[key], (layout, a["step"], key)
        for key in ("loss/loss", "train/grad_norm", "loss/approx_kl", "loss/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (layout, a["step"], key)
    tensors = lambda d: {k: v for k, v in dist_checkpoint_to_tensors(str(d / "weights")).items()  # noqa: E731
                         if isinstance(v, torch.Tensor)}
    w_ref, w_got = tensors(one), tensors(got_dir)
    assert max((w_got[k] - w_ref[k]).abs().max().item() for k in w_ref) < 5e-5


@pytest.fixture(scope="module")
def forced_token_runs(tmp_path_factory, run_dist):
    """DIST_JOB at one rank and at DP 2 with a forced first token in every later assistant turn, off the loss mask
    (tests/dist_scripts/multiturn_mask.py)."""
    root = tmp_path_factory.mktemp("multiturn_mask")
    for name, n in (("one", 1), ("dp2", 2)):
        run_dist("multiturn_mask.py", n, "--out", str(root / name), "--", *DIST_JOB, timeout=600)
    return root


def _by_role(row):
    """A dumped row's loss mask as its turns' roles would say it: 1 on the assistant turns."""
    mask = [0] * len(row["token_ids"])
    for t in row["turns"]:
        mask[t["start"]:t["end"]] = [int(t["role"] == "assistant")] * (t["end"] - t["start"])
    return mask


def test_a_loss_mask_the_roles_do_not_say_travels_with_its_row_between_dp_ranks(forced_token_runs):
    """DP 2, rows dealt to the other rank: every row's loss mask on the rank that trains it is bit for bit the one
    the generating rank built, forced tokens off it although their turn is the assistant's (a mask rebuilt from the
    roles would train on them), and the run is the one-rank run: each row's tokens, mask, reward and advantage, the
    dump (rank 0's file: every rank's rows with their conversations), the losses and the final weights."""
    from megatron_gspo.checkpoint import dist_checkpoint_to_tensors

    one, dp2 = forced_token_runs / "one", forced_token_runs / "dp2"
    dumps = {d: {step: {r["sample_id"]: r for r in map(json.loads, open(d / "rollouts" / f"step_{step:06d}.jsonl"))}
                 for step in (1, 2)} for d in (one, dp2)}
    rows = list(dumps[one][1].values()) + list(dumps[one][2].values())
    assert len(rows) == 16 and all(len(r) == 8 for r in dumps[dp2].values())
    off = [r for r in rows if r["loss_mask"] != _by_role(r)]
    assert len(off) > 4 and all(a <= b for r in rows for a, b in zip(r["loss_mask"], _by_role(r)))
    # the masks the generating ranks built, and the ones the training ranks got (masks_rank<r>.jsonl)
    masks = {r: [json.loads(x) for x in open(dp2 / f"masks_rank{r}.jsonl")] for r in (0, 1)}
    trained = _trained_rows(dp2)
    moved_off = 0
    for step in (1, 2):
        built = {**masks[0][step - 1]["held"], **masks[1][step - 1]["held"]}
        assert sorted(map(int, built)) == list(range(8))
        for r in (0, 1):
            got = masks[r][step - 1]["got"]
            for slot, mask in got.items():
                assert mask == built[slot], (step, r, slot)
                if slot not in masks[r][step - 1]["held"]:  # generated on the other rank
                    row = dumps[dp2][step][trained[(step, int(slot))]["sample"]]
                    moved_off += row["loss_mask"] != _by_role(row)
    assert moved_off > 0  # rows whose mask the roles do not say did move
    m_ref = [json.loads(x) for x in open(one / "metrics.jsonl")]
    m_got = [json.loads(x) for x in open(dp2 / "metrics.jsonl")]
    assert all(m["rollout/dp_moved_rows_frac"] > 0 for m in m_got)
    ref, got = _trained_rows(one), trained
    assert len(ref) == 16 and ref.keys() == got.keys()
    for k in ref:
        for field in ("tokens", "mask", "reward", "advantage"):
            assert ref[k][field] == got[k][field], (k, field)
    assert dumps[one] == dumps[dp2]
    for a, b in zip(m_ref, m_got):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"] and a["loss/num_tokens"] == b["loss/num_tokens"]
        for key in ("loss/loss", "train/grad_norm", "loss/approx_kl", "loss/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (a["step"], key)
    tensors = lambda d: {k: v for k, v in dist_checkpoint_to_tensors(str(d / "weights")).items()  # noqa: E731
                         if isinstance(v, torch.Tensor)}
    w_ref, w_got = tensors(one), tensors(dp2)
    assert max((w_got[k] - w_ref[k]).abs().max().item() for k in w_ref) < 5e-5


# Ranks that step together without EP (runtime/parallel.py, ParallelState.lockstep_group): expert-TP 2 at TP 1
# joins the two DP ranks through the MoE layers' token dispatch; TP 2 x EP 2 at expert-TP 1 on 2 ranks is one DP
# rank whose expert group is its TP group. Two prompts per step, so that in step 2 the rows that DP rank 0
# generates end a turn before rank 1's: rank 0 then runs a turn with no row left (generate's own dummy rows).
LOCKSTEP_JOB = [a for a in DIST_JOB if not a.startswith("train.prompts_per_step=")] + ["train.prompts_per_step=2"]
LOCKSTEP_LAYOUTS = {
    "etp2": (2, ["parallel.expert_tensor_parallel_size=2"]),
    "tp2ep2etp1": (2, ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2",
                       "parallel.expert_tensor_parallel_size=1"]),
}


@pytest.fixture(scope="module")
def lockstep_runs(tmp_path_factory, run_dist, run_dist_jobs):
    return run_layouts(tmp_path_factory.mktemp("multiturn_lockstep"), run_dist, run_dist_jobs, LOCKSTEP_JOB,
                       LOCKSTEP_LAYOUTS)


@pytest.mark.parametrize("layout", list(LOCKSTEP_LAYOUTS))
def test_ranks_joined_by_expert_tensor_parallelism_step_together_and_equal_one_rank(lockstep_runs, layout):
    """Expert-TP 2 (TP 1, EP 1: the expert group spans both DP ranks, which must run every forward together:
    generation, the turns, the micro-batch widths of the old-log-prob and training passes) and TP 2 x EP 2 at
    expert-TP 1: rows of uneven length over turns, one DP rank out of rows a turn before the other; every row,
    metric and final weight is the one-rank run's (the comparison above)."""
    from megatron_gspo.rollout.rows import generating_rank

    one = lockstep_runs / "one"
    ref = _trained_rows(one)
    dumped = {d["sample_id"]: d for d in map(json.loads, open(one / "rollouts" / "step_000002.jsonl"))}
    turns = {r["row"]: sum(t["role"] == "assistant" for t in dumped[r["sample"]]["turns"])
             for (step, _), r in ref.items() if step == 2}
    by_rank = [max(n for row, n in turns.items() if generating_rank(row, 4, 1, 2) == rank) for rank in (0, 1)]
    assert by_rank[0] < by_rank[1], turns  # DP rank 0 (of 2) has no row left in step 2's last turn
    assert len({len(r["tokens"]) for r in ref.values()}) > 2  # ragged rows
    _equals_one_rank(one, lockstep_runs / layout, layout, rows=4)


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


# ----------------------------------------------------------------------------------------------
# User code against the worker protocol, in a job: output on fd 1; the record of a huge tool result
# ----------------------------------------------------------------------------------------------


def test_an_environment_writing_to_fd_1_trains_and_its_output_reaches_the_log(tmp_path, capfd):
    """A job whose environment writes to file descriptor 1 at every reset and step (``print``, ``os.write``, a child
    process), in lines that look like replies: the job trains its step, the rows talk to env.max_turns, and what
    the environment wrote is in the log (the workers' stderr)."""
    from megatron_gspo.config import load_job_config

    out = tmp_path / "run"
    job = [a for a in BASE if not a.startswith("env.name=")] + ["env.name=multiturn_envs:Noisy",
                                                               f"train.output_dir={out}", "train.dump_rollouts=true"]
    (m,) = run_job_rows(load_job_config(None, job))
    assert m["step"] == 1 and m["rollout/env_error_frac"] == 0.0 and math.isfinite(m["loss/loss"])
    dumped = [json.loads(x) for x in open(out / "rollouts" / "step_000001.jsonl")]
    observed = [t["text"] for d in dumped for t in d["turns"] if t["role"] == "user"]
    assert observed and set(observed) == {"ok"}  # what step returned, never what it wrote
    err = capfd.readouterr().err  # every reset and every step said its three lines (a step per observation at least)
    assert err.count("noisy child process in reset") == 8 and err.count("noisy print in step") >= len(observed), err[-2000:]
    assert err.count('{"ok": "forged by os.write"}') == err.count("noisy print in") >= 8 + len(observed)


def test_the_record_keeps_a_tool_result_as_the_policy_read_it():
    """A tool's result longer than env.max_observation_tokens: the observation and the recorded tool call (what
    train.dump_rollouts writes) hold the same cut text, not what the tool returned."""
    from megatron_gspo.config import EnvConfig
    from megatron_gspo.data.tokenizer import CharTokenizer
    from megatron_gspo.env.chat import PlainFormat
    from megatron_gspo.rollout.multiturn import MultiTurnRollout, Trajectory

    tok = CharTokenizer()
    mt = MultiTurnRollout.__new__(MultiTurnRollout)
    mt.tokenizer, mt.fmt, mt.env, mt.budget = tok, PlainFormat(tok), EnvConfig(max_observation_tokens=8), 1000
    row = Trajectory(tok.encode("q"), 1)
    row.append(tok.encode("<call>huge 1</call>") + [tok.eos_id], True)
    row.num_turns = 1
    big = "0123456789" * 1000
    res = {"observation": [{"role": "tool", "content": big}], "reward": None, "done": False, "error": None,
           "tool_calls": [{"name": "huge", "arguments": {"megabytes": 1}, "result": big}], "tool_errors": 0}
    mt._observe(row, res, tok.eos_id)
    assert row.turns[-1]["text"] == "01234567" and row.tool_calls == [
        {"turn": 1, "name": "huge", "arguments": {"megabytes": 1}, "result": "01234567"}]


# Sampled text that once raised in the trainer (issue 47, row B): an integer past Python's int-string limit, JSON
# nested past its recursion limit; each a tool call of the calculator (one parameter: the bare value is read too).
_BREAKERS = [f"<call>calculator {'9' * 5000}</call>", "<call>calculator {\"expression\": " + "9" * 5000 + "}</call>",
             "<call>calculator " + "[" * 3000 + "</call>", "<call>calculator {\"expression\": " + "[" * 3000 + "}</call>"]


def test_sampled_text_that_broke_the_parser_is_a_counted_tool_error_in_a_training_job(tmp_path, monkeypatch):
    """A training job whose policy "samples" those texts at its first turn (the text the environment reads is
    replaced where the rollout decodes it): each is answered with an error observation and counted; the job trains."""
    from megatron_gspo.config import load_job_config
    from megatron_gspo.rollout import multiturn

    given = []
    take = multiturn.MultiTurnRollout._take

    def sampled(self, row, out, j, cap, routes):
        ids = take(self, row, out, j, cap, routes)
        if row.num_turns == 1 and not row.ended:  # the rows whose first turn goes to the environment
            row.final_text = _BREAKERS[len(given) % len(_BREAKERS)]
            given.append(row.final_text)
        return ids

    monkeypatch.setattr(multiturn.MultiTurnRollout, "_take", sampled)
    out = tmp_path / "b"
    rows = run_job_rows(load_job_config(None, BASE + [
        f"train.output_dir={out}", "env.name=tools", "env.tools=[calculator]", "env.max_turns=2",
        "train.dump_rollouts=true"]))
    assert len(given) >= 4 and rows[0]["step"] == 1 and math.isfinite(rows[0]["loss/loss"])
    assert rows[0]["rollout/tool_errors"] == len(given)  # one failed call per row that said one
    dumped = [json.loads(x) for x in open(out / "rollouts" / "step_000001.jsonl")]
    calls = [c for d in dumped for c in d["tool_calls"]]
    assert len(calls) == len(given) and all("error" in c and "result" not in c for c in calls)
    tool_turns = [s for d in dumped for s in d["turns"] if s["role"] == "tool"]
    assert len(tool_turns) == len(given) and all(s["text"].startswith("error: ") for s in tool_turns)


def _env_job(tmp_path, name: str, *extra: str) -> list:

    return BASE + [f"train.output_dir={tmp_path / name}", "train.dump_rollouts=true", *extra]


def _dumped(tmp_path, name: str, step: int = 1) -> list:
    return [json.loads(x) for x in open(tmp_path / name / "rollouts" / f"step_{step:06d}.jsonl")]


def test_an_environment_whose_step_raises_is_said_dumped_and_stops_the_job_past_env_max_error_frac(tmp_path):
    """(issue 47, row F) Every row's step raises (an ``async def step``): under env.max_error_frac=1 the job trains,
    the log says the first error of its kind once, with the traceback's last line and where, and each dumped row
    keeps its error; under the default (0.5) the job stops after the step's dump, naming the count and the error."""
    import logging

    from log_capture import LogLines
    from megatron_gspo.config import load_job_config
    from megatron_gspo.errors import EnvError

    where = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiturn_envs.py")
    with LogLines(logging.WARNING) as said:
        rows = run_job_rows(load_job_config(None, _env_job(tmp_path, "on", "env.name=multiturn_envs:AsyncRaising",
                                                           "env.max_error_frac=1", "train.num_steps=2")))
    dumped = _dumped(tmp_path, "on")
    failed = [d for d in dumped if d["env_error"] is not None]  # every row but one cut at its first turn's cap
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["rollout/env_error_frac"] == len(failed) / 8 >= 0.75
    told = [line for line in said.lines if line.startswith("environment error")]
    assert len(told) == 1, said.lines  # the first of its kind only, over two steps of 8 rows
    assert "(the first RuntimeError;" in told[0] and "env.max_error_frac=1" in told[0]
    assert "step() of row 0 failed: RuntimeError: the async environment broke (at " + where in told[0]
    assert all("RuntimeError: the async environment broke" in d["env_error"] for d in failed)
    with pytest.raises(EnvError, match=rf"^{len(failed)} of step 1's 8 rows ended on an environment error, more than "
                                       r"env\.max_error_frac=0\.5 of them; the first on this rank: multiturn_envs:"
                                       r"AsyncRaising\.step\(\) of row \d+ failed: RuntimeError"):
        run_job_rows(load_job_config(None, _env_job(tmp_path, "off", "env.name=multiturn_envs:AsyncRaising")))
    assert len(_dumped(tmp_path, "off")) == 8  # the step that stopped it is dumped first
    assert not os.path.exists(tmp_path / "off" / "metrics.jsonl") or not open(tmp_path / "off" / "metrics.jsonl").read()


def test_a_reward_float32_cannot_hold_is_its_row_s_environment_error_not_a_crash(tmp_path):
    """(issue 47, row C) Rewarding(1e300): each row ends on an environment error naming the environment, the row and
    the value; the job trains (env.max_error_frac=1), the rows scored by reward.name as rows without a reward."""
    from megatron_gspo.config import load_job_config

    rows = run_job_rows(load_job_config(None, _env_job(tmp_path, "c", "env.name=multiturn_envs:Rewarding",
                                                       "env.max_error_frac=1")))
    failed = [d for d in _dumped(tmp_path, "c") if d["env_error"] is not None]
    assert rows[0]["rollout/env_error_frac"] == len(failed) / 8 >= 0.75 and math.isfinite(rows[0]["loss/loss"])
    for d in failed:
        assert "multiturn_envs:Rewarding.step() of row " in d["env_error"]
        assert "returned reward 1e+300, beyond float32's range" in d["env_error"] and d["reward"] == 0.0


def test_an_observation_the_tokenizer_cannot_encode_ends_its_row_not_the_job(tmp_path):
    """(issue 47, row I) Accented answers "café": the built-in character tokenizer has no "é"; each row ends on an
    environment error saying so after its first turn, and the job trains (env.max_error_frac=1)."""
    from megatron_gspo.config import load_job_config

    rows = run_job_rows(load_job_config(None, _env_job(tmp_path, "i", "env.name=multiturn_envs:Accented",
                                                       "env.max_error_frac=1")))
    assert rows[0]["step"] == 1 and math.isfinite(rows[0]["loss/loss"])
    dumped = _dumped(tmp_path, "i")
    talked = [d for d in dumped if d["env_error"] is not None]
    assert talked and rows[0]["rollout/env_error_frac"] == len(talked) / 8
    for d in talked:
        assert "the observation after turn 1 of row " in d["env_error"] and "cannot be tokenized: " in d["env_error"]
        assert "'é'" in d["env_error"] and [s["role"] for s in d["turns"]] == ["assistant"]


def test_an_over_long_first_message_is_dropped_under_the_default_policy(tmp_path):
    """(issue 47) LongFirst opens some rows with 400 tokens > data.max_prompt_length=64: under the default policy
    (drop) each such row ends before its first turn, nothing of it trained (loss mask all 0), counted as an
    environment error; the others talk and the job trains. Under "error" the job stops, as before."""
    from megatron_gspo.config import load_job_config
    from megatron_gspo.errors import DataError

    rows = run_job_rows(load_job_config(None, _env_job(tmp_path, "drop", "env.name=multiturn_envs:LongFirst",
                                                       "env.max_error_frac=1")))
    dumped = _dumped(tmp_path, "drop")
    dropped = [d for d in dumped if d["env_error"] is not None]
    assert 0 < len(dropped) < 8 and rows[0]["rollout/env_error_frac"] == len(dropped) / 8
    for d in dropped:
        assert "renders to " in d["env_error"] and d["env_error"].endswith(
            "> data.max_prompt_length=64: dropped (data.overlong_prompt_policy=drop)")
        assert sum(d["loss_mask"]) == 0 and d["turns"] == [] and len(d["token_ids"]) == 64
    assert all(sum(d["loss_mask"]) > 0 for d in dumped if d["env_error"] is None)
    assert math.isfinite(rows[0]["loss/loss"])
    with pytest.raises(DataError, match="renders to 4.. tokens > data.max_prompt_length=64; raise"):
        run_job_rows(load_job_config(None, _env_job(tmp_path, "error", "env.name=multiturn_envs:LongFirst",
                                                    "data.overlong_prompt_policy=error")))


def test_an_async_multi_turn_job_reports_its_environment_time(tmp_path, run_dist):
    """perf/env_s of rollout.mode=async (issue 47): the rollout ranks' environment seconds travel with the record, as
    a colocated job times its own (the slowest leader's)."""
    run_dist("run_job.py", 2, "--out", str(tmp_path), "--", *DIST_JOB, "train.num_steps=1",
             *DIST_LAYOUTS["async"][1], timeout=600)
    (m,) = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert 0 < m["perf/env_s"] < m["perf/generate_s"], m.get("perf/env_s")
