"""Per-GPU memory estimate of a megatron_gspo job (GiB), from the config alone: no GPU, no model.

``estimate_memory(job_cfg, world_size) -> dict`` (GiB per GPU, the worst pipeline stage) is what
launch/memory_estimate.py writes into each recipe's ``# memory`` block, what tests/test_launch.py
asserts each recipe with, and what the preflight's memory check sets beside a measurement.

What is counted, and how megatron_gspo actually holds it (model.py / optim.py / train.py):

  weights      bf16 (fp32 for precision=fp32): 2 B/param of this rank's shard. Dense (non-expert)
               params are split over TP (attention, embedding and output layer; norms and the
               router are replicated), expert params over EP x ETP.
  grads        fp32 main-grad buffer, 4 B/param, NOT sharded by the distributed optimizer
               (wrap_ddp sets grad_reduce_in_fp32=True; the reduce-scatter lands in a full buffer).
  optimizer    Adam: fp32 master params + m + v = 12 B/param (8 without a master copy for fp32
               models), sharded by the distributed optimizer over the param's data-parallel group:
               DP = world / (TP x PP) for dense params, expert-DP = world / (EP x ETP x PP) for
               experts. Without the distributed optimizer every rank holds all 12 B.
  ref_model    a second bf16 copy of the weights when loss.kl_coef > 0 (the KL reference).
  fp8_cache    FP8 only: TE's fp8 copy of each GEMM weight and its transpose (2 B/param) while a
               micro-batch is in flight.
  routing      the behaviour routes, a field of the batch's rows (routing/policy.py): [rows, seq, L, k]
               int16 ids, every layer's top-k at every position of the rank's R / DP rows, on every TP
               rank (the old-log-prob pass fills its own sequence chunk), + the replay's int64 copy of
               one micro-batch (this TP rank's chunk) under R2 / R3.
  rows         the step's rows on the device: the prepared batch (tokens int64, mask, sample and old
               (+ reference) log-probs fp32) and the rollout record it is made from (tokens int64,
               log-probs fp32), 29 B (+4) per position of the R / DP rows; at DP > 1 the exchange's send
               and receive buffers (rollout/exchange.py: 8 B per token, + L x k B with rollout routes);
               with dynamic sampling the kept rows between rounds (12 B per position), for up to R rows
               (every kept group generated on this rank: the worst case, not the mean).
  train_act    activations of ONE micro-batch (micro_batch_size x (max_prompt_length +
               max_new_tokens) tokens; with env.name max_prompt_length + env.max_response_tokens: a
               row is its whole conversation, as in routing and rows), per layer per token, in elements of 2 B (GEMM inputs:
               1 B under FP8):
                 attention: RMSNorm in/out 2h, q/k pre-norm q+kv, q/k/v post-RoPE q+2kv,
                            core-attention out q, softmax lse 2 x heads (fp32)        -> / TP (SP)
                 router:    logits + probs in fp32 4E, top-k probs/ids 6k, RMSNorm in/out 2h  -> / TP
                 experts:   k x imbalance x (permuted in h + fc1 out 2f + SwiGLU out f + fc2 out h)
                            on this rank's T / TP tokens (alltoall: each EP rank gets T/TP x k on
                            average; ``expert_load_imbalance`` is the hottest rank's excess)
               recompute: none = all L layers; selective (core_attn, moe_act) drops the SwiGLU
               output; full/uniform(n) keeps the L/n chunk inputs (h / TP each) plus n layers
               being recomputed; full/block(n) keeps n inputs and L-n full layers (+1 recomputed).
               Plus the output layer + log-probs (fused_logprobs.py: no [T, V] logits): the final
               hidden states gathered over the sequence [T, h] and their fp32 gradient accumulator,
               the output weight's gradient [V/TP, h] before DDP adds it to the main grads, and the
               vocabulary-chunk temporaries (4 x 64 MiB, plus kept chunk logits up to 256 MiB).
  generation   rollouts run on the training model (weights, grads and optimizer stay resident), with
               the decoder the job takes (``generation.decode_impl``; auto: lean unless the config
               shows something it cannot run, LEAN_DECODE_LIMITS: FP8, PP, TE's fused router).
               The one generator serves the rollouts and the evaluation (trainer/evaluation.py), so its
               batch is the larger of the local rollout batch (prompts_per_step / DP x G rows) and, with
               eval.interval > 0, this rank's share of the evaluation's sampled pass (eval.num_prompts x
               max(1, eval.num_samples) / DP rows, rounded up; a held-out prompt is at most max_prompt_length).
               Lean: its KV cache of that batch (those rows,
               max_prompt_length + max_new_tokens - 1 slots, with env.name max_prompt_length +
               env.max_response_tokens - 1: a conversation's KV is kept to its last turn; kv_heads / TP; with
               generation.max_batch_rows below the batch, that many rows, plus a prompt store of
               max_prompt_length slots per row, live while generating; else, with
               generation.shared_prefix_attention auto or on and G > 1, a prompt store of
               max_prompt_length slots per prompt), plus the larger of one
               prefill layer (attention on this rank's heads; the MoE dispatch over the expert-TP x
               EP group in chunks of LEAN_MOE_GATHER_TOKENS gathered tokens: gathered tokens, pairs,
               fp32 partial outputs) and one decode step (the capacity-padded pairs), plus the
               gathered last-position logits. megatron's path: its static KV cache (prompt +
               max_new_tokens slots) plus one layer of the no-grad prefill over the whole prompt
               block (conservatively at TP 1). Training activations and the generation peak never
               coexist, so the peak takes the larger of the two.
  kv_cache_kept generation.cuda_graphs=true: the lean decoder's KV cache lives for the job (its captured
               steps read it: generation.Generator), so it stays resident while training too: one cache,
               the rollouts' and the evaluation's, of the batch above.
  runtime      CUDA context, NCCL / TE / cuBLAS workspaces: a fixed ``runtime_overhead_gib``, plus
               ``fragmentation`` x the dynamic (activation / generation) peak for the caching
               allocator.

  total = weights + grads + optimizer + ref_model + fp8_cache + routing + rows + kv_cache_kept
          + max(train_act, generation) x (1 + fragmentation) + runtime

It is an estimate for choosing a layout, not a guarantee: sequence lengths are the configured
maxima (a conservative choice) and the hottest expert rank's load is an assumption.
"""

