"""Generate docs/configuration.md from the configuration dataclasses.

    python docs/gen_config_reference.py            # rewrite docs/configuration.md
    python docs/gen_config_reference.py --check    # exit 1 if docs/configuration.md is stale

Walks ``JobConfig``'s sections in order and, for every field, reports its name, its annotated type,
its default in a job (``JobConfig()``: what a YAML job gets for a key it omits), the values its
``knob(choices=...)`` allows, its resume policy (``knob(resume=...)``), and its documentation, taken from the
source itself:

* the ``#`` comment lines directly above the field (ModelConfig, ParallelConfig, TrainConfig,
  GenerationConfig, OptimizerConfig), or
* the ``name: text`` entries of the class docstring (LossConfig, DataConfig, TokenizerConfig,
  RewardConfig; ``a / b:`` documents both fields, ``task_*:`` every matching field).

A few fields have neither; ``SUPPLEMENT`` below describes those (and the build fails if a key in it
stops naming a real field). tests/test_docs.py regenerates the page and asserts the committed file
is identical, so editing a config comment means re-running this script.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import inspect
import json
import os
import re
import sys
import textwrap
import typing

HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "configuration.md")

# Descriptions of fields the source leaves undocumented (no comment above them, no docstring entry).
# Keep them short and true to the code; the key must be a real "section.field".
SUPPLEMENT: dict[str, str] = {
    "model.preset": "Name of a model preset (see *Model presets* below) whose values are the defaults of "
                    "the other `model.*` keys; a `model` section without `preset` uses `tiny`, "
                    "`model.preset=null` starts from the bare field defaults.",
    "model.num_layers": "Transformer layers, every one MoE (HF `num_hidden_layers`).",
    "model.hidden_size": "Model width (HF `hidden_size`).",
    "model.num_attention_heads": "Query heads (HF `num_attention_heads`); a multiple of `num_query_groups`.",
    "model.num_query_groups": "Key/value heads of grouped-query attention (HF `num_key_value_heads`).",
    "model.kv_channels": "Head dimension (HF `head_dim`); explicit, not hidden_size / heads.",
    "model.vocab_size": "Real vocabulary size (HF `vocab_size`); the tokenizer's ids must fit. The embedding "
                        "is padded (`make_vocab_size_divisible_by`); padded ids are never sampled.",
    "model.max_position_embeddings": "Longest sequence; must hold `data.max_prompt_length + "
                                     "generation.max_new_tokens`.",
    "model.rotary_base": "RoPE base (HF `rope_theta`).",
    "model.norm_epsilon": "RMSNorm epsilon (HF `rms_norm_eps`).",
    "model.qk_layernorm": "RMSNorm on each head's queries and keys (Qwen3).",
    "model.untie_embeddings_and_output_weights": "Separate output layer (HF `tie_word_embeddings: false`).",
    "model.num_moe_experts": "Routed experts per layer (HF `num_experts`).",
    "model.moe_router_topk": "Experts per token (HF `num_experts_per_tok`).",
    "model.moe_ffn_hidden_size": "Hidden size of each expert's SwiGLU FFN (HF `moe_intermediate_size`).",
    "model.init_method_std": "Std of the random initialization (HF `initializer_range`).",
    "model.fp8": "FP8 GEMMs (Transformer Engine only): `e4m3`, or `hybrid` (E4M3 forward, E5M2 gradients); "
                 "needs `precision=bf16`.",
    "model.fp8_recipe": "Transformer Engine FP8 scaling recipe (used with `fp8`).",
    "model.recompute_method": "megatron's recompute method; required (with `recompute_num_layers`) by "
                              "`recompute_granularity=full`.",
    "model.recompute_num_layers": "Layers per recompute chunk (`uniform`) or recomputed layers (`block`).",
    "parallel.tensor_model_parallel_size": "Tensor parallelism (TP). TP > 1 needs sequence parallel with MoE.",
    "generation.max_new_tokens": "Longest response, in tokens.",
    "optimizer.weight_decay": "Decoupled weight decay (constant over the run).",
    "optimizer.adam_beta1": "Adam beta1.",
    "optimizer.adam_beta2": "Adam beta2.",
    "optimizer.adam_eps": "Adam epsilon.",
    "train.num_steps": "RL steps: one rollout each, followed by `num_minibatches` optimizer steps.",
    "train.prompts_per_step": "Prompts per RL step over all data-parallel ranks (P). The rollout has P x "
                              "`generation.n_samples_per_prompt` rows (responses), divisible by "
                              "`train.num_minibatches` x the data-parallel size (every rank holds an equal share "
                              "of every minibatch; P itself need not divide by it), and under `rollout.mode=async` "
                              "by the rollout ranks' data-parallel size.",
    "data.chat_template_kwargs": "Variables for the chat template (Qwen3: `{enable_thinking: false}`).",
    "model.moe_aux_loss_coeff": "Coefficient of the MoE load-balancing (aux) loss, per MoE layer (as megatron-core's).",
    "model.moe_router_fusion": "TE's fused router top-k. Needs Transformer Engine, and is refused together "
                               "with routing replay (the fused path skips megatron's RouterReplay).",
    "parallel.pipeline_model_parallel_size": "Validated and passed to megatron-core, but the trainer has no "
                                             "pipeline schedule: keep 1.",
    "parallel.expert_model_parallel_size": "Experts are split over this many ranks (must divide "
                                           "`model.num_moe_experts`).",
    "parallel.use_distributed_optimizer": "megatron's DistributedOptimizer: gradients reduce-scattered, Adam "
                                          "states sharded over data-parallel ranks. null (default): where it "
                                          "can also reload its checkpoints (CUDA with Transformer Engine's or "
                                          "apex's fused Adam), else the replicated optimizer; `true` where it "
                                          "cannot is refused. One decision for DDP, the RL and the SFT "
                                          "optimizer ([layouts](layouts.md#the-optimizer-layout)).",
    "parallel.seed": "Seed of the initial weights (each drawn from (seed, layout-free parameter name): the "
                     "same numbers under any TP / EP layout) and of Python / numpy / torch at start-up "
                     "(+ 100 x pipeline rank).",
    "train.advantage_estimator": "Group-relative advantage estimator: `grpo` (divide by the group std), "
                                 "`dr_grpo` or its alias `mean_only` (mean-centering only), `maxrl` (MaxRL: divide by "
                                 "the group mean; rewards >= 0).",
    "train.output_dir": "Where rank 0 writes `metrics.jsonl` and `tensorboard/` (created at the first "
                        "logged step), and wandb its files unless `train.wandb_save_dir` says otherwise.",
    "train.log_interval": "Print the progress line every N steps (metrics are logged every step).",
    "train.seed": "Per-step seed: after n completed steps, the next step reseeds Python's, numpy's and torch's "
                  "global RNGs with `seed + n` (+ 100 x pipeline rank), so a resumed run draws what the "
                  "uninterrupted run would have. Rollout sampling does not use it: its noise is keyed by "
                  "`generation.seed`.",
    "train.sft_lr": "Learning rate of the supervised warm start (constant, no weight decay).",
    "train.sft_batch_size": "Prompts per supervised warm-start step.",
    "checkpoint.save": "Checkpoint root to write `iter_XXXXXXX/` directories into (null: never save).",
    "checkpoint.save_interval": "Save every N RL steps (0: only at the end). A run that ends, is preempted "
                                "or stops on non-finite updates also saves when `save` is set.",
    "checkpoint.load": "Initial weights (model only): a torch_dist directory (e.g. from "
                       "`checkpoints_tools.hf_to_megatron`) or a checkpoint root (its newest complete "
                       "`iter_*`). With `resume=true` used only when `save` holds no complete checkpoint.",
    "checkpoint.resume": "Continue from the newest complete checkpoint under `save` (else `load`): model, "
                         "optimizer, LR schedule, data position and step. Without one the run starts fresh "
                         "(from `load`'s weights if set).",
    "checkpoint.keep_last": "Keep only the newest N complete checkpoints (0 keeps all); the newest complete "
                            "one is never deleted.",
    "optimizer.optimizer": "megatron-core optimizer.",
    "optimizer.lr": "Peak learning rate of the RL updates.",
    "optimizer.min_lr": "Floor of the decay schedule.",
    "optimizer.lr_warmup_steps": "Linear warmup, in optimizer steps (each RL step makes "
                                 "`train.num_minibatches` of them).",
    "optimizer.lr_decay_style": "megatron's OptimizerParamScheduler decay style.",
    "optimizer.clip_grad": "Global gradient-norm clip (0 disables).",
    "reward.format_kwargs": "Keyword arguments of the `format` shaping term (e.g. `require: think+boxed`).",
}

# Facts the source comment of a field leaves out or gets wrong, appended to its description.
NOTES: dict[str, str] = {
    "parallel.distributed_timeout_minutes": "megatron's groups get it rounded down, at least 1.",
    "generation.seed": "Sampling noise is a hash of (generation.seed, step, global sample index, position, "
                       "token id), never of the rank: the same samples under any layout, and a resumed run "
                       "draws what the uninterrupted one would have; `train.seed` plays no part in it.",
    "generation.stop_token_ids": "Empty in a training job: the tokenizer's end-of-sequence ids.",
    "generation.pad_token_id": "null in a training job: the tokenizer's pad id.",
}

INTRO = """\
<!-- GENERATED by docs/gen_config_reference.py from the config dataclasses: do not edit by hand.
     Regenerate with `python docs/gen_config_reference.py`; tests/test_docs.py fails when stale. -->

