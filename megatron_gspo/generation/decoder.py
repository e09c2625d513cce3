"""The model forwards of one ``generation.generate`` call, behind one small interface.

A ``DecodeBackend`` runs a prefill forward over the left-padded prompt block and then one-token
decode forwards against its KV cache, for the rows still in the decode batch; ``generate()`` owns
everything else (sampling, stop tokens, lockstep, which rows finished). Two back-ends:

``LeanBackend``      megatron_gspo/generation/lean_decoder.py's ``LeanDecoder``: the model's own modules and weights
                     (local spec or Transformer Engine spec, read as they are; no TE kernel runs),
                     a KV cache of roped keys, device-side MoE dispatch, a graph-ready decode step
                     (optionally captured with CUDA graphs: ``generation.cuda_graphs``); over TP, EP
                     and expert-TP shards with its own collectives, on one pipeline stage.
``MegatronBackend``  ``GPTModel.forward`` with megatron's ``StaticInferenceContext`` (any layout: TP
                     gathers the last position's logits, the allgather / alltoall dispatchers run
                     the MoE layers over TP x EP), with per-row RoPE angles and an explicit padding
                     mask for left-padded (ragged) prompts.

``make_backend`` picks one from ``generation.decode_impl`` ("lean" refuses what it cannot run, by
name; "auto" takes lean wherever it runs and falls back to megatron's path elsewhere: FP8, PP, a
token dispatcher or expert module it does not know; "megatron" always takes it).

The interface (shapes: B rows of the cache, P prompt-block columns, V the padded vocabulary):

    prefill(tokens [Bp, P], positions [Bp, P], masked [Bp, 1, P, P]) -> logits [Bp, V] of the last column:
                                   the prefill rows (each distinct prompt once) in cache rows 0 .. Bp-1
    share(src, length)             cache row r (of B) takes prefill row src[r]'s KV slots 0 .. length-1
    decode(tokens [b], slot, rows) -> logits [b, V]: feeds cache rows 0 .. b-1 at KV slot ``slot``;
                                     rows [b] = the original row of each cache row (None: all, in order)
    compact(order, keep)           cache rows order[:keep] move to the front (finished rows leave);
                                   ``order`` is a permutation of the decode batch's rows (a back-end that
                                   keeps its KV across calls permutes them all: see below)
    extend(tokens [b, s], positions [b, s], start, new [b, s], masked [b, 1, s, start + s]) -> logits [b, V]:
                                   a prefill of slots start .. start+s-1 onto the cache rows' kept history,
                                   writing only the slots ``new`` marks (back-ends with ``resumes`` only)
    last_routes(b, prefill)        [L, b, s, k] top-k expert ids of the last forward, or None when
                                   the back-end does not record them (routers' forward hooks do)
    context()                      model patches for the duration of the call

A refilled decode batch (``generation.max_batch_rows``: fewer cache rows than the call has rows, the lean
back-end only) prefills into a prompt store and lets rows join the cache as others end:

    prefill_to_store(tokens, positions, masked) -> logits [Bp, V]: ``prefill`` into a store of Bp rows
    admit(rows, src, left_pad)     cache rows ``rows`` take store rows ``src``'s prompt KV and ``left_pad``
    decode_at(tokens [b], slots [b], kv_len) -> logits [b, V]: each cache row fed at its own KV slot

Shared-prefix decode attention (generation.shared_prefix_attention, the lean back-end; shared_prefix.py): after
``prefill_to_store``, ``share_prefix(cells, store_left_pad)`` makes the decode steps read each prompt's KV from
the store once per prompt (``share`` / ``admit`` then name each cache row's store row instead of copying);
``shares_prefix(setting, rows, prompt_slots, cells)`` says whether a call does (the rule of ``auto``). A resumed
call (``carry``, then ``extend``) shares its rows' first-turn prompts with ``share_kept_prefix(cells, split, rep,
store_left_pad, group, prompt_end)``: the store is built from one cache row per group (LeanDecoder).

KV kept across calls (a multi-turn row's next turn: generator.py, "KV kept across turns"): a back-end with
``resumes`` (the lean one) keeps its cache past a call made with ``keep``, and starts a call made with
``carry`` = (src, delta) from it (cache row r: the kept row src[r], shifted delta[r] slots right).
megatron's path does not (its ``StaticInferenceContext`` lives for one call, keys before RoPE at slot
positions): the caller then prefills every row's whole context again.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

__all__ = ["DecodeBackend", "LeanBackend", "MegatronBackend", "make_backend"]


class DecodeBackend:
    """See the module docstring."""

    records_routes = False
    resumes = False  # keeps its KV cache across calls (keep / carry)

    def context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, tokens: torch.Tensor, slot: int, rows: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def share(self, src: torch.Tensor, length: int) -> None:
        raise NotImplementedError

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, start: int, new: torch.Tensor,
               masked: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compact(self, order: torch.Tensor, keep: int) -> None:
        raise NotImplementedError

    def last_routes(self, b: int, prefill: bool = False) -> Optional[torch.Tensor]:
        return None

    def prefill_to_store(self, tokens: torch.Tensor, positions: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def admit(self, rows: torch.Tensor, src: torch.Tensor, left_pad: torch.Tensor) -> None:
        raise NotImplementedError

    def decode_at(self, tokens: torch.Tensor, slots: torch.Tensor, kv_len: int) -> torch.Tensor:
        raise NotImplementedError

    def shares_prefix(self, setting: str, rows: int, prompt_slots: int, cells: int) -> bool:
        """Whether this call's decode steps read each prompt's KV once (generation.shared_prefix_attention; the
        lean back-end only): ``rows`` in the decode batch, ``cells`` the most of them of one prompt."""
        return False

    def share_prefix(self, cells: int, store_left_pad: torch.Tensor) -> None:
        raise NotImplementedError

    def share_kept_prefix(self, cells: int, split: int, rep: torch.Tensor, store_left_pad: torch.Tensor,
                          group: torch.Tensor, prompt_end: torch.Tensor) -> None:
        raise NotImplementedError


class LeanBackend(DecodeBackend):
    """A lean_decoder.LeanDecoder (kept across generations by generation.Generator) behind the interface, for
    one generation: ``context()`` readies it (``LeanDecoder.begin``: KV cache, left padding, weights) and
    releases it (``end``; ``keep``: its KV cache stays for the next call's ``carry``)."""

    resumes = True

    def __init__(self, dec, batch: int, slots: int, left_pad: torch.Tensor, *, record_routes: bool = False,
                 carry: Optional[tuple[torch.Tensor, torch.Tensor]] = None, keep: bool = False) -> None:
        self.dec, self.batch, self.slots, self.left_pad = dec, batch, slots, left_pad
        self.records_routes = record_routes and all(d is not None for d in _device_moes(dec.m))
        self.carry, self.keep = carry, keep

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        self.dec.begin(self.batch, self.slots, self.left_pad, record_routes=self.records_routes, carry=self.carry,
                       keep=self.keep)
        try:
            with self.dec.torch_routers():  # no TE kernel in the lean step, the router's GEMM included
                yield
        finally:
            self.dec.end(keep=self.keep)

    def prefill(self, tokens, positions, masked):
        return self.dec.prefill(tokens, positions, masked)

    def decode(self, tokens, slot, rows):
        return self.dec.decode(tokens, slot)

    def share(self, src, length):
        self.dec.share(src, length)

    def extend(self, tokens, positions, start, new, masked):
        return self.dec.extend(tokens, positions, start, new, masked)

    def compact(self, order, keep):
        self.dec.compact(order, keep)

    def last_routes(self, b, prefill=False):
        return self.dec.last_routes(b, prefill) if self.records_routes else None

    def prefill_to_store(self, tokens, positions, masked):
        return self.dec.prefill_to_store(tokens, positions, masked)

    def admit(self, rows, src, left_pad):
        self.dec.admit(rows, src, left_pad)

    def decode_at(self, tokens, slots, kv_len):
        return self.dec.decode_at(tokens, slots, kv_len)

    def shares_prefix(self, setting, rows, prompt_slots, cells):
        from megatron_gspo.generation.shared_prefix import shared_prefix_pays

        d = self.dec  # the plain step reads every row's copy of the prompt block's keys: this rank's KV groups
        return shared_prefix_pays(setting, rows * d.ng * prompt_slots * d.hn * d.dtype.itemsize, cells, d.graphs)

    def share_prefix(self, cells, store_left_pad):
        self.dec.share_prefix(cells, store_left_pad)

    def share_kept_prefix(self, cells, split, rep, store_left_pad, group, prompt_end):
        self.dec.share_kept_prefix(cells, split, rep, store_left_pad, group, prompt_end)


def _device_moes(m) -> list:
    from megatron_gspo.generation.lean_decoder import device_moe_unsupported

    return [True if device_moe_unsupported(layer.mlp) is None else None for layer in m.decoder.layers]


class MegatronBackend(DecodeBackend):
    """GPTModel.forward with megatron's StaticInferenceContext (see generator.py's module doc).

    positions / key_pad [B, slots]: the cache rows'; prefill_positions [Bp, slots]: the prefill rows'
    (None: the cache rows'). With ``record_routes`` the prefill's routes are read from the routers here
    (the prefill rows are not the cache rows: a recorder's own hooks would see Bp rows where it files B)."""

    def __init__(self, m, batch: int, slots: int, positions: torch.Tensor, key_pad: torch.Tensor, ragged: bool,
                 prefill_positions: Optional[torch.Tensor] = None, record_routes: bool = False) -> None:
        from megatron.core.inference.contexts import StaticInferenceContext

        self.m, self.positions, self.key_pad, self.ragged = m, positions, key_pad, ragged
        self.prefill_positions = positions if prefill_positions is None else prefill_positions
        self.ctx = StaticInferenceContext(max_batch_size=batch, max_sequence_length=slots)
        self.rows: Optional[torch.Tensor] = None  # the original row of each cache row (None: all)
        self.in_prefill = False
        self.records_routes = record_routes
        self._prefill_routes: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        # Equal-length real prompts: slot index = position and no padding to mask (the padding of
        # EP shape-filler rows is harmless: their outputs are dropped).
        with contextlib.ExitStack() as stack:
            if self.ragged:
                stack.enter_context(_per_row_rope(self.m, self.positions, lambda: self.rows,
                                                  self.prefill_positions, lambda: self.in_prefill))
                stack.enter_context(_padding_mask_honored(self.m))
            yield

    def prefill(self, tokens, positions, masked):
        self.in_prefill = True
        try:
            with _router_maps(self.m) if self.records_routes else contextlib.nullcontext() as maps:
                logits = self.m(input_ids=tokens, position_ids=positions, attention_mask=masked,
                                inference_context=self.ctx, runtime_gather_output=True)
        finally:
            self.in_prefill = False
        if maps is not None:
            self._prefill_routes = _routes_of(maps, self.m)
        self.ctx.increment_sequence_len_offset(tokens.shape[1])
        self.ctx.enable_decode_mode()
        return logits[:, -1, :]  # [Bp, V]: full vocabulary, last position only

    def share(self, src, length):
        for k_mem, v_mem in self.ctx.key_value_memory_dict.values():  # [S-1, B, heads, dim] each
            k_mem[:length, :src.numel()] = k_mem[:length, src]
            v_mem[:length, :src.numel()] = v_mem[:length, src]

    def last_routes(self, b, prefill=False):
        # decode steps: None (a recorder's router hooks saw the cache rows themselves)
        return self._prefill_routes[:, :b] if prefill and self._prefill_routes is not None else None

    def decode(self, tokens, slot, rows):
        self.rows = rows
        r = slice(None) if rows is None else rows
        logits = self.m(input_ids=tokens[:, None], position_ids=self.positions[r, slot:slot + 1],
                        attention_mask=self.key_pad[r, None, None, :slot + 1], inference_context=self.ctx,
                        runtime_gather_output=True)
        self.ctx.increment_sequence_len_offset(1)
        return logits[:, -1, :]

    def compact(self, order, keep):
        for k_mem, v_mem in self.ctx.key_value_memory_dict.values():  # [S-1, B, heads, dim] each
            k_mem[:, :keep] = k_mem[:, order[:keep]]
            v_mem[:, :keep] = v_mem[:, order[:keep]]


def make_backend(m, cfg, batch: int, slots: int, positions: torch.Tensor, key_pad: torch.Tensor,
                 left_pad: torch.Tensor, ragged: bool, record_routes: bool,
                 lean_decoder: Callable[[bool, int, int], object],
                 prefill_positions: Optional[torch.Tensor] = None,
                 carry: Optional[tuple[torch.Tensor, torch.Tensor]] = None, keep: bool = False) -> DecodeBackend:
    """The back-end ``cfg.decode_impl`` asks for on this model (see the module docstring).

    cfg: the GenerationConfig; positions / key_pad [B, slots] per slot; left_pad [B]; ragged: some
    real prompts are left-padded; record_routes: the caller wants each forward's routes;
    lean_decoder(graphs, batch, slots): the LeanDecoder to run (generation.Generator keeps one);
    prefill_positions [Bp, slots]: the prefill rows' positions (None: the cache rows'); carry / keep: the KV
    kept across calls (see the module doc; a back-end without ``resumes`` ignores them)."""
    from megatron_gspo.generation.lean_decoder import lean_decode_unsupported

    graphs = cfg.cuda_graphs
    if cfg.decode_impl != "megatron":
        # Routing recorders work on either path: the lean step hands its routes over explicitly and
        # calls each layer's router module (forward hooks included) in eager steps.
        reason = lean_decode_unsupported(m)
        if reason is None:
            return LeanBackend(lean_decoder(graphs, batch, slots), batch, slots, left_pad, record_routes=record_routes,
                               carry=carry, keep=keep)
        if cfg.decode_impl == "lean" or graphs or cfg.max_batch_rows:
            knob = ("generation.cuda_graphs=true (the lean decode path)" if graphs else
                    f"generation.max_batch_rows={cfg.max_batch_rows} (the lean decode path)" if cfg.max_batch_rows
                    else "generation.decode_impl=lean")
            raise ValueError(f"{knob} does not support {reason}; use decode_impl=auto or megatron"
                             + (" with cuda_graphs=false" if graphs else "")
                             + (" with max_batch_rows=0" if cfg.max_batch_rows else ""))
    # (cuda_graphs with decode_impl=megatron: GenerationConfig refuses it)
    return MegatronBackend(m, batch, slots, positions, key_pad, ragged, prefill_positions, record_routes)


@contextlib.contextmanager
def _router_maps(m) -> Iterator[list]:
    """For the block: each MoE router's routing map [t * b, E] and its input's (t, b), in layer order
    (forward hooks, removed after)."""
    from megatron_gspo.routing.common import find_routers

    routers = find_routers(m)
    maps: list = [None] * len(routers)

    def hook(l):
        def fn(mod, args, kwargs, out):
            x = args[0] if args else kwargs["input"]
            maps[l] = (out[1], x.shape[0], x.shape[1])
        return fn

    handles = [r.register_forward_hook(hook(l), with_kwargs=True) for l, r in enumerate(routers)]
    try:
        yield maps
    finally:
        for h in handles:
            h.remove()


def _routes_of(maps: list, m) -> Optional[torch.Tensor]:
    """The routing maps of one forward (``_router_maps``) as top-k expert ids [L, b, t, k] (None: no MoE
    layer ran), in the routing recorder's layout and dtype (routing.rollout_routes.RolloutRecorder)."""
    from megatron_gspo.routing.metrics import forward_routes

    if not maps or any(x is None for x in maps):
        return None
    return forward_routes(maps, m.config.num_moe_experts, m.config.moe_router_topk)


# ----------------------------------------------------------------------------------------------
# megatron's forward with left-padded prompts
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _per_row_rope(model, positions: torch.Tensor, rows: Callable[[], Optional[torch.Tensor]],
                  prefill_positions: torch.Tensor, in_prefill: Callable[[], bool]) -> Iterator[None]:
    """Make the model's RoPE return per-row angles [L, b, 1, d] for positions [B, L].

    megatron takes rotary angles from the KV slot index (``q_pos_emb[offset:offset+s]``); with
    left padding a row's true position is slot - pad. Rows of the same angle table a training
    forward uses are selected, so a token's rotation is bitwise the one of an unpadded forward.
    ``rows()`` names the rows of the current forward (None: all B), in the KV cache's order; while
    ``in_prefill()`` the forward's rows are the prefill rows, whose positions are ``prefill_positions``
    [Bp, L].
    """
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None or getattr(model, "position_embedding_type", "rope") != "rope":
        raise NotImplementedError("generation supports RoPE GPT models only "
                                  f"(position_embedding_type={getattr(model, 'position_embedding_type', None)!r})")
    L = positions.shape[1]
    table = rope.get_emb(L)[:, 0, 0, :]  # [L, d]
    emb = table[positions.t()].unsqueeze(2)  # [L, B, 1, d]
    pre = emb if prefill_positions is positions else table[prefill_positions.t()].unsqueeze(2)  # [L, Bp, 1, d]

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        assert max_seq_len == L and offset == 0 and not packed_seq, (max_seq_len, L, offset, packed_seq)
        if in_prefill():
            return pre
        r = rows()
        return emb if r is None else emb[:, r]

    rope.forward = forward  # instance attribute shadows the (lru-cached) class method
    try:
        yield
    finally:
        del rope.forward


@contextlib.contextmanager
def _padding_mask_honored(model) -> Iterator[None]:
    """Make every core attention apply the explicit padding mask of a left-padded batch.

    megatron's local ``DotProductAttention`` applies the boolean mask whatever the mask type.
    Transformer Engine's attention follows the mask *type* instead: megatron passes "causal" in the
    prefill and "no_mask" in decode steps, and TE then ignores the mask and would attend the
    left-padding slots. For the duration of the call TE attentions are told the mask is
    "arbitrary" (TE's name for an explicit [b, 1, sq, sk] boolean mask, True = masked); TE then
    picks a backend that supports explicit masks (flash attention does not; TE's unfused attention
    always does). Any other attention class is refused rather than trusted.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cores = [mod.core_attention for mod in model.modules() if hasattr(mod, "core_attention")]
    remap = [c for c in cores if not isinstance(c, DotProductAttention)]
    for c in remap:
        if type(c).__name__ != "TEDotProductAttention":
            raise NotImplementedError(
                f"generate(): prompts of different lengths need an attention that applies an explicit "
                f"padding mask; {type(c).__module__}.{type(c).__name__} is not known to apply it; use "
                f"model.transformer_impl='local' or prompts of one length")
    for c in remap:
        c.forward = _arbitrary_mask_forward(c.forward)  # instance attribute shadows the method
    try:
        yield
    finally:
        for c in remap:
            del c.forward


def _arbitrary_mask_forward(forward: Callable) -> Callable:
    """Wrap a megatron core-attention forward so that a given mask is applied as an arbitrary one."""
    from megatron.core.transformer.enums import AttnMaskType

    def wrapped(query, key, value, attention_mask, attn_mask_type=None, **kwargs):
        if attention_mask is not None:
            attn_mask_type = AttnMaskType.arbitrary
        return forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type, **kwargs)

    return wrapped
