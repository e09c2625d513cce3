"""What a rollout source hands the trainer for one step, and the asynchronous job's wire format for it.

``RolloutRecord``: this rank's sampled, scored rows of a step, before any training preparation
(advantages, micro-batches, log-prob passes: rollout/prepare.py). Both sources return one: the colocated
source from its own generation (``from_generation``), the remote source from the rollout ranks' rows.

The wire (``pack`` / ``unpack`` / ``concat``): a rollout leader sends its record to trainer rank 0 over
the bridge, trainer rank 0 concatenates every leader's part and sends the whole step to the other trainer
ranks, each time as four tensors::

    header  int64 [8]   MAGIC, WIRE_VERSION, step, rows, width, #ints, #floats, #meta bytes
    ints    int64       INT_FIELDS flattened, in order
    floats  fp32        FLOAT_FIELDS flattened, in order
    meta    uint8       META_FIELDS as one JSON object (utf-8)

A new field is one entry in one of the three tuples (and WIRE_VERSION + 1, so that a rank of another
version is refused by name instead of misreading the tensors). ``LOCAL_FIELDS`` never travel: the
routes a colocated rollout recorded (the asynchronous job refuses R3 and recomputes the old log-probs,
so nothing on its trainer ranks reads rollout routes: config/rules.py), and the step's rewards of every
row, which the trainer side assembles itself (``global_rewards``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from megatron_gspo.rollout.rows import pad_columns

if TYPE_CHECKING:
    from megatron_gspo.routing.rollout_routes import RolloutRoutes

MAGIC = 0x6A5E
WIRE_VERSION = 3  # 2: the loss mask and the multi-turn trajectories; 3: prefill tokens, live decode rows
HEADER = ("magic", "version", "step", "rows", "width", "ints", "floats", "meta_bytes")
# (field, dimensions): [B, T] grids first, then [B] columns
INT_FIELDS = (("tokens", 2), ("loss_mask", 2), ("prompt_lengths", 1), ("response_lengths", 1), ("row_ids", 1),
              ("stopped", 1), ("version_start", 1), ("version_end", 1))
FLOAT_FIELDS = (("sample_logprobs", 2), ("rewards", 1))
META_FIELDS = ("prompt_ids", "texts", "gen_s", "gen_tokens", "decode_row_steps", "decode_live_row_steps",
               "prefill_tokens", "stats", "data_state", "trajectories")
# the generation work counts: summed over the parts of a step (rounds, leaders) and over DP (perf/*)
COUNTS = ("gen_tokens", "decode_row_steps", "decode_live_row_steps", "prefill_tokens")
LOCAL_FIELDS = ("routes", "global_rewards")  # not on the wire (module doc)
_DTYPES = {"stopped": torch.bool, "loss_mask": torch.bool}  # int64 on the wire, this dtype in the record


class WireFormatError(RuntimeError):
    """The two ends of the wire do not speak the same format (or the sizes do not add up)."""


@dataclass
class RolloutRecord:
    """One step's rows on this rank. B rows, T: the grid's width (>= the longest prompt + response);
    row r holds global row ``row_ids[r]`` (prompt row_ids // G, sample row_ids % G). Every tensor on
    the rank's compute device, the routes on the host.

    tokens            [B, T] int64  prompt (from column 0) + response + pad, right-padded
    prompt_lengths    [B] int64
    response_lengths  [B] int64     tokens after the prompt: the response (its stop token included); a multi-turn
                                    row's every turn, sampled and observed
    loss_mask         [B, T] bool   the tokens the policy sampled (the response; a multi-turn row's assistant turns,
                                    not its observations): what the loss trains on
    stopped           [B] bool      the (last) response ended with a stop token (False: cut at its token limit,
                                    generation.max_new_tokens or a multi-turn row's budget: truncated)
    sample_logprobs   [B, T] fp32   the sampling policy's log-prob of tokens[:, t] at response positions, 0 elsewhere
    rewards           [B] fp32      reward (+ DAPO's overlong penalty)
    row_ids           [B] int64     global row index
    version_start     [B] int64     policy version that drew the row's first token (colocated: the step)
    version_end       [B] int64     newest policy version that drew one of its tokens (colocated: the step)
    prompt_ids, texts               [B] the prompt's dataset id, the decoded response
    gen_s, gen_tokens, decode_row_steps   generation seconds, generated tokens (every dynamic-sampling
                                    round's), decode forward rows summed over steps
    decode_live_row_steps, prefill_tokens   of those rows the ones still generating; prompt tokens prefilled
                                    (each distinct prompt of a generate call once)
    stats             source statistics: logged as they are (dynamic_sampling/*), or the remote source's
                      raw counters (STAT_MERGE)
    data_state        the prompt sampler's position after the step's prompts (remote: the rollout side's)
    trajectories      [B] multi-turn rows: their conversation (rollout/multiturn.py Trajectory.summary: turns as
                      spans over the tokens, tool calls, counts, the environment's reward); [] for single-turn rows
    routes            routing.RolloutRoutes: per row, the top-k experts of every MoE layer for each of its
                      tokens but the last, as generated (R3 replays them; without an old-log-prob pass they
                      are the routing reference); on the host; None when the routing policy records none
    global_rewards    [R] fp32  the rewards of every row of the step (all ranks), by global row id: the
                      advantages' input (rollout/prepare.py); None: prepare gathers them from the ranks
    """

    step: int
    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    stopped: torch.Tensor
    sample_logprobs: torch.Tensor
    rewards: torch.Tensor
    row_ids: torch.Tensor
    version_start: torch.Tensor
    version_end: torch.Tensor
    loss_mask: Optional[torch.Tensor] = None  # None: the response (response_mask), a single-turn row's
    prompt_ids: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    gen_s: float = 0.0
    gen_tokens: int = 0
    decode_row_steps: int = 0
    decode_live_row_steps: int = 0
    prefill_tokens: int = 0
    stats: dict = field(default_factory=dict)
    data_state: Optional[dict] = None
    trajectories: list = field(default_factory=list)
    routes: Optional["RolloutRoutes"] = None
    global_rewards: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.response_mask

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_lengths(self) -> torch.Tensor:
        """[B] int64: prompt + response tokens (the rest of the row is padding)."""
        return self.prompt_lengths + self.response_lengths

    @property
    def response_mask(self) -> torch.Tensor:
        """[B, T] bool: prompt_lengths <= t < prompt_lengths + response_lengths (generation's own mask)."""
        cols = torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :]
        return (cols < self.seq_lengths[:, None]) & (cols >= self.prompt_lengths[:, None])

    def sample_ids(self, group_size: int) -> list[str]:
        """``"<prompt id>#<sample>"`` per row, for error reports and records."""
        return [f"{p}#{r % group_size}" for p, r in zip(self.prompt_ids, self.row_ids.tolist())]

    @classmethod
    def from_generation(cls, step: int, out, rows: list[int], prompt_ids: list[str], texts: list[str],
                        rewards: torch.Tensor, *, gen_tokens: Optional[int] = None, stats: Optional[dict] = None,
                        data_state: Optional[dict] = None, version_start=None, version_end=None,
                        routes: Optional["RolloutRoutes"] = None) -> "RolloutRecord":
        """A GenerationOutput ``out`` of the global rows ``rows`` as a record; the versions default to the step
        (a colocated rollout samples with the weights it trains)."""
        dev = rewards.device
        n = len(rows)
        full = lambda v: torch.full((n,), step if v is None else v, dtype=torch.long, device=dev)  # noqa: E731
        return cls(step=step, tokens=out.tokens, prompt_lengths=out.prompt_lengths, response_lengths=out.response_lengths,
                   stopped=out.stopped, sample_logprobs=out.logprobs, loss_mask=out.response_mask, rewards=rewards,
                   row_ids=torch.tensor(rows, dtype=torch.long, device=dev),
                   version_start=full(version_start) if not isinstance(version_start, torch.Tensor) else version_start,
                   version_end=full(version_end) if not isinstance(version_end, torch.Tensor) else version_end,
                   prompt_ids=list(prompt_ids), texts=list(texts), gen_s=out.elapsed_s,
                   gen_tokens=out.num_generated_tokens if gen_tokens is None else gen_tokens,
                   decode_row_steps=out.decode_row_steps, decode_live_row_steps=out.decode_live_row_steps,
                   prefill_tokens=out.prefill_tokens, stats=dict(stats or {}), data_state=data_state,
                   trajectories=list(getattr(out, "trajectories", [])), routes=routes)

    def select(self, idx: torch.Tensor, width: Optional[int] = None) -> "RolloutRecord":
        """The rows ``idx`` ([n] int64 index tensor), the grid cut to ``width`` columns (default: the
        longest of those rows), their routes if any; step, timings, stats and data state unchanged."""
        if width is None:
            width = int(self.seq_lengths[idx].max())
        pick = idx.tolist()
        grids = {name: getattr(self, name)[idx, :width] for name, dims in INT_FIELDS + FLOAT_FIELDS if dims == 2}
        cols = {name: getattr(self, name)[idx] for name, dims in INT_FIELDS + FLOAT_FIELDS if dims == 1}
        return dataclasses.replace(self, **grids, **cols, prompt_ids=[self.prompt_ids[i] for i in pick],
                                   texts=[self.texts[i] for i in pick],
                                   trajectories=[self.trajectories[i] for i in pick] if self.trajectories else [],
                                   routes=self.routes.select(idx) if self.routes is not None else None)

    @classmethod
    def cat(cls, parts: list["RolloutRecord"], pad_id: int) -> "RolloutRecord":
        """The rows of ``parts`` (records of one step) one after the other, on one grid (T: the widest;
        tokens padded with ``pad_id``, log-probs with 0), with their routes; everything else is the first
        part's (the caller sets the step's timings and statistics)."""
        T = max(p.tokens.shape[1] for p in parts)
        tensors = {name: torch.cat([pad_columns(getattr(p, name), T, pad_id if name == "tokens" else 0.0)
                                    if dims == 2 else getattr(p, name) for p in parts])
                   for name, dims in INT_FIELDS + FLOAT_FIELDS}
        routes = None
        if parts[0].routes is not None:
            from megatron_gspo.routing.rollout_routes import RolloutRoutes  # the routing package loads megatron

            routes = RolloutRoutes.cat([p.routes for p in parts])
        return dataclasses.replace(parts[0], **tensors, prompt_ids=[x for p in parts for x in p.prompt_ids],
                                   texts=[x for p in parts for x in p.texts],
                                   trajectories=[x for p in parts for x in p.trajectories], routes=routes)


# ----------------------------------------------------------------------------------------------
# The wire
# ----------------------------------------------------------------------------------------------


def pack(rec: RolloutRecord) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(header [8] int64, ints int64, floats fp32, meta uint8), contiguous, on the record's device."""
    if rec.routes is not None:
        raise WireFormatError(f"step {rec.step + 1}'s record carries rollout routes, which never travel on the wire "
                              "(routing replay R3 runs colocated only)")
    dev = rec.tokens.device
    n, width = rec.tokens.shape
    ints = torch.cat([getattr(rec, name).reshape(-1).to(device=dev, dtype=torch.long) for name, _ in INT_FIELDS])
    floats = torch.cat([getattr(rec, name).reshape(-1).to(device=dev, dtype=torch.float32) for name, _ in FLOAT_FIELDS])
    raw = json.dumps({name: getattr(rec, name) for name in META_FIELDS}).encode()
    meta = torch.tensor(list(raw), dtype=torch.uint8, device=dev)
    header = torch.tensor([MAGIC, WIRE_VERSION, rec.step, n, width, ints.numel(), floats.numel(), meta.numel()],
                          dtype=torch.long, device=dev)
    return header, ints.contiguous(), floats.contiguous(), meta


def check_header(header, step: Optional[int] = None, sender: str = "the sender") -> dict:
    """The header as {name: int}; a wrong magic or version, or another step than ``step``, is one clear error."""
    head = dict(zip(HEADER, header.tolist() if isinstance(header, torch.Tensor) else list(header)))
    if head["magic"] != MAGIC or head["version"] != WIRE_VERSION:
        raise WireFormatError(
            f"rollout wire format mismatch: {sender} sent magic {head['magic']:#x} version {head['version']}, this "
            f"rank reads magic {MAGIC:#x} version {WIRE_VERSION} (both sides must run the same megatron_gspo)")
    if step is not None and head["step"] != step:
        raise WireFormatError(f"{sender} sent step {head['step'] + 1}'s rows where step {step + 1}'s were expected")
    return head


def empty_payload(head: dict, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ints, floats, meta) buffers for the payload a checked header (``check_header``) announces."""
    return (torch.empty(head["ints"], dtype=torch.long, device=device),
            torch.empty(head["floats"], dtype=torch.float32, device=device),
            torch.empty(head["meta_bytes"], dtype=torch.uint8, device=device))


def _sizes(n: int, width: int, fields) -> list[int]:
    return [n * width if dims == 2 else n for _, dims in fields]


def unpack(header, ints: torch.Tensor, floats: torch.Tensor, meta: torch.Tensor, *, step: Optional[int] = None,
           sender: str = "the sender") -> RolloutRecord:
    """The record ``pack`` made, on the tensors' device (views into ``ints`` / ``floats``)."""
    head = check_header(header, step, sender)
    n, width = head["rows"], head["width"]
    want = (sum(_sizes(n, width, INT_FIELDS)), sum(_sizes(n, width, FLOAT_FIELDS)))
    if (ints.numel(), floats.numel(), meta.numel()) != (*want, head["meta_bytes"]) or want != (head["ints"], head["floats"]):
        raise WireFormatError(f"{sender}'s rows of step {head['step'] + 1}: header {head} does not match "
                              f"{ints.numel()} ints, {floats.numel()} floats, {meta.numel()} meta bytes "
                              f"({n} rows x {width} columns need {want[0]} ints, {want[1]} floats)")
    values = {}
    for flat, fields in ((ints, INT_FIELDS), (floats, FLOAT_FIELDS)):
        for (name, dims), part in zip(fields, flat.split(_sizes(n, width, fields))):
            t = part.view(n, width) if dims == 2 else part
            values[name] = t.to(_DTYPES[name]) if name in _DTYPES else t
    values.update(json.loads(bytes(meta.cpu().tolist()).decode()))
    return RolloutRecord(step=head["step"], **values)


def _mean(values: list) -> float:
    return sum(values) / len(values)


# How concat combines the parts' raw stats (the rollout leaders' counters): the slowest leader's times, the
# sums of row counts, the mean of idle fractions; ``idle_frac`` is each part's idle_s / wall_s.
# rollout.engine=vllm: the bytes each leader's engine took (the same model: the largest), its prefix cache's prompt
# tokens and hits (summed: the step's hit rate)
STAT_MERGE = {"idle_frac": _mean, "sync_s": max, "partial_finished": sum, "dropped": sum, "updates": max, "env_s": max,
              "engine_sync_bytes": max, "prefix_queries": sum, "prefix_hits": sum}


def concat(parts: list[RolloutRecord], pad_id: int) -> RolloutRecord:
    """Several leaders' records of one step as one record on one grid (T: the widest; tokens padded with
    ``pad_id``, log-probs with 0). gen_s: the slowest part's; the token and row counts: summed; stats
    by STAT_MERGE; data_state: the first part's (every leader draws the same prompts)."""
    raw = [{**p.stats, "idle_frac": p.stats["idle_s"] / max(p.stats["wall_s"], 1e-9)} for p in parts]
    return dataclasses.replace(
        RolloutRecord.cat(parts, pad_id), gen_s=max(p.gen_s for p in parts),
        **{k: sum(getattr(p, k) for p in parts) for k in COUNTS},
        stats={k: merge([s[k] for s in raw]) for k, merge in STAT_MERGE.items()}, data_state=parts[0].data_state)
