"""Config loading, presets, parameter-count formulas, and every invalid layout/config error."""

import json
import re

import pytest
import torch

from megatron_gspo.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    apply_overrides,
    from_dict,
    load_yaml,
    model_config_from_hf,
    model_config_from_preset,
    parse_overrides,
)
from megatron_gspo import config
from megatron_gspo.runtime.parallel import validate_layout


def test_qwen3_30b_a3b_parameter_count():
    cfg = model_config_from_preset("qwen3-30b-a3b")
    assert cfg.kv_channels == 128 and cfg.hidden_size // cfg.num_attention_heads == 64
    h, L, E, k, f, V = 2048, 48, 128, 8, 768, 151936
    attn = h * 32 * 128 + 2 * h * 4 * 128 + 32 * 128 * h
    per_layer = attn + 2 * h + 2 * 128 + E * h + E * 3 * h * f
    total = L * per_layer + 2 * V * h + h
    assert cfg.num_parameters() == total
    active = L * (attn + 2 * h + 2 * 128 + E * h + k * 3 * h * f) + 2 * V * h + h
    assert cfg.num_parameters(active=True) == active
    # the published sizes: 30.5B total, 3.3B activated
    assert 30.3e9 < total < 30.7e9, total
    assert 3.2e9 < active < 3.45e9, active


def test_proxy_preset_is_single_gpu_sized():
    cfg = model_config_from_preset("qwen3-moe-2b-proxy")
    assert 1.0e9 <= cfg.num_parameters() <= 2.2e9
    assert cfg.hidden_size == 2048 and cfg.moe_ffn_hidden_size == 768  # same per-layer shape


def test_tiny_preset_matches_built_model(single_rank):
    from megatron_gspo.model.gpt import build_model

    cfg = model_config_from_preset("tiny", vocab_size=100)  # padded to 128 in the model
    par = ParallelConfig(device="cpu")
    st = single_rank(cfg, par)
    model = build_model(cfg, par, st)
    n = sum(p.numel() for p in model.parameters())
    padding = 2 * (cfg.padded_vocab_size - cfg.vocab_size) * cfg.hidden_size
    assert n == cfg.num_parameters() + padding


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  preset: tiny\n  num_layers: 3\nparallel:\n  tensor_model_parallel_size: 2\n")
    data = apply_overrides(load_yaml(p), parse_overrides(["model.hidden_size=128", "--parallel.seed", "7",
                                                          "--model.qk_layernorm=false"]))
    m = from_dict(ModelConfig, data["model"], "model")
    par = from_dict(ParallelConfig, data["parallel"], "parallel")
    assert (m.num_layers, m.hidden_size, m.num_moe_experts, m.qk_layernorm) == (3, 128, 4, False)
    assert par.tensor_model_parallel_size == 2 and par.seed == 7 and par.sp is True


