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

Each field declares its policy where it is declared (``config.knob(resume=Resume...)``, config/fields.py):
``Resume.MAY_CHANGE``, ``LAYOUT`` (behaves as MAY_CHANGE), ``MAY_CHANGE_AFTER_WARM_START`` (refused while the
checkpoint is an unfinished warm start: ``WARM_START``) or ``REFUSED``; this module only reads them.

``checkpoint.load`` of a checkpoint as initial weights (a fresh start: nothing of its run goes on)
compares only ``ARCHITECTURE``, the model keys its weights are bound to beyond their shapes: a
converted checkpoint's ``model_config.yaml`` (or a trainer checkpoint's job) that disagrees with
``model.*`` on the vocabulary, the positions, the rotary base, the norm epsilon, ... loads without a
shape error and computes another function. Refused by key unless ``checkpoint.allow_config_change``
names it (``check_load_config``).

Pure functions on the nested dicts of ``config.to_dict``; the CheckpointManager reads the saved one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from megatron_gspo.config import JobConfig, Resume, walk_knobs
from megatron_gspo.errors import ConfigError

# Every field of the job declares its resume policy where it is declared (config.knob(resume=...));
# tests/test_config_change.py fails naming a field without one.
POLICIES: dict[str, Resume] = {key: k.resume for key, k in walk_knobs(JobConfig) if k is not None}


def _keys(*policies: Resume) -> tuple[str, ...]:
    return tuple(key for key, p in POLICIES.items() if p in policies)


# The parallel layout: a checkpoint resumes under any TP / EP / DP / SP of the trainer (checkpoint/
# storage.py reshards) and the rollout ranks re-shard theirs from the trainer's at every weight sync.
LAYOUT: tuple[str, ...] = _keys(Resume.LAYOUT)
# Keys that may differ between a checkpoint and the job resuming from it (the layout included).
MAY_CHANGE: tuple[str, ...] = _keys(Resume.MAY_CHANGE, Resume.LAYOUT, Resume.MAY_CHANGE_AFTER_WARM_START)
# Keys that change the training trajectory: a resume that changes one is refused unless
# checkpoint.allow_config_change names it (or its section).
CHANGES_TRAJECTORY: tuple[str, ...] = _keys(Resume.REFUSED)
# Keys that may not change when the checkpoint is one of an unfinished warm start (train.sft_steps may:
# the warm start then runs to the new length, or is over)
WARM_START: tuple[str, ...] = _keys(Resume.MAY_CHANGE_AFTER_WARM_START)


# The model keys a checkpoint's weights are bound to (what they compute, beyond what their shapes say):
# loading weights under another value of one runs them as another model. Training choices of the model
# section (precision, FP8, the aux loss, the router's dtype, recompute, implementations, init) are not.
ARCHITECTURE: tuple[str, ...] = tuple(f"model.{k}" for k in (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
    "make_vocab_size_divisible_by", "max_position_embeddings", "rotary_base", "norm_epsilon", "qk_layernorm",
    "untie_embeddings_and_output_weights", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_router_pre_softmax"))


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    why: str  # "may change at resume" | "checkpoint.allow_config_change" | "not in the checkpoint's config"

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"section.key": value} of a job's nested dict: a sub-section (``rollout.vllm``) is walked to its keys
    (``rollout.vllm.enforce_eager``); mapping-valued keys (a declared field) stay whole values."""
    out: dict[str, Any] = {}
    for name, value in config.items():
        key = prefix + name
        if isinstance(value, dict) and (not prefix or (key not in POLICIES and any(k.startswith(key + ".") for k in POLICIES))):
            out.update(flatten(value, key + "."))
        elif prefix:
            out[key] = value
    return out


def policy(key: str) -> str:
    """"may change" or "changes the trajectory": ``key``'s resume policy. A key without a declared one is
    treated as changing the trajectory (refusing is the safe side; tests/test_config_change.py fails on it)."""
    declared = POLICIES.get(key, Resume.REFUSED)
    return "changes the trajectory" if declared is Resume.REFUSED else "may change"


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


def check_load_config(path: str, source: str, saved_model: dict, current_model: dict,
                      allow: Iterable[str] = ()) -> list[Change]:
    """``checkpoint.load`` of ``path`` whose model config (``saved_model``, read from ``source``) is compared with
    the job's ``current_model`` (the ``model`` sections of config.to_dict) on ARCHITECTURE: raise ConfigError
    naming every differing key that checkpoint.allow_config_change does not list; return the accepted ones."""
    keys = {k.split(".", 1)[1] for k in ARCHITECTURE}
    old = {k: v for k, v in saved_model.items() if k in keys}
    new = {k: v for k, v in current_model.items() if k in keys}
    accepted, refused = compare({"model": old}, {"model": new}, allow)
    if refused:
        keys_named = ",".join(c.key for c in refused)
        raise ConfigError(
            f"checkpoint.load={path}: its model config ({source}) differs from the job's: "
            f"{'; '.join(map(str, refused))}: the weights would run as another model (same shapes, another "
            f"function); set {'this key' if len(refused) == 1 else 'these keys'} to the checkpoint's "
            f"value{'s' if len(refused) > 1 else ''}, or accept with checkpoint.allow_config_change=[{keys_named}]")
    return [c for c in accepted if c.why == "checkpoint.allow_config_change"]
