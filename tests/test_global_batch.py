"""One global batch after generation (rollout/exchange.py, rows.deal_rows): the partition of the rows by
token count with numbers, the packed rows coming back bit for bit, and under torchrun (gloo, CPU) the
step's trajectory at DP 2 and DP 4 against DP 1 with dynamic sampling on, across a resume, and R3
replaying every kept row's own routes after the rows moved between ranks."""

import glob
import json
import re

import pytest
import torch

from megatron_gspo.rollout.exchange import (RouteSpec, Scores, conversation_bytes, exchange, pack_bits, row_bytes,
                                             unpack_bits)
from megatron_gspo.rollout.record import RolloutRecord
from megatron_gspo.rollout.rows import deal_rows, karmarkar_karp, local_rows, token_imbalance
from megatron_gspo.routing.rollout_routes import RolloutRoutes


# ----------------------------------------------------------------------------------------------
# the partition
# ----------------------------------------------------------------------------------------------


def test_karmarkar_karp_hand_example():
    # sorted pairs (10, 20) (30, 40) (70, 80) (90, 100): each pair one item per set; merging the heaviest
    # set of one with the lightest of the other evens every pair out, then the two halves
    lengths = [100, 90, 80, 70, 40, 30, 20, 10]
    sets = karmarkar_karp(lengths, 2)
    assert sorted(sum(lengths[i] for i in s) for s in sets) == [220, 220]
    assert sorted(len(s) for s in sets) == [4, 4] and sorted(i for s in sets for i in s) == list(range(8))
    # without equal sizes the classic example: 8 7 6 5 4 -> {8, 6} {7, 5, 4} (the method's answer, not the optimum)
    assert karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False) == [[0, 2], [1, 3, 4]]
    with pytest.raises(ValueError, match="7 items cannot be split into 2 equal sets"):
        karmarkar_karp([1] * 7, 2)


def test_deal_is_contiguous_where_balancing_gains_nothing():
    """Equal lengths (or balance off): every rank trains the rows it generated, so nothing moves."""
    assert deal_rows([5] * 16, 2, 2) == [local_rows(16, 2, 2, r) for r in range(2)]
    assert deal_rows(list(range(16)), 2, 2, balance=False) == [local_rows(16, 2, 2, r) for r in range(2)]
    assert deal_rows(list(range(16)), 2, 1) == [list(range(16))]