@pytest.mark.parametrize(
    "data, match",
    [
        ({"num_layrs": 2}, r"unknown config key model\.num_layrs; did you mean \['num_layers'"),
        ({"hidden_size": "big"}, r"model\.hidden_size must be an integer, got 'big'"),
        ({"num_attention_heads": 6, "num_query_groups": 4}, r"num_attention_heads=6 must be a multiple of model\.num_query_groups=4"),
        ({"moe_router_topk": 8}, r"moe_router_topk=8 exceeds model\.num_moe_experts=4"),
        ({"preset": "qwen9"}, r"model\.preset='qwen9' is unknown"),
        ({"precision": "fp16"}, r"model\.precision='fp16' is not one of"),
        ({"fp8": "e4m3"}, r"model\.fp8='e4m3' needs model\.precision='bf16'"),
        ({"qk_layernorm": "maybe"}, r"model\.qk_layernorm must be a boolean"),
    ],
)
def test_bad_model_config(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(ModelConfig, {"preset": "tiny", **data}, "model")


def test_bad_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_yaml(tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML"):
        load_yaml(p)
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_overrides(["model"])
    with pytest.raises(ConfigError, match=r"an override needs key=value: 'model\.num_layers' has no value"):
        parse_overrides(["model.num_layers"])


def test_yaml_section_or_key_given_twice_is_refused_by_file_line_and_key(tmp_path):
    """YAML keeps the last of two equal keys silently: a job file that sets one twice is refused by name."""
    p = tmp_path / "twice.yaml"
    p.write_text("train:\n  num_steps: 3\nloss:\n  name: grpo\ntrain:\n  num_steps: 5\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml:5: section 'train' is given twice \(first at line 1\)"):
        load_yaml(p)
    p.write_text("loss:\n  name: grpo\n  clip_ratio_high: 0.28\n  name: gspo\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml:4: key loss\.name is given twice \(first at line 2\)"):
        load_yaml(p)
    p.write_text("data:\n  task_kwargs:\n    max_digits: 3\n    max_digits: 4\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml:4: key data\.task_kwargs\.max_digits is given twice"):
        load_yaml(p)
    p.write_text("base: &b\n  num_steps: 3\ntrain:\n  <<: *b\n  num_steps: 4\n")  # a merge key is no repeat
    assert load_yaml(p)["train"] == {"num_steps": 4}


def test_empty_job_file_is_refused(tmp_path):
    for text in ("", "# only a comment\n", "---\n"):
        p = tmp_path / "empty.yaml"
        p.write_text(text)
        with pytest.raises(ConfigError, match=r"empty\.yaml: empty job file"):
            config.load_job_config(str(p))


def test_a_null_section_is_blamed_on_the_yaml_not_on_an_override(tmp_path):
    p = tmp_path / "null.yaml"
    p.write_text("loss:\n  name: gspo\ntrain: null\n")
    for overrides in ([], ["train.num_steps=3"]):
        with pytest.raises(ConfigError, match=r"null\.yaml:3: train: null") as e:
            config.load_job_config(str(p), overrides)
        assert "override" not in str(e.value)


TINY = dict(num_attention_heads=4, num_query_groups=2, num_moe_experts=4, moe_ffn_hidden_size=32)


@pytest.mark.parametrize(
    "model_kw, par_kw, world, match",
    [
        ({}, dict(tensor_model_parallel_size=3), 3, r"num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"),
        (dict(num_attention_heads=8, num_query_groups=2), dict(tensor_model_parallel_size=4), 4, r"num_query_groups=2 \(KV heads\) is not divisible by tensor_model_parallel_size=4"),
        ({}, dict(expert_model_parallel_size=3), 3, r"num_moe_experts=4 is not divisible by expert_model_parallel_size=3"),
        ({}, dict(tensor_model_parallel_size=2), 3, r"world size 3 is not a multiple of tensor_model_parallel_size x pipeline_model_parallel_size = 2 x 1 = 2"),
        ({}, dict(expert_model_parallel_size=4), 2, r"world size 2 is not a multiple of expert_tensor_parallel_size x expert_model_parallel_size"),
        ({}, dict(tensor_model_parallel_size=2, sequence_parallel=False), 2, r"MoE with tensor_model_parallel_size=2 requires sequence_parallel=true"),
        ({}, dict(sequence_parallel=True), 1, r"sequence_parallel=true needs tensor_model_parallel_size > 1"),
        (dict(num_layers=3), dict(pipeline_model_parallel_size=2), 2, r"num_layers=3 is not divisible by pipeline_model_parallel_size=2"),
        (dict(moe_ffn_hidden_size=30), dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=4), 4, r"moe_ffn_hidden_size=30 is not divisible by expert_tensor_parallel_size=4"),
        (dict(vocab_size=70, make_vocab_size_divisible_by=25, num_query_groups=4), dict(tensor_model_parallel_size=4), 4, r"padded vocab size 75 .* not divisible by tensor_model_parallel_size=4"),
    ],
)
def test_invalid_layouts(model_kw, par_kw, world, match):
    m = model_config_from_preset("tiny", **{**TINY, **model_kw})
    with pytest.raises(ConfigError, match=match):
        validate_layout(m, ParallelConfig(**par_kw), world)


def test_layout_error_comes_before_any_distributed_setup(monkeypatch):
    """initialize() refuses a bad layout from WORLD_SIZE alone: no process group is created."""
    import torch.distributed as dist

    from megatron_gspo.runtime import parallel

    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = model_config_from_preset("tiny")
    with pytest.raises(ConfigError, match="not divisible by tensor_model_parallel_size=3"):
        parallel.initialize(cfg, ParallelConfig(device="cpu", tensor_model_parallel_size=3))
    assert not dist.is_initialized()


def test_one_optimizer_layout_decided_in_one_place(monkeypatch):
    """parallel.use_distributed_optimizer: unset = where megatron's DistributedOptimizer can also reload
    its checkpoints (a CUDA job with TE's/apex's fused Adam), else replicated; true where it cannot is
    refused with the field named, before any process group exists. Decided from the job's device, so
    the expectations hold on any machine."""
    import torch
    import torch.distributed as dist
    from megatron.core.optimizer import distrib_optimizer

    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import load_job_config

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert load_job_config(None, []).parallel.use_distributed_optimizer is None
    assert "runs on the CPU" in parallel.distributed_optimizer_support(cpu)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    assert "neither Transformer Engine nor apex" in parallel.distributed_optimizer_support(cuda)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    assert parallel.distributed_optimizer_support(cuda) is None
    assert parallel.resolve_distributed_optimizer(ParallelConfig(), cpu) is False
    assert parallel.resolve_distributed_optimizer(ParallelConfig(use_distributed_optimizer=False), cpu) is False
    assert parallel.resolve_distributed_optimizer(ParallelConfig(), cuda) is True  # supported: unset = distributed
    assert parallel.resolve_distributed_optimizer(ParallelConfig(use_distributed_optimizer=False), cuda) is False
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"parallel.use_distributed_optimizer=true is not possible here: the job "
                                          r"runs on the CPU"):
        parallel.initialize(model_config_from_preset("tiny"), ParallelConfig(use_distributed_optimizer=True, device="cpu"))
    assert not dist.is_initialized()


