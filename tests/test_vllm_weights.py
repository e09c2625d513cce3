"""The vLLM engine's side that needs no vLLM (megatron_gspo/rollout/vllm_engine.py), in the main suite: the
Megatron model's weights as HF (name, tensor) buckets through the project's Megatron -> HF mapping, the HF
directory the engine starts from (transformers loads it and computes the Megatron model's log-probs), and the
conversion of an engine's samples into a ``GenerationOutput``. The engine itself runs in the vLLM tier
(tests/vllm/, tests/test_vllm_tier.py)."""

import json
import os

import pytest
import torch

from checkpoints_tools.qwen3_moe import Qwen3MoeMapping
from megatron_gspo.config import ParallelConfig, model_config_from_preset
from megatron_gspo.rollout.vllm_engine import (hf_weight_stream, rows_checksum, to_generation_output, unit_chunk,
                                              write_hf_dir)
from megatron_gspo.model.gpt import build_model, forward_logprobs

VOCAB = 100


@pytest.mark.parametrize("unit, chunk", [
    ("embedding.word_embeddings.weight", ("embedding.word_embeddings.weight", ())),
    ("decoder.layers.3.self_attention.linear_qkv.weight", ("decoder.layers.self_attention.linear_qkv.weight", (3,))),
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
     ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (0,))),
    ("decoder.layers.11.mlp.experts.7.linear_fc2.weight", ("decoder.layers.mlp.experts.experts.linear_fc2.weight", (11, 7))),
    ("decoder.layers.2.mlp.router.weight", ("decoder.layers.mlp.router.weight", (2,))),
    ("decoder.final_layernorm.weight", ("decoder.final_layernorm.weight", ())),
])
def test_a_unit_is_addressed_as_the_mappings_chunk(unit, chunk):
    assert unit_chunk(unit) == chunk


@pytest.fixture
def tiny(single_rank):
    cfg = model_config_from_preset("tiny", vocab_size=VOCAB, moe_aux_loss_coeff=0.0)
    st = single_rank(cfg, ParallelConfig(device="cpu", seed=7))
    return cfg, build_model(cfg, ParallelConfig(device="cpu", seed=7), st), st


def test_the_stream_is_the_mappings_hf_tensors_in_buckets(tiny):
    cfg, model, st = tiny
    small = hf_weight_stream(model, st, cfg, bucket_bytes=64 << 10)
    buckets = list(small.buckets())
    pairs = [p for b in buckets for p in b]
    names = [n for n, _ in pairs]
    assert len(names) == len(set(names))
    assert {n: tuple(t.shape) for n, t in pairs} == Qwen3MoeMapping(cfg).hf_shapes()
    assert len(buckets) > 3  # 64 KiB buckets of a 0.5 MB model
    assert small.tensors == len(pairs) and small.bytes == sum(t.numel() * 4 for _, t in pairs)
    # the bucketing changes nothing but the cut
    whole = dict(p for b in hf_weight_stream(model, st, cfg, bucket_bytes=1 << 30).buckets() for p in b)
    assert all(torch.equal(whole[n], t) for n, t in pairs)
    # the padded vocabulary rows stay behind
    emb = model.embedding.word_embeddings.weight
    assert emb.shape[0] == 128 and torch.equal(whole["model.embed_tokens.weight"], emb[:VOCAB])


