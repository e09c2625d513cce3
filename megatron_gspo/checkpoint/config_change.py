"""A resume under a changed config: which differences from the checkpoint's job are fine, which are not.

Every training checkpoint stores the job that wrote it (``extra["config"]``, trainer.save). A resume
compares it key by key with the job now running (``compare``):

* keys that only steer *how* or *how long* the same run goes on may change: the run's length, logging,
  saving, evaluation (it never moves training), the parallel layout (resuming under another TP / EP /
  DP is supported), micro-batching and implementation choices that change speed and float rounding
  only, and the warm start (it does not run when resuming). They are accepted and logged;
* any other key changes the training trajectory (the loss, the data, the sampling, the optimizer,
  dynamic sampling, the model's numerics, ...): the resume is refused naming each such key, unless
  ``checkpoint.allow_config_change`` lists it (or its section), which accepts it, logged.

Pure functions on the nested dicts of ``config.to_dict``; the CheckpointManager reads the saved one.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Iterable

from megatron_gspo.errors import ConfigError

# Every field of the job has one resume policy, declared below as "section.key" patterns: a field in
# none (or in two) fails tests/test_config_change.py, so a new field cannot drift into "refused" unseen.

# The parallel layout: a checkpoint resumes under any TP / EP / DP / SP of the trainer (checkpoint/
# storage.py reshards) and the rollout ranks re-shard theirs from the trainer's at every weight sync.
LAYOUT: tuple[str, ...] = (
    "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
    "parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size", "parallel.sequence_parallel",
    "parallel.use_distributed_optimizer",
    "rollout.world_size", "rollout.tensor_model_parallel_size", "rollout.expert_model_parallel_size",
    "rollout.expert_tensor_parallel_size",
)
# Keys that may differ between a checkpoint and the job resuming from it, besides the layout.
MAY_CHANGE: tuple[str, ...] = LAYOUT + (
    # how long, where to, and what is written
    "train.num_steps", "train.output_dir", "train.tensorboard", "train.log_interval", "train.max_consecutive_skips",
    "checkpoint.*",
    # evaluation: its own noise (eval.seed), no routing capture, training bit-identical with it on or off
    # (a held-out split of a data file changes the training set: the data sampler refuses that itself)
    "eval.*",
    # the timeouts, the initial seed (the checkpoint's RNG states replace it), the weight stream's bucket
    "parallel.distributed_timeout_minutes", "parallel.seed", "rollout.heartbeat_timeout_s",
    "rollout.weight_sync_bucket_mb",
    # the same gradient computed in other pieces or with other kernels (float rounding only); the finished-row
    # check's interval only feeds pad tokens to finished rows for longer (results do not change)
    "train.micro_batch_size", "train.max_tokens_per_micro_batch", "generation.compact_finished_rows",
    "generation.decode_impl", "generation.cuda_graphs", "generation.finished_check_interval",
    "model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers",
    "model.attention_impl", "model.transformer_impl", "model.moe_token_dispatcher_type", "model.moe_expert_impl",
    "model.moe_router_fusion", "model.preset",
    # the supervised warm start runs before step 1 only, never when resuming a training checkpoint (a
    # checkpoint of a warm start stopped half-way refuses a changed sft_lr / sft_batch_size: WARM_START)
    "train.sft_steps", "train.sft_lr", "train.sft_batch_size",
)
# Keys that change the training trajectory: a resume that changes one is refused unless
# checkpoint.allow_config_change names it (or its section).
CHANGES_TRAJECTORY: tuple[str, ...] = (
    # the model's shape and numerics (model.preset only names a shape: its fields are compared one by one)
    "model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.num_query_groups",
    "model.kv_channels", "model.vocab_size", "model.make_vocab_size_divisible_by", "model.max_position_embeddings",
    "model.rotary_base", "model.norm_epsilon", "model.qk_layernorm", "model.untie_embeddings_and_output_weights",
    "model.num_moe_experts", "model.moe_router_topk", "model.moe_ffn_hidden_size", "model.moe_router_pre_softmax",
    "model.moe_router_dtype", "model.moe_aux_loss_coeff", "model.moe_router_load_balancing_type",
    "model.init_method_std", "model.precision", "model.fp8", "model.fp8_recipe",
    "parallel.device",  # another device's kernels, rounding and random streams
    "loss.*", "optimizer.*", "rollout_correction.*", "data.*", "tokenizer.*", "reward.*",
    # sampling: what is generated
    "generation.max_new_tokens", "generation.temperature", "generation.top_p", "generation.top_k",
    "generation.n_samples_per_prompt", "generation.seed", "generation.stop_token_ids", "generation.pad_token_id",
    "generation.min_new_tokens", "generation.ignore_eos",
    # the step: its batch, its objective, its filters and seeds
    "train.prompts_per_step", "train.num_minibatches", "train.old_logprobs", "train.advantage_estimator",
    "train.routing_replay", "train.dynamic_sampling", "train.dynamic_sampling_max_rounds",
    "train.overlong_filtering", "train.seed", "train.deterministic",
    # asynchronous rollouts: which policy versions the rows come from
    "rollout.mode", "rollout.max_staleness", "rollout.partial_rollouts",
)
# Keys that may not change when the checkpoint is one of an unfinished warm start (train.sft_steps may:
# the warm start then runs to the new length, or is over)
WARM_START: tuple[str, ...] = ("train.sft_lr", "train.sft_batch_size")


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    why: str  # "may change at resume" | "checkpoint.allow_config_change" | "not in the checkpoint's config"

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"


def flatten(config: dict) -> dict[str, Any]:
    """{"section.key": value} of a job's nested dict (mapping-valued keys stay whole values)."""
    return {f"{section}.{key}": value for section, fields in config.items() if isinstance(fields, dict)
            for key, value in fields.items()}


