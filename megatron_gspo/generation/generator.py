"""RL rollout generation on the Megatron model itself: batched sampling with a KV cache.

Rollouts are sampled by the very ``GPTModel`` that is trained (same weights, same kernels, same
TP/EP sharding), so the sampling log-probs are the training policy's log-probs up to the
floating-point noise of a KV-cache forward versus a full forward (tested below 1e-5 in fp32).

The loop and its forward back-ends
    ``generate`` is the sampling loop: prefill, then per step record the sampled tokens, check the
    finished rows every few tokens, feed the rows still generating. The model forwards sit behind
    one interface (decoder.py): the lean decoder (lean_decoder.py: the model's own modules and
    sharded weights, a KV cache of roped keys, device-side MoE dispatch, a graph-ready step that
    ``generation.cuda_graphs`` captures with CUDA graphs) where it supports the layout (TP, EP,
    expert-TP; one pipeline stage), else megatron's own path below.

KV cache (megatron's path)
    megatron-core's own ``StaticInferenceContext`` is passed as ``inference_context=`` to
    ``GPTModel.forward``: every attention layer allocates its [max_len, batch, kv_heads, head_dim]
    key/value buffers in ``key_value_memory_dict`` on the first (prefill) forward and appends at
    ``sequence_len_offset`` afterwards, exactly as megatron's static text-generation controller
    drives it (prefill over the whole prompt block, ``increment_sequence_len_offset``,
    ``enable_decode_mode``, then one token per forward). The cache is sized to the batch and to
    ``prompt block + max_new_tokens - 1`` (the last sampled token is never fed to the model).
    With the context set, megatron's GPTModel materializes only the last position's hidden state
    before the output layer, so each step computes logits (and log-probs) of one position only.
    It works on CPU with the local spec, given an explicit boolean mask (True = masked): the
    prefill mask is [b, 1, P, P] (causal + left padding), the decode mask [b, 1, 1, k].

Ragged prompts: left padding with per-row RoPE positions
    Prompts are left-padded to a common block length P, so every row's last prompt token sits in
    the same slot and decode steps write one slot for all rows. Padded key slots are masked in
    every forward. megatron's RoPE ignores ``position_ids`` (rotary angles are taken from the KV
    slot index), so for the duration of the call the model's ``rotary_pos_emb`` returns per-row
    angles ``[L, b, 1, d]`` indexed by each row's true position (slot - pad): a row's prompt
    token t gets position t exactly as in a training forward of the unpadded sequence. The angles
    are rows of the very table a training forward uses, so results equal per-prompt generation up
    to summation-order noise. The mask is applied by megatron's local ``DotProductAttention`` (the
    local spec: CPU, and GPU without Transformer Engine). Transformer Engine's attention follows
    megatron's mask *type* ("causal" in the prefill, "no_mask" in decode) and would ignore the mask,
    so for a left-padded batch TE attentions are told the mask is "arbitrary" (an explicit boolean
    mask) for the duration of the call; equal-length prompts need no mask and keep TE's fast
    causal kernels.

One prefill per prompt
    The G samples of a prompt (``n_samples_per_prompt``, or rows of equal prompt ids passed separately,
    as the trainer does: one row per sample, each keyed by its global row) start from the same KV. The
    prefill runs once per distinct prompt of the call (its own [Bp, P] block: the distinct prompts in
    order of first occurrence, then filler rows of one pad token up to the lockstep group's largest
    count, which every rank agrees on in the call's one shape all-reduce), and each row's KV cache and
    first logits are its prompt's prefill row's, copied (``DecodeBackend.share``: P slots per layer,
    small next to the prefill it saves). A row's forward is the same computation on the same inputs
    whatever rows stand beside it, so the first logits and the cache, and with the noise keyed by the row
    (sampling.py) every token and log-prob, are the ones G separate prefills gave, bit for bit wherever
    the GEMMs give a row the same bits whatever the row count (tests/test_decode.py, both paths and over
    TP / EP shards). The CPU's MKL does from 12 rows on: an expert that gets fewer prefill tokens may round
    differently (~1e-6 in the first log-probs), as any change of batch composition already did (and
    GPUs pick GEMM kernels by shape). The dummy rows of the lockstep group take a filler prefill row where
    there is one (else row 0: their outputs are never read).
    ``GenerationOutput.prefill_tokens`` counts the prompt tokens prefilled (the distinct prompts' own
    tokens, without padding): perf/prefill_tokens.

Shared-prefix decode attention (``generation.shared_prefix_attention``: the lean decoder)
    Where it is on (``auto``: shared_prefix.shared_prefix_pays, the rule measured on this CPU) the prefill goes
    to the back-end's prompt store (``prefill_to_store``) and nothing is copied: every decode step reads each
    prompt's KV once for its rows (shared_prefix.py: the rows' queries in one GEMM per prompt, each row's own
    generated slots apart, the two softmaxes merged exactly). A call that keeps its KV (``keep_kv``) still copies
    the prompt into its rows (the next turn resumes on them). A resumed call shares its rows' first-turn prompts
    (KeptRows' ``group`` and ``prompt_len``): after the carry and the extend, the store takes each group's prompt
    from one of its cache rows, right-aligned to the split slot S = min over rows of (left padding + prompt
    length); a row's own keys are its slots from S on, less its prompt's tail there (masked). The same rule
    decides (its KV bytes counted over S slots), and only where every group's prompt fits left of S (equal
    prompt lengths always do); otherwise the resumed call decodes with plain attention. The tokens are those of
    the plain step, the log-probs equal to rounding (tests/test_shared_prefix.py).

KV kept across turns (multi-turn rows: rollout/multiturn.py)
    A call with ``keep_kv`` leaves its KV cache in the lean decoder and returns ``kept`` (KeptRows): each
    row's cache row, left padding and the count of its leading tokens whose keys and values the cache
    holds: its context and every sampled token but the last, which was never fed (or was fed after the
    row had finished, its KV then not kept). The next call over the same rows' longer contexts passes them
    as ``resume`` (one per row, in the call's row order): each row's history moves to its new left padding
    (``DecodeBackend`` carry: a key's RoPE is its own position's, whatever slot holds it) and the prefill
    runs on the new tokens only (``extend``: a block of the longest new suffix in the lockstep group, the
    last columns of the prompt block; a row's older columns there are attended, never written). So every
    token is run through the model once in a conversation, and the keys, values and routes its successors
    were sampled over are the ones computed when it was first processed (the routes R3 replays). Results
    equal a prefill of the whole context up to rounding (a token's KV from a decode step or a prefill
    differs in the last bits; the counter-based noise keeps the tokens where the log-probs agree to it).
    While a call keeps its KV, compaction permutes the decode batch's cache rows (finished rows move behind,
    intact) instead of overwriting them. megatron's path keeps nothing (its ``StaticInferenceContext``
    lives for one call): there ``kept`` is None and the caller's next call prefills whole contexts again.
    ``perf/prefill_tokens`` counts the tokens prefilled: a resumed call's new tokens only.

Returned layout
    ``tokens`` is right-padded, ready for training: row r = prompt (from column 0) + response +
    ``pad_token_id``. Rows are grouped by prompt: sample j of prompt i is row
    ``i * n_samples_per_prompt + j``. ``response_mask`` and ``logprobs`` live on the same [B, T]
    grid: ``logprobs[r, t]`` is the sampling log-prob of ``tokens[r, t]`` given ``tokens[r, :t]``
    at response positions (0 elsewhere), i.e. it lines up with
    ``vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:])`` shifted by one column.
    A stop token that ends a response is part of the response (mask 1, its log-prob is kept).

Sampling log-probs
    ``logprobs`` = log-softmax of the temperature-scaled, *unfiltered* logits (padded vocabulary
    columns excluded): what the policy at that temperature assigns to the sampled token, which is
    what the trainer recomputes with ``vocab_parallel_logprobs(..., temperature=T)``. top-k/top-p
    only restrict which token is drawn; they do not renormalize the recorded log-probs.
    Greedy decoding (``temperature == 0``) records temperature-1 log-probs (log-softmax of the raw
    logits): the policy's own log-prob of the chosen token; a temperature of 0 has no density.

Tensor parallelism
    Both back-ends all-gather the vocab-sharded logits of the *last position only* ([b, V], small;
    megatron's GPTModel asserts ``runtime_gather_output`` under an inference context), so
    every TP rank samples from the full distribution with the same counter-based noise (a function
    of the seed, the row key, the position and the token id: see sampling.py, so the draw does not
    depend on the rank or on the other rows either); the sampled tokens and log-probs are then
    broadcast from the TP group's first rank so the ranks cannot diverge even if their logits
    differ in the last bit. Under TP the model runs sequence-parallel for training; decode steps
    (one token) cannot be split along the sequence, so for the duration of the call the
    non-MoE modules run without sequence parallelism (the MoE layers keep their TP x EP token
    all-gather / reduce-scatter, which is correct for a full sequence per rank, as in megatron's
    own static engine) and every attribute is restored afterwards. The lean decoder never splits
    the sequence: it runs its own collectives on full-sequence activations.

Expert parallelism / lockstep
    Each MoE forward is a collective over the expert-TP x EP ranks (megatron's dispatchers and the
    lean decoder's all-gather dispatch alike) that needs the same [b, s] on every rank, and under
    EP or expert-TP those ranks are data-parallel ranks with their own prompts. The ranks connected
    through these groups and the TP groups form the *lockstep group* (``ParallelState.lockstep_group``:
    the expert group, the TP group, or the world for layouts whose sizes do not nest). Over it the batch
    size and prompt block are all-reduced (MAX) first, short batches get dummy rows (never returned),
    and at every check of the finished rows a "rows still generating" count is all-reduced, so a rank
    whose rows all finished keeps stepping (feeding pad tokens) until the group's last row ends, and
    the group's ranks compact their batches to the same size. A rank with no prompts at all (a
    multi-turn rank whose rows have all ended) runs the group's steps on dummy rows alone and gets an
    empty output: callers never build filler rows of their own (megatron's ``dummy_forward`` idea);
    when no rank of the group has a prompt, nothing runs. Another lockstep group (a second EP group)
    is not waited for. On one rank there is no collective at all.

Cost
    Runs under ``torch.no_grad`` (not ``inference_mode``: megatron's global memory buffers created
    here are reused by training, where inference tensors would be refused). Per decode step: one
    forward of one token per row, one [b, V] logits gather under TP, a [2, b] broadcast under TP; every
    ``generation.finished_check_interval`` tokens (auto: 1 on the CPU, 4 on CUDA) the one host sync
    of the loop, the finished-row count (a one-element all-reduce under TP/EP): the rows that finish
    in between are fed pad tokens until it (at most interval - 1 wasted forwards at the end, results
    unchanged). The lean step itself makes no host sync. The explicit prefill mask is [b, 1, P, P] bool,
    small next to the local attention's own [b, heads, P, P] scores. megatron's static path
    re-rotates the cached keys each step (it caches keys before RoPE).

Routing replay (R3) and routing metrics
    ``on_forward(step_idx, kind, rows)`` is called right after each model forward, ``kind`` being
    ``"prefill"`` (step 0: the whole left-padded prompt block, P positions per row; its routes, when the
    callback takes them, are each row's prompt's, read from the prefill row it shares) or
    ``"decode"`` (steps 1..: one position per row, the token sampled at the previous step). The
    last sampled token of a row is never fed to the model, so a routing recorder sees routes for
    ``prompt + response[:-1]`` of each row, plus positions that are not part of any sequence: the
    left padding of the prefill block (columns < P - prompt_length), the inputs of rows that already
    ended (decode step j is a real position of row r iff ``response_lengths[r] > j``; an ended row
    is fed its last token once, then ``pad_token_id``) and, under EP, dummy rows, which are the
    last rows of the batch (rows >= B = len(prompts) x n_samples_per_prompt). ``rows`` names the
    batch positions of that forward: None for all B rows in order, else (after finished rows left the
    decode batch) the original row index of each position. A callback that accepts a ``routes``
    keyword gets the forward's top-k expert ids [L, b, t, k] from back-ends that compute them (the
    lean decoder: no router hook runs in a replayed graph; megatron's path for the prefill, whose rows
    are the distinct prompts, not the B rows), ``routes=None`` otherwise (megatron's decode steps: the
    routers' forward hooks saw them).

Finished rows (``generation.compact_finished_rows``)
    A static batch decodes every row until its longest one ends: with long-tailed response lengths
    most of that work is for rows already done. Once that share of the batch has finished, the
    unfinished rows move to the front of every layer's KV cache and the decode batch shrinks to them
    (under EP to the largest count any lockstep rank still has, topped up with finished rows). Every
    per-row tensor stays indexed by the original row, so results are those of the static batch.

Finished rows refilled (``generation.max_batch_rows``: continuous batching, the lean decoder)
    Compaction shrinks the batch, but the long tail still runs on a few rows. With ``max_batch_rows``
    = b below the call's rows (the lockstep group's B: every rank decides alike), the KV cache has b
    rows and the other rows wait (``_Refill``). The one prefill per prompt writes into a prompt store
    (``DecodeBackend.prefill_to_store``: [Bp, groups, P, hn] per layer, freed after the call) and every
    row's first token is drawn from it at once; the first b rows still generating take the cache rows
    (``admit``: their prompt's KV copied from the store, their left padding), and at each check of
    finished rows a cache row whose row ended takes the next waiting row, in row order, with no
    collective (the batch size stays b on every rank, so no lockstep changes). Each cache row is at its
    own response position: the decode step feeds row r's last token at its own KV slot P + n_r - 1
    (``decode_at``: the lean step's write slot ``cur`` is per cache row; positions = slot - left pad,
    the mask hides the row's padding and every slot after its own, stale KV of the row before
    included) and draws position n_r with the noise of (seed, row key, n_r) (sampling.counter_uniform
    takes a position per row). So a row's draws do not depend on the cache row it ran in or on b: the
    tokens, lengths and stop flags are those of one batch, the log-probs equal to rounding (a row's
    GEMMs and attention run beside other rows over other KV lengths: within 1e-6 in fp32 on this CPU;
    tests/test_decode.py, and over EP / TP shards tests/dist_scripts/refill_layouts.py). The decode
    batch keeps its static shape (b rows, the captured buckets of ``generation.cuda_graphs`` are those
    of b). Once no row waits, compaction applies as above. perf/decode_batch_fill counts the rows
    generating over the b rows fed. The decode steps run no router hook (like a replayed graph): the
    R3 routes of each forward are filed by row and response position and handed to ``on_forward`` as
    a static batch's steps (``routes=``, rows None) after the last step, so a recorder sees one batch.
    Not taken: megatron's decode path (its cache has one write slot for all rows: refused by key), and
    weight updates between decode steps (``poll``: they are filed by decode step; an asynchronous job
    refuses the key).

FP8 (Transformer Engine)
    FP8 GEMMs refuse token counts that are not a multiple of 8 / 16 (fp8_alignment.py cites TE's
    assertions). Under ``model.fp8`` the batch is padded with filler rows (done from the start, like
    the EP dummy rows: never returned) to a multiple of the recipe's alignment, and compaction keeps
    a multiple of it, so the prefill (rows x prompt block) and every decode step (rows x 1) divide.
    ``decode_row_steps`` counts the rows fed, fillers included (the work done); ``decode_live_row_steps``
    the rows among them still generating (perf/decode_batch_fill is their ratio).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.model import fp8_alignment
from megatron_gspo.config import GenerationConfig
from megatron_gspo.generation.decoder import make_backend
from megatron_gspo.generation.groups import DecodeGroups
from megatron_gspo.generation.sampling import counter_uniform, sample_tokens

OnForward = Callable[[int, str, Optional[torch.Tensor]], None]


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


@dataclass
class GenerationOutput:
    """A batch of rollouts on the [B, T] token grid (B = prompts x n_samples_per_prompt).

    tokens           [B, T] long  prompt + response + pad, right-padded (row i*G + j: sample j of prompt i)
    prompt_lengths   [B] long
    response_lengths [B] long     generated tokens, the stop token included
    response_mask    [B, T] bool  True at response tokens
    logprobs         [B, T] fp32  sampling log-prob of tokens[:, t] at response positions, 0 elsewhere
    stopped          [B] bool     the response ended with a stop token (False: max_new_tokens reached)
    prompt_index     [B] long     index of the row's prompt in the ``prompts`` argument
    """

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    stopped: torch.Tensor
    prompt_index: torch.Tensor
    # timing (this rank): wall seconds of the whole call / of the prefill forward, model forwards
    elapsed_s: float = 0.0
    prefill_s: float = 0.0
    num_forwards: int = 0
    # rows fed to decode forwards, summed over steps (B x steps without compaction)
    decode_row_steps: int = 0
    # of those, the rows still generating (not finished, not a filler): decode_live_row_steps /
    # decode_row_steps is the decode batch's fill (perf/decode_batch_fill)
    decode_live_row_steps: int = 0
    # real prompt tokens run through the prefill: each distinct prompt once (padding and fillers not counted)
    prefill_tokens: int = 0
    temperature: float = 1.0
    # decoding stopped early on ``should_stop`` (a stop signal): rows are cut short, not for training
    abandoned: bool = False
    # keep_kv: what the decoder's KV cache holds of each row for the next call's ``resume`` (None: nothing kept)
    kept: Optional["KeptRows"] = None

    @property
    def num_generated_tokens(self) -> int:
        return int(self.response_lengths.sum().item())

    @property
    def tokens_per_s(self) -> float:
        """Generated (response) tokens per second on this rank."""
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    def responses(self) -> list[list[int]]:
        """Response token ids of every row (stop token included)."""
        out = []
        for r in range(self.tokens.shape[0]):
            p, n = int(self.prompt_lengths[r]), int(self.response_lengths[r])
            out.append(self.tokens[r, p:p + n].tolist())
        return out


@dataclass
class KeptRows:
    """Rows whose KV a ``generate(..., keep_kv=True)`` call left in the decoder (module doc, "KV kept across
    turns"), per row [n] long: ``cache_row`` (its row in the kept cache), ``left_pad`` (its left padding there:
    its token t at slot left_pad + t), ``cached`` (its first ``cached`` tokens' KV is held), ``group`` (its first
    turn's prompt: rows of one group hold the same KV of their first ``prompt_len`` tokens, which a resumed call
    reads once per group: module doc, "Shared-prefix decode attention") and ``prompt_len``."""

    cache_row: torch.Tensor
    left_pad: torch.Tensor
    cached: torch.Tensor
    group: torch.Tensor
    prompt_len: torch.Tensor

    FIELDS = ("cache_row", "left_pad", "cached", "group", "prompt_len")

    def select(self, idx: Sequence[int]) -> "KeptRows":
        i = torch.as_tensor(list(idx), dtype=torch.long, device=self.cache_row.device)
        return KeptRows(*(getattr(self, f)[i] for f in self.FIELDS))

    @staticmethod
    def cat(parts: Sequence["KeptRows"]) -> "KeptRows":
        return KeptRows(*(torch.cat([getattr(p, f) for p in parts]) for f in KeptRows.FIELDS))


# ----------------------------------------------------------------------------------------------
# Model state for the duration of a generation
# ----------------------------------------------------------------------------------------------

_SP_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


@contextlib.contextmanager
def _without_sequence_parallel(model) -> Iterator[None]:
    """Run the non-MoE modules without sequence parallelism; restore every attribute exactly.

    (megatron's ``set_model_to_sequence_parallel`` restores ``True`` unconditionally and its
    exclusion compares modules with classes, so it would also flip the experts' linears.)
    """
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    cfg = model.config
    if not cfg.sequence_parallel:
        yield
        return
    saved: list[tuple[object, str, object]] = []

    def visit(m) -> None:
        if isinstance(m, BaseMoELayer):
            return  # the token dispatcher's TP x EP all-gather handles a full sequence per rank
        for a in _SP_ATTRS:
            if hasattr(m, a) and isinstance(getattr(m, a), bool):
                saved.append((m, a, getattr(m, a)))
        for c in m.children():
            visit(c)

    visit(model)
    configs = {id(cfg): cfg}
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "sequence_parallel"):
            configs[id(c)] = c
    saved_cfg = [(c, c.sequence_parallel) for c in configs.values()]
    try:
        for m, a, _ in saved:
            setattr(m, a, False)
        for c, _ in saved_cfg:
            c.sequence_parallel = False
        yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)
        for c, v in saved_cfg:
            c.sequence_parallel = v


@contextlib.contextmanager
def _eval_mode(model) -> Iterator[None]:
    was_training = model.training
    model.eval()  # GPTModel takes its inference paths only when not training
    try:
        yield
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------------------------
# Collectives
# ----------------------------------------------------------------------------------------------


class _Lockstep:
    """The groups a generation must stay in lockstep with (every collective goes through comm.py)."""

    def __init__(self, state) -> None:
        self.tp_group = state.tp_group if state is not None and state.tp > 1 else None
        self.tp_src = comm.first_rank(self.tp_group)
        # The MoE layers' collectives run over the expert-TP x EP ranks, which under EP / expert-TP are
        # different DP ranks with different prompts: the ranks connected through them and the TP groups
        # step together (the parallel state's lockstep group: the expert group, the TP group, or the world)
        self.sync_group = getattr(state, "lockstep_group", None)
        self.sync = self.sync_group is not None

    def all_reduce_max(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return comm.all_reduce(t, "max", self.sync_group, what=what) if self.sync else t

    def broadcast_tp(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return t
        return comm.broadcast(t, self.tp_src, self.tp_group, what="generate(): sampled tokens from the TP group's first rank")

    def check_same_prompts_in_tp(self, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        if self.tp_group is None:
            return
        w = torch.arange(1, tokens.numel() + 1, device=tokens.device, dtype=torch.float64).view_as(tokens)
        sig = torch.stack([torch.tensor(float(tokens.shape[0]), dtype=torch.float64, device=tokens.device),
                           lengths.double().sum(), (tokens.double() * w).sum()])
        # max of sig and of -sig agree on every rank only if every rank sent the same sig
        both = comm.all_reduce(torch.cat([sig, -sig]), "max", self.tp_group,
                               what="generate(): same prompts on every TP rank")
        if not torch.equal(both[:3], -both[3:]):
            raise ValueError("generate(): the ranks of a tensor-parallel group were given different prompts; "
                             "every TP rank must pass the same prompts (shard the data over DP ranks only)")


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------


class Generator:
    """Generation on one model, call after call: the colocated rollout source keeps one for the job, which the
    evaluator shares (``reserve``); an asynchronous rollout rank keeps one, and so does an asynchronous job's
    evaluator, on the trainer's ranks (``generate()`` alone builds a throwaway one).

    The lean decoder (lean_decoder.LeanDecoder: its RoPE table, its MoE wrappers, its buffers) is built at the
    first call and kept. With ``generation.cuda_graphs`` its KV cache and its captured decode steps are
    kept too (a graph reads the buffers it was captured on), so the steps are captured once per job;
    a call that needs more rows or KV slots than the decoder holds grows it once (logged: the steps are
    captured again). Without graphs the KV cache is allocated per call, sized to it, and freed after
    (training reuses that memory). The weights are read where they are at each call (an optimizer step
    updates them in place; lean_decoder.LeanDecoder.begin). megatron's path (``MegatronBackend``) keeps
    nothing: its context is built per call.

    model / vocab_size / state: as ``generate``'s. rows / slots: the most rows and KV slots (prompt
    block + max_new_tokens - 1) the caller will ask for, when it knows them (sizes a graph-mode decoder
    at its first call so that it never grows; 0: the first call's). graph_factory: the capture
    mechanism (None: CUDA graphs; tests pass a CPU stand-in)."""

    def __init__(self, model, *, vocab_size: int, state=None, rows: int = 0, slots: int = 0,
                 graph_factory: Optional[Callable[[], object]] = None) -> None:
        self.model, self.vocab_size, self.state = model, vocab_size, state
        self.rows, self.slots, self.graph_factory = rows, slots, graph_factory
        self._dec = None
        self._dec_graphs: Optional[bool] = None  # the cuda_graphs setting the kept decoder was built for

    def reserve(self, rows: int, slots: int) -> None:
        """Another use of this generator (the evaluator shares the rollout's): size it for the larger of both
        uses, so that one KV cache and one set of captured steps serve every call of the job (a decoder already
        built grows at the call that needs it, as for any larger call)."""
        self.rows, self.slots = max(self.rows, rows), max(self.slots, slots)

    def generate(self, prompts: Sequence[Union[Sequence[int], torch.Tensor]], cfg: GenerationConfig,
                 **kw) -> GenerationOutput:
        """``generate(model, prompts, cfg, ...)`` on the kept decoder (keywords: seed, row_keys,
        on_forward, should_stop, poll, on_update). ``cfg`` may change between calls (the evaluator's
        greedy and sampled passes); a change of ``cuda_graphs`` builds the decoder again."""
        return generate(self.model, prompts, cfg, vocab_size=self.vocab_size, state=self.state, generator=self, **kw)

    def lean_decoder(self, graphs: bool, batch: int, slots: int, cap: int = 0):
        """The kept LeanDecoder for a call of ``batch`` rows and ``slots`` KV slots (built at the first
        call, or when cuda_graphs changed; ``LeanDecoder.begin`` grows it). cap: generation.max_batch_rows
        (0: none), the most cache rows a call takes, which bounds the reserved rows too."""
        from megatron_gspo.generation.lean_decoder import LeanDecoder
        from megatron_gspo.model.gpt import unwrap

        if self._dec is None or self._dec_graphs != graphs:
            if graphs:
                batch, slots = max(batch, min(self.rows, cap) if cap else self.rows), max(slots, self.slots)
            self._dec = None  # a graph-mode decoder's buffers go before the next one's are allocated
            self._dec = LeanDecoder(unwrap(self.model), batch, slots, slots, graphs=graphs,
                                    graph_factory=self.graph_factory, groups=DecodeGroups.of(self.state))
            self._dec_graphs = graphs
        return self._dec

    def close(self) -> None:
        """Free the kept decoder (its KV cache and captured graphs); a later call builds a new one."""
        self._dec = self._dec_graphs = None

    def release_kv(self) -> None:
        """Free the KV a ``keep_kv`` call left in the decoder (the end of a multi-turn rollout; with graphs the
        cache stays: it lives as long as the decoder)."""
        if self._dec is not None:
            self._dec.release()


def _takes_routes(fn: Callable) -> bool:
    """Whether an on_forward callback accepts the forward's routes (a ``routes`` keyword)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "routes" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


# long: the docstring documents every argument; the loop itself is ~45 lines (tests/test_code_shape.py: <= 80)
def generate(
    model, prompts: Sequence[Union[Sequence[int], torch.Tensor]], cfg: GenerationConfig, *, vocab_size: int,
    state=None, seed: Optional[int] = None, row_keys: Optional[Sequence[int]] = None,
    on_forward: Optional[OnForward] = None, should_stop: Optional[Callable[[], bool]] = None,
    poll: Optional[Callable[[], tuple[bool, bool]]] = None, on_update: Optional[Callable[[int], None]] = None,
    generator: Optional["Generator"] = None, keep_kv: bool = False, resume: Optional[KeptRows] = None,
) -> GenerationOutput:
    """Sample ``cfg.n_samples_per_prompt`` responses for every prompt with a KV cache.

    Args:
        model: this rank's GPTModel shard (DDP/Float16Module wrappers are unwrapped); its training
            mode and sequence-parallel attributes are restored on return.
        prompts: token-id lists (or 1-D tensors), at least one token each, any lengths; the same on every
            TP rank, DP ranks' own. None: no rows out (this rank steps with its lockstep group on dummy rows).
        cfg: sampling settings.
        vocab_size: the real vocabulary size (padded embedding columns are never sampled).
        state: ``parallel.ParallelState`` (None: one process, no model parallelism).
        seed: overrides ``cfg.seed`` (e.g. a function of ``cfg.seed`` and the step for fresh samples each step).
        row_keys: one non-negative integer per output row (len(prompts) x n_samples_per_prompt) naming
            the sample for the sampling noise (sampling.counter_uniform; default 0, 1, 2, ...); the trainer
            passes global row indices: a sample's tokens do not depend on which rank draws it or beside what.
        on_forward: ``f(step_idx, kind, rows)`` called after each model forward (see the module doc).
        should_stop: read at every check of finished rows (every ``finished_check_interval`` decode
            steps; a flag, no work); once True on any rank of the lockstep group, decoding stops there on
            all of them and the output is ``abandoned``. It rides on the check's "rows still generating"
            all-reduce (no extra collective); without a lockstep group the rank decides alone.
        poll / on_update: weight updates between decode steps (an asynchronous rollout rank): ``poll()``
            -> (an update is pending, stop), read at every check in place of ``should_stop``; when any
            rank of the lockstep group has an update pending, every rank calls ``on_update(step)`` between
            decode forward ``step`` (the last under the old weights) and the next (on the same vote).
        generator: the ``Generator`` whose lean decoder runs (None: a throwaway one, for a one-off generation).
        keep_kv / resume: keep the KV for the next call (``kept``) / the KeptRows of the prompts, whose rest only
            is prefilled (module doc, "KV kept across turns"; on every rank of the lockstep group that has prompts).
    Collective over ``state.lockstep_group``: every rank of it must call it.
    """
    from megatron_gspo.model.gpt import unwrap

    if poll is not None and (should_stop is not None or on_update is None):
        raise ValueError("generate(): poll replaces should_stop and needs on_update")
    generator = generator or Generator(model, vocab_size=vocab_size, state=state)  # a throwaway one
    t_start = time.perf_counter()
    m, sync = unwrap(model), _Lockstep(state)
    device = state.device if state is not None else next(m.parameters()).device
    grid = _LeftPaddedGrid(m, _check_prompts(prompts, vocab_size), cfg, sync, device, row_keys, resume)
    run = _decoding(grid, cfg, sync, vocab_size, cfg.seed if seed is None else seed, on_forward, poll,
                    keeps=keep_kv or resume is not None)
    if grid.B == 0:  # no rank of the lockstep group has a prompt: nothing runs
        return run.output(t_start)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())  # not inference_mode: megatron's global buffers outlive the call
        stack.enter_context(_eval_mode(m))
        stack.enter_context(_without_sequence_parallel(m))
        backend = _backend(m, cfg, grid, run, generator, keep_kv)
        stack.enter_context(backend.context())
        if isinstance(run, _Refill):  # generation.max_batch_rows: its own loop
            return run.run(backend, should_stop, t_start)
        tok, lp = run.start(backend, keep_kv)
        for step in range(cfg.max_new_tokens):
            rows = run.record(step, tok, lp)
            if step == cfg.max_new_tokens - 1:
                break  # the last sampled token is never fed to the model
            if (step + 1) % run.every == 0:  # the loop's one host sync: finished rows, stop, update
                n_live, update = run.vote(rows, should_stop, poll)
                if n_live > grid.B:  # a rank was asked to stop
                    run.abandoned = True
                    break
                if update:
                    on_update(step)
                if n_live == 0:
                    break
                rows = run.compact(backend, rows, n_live)
            tok, lp = run.decode(backend, rows, step)
    backend = None  # frees megatron's KV cache (a Generator keeps the lean decoder: LeanDecoder.end freed its own)
    return run.output(t_start)


def _backend(m, cfg: GenerationConfig, grid: "_LeftPaddedGrid", run: "_Decoding", generator: Generator, keep_kv: bool):
    """The call's DecodeBackend (decoder.make_backend) on the grid's shapes: a KV cache of the decode loop's
    ``batch_rows`` rows (every row, or generation.max_batch_rows of them refilled)."""
    b = run.batch_rows
    return make_backend(m, cfg, b, grid.S - 1, grid.positions, grid.key_pad, grid.left_pad[:b], ragged=grid.ragged(),
                        record_routes=run.wants_routes, prefill_positions=grid.pre_positions, carry=grid.carry,
                        keep=keep_kv, lean_decoder=functools.partial(generator.lean_decoder, cap=cfg.max_batch_rows))


def _as_list(p: Union[Sequence[int], torch.Tensor]) -> list[int]:
    return p.tolist() if isinstance(p, torch.Tensor) else [int(t) for t in p]


def _check_prompts(prompts: Sequence[Union[Sequence[int], torch.Tensor]], vocab_size: int) -> list[list[int]]:
    """The prompts as token-id lists (maybe none), none empty, every id inside the vocabulary."""
    ids = [_as_list(p) for p in prompts]
    for i, p in enumerate(ids):
        if len(p) == 0:
            raise ValueError(f"generate(): prompt {i} is empty")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"generate(): prompt {i} has a token id outside [0, vocab_size={vocab_size})")
    return ids