def test_hf_config(tmp_path):
    hf = dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
              num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
              num_experts_per_tok=8, moe_intermediate_size=768, rope_theta=1000000.0,
              rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=6144)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = model_config_from_hf(tmp_path)
    ref = model_config_from_preset("qwen3-30b-a3b")
    for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "vocab_size", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "rotary_base",
              "norm_epsilon", "untie_embeddings_and_output_weights"):
        assert getattr(cfg, k) == getattr(ref, k), k
    with pytest.raises(ConfigError, match="model_type='llama'"):
        model_config_from_hf({**hf, "model_type": "llama"})
    with pytest.raises(ConfigError, match="dense layers"):
        model_config_from_hf({**hf, "mlp_only_layers": [0]})
    with pytest.raises(ConfigError, match=r"lacks keys \['num_experts'\]"):
        model_config_from_hf({k: v for k, v in hf.items() if k != "num_experts"})


def test_hf_router_normalization_and_expert_key_spellings():
    hf = dict(model_type="qwen3_moe", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=100, num_local_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32)
    # transformers 5 writes num_local_experts; a missing norm_topk_prob means false there:
    # softmax over all experts, top-k kept un-renormalized = megatron's pre_softmax=True
    cfg = model_config_from_hf(hf)
    assert cfg.num_moe_experts == 4 and cfg.moe_router_pre_softmax is True
    assert model_config_from_hf({**hf, "norm_topk_prob": True}).moe_router_pre_softmax is False


def test_config_names_match_the_registries():
    """The config validates names without importing the subsystems; each registry offers exactly them. (The loss
    section reads the loss specs instead: tests/test_loss_specs.py.)"""
    from megatron_gspo.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from megatron_gspo.algorithms.rollout_correction import CORRECTIONS
    from megatron_gspo.config.sections import ROLLOUT_CORRECTION_MODES
    from megatron_gspo.data.tokenizer import build_tokenizer  # noqa: F401 (TOKENIZER_TYPES is its dispatch)

    assert tuple(ADVANTAGE_ESTIMATORS) == config.ADVANTAGE_ESTIMATOR_NAMES
    assert ("off", *CORRECTIONS) == ROLLOUT_CORRECTION_MODES