def policy(key: str) -> str:
    """"may change" or "changes the trajectory": ``key``'s resume policy. A key declared in neither list is
    treated as changing the trajectory (refusing is the safe side; tests/test_config_change.py fails on it)."""
    return "may change" if any(fnmatch.fnmatchcase(key, p) for p in MAY_CHANGE) else "changes the trajectory"


def allowed(key: str, allow: Iterable[str]) -> bool:
    """``key`` ("section.key") is named by checkpoint.allow_config_change, itself or by its section."""
    return any(key == a or key.split(".", 1)[0] == a for a in allow)


def compare(saved: dict, current: dict, allow: Iterable[str] = (),
            fixed: Iterable[str] = ()) -> tuple[list[Change], list[Change]]:
    """(accepted, refused) differences between the checkpoint's job ``saved`` and ``current``, both
    config.to_dict() forms. A key the checkpoint does not have (written by an older version) is
    accepted; one the current job no longer has is ignored. ``fixed``: keys of MAY_CHANGE that this
    checkpoint cannot take changed (WARM_START)."""
    allow, fixed = list(allow), set(fixed)
    old, new = flatten(saved), flatten(current)
    accepted, refused = [], []
    for key, value in new.items():
        if key not in old:
            accepted.append(Change(key, None, value, "not in the checkpoint's config"))
            continue
        if old[key] == value:
            continue
        if key not in fixed and policy(key) == "may change":
            accepted.append(Change(key, old[key], value, "may change at resume"))
        elif allowed(key, allow):
            accepted.append(Change(key, old[key], value, "checkpoint.allow_config_change"))
        else:
            refused.append(Change(key, old[key], value, "changes the training trajectory"))
    return accepted, refused


def check_resume_config(path: str, saved: dict, current: dict, allow: Iterable[str] = (),
                        fixed: Iterable[str] = ()) -> list[Change]:
    """Raise ConfigError naming every difference that changes the trajectory and is not allowed;
    return the accepted ones (for the log)."""
    accepted, refused = compare(saved, current, allow, fixed)
    if refused:
        keys = ",".join(c.key for c in refused)
        raise ConfigError(
            f"resuming {path} with a changed config: {'; '.join(map(str, refused))}: "
            f"{'this changes' if len(refused) == 1 else 'these change'} the training trajectory, so the resumed run "
            f"would not continue the checkpoint's; resume with the checkpoint's value{'s' if len(refused) > 1 else ''}, "
            f"or accept the change with checkpoint.allow_config_change=[{keys}]")
    return accepted
