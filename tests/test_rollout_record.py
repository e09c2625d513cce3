"""The rollout record's wire format (rollout/record.py) and the stop / exit reasons as values
(exit_status.StopReason, rollout.side.PeerState / is_peer_loss); one process, fast tier."""

import json

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.runtime import exit_status
from megatron_gspo.runtime.exit_status import ExitCode, StopReason
from megatron_gspo.rollout import record as wire
from megatron_gspo.rollout.record import RolloutRecord, concat, pack, unpack


def make_record(step=6, rows=(5, 2, 7), width=9, seed=0, pad_id=3, stats=None) -> RolloutRecord:
    """A record whose every field holds something other than its default."""
    g = torch.Generator().manual_seed(seed)
    n = len(rows)
    prompt = torch.randint(1, 4, (n,), generator=g)
    resp = torch.randint(1, width - 3, (n,), generator=g)
    resp[0] = width - int(prompt[0])  # one row fills the grid
    cols = torch.arange(width)[None, :]
    valid = cols < (prompt + resp)[:, None]
    tokens = torch.where(valid, torch.randint(10, 99, (n, width), generator=g), torch.full((n, width), pad_id))
    lp = torch.where(valid & (cols >= prompt[:, None]), -torch.rand(n, width, generator=g), torch.zeros(()))
    return RolloutRecord(
        step=step, tokens=tokens, prompt_lengths=prompt, response_lengths=resp,
        stopped=torch.tensor([True, False, True][:n]), sample_logprobs=lp, rewards=torch.rand(n, generator=g) - 0.5,
        row_ids=torch.tensor(rows), version_start=torch.full((n,), step - 1), version_end=torch.tensor([step - 1, step, step][:n]),
        prompt_ids=[f"p{r // 4}" for r in rows], texts=[f"answer é {r}" for r in rows], gen_s=1.25 + seed,
        gen_tokens=int(resp.sum()), decode_row_steps=17 + seed,
        stats=stats or {"idle_s": 0.5 + seed, "sync_s": 0.125 * (seed + 1), "wall_s": 4.0, "partial_finished": 1 + seed,
                        "dropped": seed, "updates": 1 + seed, "env_s": 0.25 * seed, "engine_sync_bytes": 100.0 * (1 + seed),
                        "prefix_queries": 10 + seed, "prefix_hits": seed},
        data_state={"epoch": 2, "position": 11, "order": [3, 1, 2]})


def assert_same(a: RolloutRecord, b: RolloutRecord) -> None:
    for f in a.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f
        else:
            assert x == y, f


def test_pack_unpack_is_the_identity_on_every_field():
    rec = make_record()
    header, ints, floats, meta = pack(rec)
    assert header.dtype == ints.dtype == torch.long and floats.dtype == torch.float32 and meta.dtype == torch.uint8
    assert header.tolist()[:5] == [wire.MAGIC, wire.WIRE_VERSION, 6, 3, 9]
    back = unpack(header, ints, floats, meta, step=6)
    assert_same(rec, back)
    assert back.stopped.dtype == torch.bool
    # every field of the record travels (a new field needs its place in one of the tuples)
    on_wire = {n for n, _ in wire.INT_FIELDS + wire.FLOAT_FIELDS} | set(wire.META_FIELDS) | {"step"}
    assert on_wire | set(wire.LOCAL_FIELDS) == set(RolloutRecord.__dataclass_fields__)
    assert not on_wire & set(wire.LOCAL_FIELDS)


def test_the_response_mask_is_generations():
    """record.response_mask from the lengths equals generate()'s valid & (cols >= prompt length)."""
    rec = make_record()
    cols = torch.arange(rec.tokens.shape[1])[None, :]
    want = (cols < (rec.prompt_lengths + rec.response_lengths)[:, None]) & (cols >= rec.prompt_lengths[:, None])
    assert torch.equal(rec.response_mask, want) and int(rec.response_mask.sum()) == int(rec.response_lengths.sum())
    assert rec.sample_ids(4) == ["p1#1", "p0#2", "p1#3"]


@pytest.mark.parametrize("index, value, words", [
    (0, 0x1234, [f"magic 0x1234 version {wire.WIRE_VERSION}", f"magic {wire.MAGIC:#x} version {wire.WIRE_VERSION}"]),
    (1, 7, [f"magic {wire.MAGIC:#x} version 7", f"this rank reads magic {wire.MAGIC:#x} version {wire.WIRE_VERSION}"]),
])
def test_a_wire_version_mismatch_names_both(index, value, words):
    header, ints, floats, meta = pack(make_record())
    header[index] = value
    with pytest.raises(wire.WireFormatError) as e:
        unpack(header, ints, floats, meta, sender="rollout leader 1")
    assert "rollout leader 1" in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_unpack_refuses_another_step_and_wrong_sizes():
    header, ints, floats, meta = pack(make_record(step=6))
    with pytest.raises(wire.WireFormatError, match="sent step 7's rows where step 5's were expected"):
        unpack(header, ints, floats, meta, step=4)
    with pytest.raises(wire.WireFormatError, match="does not match"):
        unpack(header, ints[:-1], floats, meta)