# Configuration reference

A job is one YAML file of typed sections plus `section.key=value` overrides. Every section is a
dataclass (the `megatron_gspo/config/` package: `sections.py`, `model.py`, `rollout.py`, and `job.py`, which
composes them into `JobConfig`) validated when it is built, so a wrong key, type or value stops the job before
anything is initialized, with a `ConfigError` that names the field. Every field declares its type, bounds,
allowed values and resume policy where it is declared (`knob(...)`, `fields.py`), checked by one validator.
Field names follow Megatron-LM's argument names where one exists.

The **Default** column is what a job gets for a key it does not set (`JobConfig()`); the no-argument
demo run starts from `megatron_gspo/configs/demo_gspo.yaml`, which sets a few of them differently
(see [The demo job](#the-demo-job)). **Allowed** lists the values a field with a fixed set accepts.
**Resume** is what resuming a checkpoint does when the key differs from the checkpoint's job
([checkpoints](checkpoints.md)): `may change` and `layout` (the parallel layout) are accepted and logged,
`may change after the warm start` likewise except while the checkpoint is an unfinished warm start, and
`changes the trajectory` is refused by key unless `checkpoint.allow_config_change` names it.

## Loading a job and overriding keys

```bash
python -m megatron_gspo.train                                  # the demo job (configs/demo_gspo.yaml)
python -m megatron_gspo.train job.yaml                         # a YAML job
python -m megatron_gspo.train job.yaml loss.name=grpo train.routing_replay=R2 optimizer.lr=1e-6
python -m megatron_gspo.train job.yaml --train.num_steps 10 --loss.name=gspo_token
```

* The first argument is the YAML file when it does not start with `-` and contains no `=`.
  Without one, the demo job is loaded and the overrides apply to it.
* An override is `section.key=value`, `--section.key=value` or `--section.key value`. The value is
  parsed as YAML: `3`, `1e-6`, `true`, `null`, `[1, 2]`, `{stop: ["\\n"]}`; a list field also takes
  `1,2`. A deeper key reaches into a mapping field: `reward.format_kwargs.require=think+boxed`.
* Unknown keys are refused with a suggestion (`unknown config key train.num_step; did you mean
  ['num_steps']?`), values of the wrong type with the field named (`train.num_steps must be an
  integer, got 'abc'`).
* `model.preset` applies first: its values are the defaults that the other `model.*` keys override,
  so `model.hidden_size=128` alone tweaks the `tiny` model; `model.preset=null` starts from the
  bare field defaults.

Checks across sections (`config/rules.py`, run in order by `JobConfig.__post_init__`), before anything is built:

* first, the `loss` section against its loss's spec (`config/losses.py`), by key: `loss.name`
  names a loss, `loss.clip_ratio_*` do not apply to `loss.name=sapo` (a gate, no clip range),
  `loss.sapo_tau_*` apply to it only, `loss.loss_agg_mode` to `grpo` and `cispo` only, every value within
  its bounds (those that overflow in the training precision after the two checks below);
* `train.prompts_per_step x generation.n_samples_per_prompt` must be divisible by
  `train.num_minibatches`;
* `train.routing_replay` other than `off` needs a loss with per-token ratios, `loss.name` `grpo`, `sapo`,
  `cispo` or `gmpo` (GSPO's sequence ratio needs no routing replay);
* `generation.n_samples_per_prompt >= 2`: every advantage estimator is group-relative (`dr_grpo` and
  `mean_only` subtract the group mean too), so a group of one response has advantage 0;
* `train.sft_steps > 0` needs reference answers: `data.answer_key` set (built-in and reasoning-gym
  tasks always have them);
* `data.task_kwargs` configures a `reasoning_gym:<task>` source only;
* `data.max_prompt_length + generation.max_new_tokens <= model.max_position_embeddings`;
* `reward.overlong_buffer_len <= generation.max_new_tokens`;
* `train.dynamic_sampling=true` needs `generation.n_samples_per_prompt >= 2` and `train.routing_replay`
  `off` or `R2`;
* no greedy sampling, plain or in disguise: `generation.temperature` not 0 nor below 0.01,
  `generation.top_k` not 1, `generation.top_p` above 1 / `model.vocab_size` (identical samples give
  every group zero advantage; and the loss's log-probs at temperature T, log-softmax(logits / T),
  move 1/T times as much as the logits, so below 0.01 one update makes the log-ratios explode);
* `train.overlong_filtering=true` cannot go with `generation.ignore_eos=true` or
  `generation.min_new_tokens >= generation.max_new_tokens` (every response would be truncated and
  filtered out);
* `generation.decode_impl=lean` runs on one pipeline stage under any TP / EP / expert-TP layout,
  without FP8 and without Transformer Engine's fused router top-k (`model.moe_router_fusion`): the rows
  with a config key of `LEAN_DECODE_LIMITS` (`config/rules.py`; `auto` picks lean wherever it can run);
* `rollout.mode=async` needs `train.old_logprobs` `auto` or `recompute`, `rollout_correction.mode`
  `tis`, `mis` or `icepop` when `rollout.max_staleness > 0`, `train.routing_replay` `off` or `R2`, and no dynamic
  sampling;
* `checkpoint.allow_config_change` names sections or `section.key`s of the job.

When the trainer starts: the parallel layout is validated against the world size
(`parallel.validate_layout`, see [troubleshooting](troubleshooting.md#invalid-parallel-layouts)),
then `JobConfig.check_data_parallel` (also run by `launch/pretrain_gspo.sh --dry-run` with
`WORLD_SIZE`): the rollout's rows must split evenly into `train.num_minibatches` x the data-parallel
size and `train.sft_batch_size` must divide by the data-parallel size. The tokenizer's vocabulary must
fit `model.vocab_size`, a chat template must parse, the `math` reward's reference answers are checked
(`reward.max_unreadable_reference_frac`), and a resume compares the job with the checkpoint's
(`checkpoint.allow_config_change`). A minibatch's rows need not be a multiple of
`train.micro_batch_size`: the last micro-batch of each minibatch is simply smaller.
"""


# ----------------------------------------------------------------------------------------------
# Reading the source
# ----------------------------------------------------------------------------------------------


def _class_ast(cls: type) -> tuple[ast.ClassDef, list[str]]:
    lines, _ = inspect.getsourcelines(cls)
    src = textwrap.dedent("".join(lines))
    tree = ast.parse(src)
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef), cls
    return node, src.splitlines()


def _is_heading(block: list[str]) -> bool:
    """A one-line comment of one or two words without punctuation ('# MoE') labels a group of
    fields; it documents none of them."""
    return len(block) == 1 and len(block[0].split()) <= 2 and not re.search(r"[.:;,()=]", block[0])


def field_comments(cls: type) -> dict[str, str]:
    """{field: text of the '#' comment lines directly above it in the class body}."""
    node, lines = _class_ast(cls)
    out: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        block: list[str] = []
        i = stmt.lineno - 2  # 0-based index of the line above
        while i >= 0 and lines[i].strip().startswith("#"):
            block.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        if block and not _is_heading(block):
            out[stmt.target.id] = " ".join(block)
    return out


_ENTRY = re.compile(r"^([A-Za-z_*][\w*]*(?:\s*/\s*[A-Za-z_*][\w*]*)*)(?:\s*\(([^)]*)\))?:\s+(.*)$")


def docstring_fields(cls: type, names: list[str]) -> tuple[str, dict[str, str]]:
    """(summary, {field: text}) from a class docstring whose entries read ``name: text`` (``a / b:``
    for several fields, ``prefix_*:`` for a family, ``name (qualifier):``), continued on indented
    lines."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    summary: list[str] = []
    entries: list[tuple[list[str], str]] = []
    for line in doc.splitlines():
        m = _ENTRY.match(line)
        if m and all(any(fnmatch.fnmatchcase(n, p.strip()) for n in names) for p in m.group(1).split("/")):
            text = m.group(3)
            if m.group(2):
                text = f"({m.group(2)}) {text}"
            entries.append(([p.strip() for p in m.group(1).split("/")], text))
        elif entries and line.startswith((" ", "\t")):
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
        elif not entries:
            summary.append(line.strip())
    out: dict[str, str] = {}
    for patterns, text in entries:
        text = re.sub(r":(?:mod|class|func|meth|attr):`", "`", text)  # Sphinx roles -> plain code
        text = text[:1].upper() + text[1:]
        for n in names:
            if any(fnmatch.fnmatchcase(n, p) for p in patterns):
                out.setdefault(n, text)
    return " ".join(s for s in summary if s), out


def field_choices(cls: type) -> dict[str, list]:
    """{field: allowed values}: the ``choices`` its ``knob(...)`` declares (config/fields.py)."""
    from megatron_gspo.config.fields import knob_of

    return {f.name: list(knob_of(f).choices) for f in dataclasses.fields(cls)
            if knob_of(f) is not None and knob_of(f).choices is not None}


def field_resume(f: dataclasses.Field) -> str:
    """The field's resume policy in words (config.Resume, read by checkpoint/config_change.py)."""
    from megatron_gspo.config.fields import knob_of

    k = knob_of(f)
    return k.resume.value if k is not None else ""


def _type_str(f: dataclasses.Field) -> str:
    t = f.type
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def render_value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else '""'
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    return str(v)


def _cell(text: str) -> str:
    text = text.replace("``", "`").replace("|", "\\|")
    return re.sub(r"\s+", " ", text).strip()


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


def sections():
    """[(section name, dataclass)] in JobConfig's order."""
    from megatron_gspo.config import JobConfig

    hints = typing.get_type_hints(JobConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(JobConfig)]


def section_table(name: str, cls: type, instance) -> tuple[str, list[str]]:
    summary, _ = docstring_fields(cls, [f.name for f in dataclasses.fields(cls)])
    choices = field_choices(cls)
    if name == "loss":  # the registry's, not a knob's: a plug-in names itself (package.module:function)
        from megatron_gspo.config.losses import LOSS_SPECS

        choices["name"] = [*LOSS_SPECS, "package.module:function"]
    rows = ["| Key | Type | Default | Allowed | Resume | Description |", "|---|---|---|---|---|---|"]
    missing = _rows(name, cls, instance, rows, choices)
    where = cls.__module__.replace(".", "/") + ".py"  # the same wherever the package is installed
    head = [f"## `{name}`", "", f"`{cls.__name__}` ({where}). {_cell(summary)}", ""]
    return "\n".join(head + rows) + "\n", missing


def _rows(name: str, cls: type, instance, rows: list[str], choices: dict) -> list[str]:
    """Append the table rows of ``cls``'s fields to ``rows`` (a sub-section's, ``rollout.vllm``, as
    ``rollout.vllm.<key>`` rows in place of its field); returns the undocumented keys."""
    _, doc_entries = docstring_fields(cls, [f.name for f in dataclasses.fields(cls)])
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    missing = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            sub = hints[f.name]
            missing += _rows(f"{name}.{f.name}", sub, getattr(instance, f.name), rows, field_choices(sub))
            continue
        desc = comments.get(f.name) or doc_entries.get(f.name) or SUPPLEMENT.get(f"{name}.{f.name}", "")
        if not desc:
            missing.append(f"{name}.{f.name}")
        if f"{name}.{f.name}" in NOTES:
            desc += f" **Note:** {NOTES[f'{name}.{f.name}']}"
        allowed = ", ".join(f"`{render_value(v)}`" for v in choices.get(f.name, []))
        rows.append(f"| `{name}.{f.name}` | `{_cell(_type_str(f))}` | `{_cell(render_value(getattr(instance, f.name)))}` "
                    f"| {allowed} | {field_resume(f)} | {_cell(desc)} |")
    return missing


def presets_table() -> str:
    from megatron_gspo.config import MODEL_PRESETS, model_config_from_preset

    names = list(MODEL_PRESETS)
    keys: list[str] = []
    for p in MODEL_PRESETS.values():
        keys += [k for k in p if k not in keys]
    cfgs = {n: model_config_from_preset(n) for n in names}
    rows = ["| Key | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
    for k in keys:
        rows.append(f"| `model.{k}` | " + " | ".join(f"`{render_value(getattr(cfgs[n], k))}`" for n in names) + " |")

    def count(n: float) -> str:
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if n >= scale:
                return f"{n / scale:.2f}{unit}"
        return str(n)

    rows.append("| parameters (total / active) | " + " | ".join(
        f"{count(cfgs[n].num_parameters())} / {count(cfgs[n].num_parameters(active=True))}" for n in names) + " |")
    text = ["## Model presets", "",
            "`model.preset` selects one of `MODEL_PRESETS` (megatron_gspo/config/model.py); keys the preset does not "
            "set keep the field defaults above, and every key can still be overridden. A model can also be "
            "described by a Hugging Face Qwen3-MoE `config.json` (`config.model_config_from_hf`, used by "
            "`checkpoints_tools.hf_to_megatron`, which writes the implied `model_config.yaml` next to the "
            "converted weights).", ""]
    return "\n".join(text + rows) + "\n"


def losses_table() -> str:
    """Each built-in loss's spec (config/losses.py): what it reads of the loss section."""
    from megatron_gspo.config.loss_spec import CONFIGURABLE
    from megatron_gspo.config.losses import loss_spec, losses_where

    rows = ["| `loss.name` | Ratio | Clip range (default, units) | Aggregation | Its own keys |", "|---|---|---|---|---|"]
    for name in losses_where(lambda spec: True):
        spec = loss_spec(name)
        clip = "none" if spec.clip is None else f"{spec.clip[0]:g} / {spec.clip[1]:g}, {spec.units.name}"
        agg = "`loss.loss_agg_mode`" if spec.aggregation == CONFIGURABLE else spec.aggregation
        own = ", ".join(f"`loss.{s.key}`" for s in spec.settings)
        rows.append(f"| `{name}` | {spec.ratio} | {clip} | {agg} | {own} |")
    text = ["## Losses", "",
            "What each loss reads of the `loss` section, from its spec (megatron_gspo/config/losses.py; its formula "
            "is the function of the same name in algorithms/losses.py; [algorithms](algorithms.md#a-loss-is-one-spec) "
            "says how to add one). Every loss takes `loss.log_ratio_bound`, `loss.kl_coef` and `loss.entropy_coef`; a key a loss does "
            "not read is refused by name. Per-token ratios are the ones `train.routing_replay` applies to. The "
            "bounds that depend on the training precision (`model.precision`) are checked when the job is loaded: "
            "a token's largest gradient weight, e^`log_ratio_bound` x max(1, `kl_coef`) / `loss_agg_norm_constant`, "
            "squared by Adam and the gradient norm, must stay finite (at most 1.84e19 in fp32 and bf16), and SAPO's "
            "temperatures lie in [1.22e-4, 1.84e19] (fp32, the loss's arithmetic in every precision).", ""]
    return "\n".join(text + rows) + "\n"


def demo_table() -> str:
    from megatron_gspo.config import load_yaml
    from megatron_gspo.train import DEMO_CONFIG

    data = load_yaml(DEMO_CONFIG)
    rows = ["| Key | Demo value |", "|---|---|"]
    for section, values in data.items():
        for key, value in (values or {}).items():
            rows.append(f"| `{section}.{key}` | `{render_value(value)}` |")
    text = ["## The demo job", "",
            f"`python -m megatron_gspo.train` without a YAML file loads `megatron_gspo/configs/{os.path.basename(DEMO_CONFIG)}` "
            "(GSPO on the `tiny` preset and the built-in 1-digit addition task); "
            "`launch/recipes/tiny_cpu.yaml` is the same job for the launch script. It sets:", ""]
    return "\n".join(text + rows) + "\n"


def render() -> str:
    from megatron_gspo.config import JobConfig

    job = JobConfig()
    for key in (*SUPPLEMENT, *NOTES):
        sec, _, fld = key.partition(".")
        if not hasattr(job, sec) or fld not in {f.name for f in dataclasses.fields(getattr(job, sec))}:
            raise KeyError(f"SUPPLEMENT names {key!r}, which is not a JobConfig field")
    parts = [INTRO]
    toc = ["Sections: " + ", ".join(f"[`{n}`](#{n})" for n, _ in sections())
           + ", [model presets](#model-presets), [losses](#losses), [the demo job](#the-demo-job).", ""]
    parts.append("\n".join(toc))
    undocumented: list[str] = []
    for name, cls in sections():
        table, missing = section_table(name, cls, getattr(job, name))
        parts.append(table)
        undocumented += missing
    parts.append(presets_table())
    parts.append(losses_table())
    parts.append(demo_table())
    if undocumented:  # not an error: a new field still gets its row; describe it in the source
        print(f"note: fields without a description: {undocumented}", file=sys.stderr)
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        with open(OUTPUT, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{os.path.relpath(OUTPUT)} is stale: run python docs/gen_config_reference.py", file=sys.stderr)
                return 1
        return 0
    with open(OUTPUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(OUTPUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