# ----------------------------------------------------------------------------------------------
# Combinations that cannot work are refused by key at load time
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, match", [
    (["model.moe_router_fusion=true"], r"fused router top-k \(model\.moe_router_fusion=true\)"),
    (["model.fp8=e4m3", "model.precision=bf16"], r"does not support FP8 \(model\.fp8="),
])
def test_lean_decode_on_a_layout_it_cannot_run_is_refused(overrides, match):
    from megatron_gspo.config import load_job_config

    with pytest.raises(ConfigError, match=match):
        load_job_config(None, ["generation.decode_impl=lean"] + overrides)
    load_job_config(None, ["generation.decode_impl=auto"] + overrides)  # auto picks megatron's path there
    load_job_config(None, ["generation.decode_impl=lean"])
    # the Transformer Engine spec is decoded by the lean path too (its weights read as they are)
    load_job_config(None, ["generation.decode_impl=lean", "model.transformer_impl=transformer_engine"])


@pytest.mark.parametrize("layout", [
    ["parallel.tensor_model_parallel_size=2"], ["parallel.expert_model_parallel_size=2"],
    ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2"],
    ["parallel.expert_tensor_parallel_size=2"],
    ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=8",
     "parallel.expert_tensor_parallel_size=1"],
], ids=["tp2", "ep2", "tp2-ep2", "etp2", "tp2-ep8-etp1"])
def test_lean_decode_runs_under_tensor_and_expert_parallelism(layout):
    """generation.decode_impl=lean decodes over TP / EP / expert-TP shards (sequence parallelism, which TP
    needs for training, is not used while decoding): no refusal at load (tests/test_decode.py runs them)."""
    from megatron_gspo.config import load_job_config

    job = load_job_config(None, ["generation.decode_impl=lean"] + layout)
    assert job.generation.decode_impl == "lean"


# A value each LEAN_DECODE_LIMITS row refuses, on a built model's TransformerConfig
_LEAN_BAD = {"pipeline_model_parallel_size": 2, "context_parallel_size": 2,
             "rotary_interleaved": True, "multi_latent_attention": True, "attention_output_gate": True,
             "apply_residual_connection_post_layernorm": True, "fp32_residual_connection": True, "fp8": "e4m3",
             "window_size": (16, 0), "softmax_type": "learnable", "apply_query_key_layer_scaling": True,
             "moe_router_fusion": True, "normalization": "LayerNorm"}


def test_the_lean_decoders_limits_are_one_table_read_by_the_config_and_the_model_check():
    """config.rules.LEAN_DECODE_LIMITS: every row with a TransformerConfig attribute names a real one of
    megatron-core's (a renamed attribute would read as None, i.e. supported) and is what
    lean_decoder.lean_decode_unsupported reports; every row with a config key is refused by key for decode_impl=lean."""
    import types

    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_gspo.config import LEAN_DECODE_LIMITS, lean_decode_limit, load_job_config

    tc = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm")
    attrs = {row.model_attr for row in LEAN_DECODE_LIMITS} - {None}
    assert attrs <= set(vars(tc)) and attrs == set(_LEAN_BAD)
    assert lean_decode_limit(tc) is None
    for row in LEAN_DECODE_LIMITS:
        if row.model_attr is not None:
            broken = types.SimpleNamespace(**{**vars(tc), row.model_attr: _LEAN_BAD[row.model_attr]})
            assert lean_decode_limit(broken) == row.reason.format(value=_LEAN_BAD[row.model_attr]), row
    bad_overrides = {"parallel.pipeline_model_parallel_size": None,  # refused for the RL loop before (PP=1)
                     "model.fp8": ["model.fp8=e4m3", "model.precision=bf16"],
                     "model.moe_router_fusion": ["model.moe_router_fusion=true"]}
    assert {row.config_key for row in LEAN_DECODE_LIMITS} - {None} == set(bad_overrides)
    for key, overrides in bad_overrides.items():
        if overrides is None:
            continue
        with pytest.raises(ConfigError, match=rf"generation\.decode_impl=lean .*{re.escape(key)}="):
            load_job_config(None, ["generation.decode_impl=lean"] + overrides)
        load_job_config(None, ["generation.decode_impl=auto"] + overrides)