def _merge_before(parts, pad_id):
    """The trainer's merge of the rollout leaders' rows before the wire format (async_rollout/source.py
    _merge at 7511e0d, with the worker's packing), kept as the oracle of ``concat``."""
    T = max(p[1] for p in parts)
    tok, cols, lps, rew, meta = [], [], [], [], {"prompt_ids": [], "texts": []}
    for n, w, ints, floats, m in parts:
        tok.append(torch.nn.functional.pad(ints[: n * w].view(n, w), (0, T - w), value=pad_id))
        cols.append(ints[n * w:].view(6, n))
        lps.append(torch.nn.functional.pad(floats[: n * w].view(n, w), (0, T - w)))
        rew.append(floats[n * w:])
        meta["prompt_ids"] += m["prompt_ids"]
        meta["texts"] += m["texts"]
    stats = [p[4]["stats"] for p in parts]
    n = sum(p[0] for p in parts)
    meta.update({
        "rows": n, "width": T, "data": parts[0][4]["data"],
        "gen_s": max(s["gen_s"] for s in stats), "decode_row_steps": sum(s["decode_row_steps"] for s in stats),
        "idle_frac": sum(s["idle_s"] / max(s["wall_s"], 1e-9) for s in stats) / len(stats),
        "sync_s": max(s["sync_s"] for s in stats), "partial_finished": sum(s["partial_finished"] for s in stats),
        "dropped": sum(s["dropped"] for s in stats), "updates": max(s["updates"] for s in stats),
        "env_s": max(s["env_s"] for s in stats), "engine_sync_bytes": max(s["engine_sync_bytes"] for s in stats),
        "prefix_queries": sum(s["prefix_queries"] for s in stats), "prefix_hits": sum(s["prefix_hits"] for s in stats)})
    ints = torch.cat([torch.cat(tok).reshape(-1), torch.cat(cols, dim=1).reshape(-1)])
    floats = torch.cat([torch.cat(lps).reshape(-1), torch.cat(rew)])
    return ints, floats, meta


def _old_part(rec):
    """What the worker sent before the wire format: (rows, width, ints, floats, meta)."""
    n, T = rec.tokens.shape
    ints = torch.cat([rec.tokens.reshape(-1), rec.prompt_lengths, rec.response_lengths, rec.row_ids, rec.stopped.long(),
                      rec.version_start, rec.version_end])
    floats = torch.cat([rec.sample_logprobs.reshape(-1), rec.rewards])
    meta = {"prompt_ids": rec.prompt_ids, "texts": rec.texts, "data": rec.data_state,
            "stats": {"gen_s": rec.gen_s, "decode_row_steps": rec.decode_row_steps, **rec.stats}}
    return n, T, ints, floats, json.loads(json.dumps(meta))


def test_concat_equals_the_merge_it_replaces():
    parts = [make_record(rows=(0, 1, 2), width=7, seed=0), make_record(rows=(3, 4, 5), width=11, seed=1),
             make_record(rows=(6, 7, 8), width=9, seed=2)]
    got = concat([unpack(*pack(p)) for p in parts], pad_id=3)
    ints, floats, meta = _merge_before([_old_part(p) for p in parts], pad_id=3)
    n, T = meta["rows"], meta["width"]
    assert got.tokens.shape == (n, T) == (9, 11)
    assert torch.equal(got.tokens, ints[: n * T].view(n, T))
    prompt, resp, row_ids, stopped, v_start, v_end = ints[n * T:].view(6, n)
    for name, want in (("prompt_lengths", prompt), ("response_lengths", resp), ("row_ids", row_ids),
                       ("stopped", stopped.bool()), ("version_start", v_start), ("version_end", v_end)):
        assert torch.equal(getattr(got, name), want), name
    assert torch.equal(got.sample_logprobs, floats[: n * T].view(n, T)) and torch.equal(got.rewards, floats[n * T:])
    assert got.prompt_ids == meta["prompt_ids"] and got.texts == meta["texts"] and got.data_state == meta["data"]
    assert (got.gen_s, got.decode_row_steps) == (meta["gen_s"], meta["decode_row_steps"])
    assert got.stats == {k: meta[k] for k in ("idle_frac", "sync_s", "partial_finished", "dropped", "updates", "env_s",
                                              "engine_sync_bytes", "prefix_queries", "prefix_hits")}
    # and the whole step goes over the trainer's world unchanged
    assert_same(got, unpack(*pack(got)))