class _LeftPaddedGrid:
    """One call's internal [B, S] token grid: prompts left-padded to a common block of P columns (every
    row's last prompt token in column P - 1), then max_new_tokens response columns (S = P +
    max_new_tokens; the KV cache needs S - 1 slots). Rows n_real.. are shape fillers (the lockstep
    group's batch size, FP8 alignment): one pad token each, never returned; n_real may be 0. key_pad /
    positions [B, S - 1] per KV slot: True = padding (never attended) / the slot's true position.

    The prefill runs on its own [Bp, P] block (``pre_tokens``): each distinct prompt once, then filler
    rows of one pad token up to the lockstep group's largest count (and FP8's alignment); ``src`` [B]
    names the prefill row whose KV and last logits each cache row takes (see the module doc, "One
    prefill per prompt"); ``shared`` is False when that mapping is the identity (nothing to copy).

    ``resume`` (KeptRows of the rows, or None): the rows continue a kept KV cache (module doc, "KV kept across
    turns"): N > 0 is the lockstep group's longest new suffix, the prefill block's width on a back-end that
    resumes; ``carry`` = (src, delta) [B], the kept cache row of each row and its slot shift (None without
    rows to carry)."""

    def __init__(self, m, ids: list[list[int]], cfg: GenerationConfig, sync: _Lockstep, device,
                 row_keys: Optional[Sequence[int]], resume: Optional[KeptRows] = None) -> None:
        G, pad = cfg.n_samples_per_prompt, cfg.pad_id
        self.n_prompts, self.G, self.device = len(ids), G, device
        n_real = self.n_real = len(ids) * G
        lens_real = torch.tensor([len(p) for p in ids], dtype=torch.long, device=device).repeat_interleave(G)
        keys = (torch.arange(n_real, dtype=torch.long) if row_keys is None
                else torch.as_tensor(list(row_keys), dtype=torch.long))
        if keys.shape != (n_real,) or bool((keys < 0).any()):
            raise ValueError(f"generate(): row_keys needs {n_real} non-negative integers (one per output row), "
                             f"got {tuple(keys.shape)}")
        distinct, of_prompt = distinct_prompts(ids)
        n_new = _new_tokens(resume, lens_real, G)  # [n_real] tokens past the kept KV (None: no resume)
        # every rank of the lockstep group needs the same [batch, prompt block] shapes, and the same prefill rows
        longest = int(lens_real.max()) if n_real else 1  # no prompt here: dummy rows of one pad token
        suffix = int(n_new.max()) if n_new is not None and n_real else 0
        shape = sync.all_reduce_max(torch.tensor([n_real, longest, len(distinct), suffix], dtype=torch.long,
                                                 device=device), what="generate(): batch, prompt-block and prefill shape")
        # FP8 GEMMs need rows x tokens divisible by the recipe's alignment (fp8_alignment.py): filler rows,
        # like the EP lockstep's dummy rows, make every decode step (rows x 1) and the prefill divide
        self.align = fp8_alignment.token_alignment(m.config)
        rows = int(shape[0])  # 0: no rank of the lockstep group has a prompt (generate() then runs nothing)
        B, P = self.B, self.P = fp8_alignment.padded_rows(rows, self.align) if rows else 0, int(shape[1])
        Bp = self.Bp = fp8_alignment.padded_rows(int(shape[2]), self.align) if rows else 0
        S = self.S = P + cfg.max_new_tokens
        max_len = getattr(m, "max_sequence_length", None)
        if max_len is not None and S - 1 > max_len:
            raise ValueError(f"generate(): longest prompt ({P}) + generation.max_new_tokens ({cfg.max_new_tokens}) "
                             f"- 1 = {S - 1} exceeds the model's max_position_embeddings={max_len}")
        self.lens = torch.ones(B, dtype=torch.long, device=device)  # dummy rows (EP shape padding): one pad token
        self.lens[:n_real] = lens_real
        # dummy rows get keys past every real one (their draws are never returned)
        first_dummy = int(keys.max()) + 1 if n_real else 0
        self.keys = torch.cat([keys, first_dummy + torch.arange(B - n_real, dtype=torch.long)]).to(device)
        grid = torch.full((B, S), pad, dtype=torch.long)
        for i, p in enumerate(ids):  # built on the host row by row, moved once
            grid[i * G:(i + 1) * G, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        self.tokens = grid.to(device)
        sync.check_same_prompts_in_tp(self.tokens[:n_real, :P], lens_real)
        self.left_pad = P - self.lens  # [B]
        slots = torch.arange(S - 1, device=device)
        self.key_pad = slots[None, :] < self.left_pad[:, None]
        self.positions = (slots[None, :] - self.left_pad[:, None]).clamp(min=0)
        self._prefill_block(ids, distinct, of_prompt, pad, slots)
        self._continue(resume, n_new, int(shape[3]))

    def _prefill_block(self, ids: list[list[int]], distinct: list[int], of_prompt: list[int], pad: int,
                       slots: torch.Tensor) -> None:
        """The prefill block (module doc, "One prefill per prompt"): ``pre_tokens`` [Bp, P], its left padding and
        positions, ``src`` [B] and ``shared``, the prompt tokens it counts."""
        P, B, Bp, G, n_real, device = self.P, self.B, self.Bp, self.G, self.n_real, self.device
        # the distinct prompts, then fillers of one pad token (like the dummy rows)
        U = len(distinct)
        pre = torch.full((Bp, P), pad, dtype=torch.long)
        pre_lens = torch.ones(Bp, dtype=torch.long)
        for u, i in enumerate(distinct):
            pre[u, P - len(ids[i]):] = torch.tensor(ids[i], dtype=torch.long)
            pre_lens[u] = len(ids[i])
        # each real row reads its prompt's prefill row; dummy row k a filler prefill row where there is one
        # (else row 0: a dummy's outputs are never read, any finite KV does)
        fill = [U + k if U + k < Bp else (U if U < Bp else 0) for k in range(B - n_real)]
        src = torch.cat([torch.as_tensor(of_prompt, dtype=torch.long).repeat_interleave(G),
                         torch.tensor(fill, dtype=torch.long)])
        self.shared = not (Bp == B and torch.equal(src, torch.arange(B)))
        self.most_rows_per_prompt = int(torch.bincount(src).max()) if B else 0  # of one prefill row (host-side)
        self.src = src.to(device)
        self.pre_tokens = pre.to(device)
        self.pre_left_pad = P - pre_lens.to(device)
        self.pre_positions = (slots[None, :] - self.pre_left_pad[:, None]).clamp(min=0)  # [Bp, S - 1] per slot
        # the real prompt tokens run through the prefill: each distinct prompt once (perf/prefill_tokens)
        self.prefill_tokens = int(pre_lens[:U].sum())
        # each real row's prompt group and prompt length (KeptRows: a resumed call reads a group's prompt once)
        self.row_group, self.row_prompt_len = self.src[:n_real], self.lens[:n_real]

    def _continue(self, resume: Optional[KeptRows], n_new: Optional[torch.Tensor], N: int) -> None:
        """The rows that continue a kept KV (``resume``, their ``n_new`` new tokens; N: the lockstep group's most):
        their new tokens (a dummy row: its one pad token) fill the prefill block's last columns; ``carry``."""
        B, n_real, device = self.B, self.n_real, self.device
        self.N, self.carry, self.resumed_tokens = N, None, 0
        if N and n_real and n_new is None:
            raise ValueError("generate(): every rank of the lockstep group that has prompts continues its rows' kept "
                             "KV (resume), or none does")
        self.n_new = torch.ones(B, dtype=torch.long, device=device)
        if n_new is not None and n_real:
            self.n_new[:n_real] = n_new.to(device)
            self.resumed_tokens = int(n_new.sum())
            src = torch.zeros(B, dtype=torch.long, device=device)
            src[:n_real] = resume.cache_row.to(device)
            delta = torch.zeros(B, dtype=torch.long, device=device)
            delta[:n_real] = self.left_pad[:n_real] - resume.left_pad.to(device)
            self.carry = (src, delta)
            self.row_group, self.row_prompt_len = resume.group.to(device), resume.prompt_len.to(device)
        self._kept_prompts(n_new is not None and n_real > 0)

    def _kept_prompts(self, resumed: bool) -> None:
        """Where a resumed call's rows read their first turn's prompt once per group (module doc, "Shared-prefix
        decode attention"): the split slot ``split`` = min over rows of left_pad + prompt_len, each row's group
        ``kept_group`` [B] (0 .. Bg-1; a dummy row: 0) and the end of its prompt ``kept_prompt_end`` [B] (its own
        keys, past the split, start there), each group's cache row ``kept_rep`` [Bg] and left padding in a store
        right-aligned at the split ``kept_store_pad`` [Bg], and the most rows of one group (host-side).
        ``kept_shares``: every group's prompt fits left of the split (equal prompt lengths always do)."""
        self.kept_shares, self.kept_rows_per_group, self.split = False, 0, 0
        if not resumed:
            return
        B, n_real = self.B, self.n_real
        lp, plen = self.left_pad[:n_real].cpu(), self.row_prompt_len.cpu()
        labels, dense = torch.unique(self.row_group.cpu(), return_inverse=True)
        Bg = labels.numel()
        self.split = split = int((lp + plen).min())
        group_len = torch.zeros(Bg, dtype=torch.long).scatter_reduce(0, dense, plen, "amax", include_self=False)
        self.kept_shares = split >= int(group_len.max())
        group = torch.cat([dense, torch.zeros(B - n_real, dtype=torch.long)])
        self.kept_rows_per_group = int(torch.bincount(group).max())
        rep = torch.full((Bg,), n_real, dtype=torch.long).scatter_reduce(0, dense, torch.arange(n_real), "amin")
        end = torch.cat([lp + plen, self.left_pad[n_real:].cpu()])  # a dummy row: no prompt of a group
        self.kept_group, self.kept_rep, self.kept_prompt_end, self.kept_store_pad = (
            t.to(self.device) for t in (group, rep, end, split - group_len))

    def ragged(self) -> bool:
        """Some real prompt is left-padded (megatron's path then needs per-row RoPE and a padding mask)."""
        return bool((self.left_pad[:self.n_real] > 0).any())

    def extend_mask(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(new [B, N] bool: the slots P-N .. P-1 that hold a row's new tokens, the ones written; masked
        [B, 1, N, P] bool, True = masked: causal over the slots + each row's left padding)."""
        P, N, dev = self.P, self.N, self.device
        cols = torch.arange(P - N, P, device=dev)
        new = cols[None, :] >= (P - self.n_new)[:, None]
        keys = torch.arange(P, device=dev)
        masked = (keys[None, :] > cols[:, None])[None] | (keys[None, :] < self.left_pad[:, None])[:, None, :]
        return new, masked[:, None]

    def prefill_mask(self) -> torch.Tensor:
        """[Bp, 1, P, P] bool, True = masked: causal + the left padding of the prefill rows."""
        P = self.P
        causal = torch.triu(torch.ones(P, P, dtype=torch.bool, device=self.device), diagonal=1)
        key_pad = torch.arange(P, device=self.device)[None, :] < self.pre_left_pad[:, None]
        return (causal[None] | key_pad[:, None, :])[:, None]


def _new_tokens(resume: Optional[KeptRows], lens: torch.Tensor, G: int) -> Optional[torch.Tensor]:
    """[n] each row's tokens past its kept KV (``resume.cached``), checked: at least one each, one sample per prompt."""
    if resume is None:
        return None
    cached = resume.cached.to(lens.device)
    if G != 1 or cached.shape != lens.shape:
        raise ValueError(f"generate(): resume needs one KeptRows entry per prompt and n_samples_per_prompt=1, got "
                         f"{tuple(cached.shape)} for {lens.numel()} rows (G={G})")
    new = lens - cached
    if bool((new < 1).any()) or bool((cached < 0).any()):
        raise ValueError("generate(): resume: every prompt needs at least one token past its kept KV")
    return new


def _swap_to_front(order: torch.Tensor, keep: int) -> torch.Tensor:
    """A permutation [n] whose first ``keep`` entries are the rows of ``order[:keep]`` (in another order): those behind
    swap places with the front's rows that are not among them; every other row stays where it is."""
    n = order.numel()
    chosen = torch.zeros(n, dtype=torch.bool, device=order.device)
    chosen[order[:keep]] = True
    front = torch.arange(n, device=order.device) < keep
    out, into = (front & ~chosen).nonzero()[:, 0], (~front & chosen).nonzero()[:, 0]
    perm = torch.arange(n, device=order.device)
    perm[out], perm[into] = into, out
    return perm


def distinct_prompts(ids: list[list[int]]) -> tuple[list[int], list[int]]:
    """(the index of each distinct prompt's first occurrence, in order of first occurrence; for each prompt
    the position of its distinct prompt in that list): equal token ids are one prompt, prefilled once."""
    seen: dict[tuple[int, ...], int] = {}  # prompt ids -> its position in ``distinct``
    distinct, of_prompt = [], []
    for i, p in enumerate(ids):
        u = seen.setdefault(tuple(p), len(distinct))
        if u == len(distinct):
            distinct.append(i)
        of_prompt.append(u)
    return distinct, of_prompt


class _Decoding:
    """The per-token work of one call around the back-end's forwards: pick (sample, one draw per TP
    group), record (the sampled tokens of the rows still generating, stop tokens; device-side, no
    sync), vote (finished rows / stop / weight update over the lockstep group), compact (finished rows
    leave the decode batch), notify (``on_forward``), and the conversion to the training grid.

    ``live``: the rows in the decode batch, in the KV cache's row order (None: all B, in order);
    every per-row tensor stays indexed by the original row."""

    def __init__(self, grid: _LeftPaddedGrid, cfg: GenerationConfig, sync: _Lockstep, vocab_size: int,
                 noise_seed: int, on_forward: Optional[OnForward]) -> None:
        B, device = grid.B, grid.device
        self.grid, self.cfg, self.sync, self.vocab_size, self.noise_seed = grid, cfg, sync, vocab_size, noise_seed
        self.on_forward = on_forward
        self.wants_routes = on_forward is not None and _takes_routes(on_forward)
        self.stop = torch.tensor(cfg.stop_token_ids, dtype=torch.long, device=device)
        self.done = torch.zeros(B, dtype=torch.bool, device=device)
        self.done[grid.n_real:] = True
        self.stopped = torch.zeros(B, dtype=torch.bool, device=device)
        self.resp_len = torch.zeros(B, dtype=torch.long, device=device)
        self.lp_grid = torch.zeros(B, cfg.max_new_tokens, dtype=torch.float32, device=device)
        # the checks of finished rows (and the lockstep vote) cost a host sync each: every ``every``
        # tokens (rows that finish in between are fed pad tokens; results do not change)
        self.every = cfg.finished_check_interval or (4 if device.type == "cuda" else 1)
        self.no_stop = None
        if cfg.min_new_tokens > 0 and self.stop.numel():  # the draw only: log-probs stay unrestricted
            self.no_stop = torch.ones(vocab_size, dtype=torch.bool, device=device)
            self.no_stop[self.stop] = False
        self.all_rows = torch.arange(B, device=device)
        self.live: Optional[torch.Tensor] = None
        self.batch_rows = B  # every row in one decode batch (a refilled one: generation.max_batch_rows)
        # the original row in each cache row (compaction permutes them); keep: the KV outlives the call
        self.cache_rows = torch.arange(B, device=device)
        self.keep, self.resumed, self.prefill_tokens = False, False, 0
        self.n_fwd, self.prefill_s, self.row_steps, self.abandoned = 0, 0.0, 0, False
        self.live_steps = torch.zeros((), dtype=torch.long, device=device)

    def pick(self, logits: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        row_keys = self.grid.keys if self.live is None else self.grid.keys[self.live]
        return self.draw(logits, row_keys, position, self.no_stop if position < self.cfg.min_new_tokens else None)

    def draw(self, logits: torch.Tensor, row_keys: torch.Tensor, position, allowed: Optional[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of logits [b, V] keyed by row_keys [b] at ``position`` (an int, or [b] per row)."""
        cfg = self.cfg
        noise = None if cfg.greedy else counter_uniform(self.noise_seed, row_keys, position)
        tok, lp = sample_tokens(logits, cfg.temperature, cfg.top_k, cfg.top_p, noise, allowed=allowed)
        if self.sync.tp_group is not None:  # one sample per TP group, bitwise (logits may differ in the last bit)
            packed = self.sync.broadcast_tp(torch.stack([tok.double(), lp.double()]))
            tok, lp = packed[0].long(), packed[1].float()
        return tok, lp

    def notify(self, backend, step: int, kind: str) -> None:
        if self.on_forward is None:
            return
        live, prefill = self.live, kind == "prefill"
        if self.wants_routes:
            g = self.grid
            b = (g.Bp if prefill and not self.resumed else g.B) if live is None else live.numel()
            routes = backend.last_routes(b, prefill=prefill)
            if prefill and g.shared and not self.resumed and routes is not None:  # its prompt's prefill row's
                routes = routes[:, g.src]
            if prefill and self.resumed and routes is not None:  # the block's columns, in place in the prompt block
                L, _, N, k = routes.shape  # (columns before it: history filed by earlier calls, never read)
                routes = torch.cat([routes.new_zeros(L, b, g.P - N, k), routes], 2)
            self.on_forward(step, kind, live, routes=routes)
        else:
            self.on_forward(step, kind, live)

    def start(self, backend, keep_kv: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's prefill (of the rows' new tokens only where they continue a kept KV and the back-end
        resumes), and the first draw; ``keep_kv``: the KV outlives the call where the back-end keeps it."""
        self.keep = keep_kv and backend.resumes
        return self.extend(backend) if self.grid.N and backend.resumes else self.prefill(backend)

    def prefill(self, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill forward over the distinct prompts, their KV shared by their rows, and the first draw."""
        g = self.grid
        t0 = time.perf_counter()
        logits = self.prefill_logits(backend)
        if g.device.type == "cuda":
            torch.cuda.synchronize(g.device)
        self.prefill_s = time.perf_counter() - t0
        self.n_fwd += 1
        self.prefill_tokens = g.prefill_tokens
        self.notify(backend, 0, "prefill")
        return self.pick(logits, 0)

    def extend(self, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill of rows that continue a kept KV: their new tokens only (the prompt block's last N
        columns), then the first draw."""
        g = self.grid
        new, masked = g.extend_mask()
        t0 = time.perf_counter()
        cols = slice(g.P - g.N, g.P)
        logits = backend.extend(g.tokens[:, cols], g.positions[:, cols], g.P - g.N, new, masked)[:, :self.vocab_size]
        cells = self.prefix_cells(backend, g.B, resumed=True)
        if cells:  # the decode steps read each group's first-turn prompt once, from the rows' carried KV
            backend.share_kept_prefix(cells, g.split, g.kept_rep, g.kept_store_pad, g.kept_group, g.kept_prompt_end)
        if g.device.type == "cuda":
            torch.cuda.synchronize(g.device)
        self.prefill_s = time.perf_counter() - t0
        self.n_fwd += 1
        self.resumed, self.prefill_tokens = True, g.resumed_tokens
        self.notify(backend, 0, "prefill")
        return self.pick(logits, 0)

    def prefix_cells(self, backend, rows: int, resumed: bool = False) -> int:
        """The cells of a prompt's block of queries when this call's ``rows`` decode rows read each prompt's KV once
        (generation.shared_prefix_attention: the back-end's rule), else 0. ``resumed``: the rows continue a kept KV,
        their first turn's prompts read from a store of ``split`` slots (``_LeftPaddedGrid._kept_prompts``)."""
        g = self.grid
        shared, most, slots = ((g.kept_shares, g.kept_rows_per_group, g.split) if resumed
                               else (g.shared, g.most_rows_per_prompt, g.P))
        cells = min(rows, most)
        return cells if shared and backend.shares_prefix(self.cfg.shared_prefix_attention, rows, slots, cells) else 0

    def prefill_logits(self, backend) -> torch.Tensor:
        """[B, vocab] each row's first logits; the cache rows hold their prompts' KV (or, with shared-prefix
        attention, read them from the back-end's prompt store)."""
        g = self.grid
        cells = self.prefix_cells(backend, g.B)
        forward = backend.prefill_to_store if cells else backend.prefill
        logits = forward(g.pre_tokens, g.pre_positions[:, :g.P], g.prefill_mask())[:, :self.vocab_size]
        if cells:
            backend.share_prefix(cells, g.pre_left_pad)
        if g.shared:  # every row's cache and first logits from its prompt's prefill row
            backend.share(g.src, g.P)
            logits = logits[g.src]
        return logits

    def record(self, step: int, tok: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """Write the sampled tokens of the rows still generating into response column ``step``;
        returns the rows of the decode batch."""
        rows = self.all_rows if self.live is None else self.live
        active = ~self.done[rows]
        self.grid.tokens[rows, self.grid.P + step] = torch.where(active, tok, self.cfg.pad_id)
        self.lp_grid[rows, step] = torch.where(active, lp, 0.0)
        self.resp_len[rows] += active.long()
        if self.stop.numel() and not self.cfg.ignore_eos:
            hit = active & torch.isin(tok, self.stop)
            self.stopped[rows] |= hit
            self.done[rows] |= hit
        return rows

    def vote(self, rows: torch.Tensor, should_stop, poll) -> tuple[int, bool]:
        """(the most unfinished rows any rank of the lockstep group still has, an update is pending on
        some rank). A rank asked to stop adds B + 1, so every rank of the group sees it at the same step."""
        unfinished = self.unfinished(rows)
        update, stop_now = poll() if poll is not None else (False, should_stop is not None and should_stop())
        if stop_now:
            unfinished = unfinished + (self.grid.B + 1)
        if poll is None:
            return int(self.sync.all_reduce_max(unfinished, what="generate(): rows still generating").item()), False
        # the update flag rides along (a fill, not a host-to-device copy)
        vote = torch.cat([unfinished, unfinished.new_full((1,), int(update))])
        n_live, update = self.sync.all_reduce_max(vote, what="generate(): rows still generating, weight update").tolist()
        return n_live, update

    def unfinished(self, rows: torch.Tensor) -> torch.Tensor:
        """[1] the rows of this rank still to generate (the decode batch's)."""
        return (~self.done[rows]).sum().reshape(1)

    def compact(self, backend, rows: torch.Tensor, n_live: int) -> torch.Tensor:
        """Once ``generation.compact_finished_rows`` of the batch has finished: this rank's unfinished
        rows first, then finished fillers so every rank of the lockstep group has the same batch (and
        FP8 an aligned one); the KV cache's row order is kept. Returns the rows of the decode batch."""
        keep = fp8_alignment.padded_rows(n_live, self.grid.align, cap=rows.numel())
        compact_at = self.cfg.compact_finished_rows
        if compact_at > 0 and n_live <= (1 - compact_at) * rows.numel() and keep < rows.numel():
            order = torch.argsort(self.done[rows].long(), stable=True)  # a permutation: the back-end keeps [:keep]
            if self.keep:  # every row's KV stays: the rows kept swap places with the front's others, no more moves
                order = _swap_to_front(order, keep)
            backend.compact(order, keep)  # (or, keeping its KV, moves the rows that change places)
            n = order.numel()
            self.cache_rows[:n] = self.cache_rows[:n][order]
            self.live = rows = rows[order[:keep]]
        return rows

    def decode(self, backend, rows: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the tokens of response column ``step`` (one decode forward) and draw the next ones."""
        col = self.grid.P + step
        logits = backend.decode(self.grid.tokens[rows, col], col, self.live)[:, :self.vocab_size]
        self.n_fwd += 1
        self.row_steps += rows.numel()
        # rows whose next token is used (not finished, not a filler): a device count, read once at the end
        self.live_steps += (~self.done[rows]).sum()
        self.notify(backend, step + 1, "decode")
        return self.pick(logits, step + 1)

    def output(self, t_start: float) -> GenerationOutput:
        """The left-padded internal grid -> the right-padded training grid (real rows only)."""
        g, cfg, device, n_real = self.grid, self.cfg, self.grid.device, self.grid.n_real
        lens, resp_len = g.lens[:n_real], self.resp_len[:n_real]
        total = lens + resp_len
        T = int(total.max()) if n_real else 0
        cols = torch.arange(T, device=device)[None, :]
        src = (cols + g.left_pad[:n_real, None]).clamp(max=g.S - 1)
        valid = cols < total[:, None]
        tokens = torch.where(valid, g.tokens[:n_real].gather(1, src), torch.full_like(src, cfg.pad_id))
        response_mask = valid & (cols >= lens[:, None])
        lp_src = (cols - lens[:, None]).clamp(0, cfg.max_new_tokens - 1)
        logprobs = torch.where(response_mask, self.lp_grid[:n_real].gather(1, lp_src), torch.zeros((), device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return GenerationOutput(
            tokens=tokens, prompt_lengths=lens, response_lengths=resp_len, response_mask=response_mask,
            logprobs=logprobs, stopped=self.stopped[:n_real],
            prompt_index=torch.arange(g.n_prompts, device=device).repeat_interleave(g.G),
            elapsed_s=time.perf_counter() - t_start, prefill_s=self.prefill_s, num_forwards=self.n_fwd,
            decode_row_steps=self.row_steps, decode_live_row_steps=int(self.live_steps.item()),
            prefill_tokens=self.prefill_tokens, temperature=cfg.temperature,
            abandoned=self.abandoned, kept=self._kept(total) if self.keep else None,
        )

    def _kept(self, total: torch.Tensor) -> KeptRows:
        """Where each real row's KV is in the kept cache: every token but its last (never fed while the row was
        live; see the module doc)."""
        g = self.grid
        at = torch.empty_like(self.cache_rows)
        at[self.cache_rows] = torch.arange(g.B, device=g.device)
        return KeptRows(at[:g.n_real], g.left_pad[:g.n_real].clone(), total - 1, g.row_group.clone(),
                        g.row_prompt_len.clone())

def _decoding(grid: _LeftPaddedGrid, cfg: GenerationConfig, sync: _Lockstep, vocab_size: int, noise_seed: int,
              on_forward: Optional[OnForward], poll, keeps: bool) -> _Decoding:
    """The call's decode loop: a refilled batch where generation.max_batch_rows is below the lockstep group's
    batch (its ranks decide alike), else every row in one batch. ``keeps``: the call keeps or resumes rows' KV
    across calls (a multi-turn rollout), which a refilled batch cannot: it hands a finished row's cache row on."""
    if not 0 < cfg.max_batch_rows < grid.B:
        return _Decoding(grid, cfg, sync, vocab_size, noise_seed, on_forward)
    if keeps:
        raise ValueError("generate(): generation.max_batch_rows hands a finished row's KV cache row to a waiting row; "
                         "a call that keeps or resumes rows' KV across calls (keep_kv, resume) cannot refill")
    if poll is not None:
        raise ValueError("generate(): generation.max_batch_rows does not take weight updates between decode steps "
                         "(poll): refilled rows are at different steps")
    return _Refill(grid, cfg, sync, vocab_size, noise_seed, on_forward)


class _Refill(_Decoding):
    """A refilled decode batch (``generation.max_batch_rows``, continuous batching; module doc, "Finished
    rows refilled"): b = max_batch_rows cache rows for the call's B rows. Every row's first token is drawn
    at the one prefill (its prompt's KV goes to the back-end's prompt store); the first b rows still
    generating take the cache rows, the others wait in row order, and at each check of finished rows a
    cache row whose row ended takes the next waiting row (``admit``: its prompt's KV from the store). Each
    cache row is at its own response position: fed at its own KV slot, drawn at its own position (the
    noise is keyed by the row and the position, so a row's draws are the same whatever its cache row).

    Host-side: ``queue`` (rows waiting), ``slot_row`` (the row of each cache row; a cache row with no row
    to generate holds a finished one, never returned twice) and ``host_len`` (an upper bound of each
    cache row's response length: the attended KV length without a host sync)."""

    def __init__(self, grid: _LeftPaddedGrid, cfg: GenerationConfig, sync: _Lockstep, vocab_size: int,
                 noise_seed: int, on_forward: Optional[OnForward]) -> None:
        super().__init__(grid, cfg, sync, vocab_size, noise_seed, on_forward)
        if on_forward is not None and not self.wants_routes:
            raise ValueError("generate(): generation.max_batch_rows files each forward's routes itself; an "
                             "on_forward callback needs a routes keyword")
        self.b = self.batch_rows = cfg.max_batch_rows
        self.queue: list[int] = []
        self.slot_row: list[int] = []
        self.host_len: list[int] = []
        self.route_grid: Optional[torch.Tensor] = None  # [L, B, max_new_tokens - 1, k]: decode step j -> column j-1

    def run(self, backend, should_stop, t_start: float) -> GenerationOutput:
        """Prefill, then decode until no rank of the lockstep group has a row to generate (or a stop)."""
        g = self.grid
        tok, lp = self.prefill(backend)
        self.record(0, tok, lp)  # every row's first token, waiting rows included
        self.done |= self.resp_len >= self.cfg.max_new_tokens
        rows = self.seat(backend)
        step = 0
        while True:
            if step % self.every == 0:  # the loop's one host sync: finished rows, refill, stop
                rows = self.admit(backend)
                n_live, _ = self.vote(rows, should_stop, None)
                if n_live > g.B:  # a rank was asked to stop
                    self.abandoned = True
                    break
                if n_live == 0:
                    break
                rows = self.compact(backend, rows, n_live)
            tok, lp = self.decode_rows(backend, rows)
            self.record_rows(rows, tok, lp)
            step += 1
        self.file_routes()
        return self.output(t_start)

    def prefill_logits(self, backend) -> torch.Tensor:
        g = self.grid
        logits = backend.prefill_to_store(g.pre_tokens, g.pre_positions[:, :g.P], g.prefill_mask())
        cells = self.prefix_cells(backend, self.b)
        if cells:  # admit names each cache row's store row rather than copying its prompt's KV
            backend.share_prefix(cells, g.pre_left_pad)
        return logits[:, :self.vocab_size][g.src]

    def seat(self, backend) -> torch.Tensor:
        """The first b rows still generating take the cache rows (then finished rows, if fewer); the rest wait."""
        g = self.grid
        done = self.done.tolist()
        waiting = [r for r in range(g.B) if not done[r]]
        first, self.queue = waiting[:self.b], waiting[self.b:]
        self.slot_row = first + [r for r in range(g.B) if done[r]][:self.b - len(first)]
        self.host_len = [1] * self.b
        self.live = torch.tensor(self.slot_row, dtype=torch.long, device=g.device)
        backend.admit(torch.arange(self.b, device=g.device), g.src[self.live], g.left_pad[self.live])
        return self.live

    def admit(self, backend) -> torch.Tensor:
        """Cache rows whose row ended take the next waiting rows. Returns the rows of the decode batch."""
        if not self.queue:
            return self.live
        g = self.grid
        free = [c for c, d in enumerate(self.done[self.live].tolist()) if d][:len(self.queue)]
        if free:
            new, self.queue = self.queue[:len(free)], self.queue[len(free):]
            for c, r in zip(free, new):
                self.slot_row[c], self.host_len[c] = r, 1
            seats = torch.tensor(free, dtype=torch.long, device=g.device)
            rows = torch.tensor(new, dtype=torch.long, device=g.device)
            backend.admit(seats, g.src[rows], g.left_pad[rows])
            self.live = self.live.index_copy(0, seats, rows)
        return self.live

    def unfinished(self, rows: torch.Tensor) -> torch.Tensor:
        return (~self.done[rows]).sum().reshape(1) + len(self.queue)

    def compact(self, backend, rows: torch.Tensor, n_live: int) -> torch.Tensor:
        kept = super().compact(backend, rows, n_live)
        if kept is not rows:  # the host's view follows the cache rows
            at = {r: c for c, r in enumerate(rows.tolist())}
            self.slot_row = kept.tolist()
            self.host_len = [self.host_len[at[r]] for r in self.slot_row]
        return kept

    def decode_rows(self, backend, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each cache row's last sampled token at its own KV slot and draw its next token at its own
        position (a finished row: its last token again, never read)."""
        g, n_rows = self.grid, rows.numel()
        n = self.resp_len[rows]  # tokens sampled so far: the position drawn next
        slots = (g.P + n - 1).clamp(min=g.P, max=g.S - 2)
        kv_len = min(g.P + max(self.host_len[:n_rows]), g.S - 1)
        logits = backend.decode_at(g.tokens[rows, slots], slots, kv_len)[:, :self.vocab_size]
        self.n_fwd += 1
        self.row_steps += n_rows
        active = ~self.done[rows]
        self.live_steps += active.sum()
        if self.wants_routes:
            self.file_step_routes(backend, rows, n, active)
        self.host_len = [min(x + 1, self.cfg.max_new_tokens) for x in self.host_len]
        allowed = None
        if self.no_stop is not None:  # per row: stop tokens barred before min_new_tokens
            allowed = self.no_stop[None, :] | (n >= self.cfg.min_new_tokens)[:, None]
        return self.draw(logits, g.keys[rows], n, allowed)

    def record_rows(self, rows: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """Write the drawn tokens of the rows still generating at each row's own response column (a
        finished row's entries are written back unchanged: no data-dependent shape)."""
        g, N = self.grid, self.cfg.max_new_tokens
        active = ~self.done[rows]
        n = self.resp_len[rows]
        col = (g.P + n).clamp(max=g.S - 1)
        g.tokens[rows, col] = torch.where(active, tok, g.tokens[rows, col])
        j = n.clamp(max=N - 1)
        self.lp_grid[rows, j] = torch.where(active, lp, self.lp_grid[rows, j])
        self.resp_len[rows] = n + active.long()
        ended = self.resp_len[rows] >= N
        if self.stop.numel() and not self.cfg.ignore_eos:
            hit = active & torch.isin(tok, self.stop)
            self.stopped[rows] |= hit
            ended |= hit
        self.done[rows] |= ended

    def file_step_routes(self, backend, rows: torch.Tensor, n: torch.Tensor, active: torch.Tensor) -> None:
        """The decode forward's routes [L, b, 1, k], filed by row at the input's response position (n - 1)."""
        routes = backend.last_routes(rows.numel())
        if routes is None:
            raise ValueError("generate(): generation.max_batch_rows with routes recorded needs the lean "
                             "decoder's route buffer (DeviceMoE in every MoE layer)")
        if self.route_grid is None:
            L, k = routes.shape[0], routes.shape[-1]
            self.route_grid = torch.zeros(L, self.grid.B, max(self.cfg.max_new_tokens - 1, 1), k,
                                          dtype=routes.dtype, device=routes.device)
        j = (n - 1).clamp(0, self.route_grid.shape[2] - 1)
        self.route_grid[:, rows, j] = torch.where(active[None, :, None], routes[:, :, 0], self.route_grid[:, rows, j])

    def file_routes(self) -> None:
        """Hand the decode routes to ``on_forward`` as a static batch's steps would (step j: every row's
        input at response position j - 1; ``from_generation`` keeps the rows longer than j)."""
        if not self.wants_routes or self.route_grid is None:
            return
        for j in range(1, int(self.resp_len.max())):
            self.on_forward(j, "decode", None, routes=self.route_grid[:, :, j - 1:j])
