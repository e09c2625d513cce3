"""benchmarks/rollout_engines.py with vLLM beside the embedded engines, at a toy size, in the vLLM tier's
interpreter: every engine samples the same rows x new tokens from the same model, and the report's
vLLM columns are the runs' arithmetic (tests/test_rollout_engines.py checks the embedded engines' side)."""

import pytest

from benchmarks import rollout_engines as rb

PROMPTS, G, NEW = 2, 3, 4
# 2 prompts of 2000 tokens (15 full KV blocks of 128 shared by a prompt's samples, 80 tokens each of their own):
# more than vLLM's default 4096 prompt tokens a scheduler step; the runner's budget takes every prompt at once
LONG = 2000


def test_vllm_beside_the_embedded_engines():
    args = rb.parse_args(["--shape", "tiny", "--prompts", str(PROMPTS), "--samples", str(G), "--prompt-lens", str(LONG),
                          "--new-tokens", str(NEW), "--rounds", "1"])
    assert args.engines == ["lean", "megatron", "vllm"]  # auto: vLLM is importable here
    res = rb.run(args)
    assert res["vllm_engine_args"]["vllm"]["max_num_batched_tokens"] >= PROMPTS * G * (LONG + NEW)
    assert res["memory"]["engine_built_mb"]["vllm"] > 0  # its own copy of the weights and its KV cache
    for L, per_engine in res["results"].items():
        assert list(per_engine) == ["lean", "megatron", "vllm"]
        v = per_engine["vllm"]
        assert v["rows"] == PROMPTS * G and v["tokens"] == PROMPTS * G * NEW
        assert "prefill_s" not in v  # vLLM reports no prefill of its own: its time to the first token stands for it
        assert v["speed_vs_vllm"] == 1.0
        for e, s in per_engine.items():
            assert s["tokens"] == v["tokens"], (L, e)
            assert s["speed_vs_vllm"] == pytest.approx(s["tokens_per_s"] / v["tokens_per_s"], rel=2e-3)
            # the same model: the sampled tokens' mean log-prob agrees to sampling noise (24 draws of a ~4.85 nat
            # entropy, standard error ~0.2 on this random model; another model is off by nats)
            assert s["mean_logprob"] == pytest.approx(v["mean_logprob"], abs=1.0), (L, e)


def test_three_turns_beside_the_embedded_engines():
    """--turns 3: vLLM gets every turn's whole contexts (the job's EngineGenerator) and its prefix cache serves each
    row's history: from the second turn on, every full block of a row's earlier stream is a hit."""
    turns, obs, L = 3, 2, 300
    args = rb.parse_args(["--shape", "tiny", "--prompts", str(PROMPTS), "--samples", str(G), "--prompt-lens", str(L),
                          "--new-tokens", str(NEW), "--rounds", "1", "--turns", str(turns), "--obs-tokens", str(obs)])
    res = rb.run(args)
    per_engine = res["results"][str(L)]
    assert list(per_engine) == ["lean", "megatron", "vllm"]
    for e, s in per_engine.items():
        assert s["turn_tokens"] == [PROMPTS * G * NEW] * turns, e
        assert s["stream_lengths"] == [L + turns * NEW + (turns - 1) * obs], e
    v = per_engine["vllm"]
    # every turn's prompts are queried: the rows' contexts, turn by turn
    queries = sum(PROMPTS * G * (L + t * (NEW + obs)) for t in range(turns))
    assert v["prefix_cache"]["queries"] == queries
    # the hits are whole blocks, at most the queried tokens less each request's last one
    assert 0 < v["prefix_cache"]["hits"] < queries and v["prefix_cache_hit_rate"] == pytest.approx(
        v["prefix_cache"]["hits"] / queries, abs=1e-4)
    assert "prefill_tokens" not in v and per_engine["lean"]["prefill_tokens"][1] == PROMPTS * G * (1 + obs)
