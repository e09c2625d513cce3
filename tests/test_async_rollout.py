"""Asynchronous rollouts (megatron_gspo/rollout/): generation and training on separate ranks of one
torchrun world, weights streamed after every step, bounded staleness, faults.

Multi-rank tests run torchrun on the CPU with gloo (tests/conftest.py run_dist, slow tier); the config
checks and the generation-with-updates logic run in one process (fast tier)."""

import json
import os

import pytest
import torch

from megatron_gspo.checkpoint import dist_checkpoint_to_tensors, latest_complete
from megatron_gspo.config import ConfigError, ParallelConfig, load_job_config

HERE = os.path.dirname(os.path.abspath(__file__))
ASYNC = ["rollout.mode=async", "rollout.world_size=1"]


def tensors(path):
    return {k: v for k, v in dist_checkpoint_to_tensors(path).items() if isinstance(v, torch.Tensor)}


# ----------------------------------------------------------------------------------------------
# config (fast)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["rollout.world_size=2"], "rollout.world_size=2 is only used with rollout.mode=async"),
    (["rollout.mode=async"], "rollout.mode=async needs rollout.world_size >= 1"),
    (["rollout.mode=sync"], "rollout.mode='sync' is not one of ['colocated', 'async']"),
    (ASYNC + ["rollout.partial_rollouts=keep"], "rollout.partial_rollouts='keep' is not one of ['finish', 'drop']"),
    (ASYNC + ["rollout.max_staleness=-1"], "rollout.max_staleness must be an integer >= 0"),
    (ASYNC, "rollout.max_staleness=1 trains on rollouts of older weights"),
    (ASYNC + ["rollout.max_staleness=0", "train.old_logprobs=rollout"], "train.old_logprobs=rollout with rollout.mode=async"),
    (ASYNC + ["rollout.max_staleness=0", "loss.name=grpo", "train.routing_replay=R3"],
     "train.routing_replay=R3 with rollout.mode=async"),
    (ASYNC + ["rollout.max_staleness=0", "train.dynamic_sampling=true"], "train.dynamic_sampling=true with rollout.mode=async"),
    (ASYNC + ["rollout.max_staleness=0", "generation.max_batch_rows=8"], "generation.max_batch_rows=8 with rollout.mode=async"),
])
def test_config_refuses_what_async_cannot_do(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_job_config(None, overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("world, overrides, message", [
    (1, [], "needs more ranks than that (the trainer gets the rest), but the job has 1"),
    (4, ["parallel.tensor_model_parallel_size=2"], "world size 3 is not a multiple of tensor_model_parallel_size"),
    (3, ["rollout.tensor_model_parallel_size=2"], "rollout.tensor_model_parallel_size"),
    (4, ["rollout.world_size=2", "rollout.expert_model_parallel_size=3"], "rollout.expert_model_parallel_size"),
    (5, ["rollout.world_size=3", "train.prompts_per_step=4", "generation.n_samples_per_prompt=2"],
     "8 rollout rows are not divisible by the rollout ranks' data-parallel size 3"),
])
def test_world_size_checks_name_the_keys(world, overrides, message):
    from megatron_gspo.rollout.layout import check_world

    cfg = load_job_config(None, ASYNC + ["rollout.max_staleness=0"] + overrides)
    with pytest.raises(ConfigError) as e:
        check_world(cfg, world)
    assert message in str(e.value)


def test_split_of_a_world():
    from megatron_gspo.rollout.layout import check_world

    cfg = load_job_config(None, ["rollout.mode=async", "rollout.world_size=4", "rollout.max_staleness=0",
                                 "rollout.tensor_model_parallel_size=2", "parallel.tensor_model_parallel_size=2"])
    s = check_world(cfg, 8)
    assert (s.trainer_size, s.rollout_size, s.trainer_dp, s.rollout_dp) == (4, 4, 2, 2)
    assert [s.role(r) for r in range(8)] == ["trainer"] * 4 + ["rollout"] * 4
    assert [s.side_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert s.rollout_leaders == [0, 2]


def test_colocated_is_the_default_and_keeps_the_old_logprob_decision():
    from megatron_gspo.config import old_logprob_source

    cfg = load_job_config(None, [])
    assert cfg.rollout.mode == "colocated" and cfg.rollout.world_size == 0
    assert old_logprob_source(cfg, "cpu")[0] is False  # fp32 on the CPU: the rollout's, as before
    cfg = load_job_config(None, ASYNC + ["rollout.max_staleness=0"])
    assert old_logprob_source(cfg, "cpu")[0] is True


# ----------------------------------------------------------------------------------------------
# weight sync (slow)
# ----------------------------------------------------------------------------------------------

TP2 = "parallel.tensor_model_parallel_size=2"
EP2 = "parallel.expert_model_parallel_size=2"


@pytest.fixture(scope="module")
def one_rank_weights(tmp_path_factory):
    """The trained weights of the sync test (seed 777) on one rank, fp32 and bf16."""
    from megatron_gspo.runtime import parallel
    from megatron_gspo.checkpoint import save_model
    from megatron_gspo.model.init_weights import init_weights
    from megatron_gspo.model.gpt import build_model

    out = {}
    for precision in ("fp32", "bf16"):
        cfg = load_job_config(None, [f"model.precision={precision}"])
        st = parallel.initialize(cfg.model, ParallelConfig(device="cpu"))
        m = build_model(cfg.model, ParallelConfig(device="cpu"), st)
        init_weights(m, 777, st, init_method_std=cfg.model.init_method_std, num_layers=cfg.model.num_layers)
        path = str(tmp_path_factory.mktemp("one_rank") / precision)
        save_model(m, path)
        out[precision] = tensors(path)
        parallel.destroy()
    return out


@pytest.mark.parametrize("nproc, rollout_ranks, pairs", [
    # trainer TP2 -> rollout TP1, EP2 -> 1, DP2 -> 1 (1 rollout rank)
    (3, 1, [f"{TP2}|", f"{EP2}|", "|"]),
    # 2 + 2 ranks: TP2 -> DP2, EP2 -> TP2, TP2 x EP2 (expert-TP 1) -> EP2, DP2 -> TP2 x EP2, and bf16 TP2 -> TP2
    (4, 2, [f"{TP2}|", f"{EP2}|tensor_model_parallel_size=2",
            f"{TP2},{EP2},parallel.expert_tensor_parallel_size=1|expert_model_parallel_size=2",
            "|tensor_model_parallel_size=2,expert_model_parallel_size=2,expert_tensor_parallel_size=1",
            f"model.precision=bf16,{TP2}|tensor_model_parallel_size=2"]),
])
def test_rollout_weights_bit_identical_after_sync(run_dist, tmp_path, one_rank_weights, nproc, rollout_ranks, pairs):
    args = ["--out", str(tmp_path), "--rollout-ranks", str(rollout_ranks)]
    for p in pairs:
        args += ["--pair", p]
    out = run_dist("weight_sync.py", nproc, *args, timeout=600).stdout
    assert out.count("SYNCED") == nproc * len(pairs), out
    for i, pair in enumerate(pairs):
        want = one_rank_weights["bf16" if "bf16" in pair else "fp32"]
        trainer, rollout = tensors(tmp_path / str(i) / "trainer"), tensors(tmp_path / str(i) / "rollout")
        assert trainer.keys() == rollout.keys() == want.keys(), pair
        assert len(want) >= 10
        for k in want:
            assert rollout[k].dtype == want[k].dtype, (pair, k)
            assert torch.equal(trainer[k], want[k]), (pair, k)  # the trainer holds the one-rank model's numbers
            assert torch.equal(rollout[k], want[k]), (pair, k)  # and so, bit for bit, does the rollout copy


# ----------------------------------------------------------------------------------------------
# training (slow): staleness 0 = colocated, the staleness bound, kill and resume
# ----------------------------------------------------------------------------------------------

JOB = [
    "train.sft_steps=0", "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "generation.max_new_tokens=6",
    "train.micro_batch_size=8", "train.num_minibatches=2", "optimizer.lr=1e-3", "eval.interval=0",
    f"reward.name={HERE}/reward_plugins.py:digit_fraction", "train.old_logprobs=recompute",
]
K1 = ["rollout.mode=async", "rollout.world_size=2", "rollout.max_staleness=1", "rollout_correction.mode=tis"]


def job(run_dist, out, nproc, *overrides, check=True, script_args=False):
    """run_job.py with ``overrides``; ``script_args``: the overrides end with run_job.py options (faults)."""
    opts = []
    if script_args:
        first = next(i for i, x in enumerate(overrides) if x.startswith("--"))
        overrides, opts = overrides[:first], list(overrides[first:])
    return run_dist("run_job.py", nproc, "--out", str(out), *opts, "--", *JOB, *overrides, timeout=600, check=check)


def metrics(out):
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def trained_rows(out):
    """Every row the trainer trained on, as RecordRollouts wrote it (run_job.py)."""
    for name in sorted(os.listdir(out)):
        if name.startswith("rollouts.dp"):
            yield from (json.loads(line) for line in open(os.path.join(out, name)))


def records(out):
    """(step, global row) -> (sample id, tokens) of every row the trainer trained on."""
    got = {}
    for r in trained_rows(out):
        key = (r["step"], r["row"])
        assert key not in got, f"row {key} trained twice"
        got[key] = (r["sample"], r["tokens"])
    return got


def row_versions(out):
    """(step, global row) -> (version_start, version_end) of every row the trainer trained on."""
    return {(r["step"], r["row"]): tuple(r["versions"]) for r in trained_rows(out)}


def versions(out):
    """step -> [(version_start, version_end)] of every row the trainer trained on, as the rows carried them."""
    got = {}
    for r in trained_rows(out):
        got.setdefault(r["step"], []).append(tuple(r["versions"]))
    return got


def test_staleness_zero_trains_the_colocated_trajectory(run_dist, tmp_path):
    """One trainer rank + one rollout rank with rollout.max_staleness=0 against one colocated rank: the same
    samples, the same metrics (loss, ratios, grad norm ... every logged number but timings) and the same
    final weights, bit for bit."""
    steps = ["train.num_steps=3"]
    job(run_dist, tmp_path / "colocated", 1, *steps)
    job(run_dist, tmp_path / "async", 2, *steps, "rollout.mode=async", "rollout.world_size=1", "rollout.max_staleness=0")
    a, c = records(tmp_path / "async"), records(tmp_path / "colocated")
    assert len(c) == 3 * 16 and a == c
    ma, mc = metrics(tmp_path / "async"), metrics(tmp_path / "colocated")
    assert [m["async/staleness_max"] for m in ma] == [0, 0, 0]
    for x, y in zip(ma, mc):
        same = {k: (x[k], y[k]) for k in y if not k.startswith("perf/") and x[k] != y[k]}
        assert not same, same
    wa, wc = tensors(tmp_path / "async" / "weights"), tensors(tmp_path / "colocated" / "weights")
    assert wa.keys() == wc.keys() and all(torch.equal(wa[k], wc[k]) for k in wc)


@pytest.fixture(scope="module")
def uninterrupted_k1(run_dist, tmp_path_factory):
    """A 4-step async job, staleness 1, 1 trainer rank + 2 rollout ranks (rollout DP 2)."""
    out = tmp_path_factory.mktemp("k1")
    job(run_dist, out, 3, "train.num_steps=4", *K1)
    return out


def test_staleness_never_exceeds_the_bound(uninterrupted_k1):
    rows = metrics(uninterrupted_k1)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # step 1 starts on the initial weights; from then on the rollout ranks generate step s+1 while the trainer
    # trains step s, with version s: exactly one version old (the finish policy keeps a row's start version)
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert all(r["async/staleness_frac_0"] + r["async/staleness_frac_1"] == 1 for r in rows)
    rows_versions = versions(uninterrupted_k1)
    for r in rows:
        # row by row, as the rollout ranks recorded them: step s (0-based) trains rows that began with version
        # s - 1 or s, none of whose tokens came from a version newer than s (pushed before its rows were taken)
        s, vs = r["step"] - 1, rows_versions[r["step"]]
        assert len(vs) == 16 and all(s - 1 <= v0 <= v1 <= s for v0, v1 in vs), vs
        assert r["async/staleness_max"] == max(s - v0 for v0, _ in vs)
        # the rows of two versions, counted from the rows themselves, are the trainer's count and the rollout
        # ranks' own count of rows an update reached mid-generation (finish: they finished under the new weights)
        mixed = sum(v0 != v1 for v0, v1 in vs)
        assert r["async/mixed_version_rows"] == mixed == r["async/partial_finished_rows"]
        assert r["async/weight_sync_bytes"] > 0 and r["async/weight_sync_s"] > 0
        assert 0 <= r["async/rollout_idle_frac"] <= 1 and 0 <= r["async/trainer_idle_frac"] <= 1
        assert r["async/partial_dropped_rows"] == 0
        assert "rollout/logprob_diff_max" in r and "rollout_correction/weight_mean" in r
    assert len(records(uninterrupted_k1)) == 4 * 16


def test_dead_rollout_rank_checkpoints_stops_and_resumes(run_dist, tmp_path, uninterrupted_k1, monkeypatch):
    """A rollout rank is SIGKILLed as it starts step 3: the job stops (no hang) with a message naming the
    rollout rank and a checkpoint of the last trained step; the resumed job drops what was in flight,
    regenerates it from the checkpoint's data position and trains every step's rows exactly once."""
    import time

    ck = ["checkpoint.save_interval=100", f"checkpoint.save={tmp_path}/ckpt"]  # only the stop saves mid-run
    monkeypatch.setenv("MEGATRON_GSPO_FAULTS", "kill@3:1")
    t0 = time.time()
    p = job(run_dist, tmp_path / "run", 3, "train.num_steps=4", *K1, *ck, check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and time.time() - t0 < 240, out[-3000:]
    # Who reaches the trainer first is a race: the dead rank (a failed receive, a silent heartbeat) or torchrun's
    # SIGTERM to the survivors; the stop line names the rank either way (both orders made certain:
    # test_a_dead_rollout_rank_is_named_whichever_reaches_the_trainer_first). Both save and exit 75.
    line = next((x for x in out.splitlines() if x.startswith("STOPPED exit")), "")
    assert line.startswith("STOPPED exit 75: stopping before step "), out[-3000:]
    assert any(name in line for name in ("rollout rank(s) [1]", "rollout rank 1 ", "(global rank 1)")), line
    assert f"checkpoint saved to {tmp_path}/ckpt" in out
    saved = latest_complete(f"{tmp_path}/ckpt")
    assert saved in (1, 2), saved  # step 2's rows may have died with the rank before the trainer read them
    monkeypatch.delenv("MEGATRON_GSPO_FAULTS")
    job(run_dist, tmp_path / "run", 3, "train.num_steps=4", *K1, *ck, "checkpoint.resume=true")
    got, want = records(tmp_path / "run"), records(uninterrupted_k1)
    assert got.keys() == want.keys()  # every step's every row trained exactly once (records() refuses twice)
    assert all(got[k][0] == want[k][0] for k in want)  # the same prompts and samples at every step
    # Trained before the kill: bit-identical tokens where both runs drew the row from the same weights. Which
    # version a row of step s > 1 begins with (s - 2 or s - 1), and whether a push lands mid-row, is a race
    # with the trainer (test_staleness_never_exceeds_the_bound); step 1's rows are always the initial weights'.
    got_v, want_v = row_versions(tmp_path / "run"), row_versions(uninterrupted_k1)
    same = [k for k in want if k[0] <= saved and got_v[k][0] == got_v[k][1] and got_v[k] == want_v[k]]
    assert {k for k in want if k[0] == 1} <= set(same), (got_v, want_v)
    for k in same:
        assert got[k] == want[k], (k, got_v[k])
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------------------------
# weight updates between decode steps (fast, one process)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def two_versions(single_rank):
    """The tiny model with version-0 weights (seed 1234) and a state dict of version 1 (seed 777)."""
    from megatron_gspo.model.init_weights import init_weights
    from megatron_gspo.model.gpt import build_model

    cfg = load_job_config(None, [])
    st = single_rank(cfg.model)
    model = build_model(cfg.model, ParallelConfig(device="cpu"), st)
    other = build_model(cfg.model, ParallelConfig(device="cpu"), st)
    init_weights(other, 777, st, init_method_std=cfg.model.init_method_std, num_layers=cfg.model.num_layers)
    weights = lambda m: {k: v.detach().clone() for k, v in m.named_parameters()}  # noqa: E731
    return cfg, st, _Loadable(model), weights(model), weights(other)


class _Loadable:
    """The model, with ``load_state_dict`` taking a {parameter name: tensor} dict (a weight version)."""

    def __init__(self, model):
        self.model = model

    def load_state_dict(self, params):
        with torch.no_grad():
            for k, p in self.model.named_parameters():
                p.copy_(params[k])


def _gen(cfg, st, model, **kw):
    import dataclasses

    from megatron_gspo.rollout.worker import generate_with_updates
    from megatron_gspo.generation.generator import generate

    g = dataclasses.replace(cfg.generation, n_samples_per_prompt=1, max_new_tokens=8, ignore_eos=True,
                            stop_token_ids=[1], pad_token_id=0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    args = dict(vocab_size=cfg.model.vocab_size, state=st, seed=99, row_keys=[0, 1, 2])
    if not kw:
        return generate(model.model, prompts, g, **args)
    return generate_with_updates(model.model, prompts, g, **args, **kw)


def _updates_at(call, model, new_state, stop=False):
    calls = {"n": 0}

    def poll():
        calls["n"] += 1
        return (calls["n"] == call + 1 and not stop), (calls["n"] == call + 1 and stop)

    def apply():
        model.load_state_dict(new_state)
        return 1

    return poll, apply


def test_finish_policy_draws_the_rest_of_each_response_with_the_new_weights(two_versions):
    cfg, st, model, v0, v1 = two_versions
    ref0 = _gen(cfg, st, model)
    model.load_state_dict(v1)
    ref1 = _gen(cfg, st, model)
    model.load_state_dict(v0)
    poll, apply = _updates_at(2, model, v1)  # after forward 2: response tokens 0..2 from v0, 3.. from v1
    got = _gen(cfg, st, model, version=0, poll=poll, apply=apply, policy="finish")
    out = got.out
    assert got.version_start == 0 and got.updates == 1 and got.dropped_rows == 0
    assert got.version_end.tolist() == [1, 1, 1] and got.finished_partial == 3
    for r in range(3):
        p = int(out.prompt_lengths[r])
        assert torch.equal(out.tokens[r, : p + 3], ref0.tokens[r, : p + 3])  # before the update: v0's draws
        assert torch.equal(out.logprobs[r, : p + 3], ref0.logprobs[r, : p + 3])
    assert not torch.equal(out.tokens, ref0.tokens) and not torch.equal(out.tokens, ref1.tokens)
    model.load_state_dict(v0)
    # the log-probs recorded are those of the distribution each token was drawn from: before the update
    # v0's (a v0 forward gives them to float noise), after it the new weights' (over the prefix's KV cache,
    # kept from v0: no re-prefill), which a v0 forward does not give
    from megatron_gspo.model.logprobs import vocab_parallel_logprobs
    from megatron_gspo.model.gpt import forward_logits

    with torch.no_grad():
        lp, _ = vocab_parallel_logprobs(forward_logits(model.model, out.tokens[:, :-1]), out.tokens[:, 1:],
                                        cfg.model.vocab_size, None, with_entropy=False)
    for r in range(3):
        p = int(out.prompt_lengths[r])
        assert torch.allclose(lp[r, p - 1: p + 2], out.logprobs[r, p: p + 3], atol=1e-5), r
        assert (lp[r, p + 2: p + 7] - out.logprobs[r, p + 3: p + 8]).abs().max() > 1e-3, r


def test_drop_policy_generates_again_under_the_new_weights(two_versions):
    cfg, st, model, v0, v1 = two_versions
    model.load_state_dict(v1)
    ref1 = _gen(cfg, st, model)
    model.load_state_dict(v0)
    poll, apply = _updates_at(2, model, v1)
    got = _gen(cfg, st, model, version=0, poll=poll, apply=apply, policy="drop")
    assert got.version_start == 1 and got.version_end.tolist() == [1, 1, 1]
    # the update was applied while generating (async/mid_generation_updates counts it, whatever the policy)
    assert got.dropped_rows == 3 and got.finished_partial == 0 and got.updates == 1
    assert torch.equal(got.out.tokens, ref1.tokens) and torch.equal(got.out.logprobs, ref1.logprobs)


@pytest.mark.parametrize("policy", ["finish", "drop"])
def test_async_counts_agree_with_their_definitions(two_versions, policy):
    """Two updates mid-generation (at the 2nd and the 5th forward), against docs/algorithms.md's async/*:
    mid_generation_updates = updates applied while generating (2, under either policy: drop counts them
    beside its 6 dropped rows); partial_dropped_rows = every row of each generation in flight that was thrown
    away (drop: 2 x 3); partial_finished_rows = rows in flight at an update that finished under the new
    weights (finish: 3, never under drop) = mixed_version_rows (rows whose tokens come from two versions);
    staleness counts from the version a row started with (drop: the last restart's)."""
    cfg, st, model, v0, v1 = two_versions
    calls, versions = {"n": 0}, []

    def poll():
        calls["n"] += 1
        return calls["n"] in (2, 5), False

    def apply():
        model.load_state_dict(v1 if len(versions) % 2 == 0 else v0)
        versions.append(len(versions) + 1)
        return versions[-1]

    got = _gen(cfg, st, model, version=0, poll=poll, apply=apply, policy=policy)
    mixed = int((got.version_end != got.version_start).sum())
    assert got.updates == len(versions) == 2
    if policy == "drop":
        assert (got.dropped_rows, got.finished_partial, mixed, got.version_start) == (6, 0, 0, 2)
    else:
        assert (got.dropped_rows, got.finished_partial, mixed, got.version_start) == (0, 3, 3, 0)
        assert got.version_end.tolist() == [2, 2, 2]


def test_stop_leaves_generation(two_versions):
    from megatron_gspo.runtime.stop import Cancelled

    cfg, st, model, v0, v1 = two_versions
    poll, apply = _updates_at(1, model, v1, stop=True)
    with pytest.raises(Cancelled):
        _gen(cfg, st, model, version=0, poll=poll, apply=apply, policy="finish")


def test_rollout_rank_that_raises_stops_the_trainer_with_its_message(run_dist, tmp_path, monkeypatch):
    """The rollout rank's exception reaches the trainer's last line (exit 1), after a checkpoint."""
    monkeypatch.setenv("MEGATRON_GSPO_FAULTS", "raise@2:1")
    p = job(run_dist, tmp_path / "run", 2, "train.num_steps=3", "rollout.mode=async", "rollout.world_size=1",
            "rollout.max_staleness=0", f"checkpoint.save={tmp_path}/ckpt", check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert ("STOPPED exit 1: stopping before step 2: rollout rank 1 failed: RuntimeError: injected fault: rank 1 "
            "raises at step 2") in out, out[-3000:]
    assert latest_complete(f"{tmp_path}/ckpt") == 1


def test_heartbeat_timeout_shorter_than_three_beats_is_refused():
    from megatron_gspo.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_job_config(None, [*ASYNC, "rollout.max_staleness=0", "rollout.heartbeat_timeout_s=0.5"])
    assert str(e.value).startswith("rollout.heartbeat_timeout_s=0.5 is shorter than 3 s: every rank beats once "
                                   "every 1 s"), str(e.value)
    assert load_job_config(None, [*ASYNC, "rollout.max_staleness=0", "rollout.heartbeat_timeout_s=3"])


def stopped_line(run_dist, tmp_path, steps: int, *overrides: str) -> str:
    """Run a 2-rank async job (1 trainer rank, 1 rollout rank, staleness 0, a checkpoint root) with
    ``overrides`` (then run_job.py fault options); its trainer's ``STOPPED exit ...`` line."""
    p = job(run_dist, tmp_path / "run", 2, f"train.num_steps={steps}", "rollout.mode=async", "rollout.world_size=1",
            "rollout.max_staleness=0", f"checkpoint.save={tmp_path}/ckpt", *overrides, check=False, script_args=True)
    out = p.stdout + p.stderr
    line = next((x for x in out.splitlines() if x.startswith("STOPPED exit")), "")
    print(line)
    assert line.startswith("STOPPED exit 75: "), out[-3000:]
    return line


def test_a_heartbeat_timeout_says_so_in_the_stop_line(run_dist, tmp_path):
    """The trainer's heartbeat stops at step 2 (a hung trainer, seen from the rollout rank): after
    rollout.heartbeat_timeout_s the rollout rank leaves, and the trainer's stop line says that a heartbeat
    timeout ended it, quoting the timeout (not "rollout rank 1 exited: finished"). The job asks for far more
    steps than it runs: at 0.07 s a step on an idle machine, 40 steps ended before the 3 s timeout (CI, exit 0)."""
    line = stopped_line(run_dist, tmp_path, 1000, "rollout.heartbeat_timeout_s=3", "--silence-trainer-at", "2")
    assert line.startswith("STOPPED exit 75: stopping before step "), line
    assert ("rollout rank 1 exited: declared the trainer dead: trainer rank 0 sent no heartbeat for "
            in line and "(rollout.heartbeat_timeout_s=3)" in line), line
    assert f"checkpoint saved to {tmp_path}/ckpt" in line
    assert latest_complete(f"{tmp_path}/ckpt") >= 1


@pytest.mark.parametrize("first", ["the dead rank", "the signal"])
def test_a_dead_rollout_rank_is_named_whichever_reaches_the_trainer_first(run_dist, tmp_path, first):
    """A rollout rank dies under bare torchrun, which then SIGTERMs every other rank: the trainer learns of the
    death from the rank itself (a failed weight push, a silent heartbeat) or from the signal, whichever comes
    first. Each order made certain: the dead rank first (rank 1 SIGKILLed once it received the header of the
    push of version 2, while the trainer streams the rest to it; the trainer's ranks never see SIGTERM), or
    the signal first (after step 2, trainer rank 0 SIGKILLs rank 1 and sends itself SIGTERM as torchrun
    would: its next stop vote sees the signal before anything touches the dead rank). Both stop before step 3
    with a line that names rollout rank 1, exit 75, a checkpoint of step 2."""
    fault = (["--kill-in-push", "2:1", "--hold-sigterm"] if first == "the dead rank"
             else ["--kill-rollout-after", "2:1"])
    # a heartbeat timeout well inside torchrun's 30 s before SIGKILL, and above the beats' lag on a loaded
    # machine (at 5 s a rollout rank once declared a busy trainer dead before step 2)
    line = stopped_line(run_dist, tmp_path, 6, "rollout.weight_sync_bucket_mb=0.05", "rollout.heartbeat_timeout_s=10",
                        *fault)
    assert line.startswith("STOPPED exit 75: stopping before step 3: "), line
    if first == "the dead rank":
        # the push fails on the dead peer (gloo: the connection closed), or, had the kernel buffered the rest
        # of the stream, the wait for its rows times out on its heartbeat: the rank is named either way
        assert ("rollout rank(s) [1] stopped beating (killed, or their node is gone); the weight push of version 2"
                in line or "rollout rank 1 sent no heartbeat for" in line), line
    else:
        assert ("stopping before step 3: rollout rank(s) [1] stopped beating (killed, or their node is gone), and "
                "the job got SIGTERM (torchrun stops every rank when one exits); checkpoint saved to "
                f"{tmp_path}/ckpt (resume with checkpoint.resume=true") in line, line
    assert latest_complete(f"{tmp_path}/ckpt") == 2


def test_a_stop_signal_to_a_rollout_rank_alone_stops_the_job(run_dist, tmp_path):
    """SIGTERM to the rollout rank only (`kill <its pid>`), as it begins step 3: it asks the trainer to stop
    (the control plane), the trainer saves the last trained step and exits 75, the rollout rank follows
    (the signal is not swallowed: the job does not run on to its end)."""
    line = stopped_line(run_dist, tmp_path, 40, "--sigterm-rollout-at", "3:1")
    assert "preempted by signal SIGTERM (on rollout rank 1)" in line, line
    saved = latest_complete(f"{tmp_path}/ckpt")
    assert saved in (2, 3) and [m["step"] for m in metrics(tmp_path / "run")] == list(range(1, saved + 1))