def long_tailed_lengths(rows=256, seed=0, prompt=(20, 200), max_new=1024):
    """Prompt lengths uniform in ``prompt``, response lengths log-normal (median ~110, a tail cut at
    ``max_new``): the shape of reasoning rollouts, most responses short, a few at the limit (here rows of
    43 to 1223 tokens, median 241)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(prompt[0], prompt[1], (rows,), generator=g)
    r = torch.exp(torch.randn(rows, generator=g) * 1.1 + 4.7).clamp(1, max_new).long()
    return (p + r).tolist()


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_balanced_deal_on_long_tailed_lengths(dp):
    """256 rows in 2 minibatches: equal row counts per rank, every row of a minibatch dealt once within
    it, and the heaviest rank's tokens (summed over minibatches, each an optimizer step that waits for
    it) within 0.1% of the mean, where the contiguous split of the same rows is 13-37% over."""
    lengths = long_tailed_lengths()
    assert max(lengths) > 5 * sorted(lengths)[len(lengths) // 2]  # long-tailed
    deal = deal_rows(lengths, 2, dp)
    share = 256 // (2 * dp)
    assert all(len(rows) == 2 * share for rows in deal)
    for k in range(2):
        assert sorted(i for rows in deal for i in rows[k * share:(k + 1) * share]) == list(range(k * 128, (k + 1) * 128))
    before = token_imbalance(lengths, deal_rows(lengths, 2, dp, balance=False), 2)
    after = token_imbalance(lengths, deal, 2)
    # measured: DP 2 1.134 -> 1.00001, DP 4 1.211 -> 1.00004, DP 8 1.366 -> 1.0004
    assert before > 1.1 and after < 1.001, (before, after)


def test_token_imbalance_hand_example():
    lengths = [100, 90, 80, 70, 40, 30, 20, 10]
    assert token_imbalance(lengths, [[0, 1, 2, 3], [4, 5, 6, 7]], 1) == pytest.approx(340 / 220)
    assert token_imbalance(lengths, deal_rows(lengths, 1, 2), 1) == 1.0


# ----------------------------------------------------------------------------------------------
# the rows on the wire
# ----------------------------------------------------------------------------------------------


def _pool(rows=5, layers=3, topk=2, experts=8, seed=0, pad_id=0, lengths=None):
    """A record of ``rows`` ragged rows with routes, as one round's generation leaves it (``lengths``:
    (prompt, response) of every row instead)."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, 5, (rows,), generator=g) if lengths is None else torch.full((rows,), lengths[0])
    rlen = torch.randint(1, 6, (rows,), generator=g) if lengths is None else torch.full((rows,), lengths[1])
    width = int((plen + rlen).max()) + 2
    cols = torch.arange(width)[None, :]
    valid = cols < (plen + rlen)[:, None]
    tokens = torch.where(valid, torch.randint(1, 151_000, (rows, width), generator=g), torch.full((rows, width), pad_id))
    lp = torch.where(valid & (cols >= plen[:, None]), -torch.rand(rows, width, generator=g), torch.zeros(()))
    routes = RolloutRoutes.from_rows([torch.randint(0, experts, (layers, int(n) - 1, topk), generator=g)
                                      for n in plen + rlen], layers, topk, experts)
    rec = RolloutRecord(step=3, tokens=tokens, prompt_lengths=plen, response_lengths=rlen,
                        stopped=torch.rand(rows, generator=g) > 0.5, sample_logprobs=lp,
                        rewards=torch.rand(rows, generator=g), row_ids=torch.arange(rows),
                        version_start=torch.full((rows,), 3), version_end=torch.full((rows,), 3),
                        prompt_ids=[f"p{i}" for i in range(rows)], texts=[f"t{i}" for i in range(rows)], routes=routes)
    return rec, Scores(rec.rewards, plen, rlen, rec.stopped)