def test_greedy_rollouts_with_several_samples_are_refused():
    from megatron_gspo.config import load_job_config

    with pytest.raises(ConfigError, match=r"generation\.temperature=0 \(greedy\) with generation\.n_samples_per_prompt=4: "
                                          r"every sample of a prompt would be the same response"):
        load_job_config(None, ["generation.temperature=0"])
    # one sample per prompt is no way out: every estimator is group-relative
    with pytest.raises(ConfigError, match=r"generation\.n_samples_per_prompt must be >= 2"):
        load_job_config(None, ["generation.temperature=0", "generation.n_samples_per_prompt=1",
                               "train.advantage_estimator=mean_only", "train.num_minibatches=1"])


@pytest.mark.parametrize("overrides, match", [
    # a group of one: r - mean(r) = 0 with every estimator, not only grpo's std-normalized one
    (["generation.n_samples_per_prompt=1", "train.advantage_estimator=dr_grpo", "train.num_minibatches=1"],
     r"generation\.n_samples_per_prompt must be >= 2 for group-relative advantages, got 1: with "
     r"train\.advantage_estimator=dr_grpo a group of one response has advantage r - mean\(r\) = 0"),
    (["generation.n_samples_per_prompt=1", "train.advantage_estimator=mean_only", "train.num_minibatches=1",
      "loss.name=grpo", "loss.kl_coef=0.1"], r"train\.advantage_estimator=mean_only a group of one"),
    # greedy in all but name: a temperature near 0, top-k 1, a nucleus no second token can enter
    (["generation.temperature=1e-8"], r"generation\.temperature=1e-08 is below 0\.01: sampling at it is greedy in "
                                      r"all but name .* move 1e\+08 times as much as the logits"),
    (["generation.temperature=0.009"], r"generation\.temperature=0\.009 is below 0\.01"),
    (["generation.top_k=1", "generation.n_samples_per_prompt=8"],
     r"generation\.top_k=1 with generation\.n_samples_per_prompt=8: only the most likely token can be drawn"),
    (["generation.top_p=0.005"], r"generation\.top_p=0\.005 <= 1 / model\.vocab_size: the most likely token alone"),
    (["eval.temperature=1e-8"], r"eval\.temperature=1e-08 is below 0\.01: the pass@k samples would all be the "
                                r"greedy response"),
])
def test_sampling_that_gives_every_group_zero_advantage_is_refused(overrides, match):
    from megatron_gspo.config import load_job_config

    with pytest.raises(ConfigError, match=match):
        load_job_config(None, overrides)


def test_sampling_at_the_edges_of_the_refused_ranges_is_accepted():
    from megatron_gspo.config import load_job_config

    load_job_config(None, ["generation.temperature=0.01", "eval.temperature=0.01"])
    load_job_config(None, ["generation.top_k=2", "generation.top_p=0.01"])  # 0.01 > 1/128 (tiny vocabulary)
    load_job_config(None, ["eval.temperature=1e-8", "eval.num_samples=0"])  # greedy accuracy only: no samples


@pytest.mark.parametrize("dp, overrides, match", [
    (3, [], r"= 64 rollout rows are not divisible by train\.num_minibatches x the data-parallel size = 2 x 3"),
    (4, ["train.sft_steps=1", "train.sft_batch_size=6", "train.num_minibatches=1"],
     r"train\.sft_batch_size=6 is not divisible by the data-parallel size 4"),
])
def test_data_parallel_checks(dp, overrides, match):
    from megatron_gspo.config import load_job_config

    cfg = load_job_config(None, overrides)
    cfg.check_data_parallel(1)
    with pytest.raises(ConfigError, match=match):
        cfg.check_data_parallel(dp)


def test_prompts_per_step_need_not_divide_by_the_data_parallel_size_as_the_docs_say():
    """Issue 47: the reference said train.prompts_per_step must divide by the data-parallel size; the rule
    (JobConfig.check_data_parallel) is on the rollout's rows, split over minibatches and ranks."""
    import os

    from megatron_gspo.config import load_job_config

    cfg = load_job_config(None, ["train.prompts_per_step=3", "generation.n_samples_per_prompt=4",
                                 "train.num_minibatches=2"])
    cfg.check_data_parallel(2)  # 3 prompts, 12 rows: 6 per minibatch, 3 on each of 2 ranks
    with pytest.raises(ConfigError, match="12 rollout rows are not divisible by train.num_minibatches x the "
                                          "data-parallel size = 2 x 4"):
        cfg.check_data_parallel(4)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    row = next(ln for ln in open(os.path.join(root, "docs", "configuration.md")) if ln.startswith("| `train.prompts_per_step`"))
    assert "divisible by the data-parallel size" not in row, row
    assert "`train.num_minibatches` x the data-parallel size" in row, row