def test_select_cuts_rows_and_width():
    rec = make_record(rows=(5, 2, 7), width=9)
    mine = rec.select(torch.tensor([2, 1]))
    width = int((rec.prompt_lengths + rec.response_lengths)[[2, 1]].max())
    assert mine.tokens.shape == (2, width) and mine.row_ids.tolist() == [7, 2]
    assert mine.texts == [rec.texts[2], rec.texts[1]] and torch.equal(mine.sample_logprobs, rec.sample_logprobs[[2, 1], :width])


# ----------------------------------------------------------------------------------------------
# stop and exit reasons as values
# ----------------------------------------------------------------------------------------------


def test_exit_codes_keep_their_integers():
    """The launcher reads plain ints from the ranks' exit files: the codes must not move."""
    assert [int(c) for c in ExitCode] == [0, 1, 2, 74, 75, 76, 79]
    assert (exit_status.EXIT_USER_ERROR, exit_status.EXIT_PREEMPTED, exit_status.EXIT_TOO_MANY_SKIPS,
            exit_status.EXIT_PREEMPTED_NOTHING_SAVED, exit_status.EXIT_CHECKPOINT_WRITE_FAILED) == (2, 75, 76, 79, 74)
    assert json.dumps({"code": exit_status.EXIT_PREEMPTED}) == '{"code": 75}' and f"{ExitCode.PREEMPTED}" == "75"


@pytest.mark.parametrize("reason, code", [
    (StopReason.PREEMPTED, 75), (StopReason.PREEMPTED_NOTHING_SAVED, 79), (StopReason.TOO_MANY_SKIPS, 76),
    (StopReason.ROLLOUT_RANK_FAILED, 1), (StopReason.ROLLOUT_RANK_EXITED, 75), (StopReason.ROLLOUT_RANK_SILENT, 75),
    (StopReason.ROLLOUT_RANK_GONE, 75),
])
def test_each_stop_reason_has_its_exit_code(reason, code):
    from megatron_gspo.runtime.exit_status import StoppedFor

    assert reason.exit_code == code
    # whatever the message says: the code is the reason's
    assert StoppedFor("rollout rank 3 failed: weight push", reason).exit_code == code
    assert StoppedFor(" failed: ", reason).exit_code == code


def _control():
    from megatron_gspo.rollout.layout import RankSplit
    from megatron_gspo.rollout.side import Control

    split = RankSplit(world_size=3, trainer_size=1, rollout_size=2, trainer_dp=1, rollout_dp=2, rollout_tp=1)
    store = dist.HashStore()
    return Control(store, split, 0), (lambda rank: Control(store, split, rank))


def test_check_peers_returns_the_state_and_the_source_maps_it_to_a_reason():
    from megatron_gspo.rollout.remote import _REASON
    from megatron_gspo.rollout.side import PeerState

    trainer, rank = _control()
    rank(1).beat(), rank(2).beat()
    assert trainer.check_peers([1, 2], 60.0, "rollout") == (PeerState.ALIVE, "")
    rank(2).record_exit("finished", error=False)
    state, why = trainer.check_peers([1, 2], 60.0, "rollout")
    assert state is PeerState.EXITED and why == "rollout rank 2 exited: finished"
    rank(1).record_exit("RuntimeError: boom (mentions a weight push)", error=True)
    state, why = trainer.check_peers([1, 2], 60.0, "rollout")
    assert state is PeerState.FAILED and why.startswith("rollout rank 1 failed: RuntimeError: boom")
    _, fresh = _control()
    assert fresh(0).check_peers([1], -1.0, "rollout")[0] is PeerState.SILENT  # no beat within the timeout
    assert {s: _REASON[s].exit_code for s in _REASON} == {PeerState.FAILED: 1, PeerState.EXITED: 75, PeerState.SILENT: 75}


PEER_LOSS_MESSAGES = [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:1234",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation",
    "Wait timeout: timed out after 60 s",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:589] Write error: Broken pipe",
]


def test_every_peer_loss_text_has_a_message_here():
    from megatron_gspo.rollout.side import PEER_LOSS_TEXTS

    assert {t for m in PEER_LOSS_MESSAGES for t in PEER_LOSS_TEXTS if t in m} == set(PEER_LOSS_TEXTS)


@pytest.mark.parametrize("message", PEER_LOSS_MESSAGES)
def test_each_c10d_peer_loss_message_is_recognized(message):
    from megatron_gspo.rollout.side import PEER_LOSS_TEXTS, is_peer_loss, peer_loss_text

    assert peer_loss_text(message) and is_peer_loss(RuntimeError(message))
    assert is_peer_loss(dist.DistBackendError(message))
    assert not is_peer_loss(ValueError(message))  # not a c10d error, whatever it says
    assert sum(t in message for t in PEER_LOSS_TEXTS) >= 1


def test_peer_loss_is_classified_by_type_first():
    from megatron_gspo.rollout.side import is_peer_loss

    assert is_peer_loss(dist.DistNetworkError("failed to recv, got 0 bytes"))  # no known wording needed
    assert not is_peer_loss(RuntimeError("CUDA out of memory"))
