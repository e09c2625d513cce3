"""A step's scored rows as one global batch, dealt to the data-parallel ranks by token count.

Each DP rank generates its share of every generation round (``rows.local_rows``) and scores it. Then:

    gather_scores   every rank's rewards, lengths and stop flags of the round, by global row: one all-gather
                    of [rows, 4] per round. Dynamic sampling decides on them, the deal is made of them, the
                    advantages are computed from them: every rank derives the same decisions from the same
                    numbers, so nothing else has to be agreed.
    exchange        after the last round: the kept rows to the ranks they are dealt to (``rows.deal_rows``),
                    in one all-to-all of a packed byte buffer.

What moves is only what the trainer needs of a row, by length (no padding): its tokens (int32), the
sampling log-probs of its response (fp32) and, when the routing policy recorded them, its routes (one id
per token but the last, layer and top-k slot: uint8 up to 256 experts). Rewards, lengths and stop flags
are known everywhere already; prompt ids follow from the row (every rank drew the same prompts); the
response text is decoded where the row lands. ``row_bytes`` is the size of one row on the wire.

A multi-turn row (env.name, rollout/multiturn.py) also carries its loss mask, one bit per token (the tokens the
policy sampled: not derivable from the lengths, and the rank that generated the row is the one that knows it),
and its conversation (Trajectory.summary, as JSON). The conversation's size is the fifth column of the scores'
gather, so the exchange still knows every size without asking, and a conversation travels once, with its row,
to the one rank that trains it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import json

import torch

from megatron_gspo.rollout.record import RolloutRecord
from megatron_gspo.rollout.rows import local_rows
from megatron_gspo.runtime import comm

_ALIGN = 8  # every row starts at a multiple of this many bytes, so its parts can be viewed in place


@dataclass
class Scores:
    """Rows of every rank, by global row: rewards [n] fp32, prompt_lengths / response_lengths [n] int64,
    stopped [n] bool, on the compute device; conversation_bytes [n] int64: the size of a multi-turn row's
    conversation on the wire (the length of ``conversation_bytes(summary)``), None for single-turn rows."""

    rewards: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    stopped: torch.Tensor
    conversation_bytes: Optional[torch.Tensor] = None

    @property
    def seq_lengths(self) -> torch.Tensor:
        return self.prompt_lengths + self.response_lengths

    def rows(self, lo: int, hi: int) -> "Scores":
        return Scores(*(None if t is None else t[lo:hi] for t in self._columns()))

    def _columns(self) -> tuple:
        return (self.rewards, self.prompt_lengths, self.response_lengths, self.stopped, self.conversation_bytes)

    @classmethod
    def cat(cls, parts: list["Scores"]) -> "Scores":
        return cls(*(None if cols[0] is None else torch.cat(cols) for cols in zip(*(p._columns() for p in parts))))


def conversation_bytes(summary: dict) -> bytes:
    """A multi-turn row's conversation (Trajectory.summary) as it travels: JSON, utf-8."""
    return json.dumps(summary).encode()


def gather_scores(rewards: torch.Tensor, out, num_rows: int, num_minibatches: int, dp_size: int, group,
                  device: torch.device, conversations: Optional[list] = None) -> Scores:
    """The round's [R] scores of every rank in global row order (rank r generated
    ``local_rows(R, M, DP, r)``): rewards [B] and ``out`` (this rank's GenerationOutput) -> Scores.
    One all-gather of fp64 [B, 4] (exact for fp32 rewards and for lengths); [B, 5] with ``conversations``
    (multi-turn rows: [B] Trajectory.summary), the fifth column their sizes on the wire."""
    cols = [rewards, out.prompt_lengths, out.response_lengths, out.stopped]
    if conversations is not None:
        cols.append(torch.tensor([len(conversation_bytes(c)) for c in conversations]))
    local = torch.stack([c.to(device, torch.float64) for c in cols], 1)
    parts = comm.all_gather(local, group, what="global batch: rewards and lengths of the round's rows")
    full = torch.empty(num_rows, len(cols), dtype=torch.float64, device=device)
    for r, part in enumerate(parts):
        full[torch.tensor(local_rows(num_rows, num_minibatches, dp_size, r), device=device)] = part
    return Scores(full[:, 0].float(), full[:, 1].long(), full[:, 2].long(), full[:, 3].bool(),
                  full[:, 4].long() if conversations is not None else None)