def test_exchanged_rows_come_back_bit_for_bit():
    """Every row through the packed buffer (one rank: the all-to-all is a copy): tokens, log-probs, routes,
    scores as they were, in the dealt order; the texts of rows held here kept (not decoded again)."""
    pool, scores = _pool()
    deal = [[4, 1, 3, 0, 2]]
    got = exchange(pool, {i: i for i in range(5)}, deal, [0] * 5, scores, [f"p{i}" for i in range(5)], rank=0,
                   group=None, device=torch.device("cpu"), pad_id=0, decode=lambda ids: "decoded")
    want = pool.select(torch.tensor(deal[0]))
    for name in ("tokens", "loss_mask", "prompt_lengths", "response_lengths", "stopped", "sample_logprobs", "rewards"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.row_ids.tolist() == deal[0] and got.prompt_ids == [f"p{i}" for i in deal[0]]
    assert torch.equal(got.routes.count, want.routes.count)
    for i in range(5):
        assert torch.equal(got.routes.row(i), want.routes.row(i))
    assert got.sample_logprobs.dtype == torch.float32 and got.tokens.dtype == torch.long
    assert got.texts == [f"t{i}" for i in deal[0]]
    # 5 tokens x 4 B + 2 log-probs x 4 B = 28, padded to 32; routes: 4 positions x 48 layers x top-8, 1 B each
    assert row_bytes(3, 2, None) == 32 and row_bytes(3, 2, RouteSpec(48, 8, 128)) == 28 + 4 * 48 * 8 + 4


def _multi_turn_pool(rows=5):
    """``_pool``'s rows as multi-turn rows of 3 + 9 tokens: the prompt, an assistant turn [3, 6), an observation
    [6, 8), an assistant turn [8, 12) whose first token (8) is forced in the even rows: off the loss mask, although
    its role says assistant (the mask is not the assistant turns' spans). Their conversations, each its own."""
    pool, scores = _pool(rows=rows, lengths=(3, 9))
    pool.loss_mask = torch.zeros_like(pool.tokens, dtype=torch.bool)
    pool.trajectories = []
    for i in range(rows):
        pool.loss_mask[i, 3:6] = pool.loss_mask[i, 9 if i % 2 == 0 else 8:12] = True
        pool.trajectories.append({
            "turns": [{"role": "assistant", "start": 3, "end": 6, "text": f"row {i} asks"},
                      {"role": "tool", "start": 6, "end": 8, "text": "résultat " * i},
                      {"role": "assistant", "start": 8, "end": 12, "text": f"row {i} answers"}],
            "tool_calls": [{"turn": 1, "name": "add", "arguments": {"a": i, "b": 2}, "result": str(i + 2)}],
            "num_turns": 2, "tool_errors": 0, "observation_tokens": 2, "max_turns_reached": False, "env_error": None,
            "env_reward": None if i == 3 else i / 4, "final_text": f"row {i} answers"})
    scores.conversation_bytes = torch.tensor([len(conversation_bytes(t)) for t in pool.trajectories])
    return pool, scores


def test_multi_turn_rows_come_back_with_their_loss_mask_and_conversation():
    """Multi-turn rows through the packed buffer: each row's loss mask bit for bit (the forced tokens off it, as
    the generating rank built it: a mask rebuilt from the turns' roles would put them on) and its conversation,
    in the dealt order; on the wire one bit per token and the conversation's JSON after the row's other parts."""
    pool, scores = _multi_turn_pool()
    deal = [[4, 1, 3, 0, 2]]
    got = exchange(pool, {i: i for i in range(5)}, deal, [0] * 5, scores, [""] * 5, rank=0, group=None,
                   device=torch.device("cpu"), pad_id=0, decode=str)
    want = pool.select(torch.tensor(deal[0]))
    for name in ("tokens", "loss_mask", "sample_logprobs", "rewards"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.loss_mask[:, 8].tolist() == [False, True, True, False, False]  # rows 4 1 3 0 2: the even ones forced
    assert got.trajectories == want.trajectories and got.trajectories is not want.trajectories
    conv = int(scores.conversation_bytes[0])
    # 12 tokens x 4 B + 9 log-probs x 4 B + routes 11 x 3 layers x top-2 x 1 B + 2 mask bytes + the JSON, padded to 8
    assert row_bytes(3, 9, RouteSpec.of(pool.routes), conv) == -(-(48 + 36 + 66 + 2 + conv) // 8) * 8
    assert row_bytes(3, 9, None) == 88  # single-turn rows: no mask, no conversation


def test_loss_mask_bits_by_hand():
    bits = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    raw = pack_bits(bits)
    assert raw.dtype == torch.uint8 and raw.tolist() == [0b1101, 1]
    assert torch.equal(unpack_bits(raw, 9), bits)
    assert pack_bits(torch.zeros(0, dtype=torch.bool)).numel() == 0
    assert unpack_bits(torch.zeros(0, dtype=torch.uint8), 0).numel() == 0
    every = torch.rand(1000, generator=torch.Generator().manual_seed(0)) > 0.5
    assert torch.equal(unpack_bits(pack_bits(every), 1000), every) and pack_bits(every).numel() == 125


def test_the_wire_holds_expert_ids_in_the_smallest_type():
    assert RouteSpec(2, 2, 128).dtype == torch.uint8 and RouteSpec(2, 2, 256).dtype == torch.uint8
    assert RouteSpec(2, 2, 257).dtype == torch.int16 and RouteSpec(2, 2, 1 << 16).dtype == torch.int32
    pool, scores = _pool(experts=300)  # ids above 255 survive the int16 wire
    pool.routes.routes[pool.routes.routes > 0] += 250
    got = exchange(pool, {i: i for i in range(5)}, [list(range(5))], [0] * 5, scores, [""] * 5, rank=0, group=None,
                   device=torch.device("cpu"), pad_id=0, decode=str)
    assert all(torch.equal(got.routes.row(i), pool.routes.row(i)) for i in range(5))
    assert int(got.routes.routes.max()) > 255


def test_gathered_scores_and_exchanged_rows_on_the_state_device(monkeypatch):
    """On CUDA (tests/cuda_on_cpu.py) every collective of the global batch gets tensors on the device."""
    from cuda_on_cpu import FakeNccl, cuda_on_cpu

    from megatron_gspo.rollout.exchange import gather_scores
    from megatron_gspo.runtime import comm

    fake = FakeNccl(world=2)
    monkeypatch.setattr(comm, "_transport", fake)
    pool, _ = _pool(rows=4, lengths=(3, 2))  # equal sizes: the fake all-to-all hands each rank its own bytes back
    cuda = torch.device("cuda", 0)
    with cuda_on_cpu():
        on = {n: getattr(pool, n).to(cuda) for n in ("tokens", "prompt_lengths", "response_lengths", "stopped",
                                                     "sample_logprobs", "rewards", "row_ids")}
        pool = RolloutRecord(**{**pool.__dict__, **on})
        out = type("Out", (), {"prompt_lengths": on["prompt_lengths"][:2], "response_lengths": on["response_lengths"][:2],
                               "stopped": on["stopped"][:2]})
        scores = gather_scores(on["rewards"][:2], out, 4, 1, 2, object(), cuda)
        assert scores.rewards.device.type == "cuda" and scores.rewards.shape == (4,)
        got = exchange(pool, {2: 0, 3: 1}, [[0, 1], [2, 3]], [1, 1, 0, 0], scores, [""] * 4, rank=0, group=object(),
                       device=cuda, pad_id=0, decode=str)
        assert got.tokens.device.type == "cuda" and got.row_ids.tolist() == [0, 1]
        assert got.texts == [str(got.tokens[i, 3:5].tolist()) for i in range(2)]  # arrived: decoded here
    assert fake.calls == [("all_gather", "cuda"), ("all_to_all_single", "cuda")], fake.calls


# ----------------------------------------------------------------------------------------------
# under torchrun: DP 1 / 2 / 4 with dynamic sampling, a resume in the middle
# ----------------------------------------------------------------------------------------------

# The demo job (exact-match reward after a short warm start: a mix of constant and informative groups),
# short: 5 SFT + 4 GSPO steps with dynamic sampling, the default MoE load-balancing loss (per sequence: the
# rows dynamic sampling keeps are dealt to other ranks and micro-batches under DP 2 / 4 than under DP 1).
DS_JOB = ["train.num_steps=4", "train.sft_steps=5", "train.micro_batch_size=128", "train.dynamic_sampling=true",
          "train.dynamic_sampling_max_rounds=2", "eval.interval=0"]


def _rollouts(d):
    out = {}
    for f in glob.glob(str(d / "rollouts.dp*.jsonl")):
        for line in open(f):
            r = json.loads(line)
            assert (r["step"], r["row"]) not in out, "a row trained twice"
            out[(r["step"], r["row"])] = r
    return out


@pytest.fixture(scope="module")
def ds_trajectories(tmp_path_factory, run_dist, run_dist_jobs):
    """DP 1 straight; DP 2 and DP 4 stopped after step 2 (checkpoint) and resumed to step 4 (the resumed job a new
    Trainer in the same torchrun: jobs.py)."""
    root = tmp_path_factory.mktemp("ds_traj")
    run_dist("run_job.py", 1, "--out", str(root / "dp1"), "--", *DS_JOB, timeout=900)
    jobs = {}
    for n in (2, 4):
        ckpt = [f"checkpoint.save={root}/dp{n}/ckpt", "checkpoint.save_interval=2"]
        out = ["run_job.py", "--out", root / f"dp{n}"]
        jobs[f"dp{n} to step 2"] = (n, [*out, "--", *DS_JOB, *ckpt, "train.num_steps=2"])
        jobs[f"dp{n} resumed"] = (n, [*out, "--check-replicas", "--", *DS_JOB, *ckpt, "checkpoint.resume=true"])
    run_dist_jobs(jobs, root, job_timeout=450)
    return root


@pytest.mark.parametrize("dp", [2, 4])
def test_dynamic_sampling_trajectory_matches_one_rank_across_a_resume(ds_trajectories, dp):
    """Every step samples, keeps and scores the same rows as DP 1 (the groups dynamic sampling keeps are
    decided over the whole batch), each row trained once on some rank with the DP 1 advantage; the
    metrics that are functions of the rows are bit-identical, the gradient-derived ones equal within the
    float reassociation of a sum over other ranks (test_layouts.py's bounds), the replicas bit-identical."""
    ref_dir, got_dir = ds_trajectories / "dp1", ds_trajectories / f"dp{dp}"
    ref, got = _rollouts(ref_dir), _rollouts(got_dir)
    assert len(ref) == 4 * 256 and ref.keys() == got.keys()
    assert all(ref[k]["tokens"] == got[k]["tokens"] and ref[k]["sample"] == got[k]["sample"] for k in ref)
    assert all(ref[k]["reward"] == got[k]["reward"] and ref[k]["advantage"] == got[k]["advantage"] for k in ref)
    rows_ref = [json.loads(x) for x in open(ref_dir / "metrics.jsonl")]
    rows_got = [json.loads(x) for x in open(got_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows_got] == [1, 2, 3, 4]
    assert sum(r["dynamic_sampling/rounds"] for r in rows_ref) > 4  # extra rounds ran
    for a, b in zip(rows_ref, rows_got):
        for key in [k for k in a if k.startswith("dynamic_sampling/")] + ["rollout/reward_mean",
                                                                          "rollout/zero_advantage_frac"]:
            assert a[key] == b[key], (a["step"], key)
        for key in ("loss/loss", "train/grad_norm", "loss/approx_kl", "loss/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (a["step"], key)
        assert b["loss/num_sequences"] == a["loss/num_sequences"] and b["loss/num_tokens"] == a["loss/num_tokens"]
        assert 1.0 <= b["rollout/dp_token_imbalance"] <= b["rollout/dp_token_imbalance_unbalanced"]
        assert 0 < b["rollout/dp_moved_rows_frac"] <= 1 and b["rollout/dp_exchange_bytes"] > 0
    w_ref = _weights(ref_dir / "weights")
    w_got = _weights(got_dir / "weights")
    worst = max((w_got[k] - w_ref[k]).abs().max().item() for k in w_ref)
    assert worst < 5e-5, worst
    replicas = json.load(open(got_dir / "replicas.json"))
    assert replicas["params"] == 0.0 and replicas["optimizer_state"] == 0.0 and replicas["params_compared"] > 0


def _weights(path):
    from megatron_gspo.checkpoint import dist_checkpoint_to_tensors

    return {k: v for k, v in dist_checkpoint_to_tensors(str(path)).items() if isinstance(v, torch.Tensor)}


def test_r3_with_dynamic_sampling_at_dp2_replays_every_kept_rows_own_routes(tmp_path, run_dist_jobs):
    """DP 2, dynamic sampling over rounds, the kept rows dealt to the other rank with their routes: R3's
    old-log-prob pass replays each row's routes and gives back its sampling log-probs (another row's
    routes would move them far beyond float noise); without replay and without an old-log-prob pass the
    first minibatch, on-policy, changes no route against the rows' own rollout routes."""
    printed = run_dist_jobs({mode: (2, ["global_batch.py", "--mode", mode, "--", f"train.output_dir={tmp_path}/{mode}"])
                             for mode in ("R3", "ref")}, tmp_path, job_timeout=450)
    found = re.findall(r"GLOBAL_BATCH (\{[^{}]*\})", "".join(printed.values()))
    assert len(found) == 4, found
    for obj in found:
        r = json.loads(obj)
        assert r["rounds"] > 1 and r["moved_rows_frac"] > 0 and r["rows"] == 8, r
        assert r["routing_change"] == 0.0, r  # (NaN, nothing compared, is not 0.0)
        if r["mode"] == "R3":  # measured 4.8e-7
            assert r["old_vs_sample_max"] < 1e-4, r