def test_the_engines_hf_directory_computes_the_megatron_log_probs(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg, model, st = tiny
    write_hf_dir(str(tmp_path), cfg, hf_weight_stream(model, st, cfg, bucket_bytes=128 << 10), torch.float32)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager", dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, _ = forward_logprobs(model, tokens[:, :-1], tokens[:, 1:], VOCAB, with_entropy=False)
        logits = hf(tokens[:, :-1]).logits.float()
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert logits.shape[-1] == VOCAB and (lp - ref).abs().max().item() < 1e-5


def test_samples_become_the_generation_output_grid():
    out = to_generation_output([[7, 8, 9], [4]], 2, responses=[[1, 2], [3], [5, 6, 1], []],
                               logprobs=[[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6], []],
                               stopped=[True, False, True, False], pad_id=0, temperature=0.7, elapsed_s=2.0)
    assert out.tokens.tolist() == [[7, 8, 9, 1, 2], [7, 8, 9, 3, 0], [4, 5, 6, 1, 0], [4, 0, 0, 0, 0]]
    assert out.prompt_lengths.tolist() == [3, 3, 1, 1] and out.response_lengths.tolist() == [2, 1, 3, 0]
    assert out.response_mask.tolist() == [[False] * 3 + [True] * 2, [False] * 3 + [True, False],
                                          [False, True, True, True, False], [False] * 5]
    assert torch.allclose(out.logprobs, torch.tensor([[0, 0, 0, -0.1, -0.2], [0, 0, 0, -0.3, 0],
                                                      [0, -0.4, -0.5, -0.6, 0], [0] * 5]))
    assert out.stopped.tolist() == [True, False, True, False] and out.prompt_index.tolist() == [0, 0, 1, 1]
    assert out.responses() == [[1, 2], [3], [5, 6, 1], []] and out.temperature == 0.7 and out.tokens_per_s == 3.0
    with pytest.raises(ValueError, match="row 1 has 1 response tokens and 2 log-probs"):
        to_generation_output([[1]], 2, [[2], [3]], [[-1.0], [-1.0, -2.0]], [False, False], 0, 1.0)
    with pytest.raises(ValueError, match="1 prompts x 2 samples = 2 rows, got 1 responses"):
        to_generation_output([[1]], 2, [[2]], [[-1.0]], [False], 0, 1.0)


def test_the_rows_checksum_of_an_engines_tp_ranks_tells_rows_apart():
    """What the ranks of a TP group's engine compare after every generation (vllm_engine._check_tp_ranks_agree)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 100, (6, 9), generator=g)
    assert torch.equal(rows_checksum(rows), rows_checksum(rows.clone()))
    swapped = rows[[1, 0, 2, 3, 4, 5]]  # same ids, two rows swapped
    other = rows.clone()
    other[5, 8] = (other[5, 8] + 1) % 100  # one token
    for x in (swapped, other, rows[:, :8], rows[:5]):
        assert not torch.equal(rows_checksum(x), rows_checksum(rows))


# ----------------------------------------------------------------------------------------------
# rollout.engine
# ----------------------------------------------------------------------------------------------

R3 = ["loss.name=grpo", "train.routing_replay=R3"]


@pytest.mark.parametrize("overrides, match", [
    (["parallel.device=cpu", *R3], r"train.routing_replay=R3 with rollout.engine=vllm on the CPU: .*needs its V2 model "
                                   r"runner, and on a CPU that needs triton-cpu \(not on PyPI\)"),
    (["parallel.device=cuda", "parallel.tensor_model_parallel_size=2", *R3],
     r"train.routing_replay=R3 with rollout.engine=vllm at parallel.tensor_model_parallel_size=2: vLLM returns the "
     r"routes on the first rank of its TP group only"),
    (["train.old_logprobs=rollout"], r"train.old_logprobs=rollout with rollout.engine=vllm"),
    (["parallel.device=cpu", "rollout.vllm.sleep_level=1"],
     r"rollout.vllm.sleep_level=1 on the CPU: vLLM's sleep mode needs a GPU"),
    (["parallel.device=cuda", "rollout.mode=async", "rollout.world_size=1", "rollout.max_staleness=0",
      "rollout.vllm.sleep_level=2"],
     r"rollout.vllm.sleep_level=2 with rollout.mode=async: the rollout ranks' engines never make room"),
])
def test_what_the_vllm_engine_does_not_run_is_refused_by_key(overrides, match):
    from megatron_gspo.config import ConfigError, load_job_config

    with pytest.raises(ConfigError, match=match):
        load_job_config(None, ["rollout.engine=vllm", *overrides])
    load_job_config(None, overrides)  # the megatron engine runs each of them


def test_async_rollouts_run_on_vllm_and_r3_stays_refused():
    """rollout.mode=async on vLLM: the rollout ranks' engines (rollout/worker.py; tests/vllm/test_vllm_async.py runs
    it); R3 with it stays refused by key, on a GPU too (where a colocated job takes R3 on vLLM): an async job's
    rows carry no routes the trainer replays (config/rules.py async_without_r3)."""
    from megatron_gspo.config import ConfigError, load_job_config

    job = ["rollout.engine=vllm", "rollout.mode=async", "rollout.world_size=1", "rollout.max_staleness=0"]
    assert load_job_config(None, job).rollout.is_async
    with pytest.raises(ConfigError, match=r"train.routing_replay=R3 with rollout\.mode=async"):
        load_job_config(None, [*job, "parallel.device=cuda", *R3])


@pytest.mark.parametrize("layout", [["parallel.device=cuda", *R3], ["parallel.device=cuda", "parallel.expert_model_parallel_size=2", *R3]])
def test_r3_on_vllm_is_taken_on_a_gpu(layout):
    """On a GPU R3 replays the routes vLLM returns (rollout/vllm_routes.py; the alignment: tests/test_vllm_routes.py):
    the job's config is accepted."""
    from megatron_gspo.config import load_job_config

    cfg = load_job_config(None, ["rollout.engine=vllm", *layout])
    assert (cfg.rollout.engine, cfg.train.routing_replay, cfg.parallel.device) == ("vllm", "R3", "cuda")


@pytest.mark.parametrize("layout", [["parallel.tensor_model_parallel_size=2"], ["parallel.expert_model_parallel_size=2"]])
def test_the_vllm_engine_takes_tp_and_ep_layouts(layout):
    """One engine per trainer TP group, each DP replica its own rows (rollout/vllm_engine.py engine_layout_args;
    tests/vllm/test_vllm_layouts.py runs them)."""
    from megatron_gspo.config import load_job_config

    assert load_job_config(None, ["rollout.engine=vllm", *layout]).rollout.engine == "vllm"