@dataclass(frozen=True)
class RouteSpec:
    """Routes on the wire: [n - 1, L, k] expert ids of a row of n tokens, in ``dtype``."""

    num_layers: int
    topk: int
    num_experts: Optional[int]

    @property
    def dtype(self) -> torch.dtype:
        e = self.num_experts or 1 << 31
        return torch.uint8 if e <= 256 else torch.int16 if e <= 1 << 15 else torch.int32

    @classmethod
    def of(cls, routes) -> Optional["RouteSpec"]:
        return None if routes is None else cls(routes.num_layers, routes.topk, routes.num_experts)


def row_bytes(prompt_length: int, response_length: int, routes: Optional[RouteSpec],
              conversation: Optional[int] = None) -> int:
    """Bytes of one row on the wire: tokens (int32), response log-probs (fp32), routes; a multi-turn row's loss
    mask (one bit per token) and its ``conversation`` (that many bytes; None: a single-turn row); padded to 8."""
    n = prompt_length + response_length
    size = 4 * n + 4 * response_length
    if routes is not None:
        size += max(n - 1, 0) * routes.num_layers * routes.topk * torch.empty(0, dtype=routes.dtype).element_size()
    if conversation is not None:
        size += -(-n // 8) + conversation
    return -(-size // _ALIGN) * _ALIGN


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[n] bool -> [ceil(n / 8)] uint8, bit j of byte i = bits[8 i + j] (on the host)."""
    n = bits.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8)
    padded[:n] = bits.reshape(-1).cpu()
    return (padded.view(-1, 8).long() << torch.arange(8)).sum(1).to(torch.uint8)


def unpack_bits(raw: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of ``pack_bits``: [ceil(n / 8)] uint8 -> [n] bool."""
    return ((raw.long()[:, None] >> torch.arange(8)) & 1).reshape(-1)[:n].bool()


def _pack(pool: RolloutRecord, rows: list[int], sizes: list[int], spec: Optional[RouteSpec],
          multi_turn: bool) -> torch.Tensor:
    """The pool's ``rows`` (indices) one after the other, each ``sizes[i]`` bytes: uint8 [sum], on the host."""
    tokens, logprobs = pool.tokens.cpu(), pool.sample_logprobs.cpu().float()  # one copy each
    mask = pool.loss_mask.cpu() if multi_turn else None
    plen, rlen = pool.prompt_lengths.tolist(), pool.response_lengths.tolist()
    parts = []
    for i, size in zip(rows, sizes):
        n = plen[i] + rlen[i]
        row = [tokens[i, :n].to(torch.int32).view(torch.uint8), logprobs[i, plen[i]:n].contiguous().view(torch.uint8)]
        if spec is not None:
            row.append(pool.routes.row(i).transpose(0, 1).to(spec.dtype).contiguous().view(torch.uint8).reshape(-1))
        if multi_turn:
            row += [pack_bits(mask[i, :n]), torch.frombuffer(bytearray(conversation_bytes(pool.trajectories[i])),
                                                             dtype=torch.uint8)]
        used = sum(x.numel() for x in row)
        if not 0 <= size - used < _ALIGN:  # the receiver reads the sizes the scores announced
            raise RuntimeError(f"global batch: row {i} of this rank's pool packs to {used} bytes where its scores "
                               f"announced {size} (its conversation changed after the scores' gather?)")
        parts += row + [torch.zeros(size - used, dtype=torch.uint8)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _unpack(buf: torch.Tensor, slots: list[int], plen: list[int], rlen: list[int], spec: Optional[RouteSpec],
            conversation: Optional[list[int]]) -> dict:
    """slot -> (tokens [n] int64, response log-probs [r] fp32, routes [L, n - 1, k] or None, loss mask [n] bool
    and conversation dict, or None and None for single-turn rows) of the rows packed one after the other in
    ``buf`` (host uint8), in ``slots`` order; ``conversation``: every slot's conversation bytes (multi-turn)."""
    out, at = {}, 0
    for s in slots:
        n, r = plen[s] + rlen[s], rlen[s]
        tokens = buf[at:at + 4 * n].view(torch.int32).long()
        lp = buf[at + 4 * n:at + 4 * n + 4 * r].view(torch.float32).clone()
        lo = at + 4 * n + 4 * r
        routes = mask = summary = None
        if spec is not None:
            k = max(n - 1, 0) * spec.num_layers * spec.topk
            width = torch.empty(0, dtype=spec.dtype).element_size()
            ids = buf[lo:lo + k * width].view(spec.dtype).reshape(max(n - 1, 0), spec.num_layers, spec.topk)
            routes = ids.transpose(0, 1)
            lo += k * width
        if conversation is not None:
            mask = unpack_bits(buf[lo:lo + -(-n // 8)], n)
            lo += -(-n // 8)
            summary = json.loads(buf[lo:lo + conversation[s]].numpy().tobytes().decode())
        out[s] = (tokens, lp, routes, mask, summary)
        at += row_bytes(plen[s], rlen[s], spec, None if conversation is None else conversation[s])
    return out


def exchange(pool: RolloutRecord, where: dict[int, int], deal: list[list[int]], holder: list[int], scores: Scores,
             prompt_ids: list[str], *, rank: int, group, device: torch.device, pad_id: int,
             decode: Callable[[list[int]], str]) -> RolloutRecord:
    """This rank's dealt rows ``deal[rank]`` as a record (row_ids: the slots), moved from the ranks that hold
    them in one all-to-all over ``group`` (the data-parallel group).

    pool: this rank's scored rows; where: slot -> its row in the pool, for the slots held here; holder:
    slot -> the rank holding it; scores / prompt_ids: every slot's (known on every rank). The rows sent
    to rank d are the slots of ``deal[d]`` held here, in that order, so that both ends know the order and
    every size without asking. The record's tensors on ``device``, its routes on the host. Multi-turn rows
    (the scores' ``conversation_bytes``) bring their loss masks and conversations with them (module doc)."""
    spec = RouteSpec.of(pool.routes)
    plen, rlen = scores.prompt_lengths.tolist(), scores.response_lengths.tolist()
    conv = scores.conversation_bytes.tolist() if scores.conversation_bytes is not None else None
    sizes = [row_bytes(p, r, spec, None if conv is None else conv[s]) for s, (p, r) in enumerate(zip(plen, rlen))]
    sends = [[s for s in rows if holder[s] == rank] for rows in deal]
    recvs = [[s for s in deal[rank] if holder[s] == src] for src in range(len(deal))]
    flat = [s for rows in sends for s in rows]
    buf = _pack(pool, [where[s] for s in flat], [sizes[s] for s in flat], spec, conv is not None).to(device)
    got = torch.empty(sum(sizes[s] for rows in recvs for s in rows), dtype=torch.uint8, device=device)
    comm.all_to_all_single(got, buf, group, what="global batch: rows to the ranks they are dealt to",
                           out_splits=[sum(sizes[s] for s in rows) for rows in recvs],
                           in_splits=[sum(sizes[s] for s in rows) for rows in sends])
    rows = _unpack(got.cpu(), [s for r in recvs for s in r], plen, rlen, spec, conv)
    mine = deal[rank]
    width = max(plen[s] + rlen[s] for s in mine)
    tokens = torch.full((len(mine), width), pad_id, dtype=torch.long)
    logprobs = torch.zeros(len(mine), width, dtype=torch.float32)
    mask = torch.zeros(len(mine), width, dtype=torch.bool)
    for i, s in enumerate(mine):
        n = plen[s] + rlen[s]
        tokens[i, :n] = rows[s][0]
        logprobs[i, plen[s]:n] = rows[s][1]
        if conv is not None:  # the generating rank's mask
            mask[i, :n] = rows[s][3]
        else:  # a single-turn row's: its response
            mask[i, plen[s]:n] = True
    texts = [pool.texts[where[s]] if s in where else decode(rows[s][0][plen[s]:].tolist()) for s in mine]
    trajectories = [rows[s][4] for s in mine] if conv is not None else []  # each as it came with its row
    routes = None
    if spec is not None:
        from megatron_gspo.routing.rollout_routes import RolloutRoutes  # the routing package loads megatron

        routes = RolloutRoutes.from_rows([rows[s][2] for s in mine], spec.num_layers, spec.topk, spec.num_experts)
    idx = torch.tensor(mine, dtype=torch.long, device=device)
    return RolloutRecord(
        step=pool.step, tokens=tokens.to(device), prompt_lengths=scores.prompt_lengths[idx],
        response_lengths=scores.response_lengths[idx], stopped=scores.stopped[idx], sample_logprobs=logprobs.to(device),
        rewards=scores.rewards[idx], row_ids=idx, version_start=torch.full_like(idx, pool.step),
        version_end=torch.full_like(idx, pool.step), prompt_ids=[prompt_ids[s] for s in mine], texts=texts,
        loss_mask=mask.to(device), trajectories=trajectories, routes=routes)
