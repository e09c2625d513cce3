"""The ``rollout`` section: where rollouts are generated (megatron_gspo/rollout/). Its checks across
sections are config/rules.py's (``async_*``, ``old_logprobs_under_async``); the checks that need the world
size live with the rank split (rollout.layout.check_world)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo.config.checks import check
from megatron_gspo.errors import ConfigError
from megatron_gspo.config.fields import Resume, knob, validate

ROLLOUT_MODES = ("colocated", "async")
ROLLOUT_ENGINES = ("megatron", "vllm")
PARTIAL_ROLLOUT_POLICIES = ("finish", "drop")
# Every rank of an async job bumps its heartbeat this often (rollout.side.Heartbeat). A timeout must
# span several beats: one beat late (a loaded host, a long GIL hold) must not declare a healthy rank dead.
HEARTBEAT_PERIOD_S = 1.0
MIN_HEARTBEAT_TIMEOUT_S = 3 * HEARTBEAT_PERIOD_S


# vllm.LLM's arguments the engine sets from the job (rollout/vllm_engine.py: the model, its dtype and length, the
# token-in / token-out contract, the log-probs' meaning) or from its own rollout.vllm.* keys: never passed through
# rollout.vllm.engine_args, which would silently change what the trainer relies on.
VLLM_OWNED_ARGS = {
    "model": "the job's model, written from its weights", "tokenizer": "prompts go in as token ids",
    "skip_tokenizer_init": "prompts go in as token ids", "dtype": "the model's precision (model.precision)",
    "seed": "generation.seed", "max_model_len": "data.max_prompt_length + the response budget",
    "logprobs_mode": "the behaviour policy's log-probs (processed_logprobs)",
    "enable_prefix_caching": "the prompt's KV shared by its samples and a conversation's by its next turn",
    "enforce_eager": "rollout.vllm.enforce_eager", "kv_cache_memory_bytes": "rollout.vllm.kv_cache_memory_gib",
    "tensor_parallel_size": "parallel.tensor_model_parallel_size: one engine per trainer TP group",
    "distributed_executor_backend": "the job's torchrun world (external_launcher under torchrun)",
    "enable_return_routed_experts": "train.routing_replay=R3 (the routes R3 replays)",
    "enable_sleep_mode": "rollout.vllm.sleep_level",
}


@dataclass
class VllmConfig:
    """The vLLM engine of ``rollout.engine=vllm`` (rollout/vllm_engine.py)."""

    # The engine's KV cache, GiB (vLLM's kv_cache_memory_bytes). null: on a CPU sized to the job (256
    # sequences of data.max_prompt_length + the response budget, clamped to 32 MiB - 4 GiB: vLLM's default
    # takes a share of the host's memory, which the trainer shares); on a GPU vLLM's own sizing
    # (gpu_memory_utilization, settable through rollout.vllm.engine_args).
    kv_cache_memory_gib: Optional[float] = knob(None, resume=Resume.MAY_CHANGE, gt=0)
    # Run the engine's model eagerly (vLLM's enforce_eager): no torch.compile and no CUDA graphs, so it starts
    # in seconds; false captures them (a GPU's faster decode, a slower start).
    enforce_eager: bool = knob(True, resume=Resume.MAY_CHANGE)
    # More arguments of vllm.LLM (vLLM's EngineArgs names: max_num_seqs, block_size, gpu_memory_utilization,
    # ...), passed through as given; the ones the engine sets itself are refused by name (VLLM_OWNED_ARGS).
    # On a CPU block_size defaults to 32 (vLLM's CPU default, 128, is longer than a short prompt: the prefix
    # cache shares whole blocks only).
    engine_args: dict = knob(default_factory=dict, resume=Resume.MAY_CHANGE)
    # Between two generations the engine gives its GPU memory back to training (vLLM's sleep mode): 1 moves
    # its weights to host memory and drops the KV cache, 2 drops both (every generation starts with a weight
    # sync anyway, so nothing is lost: the default on a GPU), 0 keeps the engine resident. null: 2 for a
    # colocated engine on a GPU, 0 elsewhere (vLLM has no sleep mode on a CPU; an async job's rollout ranks
    # do not train). rollout/vllm_engine.py VllmEngine.rest.
    sleep_level: Optional[int] = knob(None, resume=Resume.MAY_CHANGE, choices=(None, 0, 1, 2))

    def __post_init__(self) -> None:
        validate(self, "rollout.vllm")
        for key in self.engine_args:
            if key in VLLM_OWNED_ARGS:
                raise ConfigError(f"rollout.vllm.engine_args.{key}: set by the engine itself "
                                  f"({VLLM_OWNED_ARGS[key]}); remove it from rollout.vllm.engine_args")
            if not isinstance(key, str) or not key.isidentifier():
                raise ConfigError(f"rollout.vllm.engine_args: {key!r} is not an argument name of vllm.LLM")


@dataclass
class RolloutConfig:
    """Colocated rollouts (every rank generates, then trains) or asynchronous ones on ranks of their own."""

    # "colocated" (default): every rank samples its share of a step's rollout, then trains on it. "async":
    # the last rollout.world_size ranks of the job only generate, the others only train; after every step
    # the trainer streams its weights to them and they generate ahead of it, up to rollout.max_staleness
    # policy versions (docs/algorithms.md#asynchronous-rollouts).
    mode: str = knob("colocated", resume=Resume.REFUSED, choices=ROLLOUT_MODES)
    # What samples the rollouts: "megatron" (default), the training model's own decoders
    # (generation.decode_impl); "vllm", a vLLM engine in the process, built from the model and given its
    # weights before every step's generation (rollout/vllm_engine.py; `pip install -e ".[vllm]"` on a GPU,
    # the venv of .ci/setup-vllm-venv on a CPU; its settings: rollout.vllm.*). Colocated: under torchrun one
    # engine per trainer TP group; rollout.mode=async: one per rollout TP group, on the rollout ranks, given
    # every weight push between two engine steps. Single- and multi-turn rows (env.name) and the evaluation
    # sample on it.
    engine: str = knob("megatron", resume=Resume.MAY_CHANGE, choices=ROLLOUT_ENGINES)
    # Ranks that generate (async only): the last world_size ranks of the torchrun world. The trainer gets
    # the others, laid out by parallel.*; both in one torchrun launch / one SLURM job.
    world_size: int = knob(0, resume=Resume.LAYOUT, ge=0)
    # Tensor parallelism of the rollout ranks (async): their own layout, resharded from the trainer's at
    # every weight sync. Data parallelism over them is world_size / this.
    tensor_model_parallel_size: int = knob(1, resume=Resume.LAYOUT, ge=1)
    # Expert parallelism of the rollout ranks (async); must divide model.num_moe_experts.
    expert_model_parallel_size: int = knob(1, resume=Resume.LAYOUT, ge=1)
    # Expert tensor parallelism of the rollout ranks (async); null = rollout.tensor_model_parallel_size.
    expert_tensor_parallel_size: Optional[int] = knob(None, resume=Resume.LAYOUT, ge=1)
    # Rollouts of policy version v (the weights after v steps) are trained at step <= v + max_staleness
    # (async). 0 is on-policy, the same samples and updates as colocated with train.old_logprobs=recompute
    # (generation and training then take turns); 1 lets step s+1's generation overlap step s's training.
    max_staleness: int = knob(1, resume=Resume.REFUSED, ge=0)
    # A weight update that reaches the rollout ranks while they generate (async): "finish" the responses in
    # flight under the new weights (over their prefix's KV cache from the old ones; each token's log-prob
    # is that of the distribution it was drawn from) or "drop" the generation in flight and draw it again
    # under the new weights (same noise). Counted in async/partial_finished_rows and async/partial_dropped_rows.
    partial_rollouts: str = knob("finish", resume=Resume.REFUSED, choices=PARTIAL_ROLLOUT_POLICIES)
    # Bucket of the weight stream (async), MiB of full (unsharded) tensors: the most a trainer rank and a
    # rollout rank hold at once beyond their own shards while weights stream.
    weight_sync_bucket_mb: float = knob(256.0, resume=Resume.MAY_CHANGE, gt=0)
    # Seconds without a heartbeat after which a rollout rank (or the trainer, seen from a rollout rank) is
    # declared dead (async): the trainer checkpoints and stops with a message naming the rank and the
    # timeout. Ranks beat once a second: at least 3.
    heartbeat_timeout_s: float = knob(60.0, resume=Resume.MAY_CHANGE, gt=0)
    # rollout.vllm.*: the vLLM engine's settings (rollout.engine=vllm)
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def __post_init__(self) -> None:
        validate(self, "rollout")
        check(self.heartbeat_timeout_s >= MIN_HEARTBEAT_TIMEOUT_S,
              f"rollout.heartbeat_timeout_s={self.heartbeat_timeout_s:g} is shorter than {MIN_HEARTBEAT_TIMEOUT_S:g} "
              f"s: every rank beats once every {HEARTBEAT_PERIOD_S:g} s, so a healthy rank would be declared dead "
              f"between two beats or at the first pause; use at least {MIN_HEARTBEAT_TIMEOUT_S:g} (default 60)")
        if self.mode == "async":
            check(self.world_size >= 1, "rollout.mode=async needs rollout.world_size >= 1: the number of ranks "
                                        "(the last ones of the job) that generate")
        else:
            check(self.world_size == 0, f"rollout.world_size={self.world_size} is only used with rollout.mode=async; "
                                        "a colocated job generates on every rank (leave it at 0)")

    @property
    def is_async(self) -> bool:
        return self.mode == "async"

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size
