"""R3 on vLLM without vLLM (megatron_gspo/rollout/vllm_routes.py): the routes vLLM returns per sample
(``routed_experts`` [n - 1, hidden layers, k], uint8) filed to the R3 recorder as an embedded generation's
forwards. The reference is the lean decoder's own record of the same rows: the routes laid out as vLLM lays
them out must file to exactly that record, and replaying them in a training forward must give the rollout's
log-probs; routes one position off must not."""

import numpy as np
import pytest
import torch

from megatron_gspo.config import ParallelConfig, model_config_from_preset
from megatron_gspo.rollout.vllm_routes import engine_route_rows, file_engine_routes, moe_layer_ids
from megatron_gspo.routing import RolloutRoutes, RoutingReplayError

# ------------------------------------------------------------------------------------------------
# Hand examples
# ------------------------------------------------------------------------------------------------


def test_moe_layers_follow_the_hf_configs_rule():
    assert moe_layer_ids({"num_hidden_layers": 3}) == [0, 1, 2]
    assert moe_layer_ids({"num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 1}) == [1, 2, 3]
    assert moe_layer_ids({"num_hidden_layers": 6, "mlp_only_layers": [3], "decoder_sparse_step": 2}) == [1, 5]


def test_engine_rows_take_the_moe_layers_of_every_token_but_the_last():
    # 3 hidden layers, MoE at 0 and 2 (layer 1 dense: vLLM never writes its slot); a row of 2 + 2 tokens
    a = np.array([[[1, 2], [9, 9], [3, 0]], [[0, 3], [9, 9], [2, 1]], [[2, 3], [9, 9], [0, 1]]], dtype=np.uint8)
    (r,) = engine_route_rows([a], [2], [2], layers=[0, 2], topk=2, num_experts=4)
    assert r.dtype == torch.int16 and r.tolist() == [[[1, 2], [3, 0]], [[0, 3], [2, 1]], [[2, 3], [0, 1]]]
    # more than 256 experts: vLLM's ids are uint16, the recorder's int16 up to 32767 experts
    (w,) = engine_route_rows([a.astype(np.uint16) + 300], [2], [2], layers=[2], topk=2, num_experts=512)
    assert w.dtype == torch.int16 and w[:, 0].tolist() == [[303, 300], [302, 301], [300, 301]]
    with pytest.raises(RoutingReplayError, match=r"row 0 routed_experts of shape \(3, 3, 2\); expected \[4 \(its 5 "
                                                 r"tokens but the last\)"):
        engine_route_rows([a], [2], [3], layers=[0, 2], topk=2, num_experts=4)
    with pytest.raises(RoutingReplayError, match="row 0 has expert ids in \\[0, 3\\], the model has 3 experts"):
        engine_route_rows([a], [2], [2], layers=[0, 2], topk=2, num_experts=3)
    with pytest.raises(RoutingReplayError, match="row 1 came back without routed_experts"):
        engine_route_rows([a, None], [2, 2], [2, 2], layers=[0, 2], topk=2, num_experts=4)


def test_filed_forwards_hand_example():
    """Two rows: prompts of 3 and 1 tokens, responses of 1 and 3: the prefill block is left-padded, decode step s
    feeds response token s - 1, and the recorder's record is each row's routes in order."""
    L, k = 1, 1
    rows = [torch.tensor([[[10]], [[11]], [[12]]], dtype=torch.int16),   # 3 + 1 tokens: 3 routes
            torch.tensor([[[20]], [[21]], [[22]]], dtype=torch.int16)]   # 1 + 3 tokens: 3 routes
    got = []
    n = file_engine_routes(lambda step, kind, live, routes: got.append((step, kind, live, routes)), rows, [3, 1], [1, 3])
    assert n == 3 and [(s, kd, lv) for s, kd, lv, _ in got] == [(0, "prefill", None), (1, "decode", None),
                                                                (2, "decode", None)]
    assert got[0][3].shape == (L, 2, 3, k) and got[0][3][0, :, :, 0].tolist() == [[10, 11, 12], [0, 0, 20]]
    assert [g[3][0, 1, 0, 0].item() for g in got[1:]] == [21, 22]  # row 1's response tokens 0 and 1 fed
    rr = RolloutRoutes.from_generation([g[3] for g in got], torch.tensor([3, 1]), torch.tensor([1, 3]), topk=k)
    assert rr.row(0)[0, :, 0].tolist() == [10, 11, 12] and rr.row(1)[0, :, 0].tolist() == [20, 21, 22]
    assert file_engine_routes(lambda *a, **kw: got.append(a), [], [], []) is None
    with pytest.raises(RoutingReplayError, match=r"row 1 routes \(3, 1, 1\); expected \[2, 1, 1\]"):
        file_engine_routes(lambda *a, **kw: None, rows, [3, 1], [1, 2])


# ------------------------------------------------------------------------------------------------
# Against the lean decoder's own record, and replayed in a training forward
# ------------------------------------------------------------------------------------------------


def as_vllm_returns(routes: RolloutRoutes) -> list[np.ndarray]:
    """The routes of each row as vLLM returns them: [n - 1, H, k] uint8 (every layer of the tiny model is MoE)."""
    return [routes.row(i).permute(1, 0, 2).numpy().astype(np.uint8) for i in range(routes.batch_size)]


@pytest.fixture(scope="module")
def lean_rollout():
    """A tiny MoE generating ragged rows on the lean decoder with the R3 recorder: (model, state, cfg, output,
    the recorder, its record)."""
    from megatron_gspo.generation.generator import GenerationConfig, generate
    from megatron_gspo.model.gpt import build_model
    from megatron_gspo.routing import RolloutRecorder
    from megatron_gspo.runtime import parallel

    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=0.0)
    par = ParallelConfig(device="cpu", seed=3)
    st = parallel.initialize(cfg, par)
    try:
        model = build_model(cfg, par, st, routing_replay=True)
        rec = RolloutRecorder(model)
        gcfg = GenerationConfig(max_new_tokens=7, n_samples_per_prompt=2, temperature=1.0, seed=11,
                                stop_token_ids=list(range(40)), decode_impl="lean")
        with rec.recording():
            out = generate(model, [[50, 61, 72, 83, 94], [100, 111], [45, 46, 47]], gcfg, vocab_size=cfg.vocab_size,
                           state=st, on_forward=rec.on_forward)
        assert int(out.response_lengths.min()) < int(out.response_lengths.max()), "want ragged responses"
        yield model, st, cfg, out, rec, rec.finish(out)
    finally:
        parallel.destroy()


def file_as_vllm(rec, out, returned, cfg) -> RolloutRoutes:
    """vLLM's returned routes through the engine generator's path: rows, then forwards filed to the recorder."""
    rows = engine_route_rows(returned, out.prompt_lengths.tolist(), out.response_lengths.tolist(),
                             layers=list(range(cfg.num_layers)), topk=cfg.moe_router_topk, num_experts=cfg.num_moe_experts)
    with rec.recording():
        file_engine_routes(rec.on_forward, rows, out.prompt_lengths.tolist(), out.response_lengths.tolist())
    return rec.finish(out)


def test_vllm_routes_file_to_the_lean_decoders_record(lean_rollout):
    _, _, cfg, out, rec, lean = lean_rollout
    lean_prefill = rec.steps[0].shape
    filed = file_as_vllm(rec, out, as_vllm_returns(lean), cfg)
    assert rec.steps[0].shape == lean_prefill  # the same prompt block: [L, B, P, k]
    assert torch.equal(filed.count, lean.count) and filed.count.tolist() == (out.prompt_lengths + out.response_lengths
                                                                             - 1).tolist()
    assert filed.routes.dtype == lean.routes.dtype
    for i in range(out.tokens.shape[0]):
        assert torch.equal(filed.row(i), lean.row(i)), f"row {i}"
    S = out.tokens.shape[1]
    assert torch.equal(filed.routes_for(range(6), S - 1), lean.routes_for(range(6), S - 1))


def replay_gap(model, st, cfg, out, routes: RolloutRoutes, mb: str) -> float:
    """Largest |training log-prob - rollout log-prob| over the response tokens, the training forward replaying
    ``routes`` (R3)."""
    from megatron_gspo.model.gpt import forward_logprobs
    from megatron_gspo.routing import RoutingReplay

    replay = RoutingReplay.from_model("R3", model, st)
    B, S = out.tokens.shape
    replay.load(mb, routes.routes_for(range(B), S - 1))
    with replay.replaying(mb), torch.no_grad():
        lp, _ = forward_logprobs(model, out.tokens[:, :-1], out.tokens[:, 1:], cfg.vocab_size, with_entropy=False)
    replay.finish_step()
    mask = out.response_mask[:, 1:]
    return float((lp - out.logprobs[:, 1:]).abs()[mask].max())


def test_replayed_vllm_routes_give_the_rollouts_log_probs_and_one_position_off_does_not(lean_rollout):
    model, st, cfg, out, rec, lean = lean_rollout
    returned = as_vllm_returns(lean)
    gap = replay_gap(model, st, cfg, out, file_as_vllm(rec, out, returned, cfg), "aligned")
    assert gap < 5e-6, gap  # measured 4.8e-7: fp32 rounding between the lean decode step and the training forward
    # each row's routes one token late (route j of token j - 1; the first repeated): same shapes, wrong alignment
    late = [np.concatenate([a[:1], a[:-1]]) for a in returned]
    off = replay_gap(model, st, cfg, out, file_as_vllm(rec, out, late, cfg), "late")
    assert off > 1e-3, off
