"""R3 on vLLM: the routes vLLM returns with each sample, filed to the R3 recorder as the forwards of an
embedded generation.

What vLLM returns
    With ``enable_return_routed_experts=True`` (vLLM's auxiliary outputs; its V2 model runner, prefix caching
    on) every finished request's ``CompletionOutput.routed_experts`` is a numpy array [n - 1, H, k] for its n
    tokens (prompt + response): row j holds the top-k expert ids every hidden layer chose for token j, for
    every token the engine processed, i.e. all but the last sampled one (vLLM's scheduler connector hands
    positions ``[routed_experts_prompt_start, num_tokens - 1)``; the engine leaves the start at 0). H is the
    model's number of hidden layers (``num_hidden_layers``; a dense layer's slot is never written), the ids are
    uint8 (up to 256 experts) or uint16. Prompt positions the prefix cache served come from the engine's route
    store: the routes of the forward that first processed them, as the embedded decoder's kept KV does.

What the R3 recorder takes
    ``routing.rollout_routes.RolloutRecorder.on_forward(step, kind, rows, routes=)`` once per model forward:
    step 0 the prefill over the left-padded prompt block [L, B, P, k], then decode step s [L, B, 1, k] with the
    route of response token s - 1 (the input of that forward), L = the model's MoE layers in the order of its
    routers. ``RolloutRecorder.finish`` keeps the real positions (a prompt's columns, a decode step of a row
    whose response is longer than s) and checks n - 1 routes per row. ``file_engine_routes`` hands the
    engine's routes over as exactly those forwards, so the recorder's record is the one the embedded decoder
    would have made for the same tokens (tests/test_vllm_routes.py checks it against the lean decoder).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from megatron_gspo.routing.common import RoutingReplayError, index_dtype


def moe_layer_ids(hf_config: dict) -> list[int]:
    """The hidden-layer indices that hold an MoE block in a Qwen3-MoE HF config (its own rule: not in
    ``mlp_only_layers`` and (index + 1) divisible by ``decoder_sparse_step``): vLLM's ``routed_experts`` layer
    axis is the hidden layer's index, the recorder's is the MoE layer's."""
    step = int(hf_config.get("decoder_sparse_step", 1))
    dense = set(hf_config.get("mlp_only_layers") or [])
    return [i for i in range(int(hf_config["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0]


def engine_route_rows(routed: Sequence, prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                      layers: Sequence[int], topk: int, num_experts: int) -> list[torch.Tensor]:
    """vLLM's ``routed_experts`` of B rows -> each row's routes aligned with its token stream.

    routed[r]: [n_r - 1, H, k] expert ids (numpy or tensor; n_r = prompt_lengths[r] + response_lengths[r]),
    row j the route of token j. layers: the hidden-layer indices of the model's MoE layers, in router order
    (``moe_layer_ids``). Returns per row [n_r - 1, L, k] in ``index_dtype(num_experts)`` on the CPU, L =
    len(layers). A row of another length, another top-k or an id out of range is refused naming the row."""
    plen, rlen = [int(x) for x in prompt_lengths], [int(x) for x in response_lengths]
    if not len(routed) == len(plen) == len(rlen):
        raise RoutingReplayError(f"vLLM routes: {len(routed)} rows of routed_experts for {len(plen)} prompts lengths "
                                 f"and {len(rlen)} response lengths")
    dtype, sel = index_dtype(num_experts), torch.tensor(list(layers), dtype=torch.long)
    out = []
    for r, a in enumerate(routed):
        if a is None:
            raise RoutingReplayError(f"vLLM routes: row {r} came back without routed_experts (the engine was not "
                                     "built with enable_return_routed_experts)")
        x = torch.as_tensor(np.asarray(a, dtype=np.int64))  # (vLLM's uint16 ids: torch indexes no uint16)
        n = plen[r] + rlen[r]
        if x.dim() != 3 or x.shape[0] != n - 1 or x.shape[2] != topk or x.shape[1] <= int(sel.max()):
            raise RoutingReplayError(f"vLLM routes: row {r} routed_experts of shape {tuple(x.shape)}; expected "
                                     f"[{n - 1} (its {n} tokens but the last), H > {int(sel.max())} hidden layers, "
                                     f"k={topk}]")
        x = x[:, sel]
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= num_experts):
            raise RoutingReplayError(f"vLLM routes: row {r} has expert ids in [{int(x.min())}, {int(x.max())}], the "
                                     f"model has {num_experts} experts")
        out.append(x.to(dtype))
    return out


def file_engine_routes(on_forward: Callable, rows: Sequence[torch.Tensor], prompt_lengths: Sequence[int],
                       response_lengths: Sequence[int], device: Union[str, torch.device] = "cpu") -> Optional[int]:
    """File the routes of B generated rows (``engine_route_rows``: [n_r - 1, L, k] each) to an R3 recorder's
    ``on_forward`` as one generation's forwards: the prefill [L, B, P, k] (P = the longest prompt; row r's
    prompt routes in its last prompt_lengths[r] columns, as the left-padded prompt block), then decode steps
    s = 1 .. max(response_lengths) - 1 [L, B, 1, k] (row r's route of token prompt_lengths[r] + s - 1, the
    response token that step feeds). Columns that are no token of a row hold routes the recorder drops (left
    padding: route 0; a row that already ended: one of its own routes). Returns the number of forwards filed (None for no rows: nothing
    is filed). Every row needs a response token (vLLM samples at least one)."""
    B = len(rows)
    if B == 0:
        return None
    plen = torch.as_tensor([int(x) for x in prompt_lengths], dtype=torch.long)
    rlen = torch.as_tensor([int(x) for x in response_lengths], dtype=torch.long)
    if plen.numel() != B or rlen.numel() != B or int(rlen.min()) < 1 or int(plen.min()) < 1:
        raise RoutingReplayError(f"file_engine_routes: {B} rows of routes, prompt lengths {plen.tolist()}, response "
                                 f"lengths {rlen.tolist()}: one of each per row, at least one token each")
    _, L, k = rows[0].shape
    width = int((plen + rlen).max()) - 1
    grid = torch.zeros(B, width, L, k, dtype=rows[0].dtype)  # row r's routes by token position, right-padded
    for r, x in enumerate(rows):
        if tuple(x.shape) != (int(plen[r] + rlen[r]) - 1, L, k):
            raise RoutingReplayError(f"file_engine_routes: row {r} routes {tuple(x.shape)}; expected "
                                     f"[{int(plen[r] + rlen[r]) - 1}, {L}, {k}]")
        grid[r, :x.shape[0]] = x
    at = torch.arange(B)[:, None]
    P = int(plen.max())
    col = torch.arange(P)[None, :] - (P - plen)[:, None]  # [B, P]: the token in each prompt-block column (< 0: pad)
    prefill = torch.where((col >= 0)[:, :, None, None], grid[at, col.clamp(min=0)], 0)
    on_forward(0, "prefill", None, routes=prefill.permute(2, 0, 1, 3).to(device))
    steps = int(rlen.max())
    for s in range(1, steps):
        fed = (plen + s - 1).clamp(max=width - 1)  # the token decode step s feeds (rows that ended: any, dropped)
        on_forward(s, "decode", None, routes=grid[at[:, 0], fed].permute(1, 0, 2)[:, :, None].to(device))
    return steps