@pytest.mark.parametrize("overrides, device, level", [
    ([], "cuda", 2), ([], "cpu", 0),  # null: a colocated engine on a GPU sleeps; vLLM has no sleep mode on a CPU
    (["rollout.mode=async", "rollout.world_size=1", "rollout.max_staleness=0"], "cuda", 0),  # a rollout rank does not train
    (["rollout.vllm.sleep_level=1"], "cuda", 1), (["rollout.vllm.sleep_level=0"], "cuda", 0)])
def test_the_engine_sleeps_between_generations_where_training_takes_its_memory(overrides, device, level):
    """rollout.vllm.sleep_level's null, resolved on the rank's device (rollout/colocated.py _sleep_level; what
    a level does to the engine: tests/vllm/test_vllm_engine.py)."""
    import types

    from megatron_gspo.config import load_job_config
    from megatron_gspo.rollout.colocated import _sleep_level

    cfg = load_job_config(None, ["rollout.engine=vllm", f"parallel.device={device}", *overrides])
    assert _sleep_level(cfg, types.SimpleNamespace(device=torch.device(device))) == level


def test_the_default_engine_is_megatron_and_vllm_recomputes_the_old_log_probs():
    from megatron_gspo.config import load_job_config, old_logprob_source

    assert load_job_config(None, []).rollout.engine == "megatron"
    cpu = torch.device("cpu")
    assert old_logprob_source(load_job_config(None, ["parallel.device=cpu"]), cpu)[0] is False  # unchanged
    recompute, why = old_logprob_source(load_job_config(None, ["parallel.device=cpu", "rollout.engine=vllm"]), cpu)
    assert recompute and "rollout.engine=vllm" in why


@pytest.mark.slow
def test_a_vllm_job_without_vllm_says_how_to_get_it(tmp_path):
    """Here vLLM is not installed (it lives in the tier's venv): one line naming the key and the install, exit 2."""
    import subprocess
    import sys

    from vllm_tier import vllm_in_process

    if vllm_in_process():
        pytest.skip("vLLM is installed here")
    p = subprocess.run([sys.executable, "-m", "megatron_gspo.train", "parallel.device=cpu", "rollout.engine=vllm",
                        "model.kv_channels=32", "train.sft_steps=0", f"train.output_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert "error: rollout.engine=vllm needs vLLM in this interpreter: `pip install -e \".[vllm]\"`" in out
    assert "Traceback" not in out


# ----------------------------------------------------------------------------------------------
# rollout.vllm.*
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, why", [("seed", "generation.seed"), ("max_model_len", "data.max_prompt_length"),
                                      ("kv_cache_memory_bytes", "rollout.vllm.kv_cache_memory_gib"),
                                      ("enforce_eager", "rollout.vllm.enforce_eager"), ("model", "the job's model"),
                                      ("enable_return_routed_experts", "train.routing_replay=R3"),
                                      ("enable_sleep_mode", "rollout.vllm.sleep_level")])
def test_engine_args_the_engine_sets_itself_are_refused_in_one_line(key, why):
    from megatron_gspo.config import ConfigError, load_job_config

    with pytest.raises(ConfigError) as e:
        load_job_config(None, ["rollout.engine=vllm", f"rollout.vllm.engine_args={{{key}: 1}}"])
    assert str(e.value).startswith(f"rollout.vllm.engine_args.{key}: set by the engine itself") and why in str(e.value)
    assert "\n" not in str(e.value)


def test_the_vllm_keys_become_the_engines_arguments_and_may_change_at_resume():
    from megatron_gspo.checkpoint.config_change import compare
    from megatron_gspo.config import load_job_config, to_dict
    from megatron_gspo.rollout.vllm_engine import engine_args_of

    default = load_job_config(None, ["rollout.engine=vllm"])
    assert engine_args_of(default.rollout.vllm) == {"enforce_eager": True}  # the KV cache: the engine's job-sized default
    cfg = load_job_config(None, ["rollout.engine=vllm", "rollout.vllm.kv_cache_memory_gib=0.25",
                                 "rollout.vllm.enforce_eager=false", "rollout.vllm.engine_args={max_num_seqs: 8}"])
    assert engine_args_of(cfg.rollout.vllm) == {"enforce_eager": False, "kv_cache_memory_bytes": 1 << 28, "max_num_seqs": 8}
    accepted, refused = compare(to_dict(default), to_dict(cfg))
    assert refused == [] and sorted(c.key for c in accepted) == [
        "rollout.vllm.enforce_eager", "rollout.vllm.engine_args", "rollout.vllm.kv_cache_memory_gib"]
    # a checkpoint of a version without the section: its keys are new, accepted
    old = to_dict(default)
    del old["rollout"]["vllm"]
    assert {c.key for c in compare(old, to_dict(cfg))[0]} >= {"rollout.vllm.engine_args"}