from __future__ import annotations

from typing import Any

from megatron_gspo.config.rules import row_token_budget

__all__ = ["GIB", "H100_80GB_GIB", "estimate_memory"]

GIB = 1024 ** 3
# An "80 GB" H100 SXM reports 81559 MiB in nvidia-smi.
H100_80GB_GIB = 81559 / 1024


def _param_counts(m, par) -> dict[str, float]:
    """Parameters held by one GPU of the largest pipeline stage (dense, expert, GEMM weights)."""
    h, q, kv = m.hidden_size, m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    tp, pp, ep, etp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                       par.expert_model_parallel_size, par.etp)
    layers = m.num_layers // pp
    attn = (h * q + 2 * h * kv + q * h) / tp               # q, k, v, o: column/row parallel
    replicated = 2 * h + (2 * m.kv_channels if m.qk_layernorm else 0) + m.num_moe_experts * h  # norms, router
    vocab = m.padded_vocab_size * h / tp                   # vocab-parallel
    n_tables = 2 if m.untie_embeddings_and_output_weights else 1
    # Embedding, output layer and final norm are counted on the stage: exact for PP=1 (the only
    # layout the trainer runs), an upper bound for any stage under PP>1.
    dense = layers * (attn + replicated) + n_tables * vocab + h
    experts = layers * m.num_moe_experts * 3 * h * m.moe_ffn_hidden_size / (ep * etp)
    return {"dense": dense, "expert": experts, "gemm": layers * attn + experts}