def test_dynamic_sampling_is_accepted_at_any_data_parallel_size():
    """The kept groups are decided over the whole batch and move to the ranks they are dealt to
    (rollout/exchange.py): no data-parallel limit left."""
    from megatron_gspo.config import load_job_config

    cfg = load_job_config(None, ["train.dynamic_sampling=true"])
    for dp in (1, 2, 4, 8):
        cfg.check_data_parallel(dp)


def test_an_option_that_is_not_a_setting_is_named():
    with pytest.raises(ConfigError, match=r"^unknown option --frobnicate; settings are section\.key=value"):
        parse_overrides(["--frobnicate"])
    with pytest.raises(ConfigError, match=r"^unknown option --frobnicate"):
        parse_overrides(["--frobnicate", "--train.num_steps", "3"])
    assert parse_overrides(["--train.num_steps", "3"]) == [("train.num_steps", "3")]


@pytest.mark.parametrize("args", [["train.num_step=3"], ["train.dynamic_sampling_max_rounds=-1"]])
def test_a_config_error_is_the_last_line_printed(args):
    """Nothing (megatron's import-time notices included) follows the one-line error of a refused config."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = root
    p = subprocess.run([sys.executable, "-m", "megatron_gspo.train", *args], capture_output=True, text=True,
                       cwd=root, env=env, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), lines
    assert len(lines) == 1, lines


@pytest.mark.parametrize("override", ["model.transformer_impl=transformer_engine", "model.precision=bf16 model.fp8=e4m3"])
def test_transformer_engine_choices_on_the_cpu_device_are_refused_at_load(override):
    """Transformer Engine runs on a GPU only: a job asking for it with parallel.device=cpu is refused when its
    config loads (by key), not when every rank builds the model."""
    from megatron_gspo.config import load_job_config

    key = override.split()[-1].split("=")[0]
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}=.* needs Transformer Engine's CUDA kernels, but "
                                          r"parallel\.device='cpu'"):
        load_job_config(None, ["parallel.device=cpu", *override.split()])
    load_job_config(None, ["parallel.device=cpu", "model.transformer_impl=local"])


def test_a_te_request_the_job_cannot_run_names_the_reason(monkeypatch):
    """model.transformer_impl=transformer_engine where it cannot run: the reason is TE's own (compat.te_status)
    or the device, never a bare boolean."""
    from megatron_gspo.runtime import compat
    from megatron_gspo.model.gpt import resolve_impl

    cfg = model_config_from_preset("tiny", transformer_impl="transformer_engine")
    monkeypatch.setattr(compat, "te_status", lambda: (False, "`import transformer_engine.pytorch` failed: OSError: libcudnn.so.9"))
    monkeypatch.setattr("megatron_gspo.model.gpt.te_status", compat.te_status)
    with pytest.raises(ConfigError, match=r"cannot run here: `import transformer_engine\.pytorch` failed: OSError: libcudnn"):
        resolve_impl(cfg, torch.device("cuda", 0))
    monkeypatch.setattr("megatron_gspo.model.gpt.te_status", lambda: (True, "TE 2.20.2 imports"))
    with pytest.raises(ConfigError, match=r"the job runs on cpu and Transformer Engine's kernels need a CUDA device"):
        resolve_impl(cfg, torch.device("cpu"))
    assert resolve_impl(cfg, torch.device("cuda", 0)) == "transformer_engine"


@pytest.mark.parametrize("precision, device, bf16, want", [
    ("auto", "cpu", True, "fp32"),  # the CPU default job keeps its numbers
    ("auto", "cuda", True, "bf16"),  # TE's kernels and torch._grouped_mm experts run bf16 on a GPU
    ("auto", "cuda", False, "fp32"),  # a GPU without bf16
    ("fp32", "cuda", True, "fp32"), ("bf16", "cpu", True, "bf16"),  # an explicit choice is kept
])
def test_precision_auto_is_fp32_on_the_cpu_and_bf16_on_a_gpu(precision, device, bf16, want):
    from megatron_gspo.config import resolve_precision

    got, why = resolve_precision(precision, device, bf16)
    assert got == want and why
    assert why.startswith("auto:") == (precision == "auto")


def test_the_default_job_is_fp32_on_the_cpu_and_bf16_on_a_gpu():
    """The README's default job (no YAML: the demo on the tiny preset) asks for "auto" precision: its CPU
    numbers stay fp32, a GPU runs bf16 (not fp32 there, not the per-expert loop on a GPU without TE, not the
    TE spec in fp32 in the container)."""
    from megatron_gspo.config import load_job_config, resolve_precision

    m = load_job_config(None, []).model
    assert m.precision == "auto" and model_config_from_preset("tiny").precision == "auto"
    assert resolve_precision(m.precision, "cpu", True)[0] == "fp32"
    assert resolve_precision(m.precision, "cuda", True)[0] == "bf16"
    # the 30B recipes keep their explicit bf16; the memory estimate of an "auto" job is that of bf16 (per GPU)
    assert model_config_from_preset("qwen3-30b-a3b").precision == "bf16"


# ----------------------------------------------------------------------------------------------
# One validator (config/fields.py): every field's annotated type and declared bounds, for a section built
# in code as for one loaded from YAML
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("section, kwargs, match", [
    ("TrainConfig", dict(num_steps=True), r"train\.num_steps must be an integer >= 1, got True"),
    ("ParallelConfig", dict(tensor_model_parallel_size=True),
     r"parallel\.tensor_model_parallel_size must be an integer >= 1, got True"),
    ("ParallelConfig", dict(sequence_parallel=1), r"parallel\.sequence_parallel must be true or false or null, got 1"),
    ("ModelConfig", dict(num_layers=True), r"model\.num_layers must be a positive integer, got True"),
    ("GenerationConfig", dict(cuda_graphs=1), r"generation\.cuda_graphs must be true or false, got 1"),
    ("GenerationConfig", dict(stop_token_ids=[1, True]), r"generation\.stop_token_ids must be a list of integers >= 0"),
    ("OptimizerConfig", dict(clip_grad=float("nan")),
     r"optimizer\.clip_grad must be a finite number >= 0 \(0 disables\), got nan"),
    ("TrainConfig", dict(sft_lr="1e-3"), r"train\.sft_lr must be a finite number, got '1e-3'"),
    ("TrainConfig", dict(max_tokens_per_micro_batch=0), r"train\.max_tokens_per_micro_batch must be a positive "
                                                        r"integer or null, got 0"),
    ("RewardConfig", dict(kwargs=[]), r"reward\.kwargs must be a mapping, got \[\]"),
    ("RolloutCorrectionConfig", dict(threshold_low=1.0), r"rollout_correction\.threshold_low must be in \[0, 1\) or null"),
    ("TrainConfig", dict(old_logprobs="sometimes"), r"train\.old_logprobs='sometimes' is not one of \['auto', "),
])
def test_every_field_is_checked_against_its_type_and_bounds(section, kwargs, match):
    """bool is never an int, a number is finite, Optional takes null, a list's items and a mapping are checked."""
    with pytest.raises(ConfigError, match=match):
        getattr(config, section)(**kwargs)