def _layer_act_bytes(m, tp: int, fp8: bool, imbalance: float, recompute_moe_act: bool) -> float:
    """Bytes one layer saves for backward, per token of the micro-batch (divided by TP: SP)."""
    h, E, k, f = m.hidden_size, m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size
    heads, q, kv = m.num_attention_heads, m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    gemm_in = 1 if fp8 else 2  # TE keeps FP8 GEMM inputs in 1 byte
    attn = (2 * h                    # RMSNorm input (residual stream)
            + gemm_in * h            # RMSNorm output = QKV GEMM input
            + 2 * (q + kv)           # q, k before qk-norm
            + 2 * (q + 2 * kv)       # q, k, v after RoPE (flash-attention inputs)
            + gemm_in * q            # core-attention output = o-proj GEMM input
            + 4 * heads)             # softmax log-sum-exp, fp32
    router = (2 * h + 2 * h          # pre-MLP RMSNorm input and output
              + 4 * 2 * E            # router logits and probabilities, fp32
              + 12 * k)              # top-k probabilities (fp32) and expert ids (int64)
    per_routed = (gemm_in * h        # permuted tokens = fc1 GEMM input
                  + 2 * 2 * f        # fc1 output (gate, up) = SwiGLU input
                  + (0 if recompute_moe_act else gemm_in * f)  # SwiGLU output = fc2 GEMM input
                  + 2 * h)           # fc2 output, kept for the routing-probability backward
    return (attn + router + k * imbalance * per_routed) / tp


def _train_activation_bytes(m, tokens: int, layers: int, tp: int, w_bytes: int, imbalance: float) -> float:
    """Training activations of one micro-batch of ``tokens`` tokens (recompute as configured) + the fused
    output layer's log-prob working set."""
    per_layer = _layer_act_bytes(m, tp, bool(m.fp8), imbalance, recompute_moe_act=m.recompute_granularity == "selective")
    chunk_input = 2 * m.hidden_size / tp
    if m.recompute_granularity == "full":
        n = m.recompute_num_layers or 1
        if m.recompute_method == "uniform":
            act = (-(-layers // n)) * chunk_input + min(n, layers) * per_layer
        else:  # block: the first n layers are recomputed, the rest keep everything
            n = min(n, layers)
            act = n * chunk_input + (layers - n) * per_layer + (per_layer if n else 0)
    else:
        act = layers * per_layer
    v_local = m.padded_vocab_size / tp
    # fused output layer + log-probs: hidden [T, h] (gathered, batch-first copy) + fp32 gradient
    # accumulator, the output weight's gradient, the vocabulary-chunk temporaries and kept logits
    logits = tokens * m.hidden_size * (2 * w_bytes + 4) + v_local * m.hidden_size * w_bytes \
        + 4 * (64 << 20) + (256 << 20)
    return tokens * act + logits


def _generation_bytes(m, rows_local: int, seq: int, prompt_len: int, layers: int, tp: int, w_bytes: int,
                      imbalance: float) -> tuple[float, float]:
    """(KV cache of the local batch, the live tensors of one no-grad prefill block) in bytes."""
    k = m.moe_router_topk
    kv_heads_local = max(1, m.num_query_groups // tp)
    kv_cache = layers * 2 * rows_local * seq * kv_heads_local * m.kv_channels * w_bytes
    prefill_tokens = rows_local * prompt_len
    h, f, q = m.hidden_size, m.moe_ffn_hidden_size, m.num_attention_heads * m.kv_channels
    kvd = m.num_query_groups * m.kv_channels
    # no-grad prefill: the live tensors of one block (no SP while generating; conservative TP=1)
    attn_ws = 2 * (2 * h + (q + 2 * kvd) + q)
    moe_ws = 2 * 2 * h + k * imbalance * 2 * (h + 2 * f + f + h)
    prefill = prefill_tokens * max(attn_ws, moe_ws) \
        + rows_local * m.padded_vocab_size * 4 * 2  # last-position logits gathered over TP, fp32
    return kv_cache, prefill


def _lean_moe_bytes(m, tokens: int, ep: int, etp: int, w_bytes: int, imbalance: float, static: bool) -> float:
    """Live bytes of one MoE layer of the lean decoder (generation/lean_decoder.py, DeviceMoE) on ``tokens``
    tokens of this rank: its input and output, plus one dispatch over the expert-TP x EP group (at most
    LEAN_MOE_GATHER_TOKENS gathered tokens; a prefill goes through in chunks of that many): the gathered
    tokens and routes, the (token, local expert) pairs through the experts' expert-TP shard, the partial
    outputs and their fp32 copy for the reduce-scatter. ``static``: a decode step's pair buffer, padded to
    the capacity (every gathered token could be this rank's, min(k, local experts) pairs each); else the
    prefill's exact count (k / EP pairs per gathered token, times the hottest rank's ``imbalance``)."""
    from megatron_gspo.config.rules import LEAN_MOE_GATHER_TOKENS

    h, k, f = m.hidden_size, m.moe_router_topk, m.moe_ffn_hidden_size / etp
    per_pair = (2 * h + 3 * f) * w_bytes + 16  # permuted input, fc1 out (gate, up), SwiGLU out, fc2 out; ids, prob
    group = ep * etp
    if group == 1:
        return tokens * (2 * h * w_bytes + k * per_pair)
    gathered = min(group * tokens, LEAN_MOE_GATHER_TOKENS)
    pairs = gathered * (min(k, m.num_moe_experts // ep) if static else k / ep * imbalance)
    dispatch = gathered * (h * w_bytes + 8 * k + h * (w_bytes + 4)) + pairs * per_pair
    return tokens * 2 * h * w_bytes + dispatch


def _lean_generation_bytes(m, rows_local: int, seq: int, prompt_len: int, layers: int, tp: int, ep: int, etp: int,
                           w_bytes: int, imbalance: float, batch_rows: int = 0,
                           shared_prompts: int = 0) -> tuple[float, float]:
    """(KV cache, the larger of one prefill layer's and one decode step's live tensors) of the lean decoder
    over this rank's TP / EP / expert-TP shards: a KV cache of roped keys for this rank's query groups,
    prompt block + max_new_tokens - 1 slots; the prefill's attention on this rank's heads; the MoE
    dispatches (``_lean_moe_bytes``); the last position's vocab-parallel logits gathered over TP (fp32 for
    the sampler). batch_rows: generation.max_batch_rows (0: none): the KV cache and the decode step hold
    that many rows at most, and the prompt store of the refilled batch (each prompt's KV, prompt_len slots,
    counted for every row: at most one prompt per row) lives for the generation. shared_prompts: the prompts whose
    KV shared-prefix decode attention keeps in that store (generation.shared_prefix_attention; 0: none); the cache
    rows keep their slots, so the store adds that many prompts' prompt_len slots (the refilled store holds them)."""
    kv_heads_local = max(1, m.num_query_groups // tp)
    per_slot = layers * 2 * kv_heads_local * m.kv_channels * w_bytes
    refill = 0 < batch_rows < rows_local
    cache_rows = batch_rows if refill else rows_local
    kv_cache = per_slot * cache_rows * (seq - 1)
    store = per_slot * (rows_local if refill else shared_prompts) * prompt_len
    h = m.hidden_size
    q, kvd = m.num_attention_heads * m.kv_channels / tp, m.num_query_groups * m.kv_channels / tp
    tokens = rows_local * prompt_len
    attn_ws = w_bytes * (2 * h + 2 * (q + 2 * kvd) + q + h)  # norm in/out, q/k/v before and after RoPE, ctx, out
    prefill = max(tokens * attn_ws + rows_local * prompt_len ** 2 * w_bytes,  # + the [b, 1, P, P] mask bias
                  _lean_moe_bytes(m, tokens, ep, etp, w_bytes, imbalance, static=False))
    decode = _lean_moe_bytes(m, cache_rows, ep, etp, w_bytes, imbalance, static=True)
    logits = rows_local * m.padded_vocab_size * (w_bytes / tp + 4 * 2)  # the prefill's: every row's first draw
    return kv_cache, max(prefill, decode) + logits + store


def _decoder_bytes(job_cfg, rows_local: int, seq: int, layers: int, w_bytes: int,
                   imbalance: float) -> tuple[str, float, float]:
    """(the decoder the job's generation takes, its KV cache, its other live tensors) in bytes."""
    from megatron_gspo.config.rules import lean_decode_config_limit

    m, par, prompt = job_cfg.model, job_cfg.parallel, job_cfg.data.max_prompt_length
    tp, ep, etp = par.tensor_model_parallel_size, par.expert_model_parallel_size, par.etp
    gen = job_cfg.generation
    if gen.decode_impl != "megatron" and lean_decode_config_limit(job_cfg) is None:
        # shared-prefix attention (auto or on; never with cuda_graphs) keeps each prompt's KV in a store: G rows a prompt
        shares = gen.shared_prefix_attention != "off" and not gen.cuda_graphs and gen.n_samples_per_prompt > 1
        prompts = -(-rows_local // gen.n_samples_per_prompt) if shares else 0
        return ("lean", *_lean_generation_bytes(m, rows_local, seq, prompt, layers, tp, ep, etp, w_bytes, imbalance,
                                                gen.max_batch_rows, prompts))
    return ("megatron", *_generation_bytes(m, rows_local, seq, prompt, layers, tp, w_bytes, imbalance))


def _eval_rows_per_rank(job_cfg, dp: int) -> int:
    """config.rules.eval_rows_per_rank of the job's evaluation (0: none)."""
    from megatron_gspo.config.rules import eval_rows_per_rank

    e = job_cfg.eval
    return eval_rows_per_rank(e.num_prompts, e.num_samples, dp) if e.interval > 0 else 0


def _routing_bytes(job_cfg, rows_local: int, seq: int, layers: int, tp: int) -> float:
    """The batch's behaviour routes (int16, every position of every local row, on every TP rank) + the
    replay's int64 copy of one micro-batch's chunk (R2 / R3)."""
    t, k = job_cfg.train, job_cfg.model.moe_router_topk
    replay = t.micro_batch_size * seq / tp * layers * k * 8 if t.routing_replay != "off" else 0
    return rows_local * seq * layers * k * 2 + replay


def _rows_bytes(job_cfg, rows_local: int, seq: int, layers: int, dp: int) -> float:
    """The step's rows on the device (module doc: ``rows``)."""
    t, g, k = job_cfg.train, job_cfg.generation, job_cfg.model.moe_router_topk
    R = t.prompts_per_step * g.n_samples_per_prompt
    held = R if t.dynamic_sampling else rows_local  # rows a rank may hold before the deal
    batch = rows_local * seq * (29 + (4 if job_cfg.loss.kl_coef > 0 else 0))
    pool = held * seq * 12 if t.dynamic_sampling else 0
    rollout_routes = t.routing_replay == "R3" or t.old_logprobs == "rollout"
    wire = (held + rows_local) * seq * (8 + (layers * k if rollout_routes else 0)) if dp > 1 else 0
    return batch + pool + wire


def estimate_memory(job_cfg, world_size: int, *, expert_load_imbalance: float = 1.5,
                    runtime_overhead_gib: float = 3.0, fragmentation: float = 0.10) -> dict[str, Any]:
    """Estimated peak memory of one GPU of ``job_cfg`` on ``world_size`` GPUs, in GiB.

    Returns a dict with the components documented in the module docstring (GiB), ``total``,
    ``budget`` (an 80 GB H100), ``fits`` and the layout numbers it used (dp, expert_dp, params).
    """
    from megatron_gspo.runtime.parallel import validate_layout

    m, par, t, g = job_cfg.model, job_cfg.parallel, job_cfg.train, job_cfg.generation
    dp = validate_layout(m, par, world_size)
    tp, pp, ep, etp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                       par.expert_model_parallel_size, par.etp)
    expert_dp = world_size // (ep * etp * pp)
    p = _param_counts(m, par)
    n_params = p["dense"] + p["expert"]
    bf16 = m.precision in ("bf16", "auto")  # per GPU: "auto" is bf16 there (config.resolve_precision)
    w_bytes = 2 if bf16 else 4
    adam = job_cfg.optimizer.optimizer == "adam"
    opt_bytes = (4 if bf16 else 0) + (8 if adam else 4)  # master copy + (m, v) | momentum
    # the recipes are for H100s with Transformer Engine, where "unset" means distributed
    dist_opt = par.use_distributed_optimizer is not False
    shard_dense = dp if dist_opt else 1
    shard_expert = expert_dp if dist_opt else 1

    out: dict[str, Any] = {}
    out["weights"] = n_params * w_bytes / GIB
    out["grads"] = n_params * 4 / GIB
    out["optimizer"] = (p["dense"] * opt_bytes / shard_dense + p["expert"] * opt_bytes / shard_expert) / GIB
    out["ref_model"] = n_params * w_bytes / GIB if job_cfg.loss.kl_coef > 0 else 0.0
    out["fp8_cache"] = p["gemm"] * 2 / GIB if m.fp8 else 0.0
    # sequences and tokens
    seq = row_token_budget(job_cfg)  # a prompt and its response, or a whole conversation (env.name)
    rows_local = t.prompts_per_step * g.n_samples_per_prompt // dp  # generated, and dealt after (rows.deal_rows)
    layers = m.num_layers // pp
    out["routing"] = _routing_bytes(job_cfg, rows_local, seq, layers, tp) / GIB
    out["rows"] = _rows_bytes(job_cfg, rows_local, seq, layers, dp) / GIB
    # activations: training (one micro-batch) or generation (KV cache + one prefill block)
    tokens = t.micro_batch_size * seq
    out["train_act"] = _train_activation_bytes(m, tokens, layers, tp, w_bytes, expert_load_imbalance) / GIB
    eval_rows = _eval_rows_per_rank(job_cfg, dp)  # one generator for rollouts and evaluation: the larger batch
    out["decoder"], kv_cache, prefill = _decoder_bytes(job_cfg, max(rows_local, eval_rows), seq, layers, w_bytes,
                                                      expert_load_imbalance)
    out["generation"] = (kv_cache + prefill) / GIB
    out["kv_cache_kept"] = kv_cache / GIB if g.cuda_graphs else 0.0

    static = sum(out[x] for x in ("weights", "grads", "optimizer", "ref_model", "fp8_cache", "routing", "rows",
                                  "kv_cache_kept"))
    dynamic = max(out["train_act"], out["generation"]) * (1 + fragmentation)
    out["runtime"] = runtime_overhead_gib + dynamic - max(out["train_act"], out["generation"])
    out["total"] = static + dynamic + runtime_overhead_gib
    out["budget"] = H100_80GB_GIB
    out["fits"] = out["total"] <= H100_80GB_GIB
    out.update(world_size=world_size, tp=tp, pp=pp, ep=ep, etp=etp, dp=dp, expert_dp=expert_dp,
               sequence_parallel=par.sp, distributed_optimizer=dist_opt,
               recompute=m.recompute_granularity or "none",
               params_dense_b=p["dense"] / 1e9, params_expert_b=p["expert"] / 1e9,
               params_total_b=m.num_parameters() / 1e9, seq_len=seq, micro_batch_tokens=tokens,
               rollout_rows_per_rank=rows_local, eval_rows_per_rank=eval_rows)
    return out


# ----------------------------------------------------------------------------------------------
# Recipes: world size from the header, generated comment block
# ----------------------------------------------------------------------------------------------