def test_the_validator_accepts_what_the_annotations_allow():
    assert config.ParallelConfig(expert_tensor_parallel_size=None, sequence_parallel=None).etp == 1
    assert config.GenerationConfig(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]  # a tuple is stored as a list
    assert config.LossConfig(kl_coef=0).kl_coef == 0  # an int for a float
    assert config.ModelConfig(moe_router_dtype=None).moe_router_dtype is None  # None among the choices


@pytest.mark.parametrize("override, message", [
    ("data.source=reasoning_gym:",
     "data.source must be a string, got a mapping: YAML read reasoning_gym: (a colon at the end) as a key with no "
     "value; write what follows the colon (reasoning_gym:<...>), or quote the value to keep it as written: "
     "data.source=\"'reasoning_gym:'\" on the command line, 'reasoning_gym:' in a YAML file"),
    ("reward.name=mod:",
     "reward.name must be a string, got a mapping: YAML read mod: (a colon at the end) as a key with no value; write "
     "what follows the colon (mod:<...>), or quote the value to keep it as written: reward.name=\"'mod:'\" on the "
     "command line, 'mod:' in a YAML file"),
    ("data.source=reasoning_gym: chain_sum",
     "data.source must be a string, got a mapping: YAML read 'reasoning_gym: chain_sum' (a colon before a space) as a "
     "key and its value; drop the space (reasoning_gym:chain_sum), or quote the value to keep it as written: "
     "data.source=\"'reasoning_gym: chain_sum'\" on the command line, 'reasoning_gym: chain_sum' in a YAML file"),
])
def test_a_string_that_yaml_read_as_a_mapping_says_what_happened_and_what_to_write(override, message):
    with pytest.raises(ConfigError) as e:
        config.load_job_config(None, [override])
    assert str(e.value) == message
    # the quoting it suggests gives the string (here refused further on for naming no task / function)
    quoted = override.split("=", 1)[0] + "='" + override.split("=", 1)[1] + "'"
    section, key = override.split("=")[0].split(".")
    if override.endswith(":"):
        assert getattr(getattr(config.load_job_config(None, [quoted]), section), key) == override.split("=", 1)[1]


def test_the_micro_batch_token_budget_counts_a_multi_turn_rows_whole_conversation():
    """A multi-turn row holds its prompt and every turn and observation (env.max_response_tokens), not one
    generation.max_new_tokens: 16 + 64 = 80 tokens do not fit 25 (issue 47, row J)."""
    from megatron_gspo.config import load_job_config

    job = ["env.tools=[calculator]", "env.max_response_tokens=64", "data.max_prompt_length=16", "generation.max_new_tokens=8"]
    with pytest.raises(ConfigError, match=r"train\.max_tokens_per_micro_batch=25 cannot hold one row of up to "
                                          r"data\.max_prompt_length \+ env\.max_response_tokens = 80 tokens"):
        load_job_config(None, job + ["train.max_tokens_per_micro_batch=25"])
    assert load_job_config(None, job + ["train.max_tokens_per_micro_batch=80"]).train.max_tokens_per_micro_batch == 80
    with pytest.raises(ConfigError, match=r"data\.max_prompt_length \+ env\.max_response_tokens = 100064 exceeds "
                                          r"model\.max_position_embeddings=512"):
        load_job_config(None, ["env.tools=[calculator]", "env.max_response_tokens=100000"])


def test_a_yaml_s_relative_env_sft_source_is_read_from_the_yaml_s_directory(tmp_path, monkeypatch):
    """examples/tools/gspo_calculator_tiny.yaml runs from any working directory: its demonstrations file is found next
    to it (issue 47); a path given on the command line stays relative to the working directory."""
    import os

    from megatron_gspo.config import load_job_config

    ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    example = os.path.join(ROOT, "examples", "tools", "gspo_calculator_tiny.yaml")
    monkeypatch.chdir(tmp_path)
    cfg = load_job_config(example)
    assert cfg.env.sft_source == os.path.join(ROOT, "examples", "tools", "calculator_demonstrations.jsonl")
    assert os.path.isfile(cfg.env.sft_source)
    assert load_job_config(example, ["env.sft_source=mine.jsonl"]).env.sft_source == "mine.jsonl"


def test_tool_environment_settings_are_refused_where_they_would_do_nothing():
    """env.tool_format / env.on_tool_error with an environment class, and the qwen3 format without a chat template,
    are refused by key (issue 47): accepted, they did nothing."""
    from megatron_gspo.config import load_job_config

    game = "env.name=megatron_gspo.env.games:GuessWithFeedback"
    for setting in ("env.tool_format=plain", "env.on_tool_error=end"):
        key = setting.split("=")[0]
        with pytest.raises(ConfigError, match=rf"^{key}='\w+' is a setting of the tool environment"):
            load_job_config(None, [game, setting])
    with pytest.raises(ConfigError, match=r"^env\.tool_format=qwen3 is the chat template's format"):
        load_job_config(None, ["env.tools=[calculator]", "env.tool_format=qwen3"])
    assert load_job_config(None, ["env.tools=[calculator]", "env.tool_format=plain",
                                  "env.on_tool_error=end"]).env.on_tool_error == "end"
