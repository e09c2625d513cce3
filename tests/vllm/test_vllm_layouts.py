"""The vLLM engine under the trainer's torchrun layouts (gloo, CPU), in the vLLM tier's interpreter: TP 2 (one
engine whose two ranks are vLLM's TP shards, vLLM's ``external_launcher`` inside the job's world) and EP 2 (two DP
replicas, each its own engine over the whole model). tests/dist_scripts/vllm_layouts.py builds the tiny Qwen3-MoE
(fp32, head size 32; experts' intermediate size 16 per rank at TP 2, which vLLM's CPU MoE kernel pads), then
checks on every rank that after 10 optimizer updates (the trainer's DDP and optimizer) and a sync from the
bucket stream the engine's log-probs of a fixed batch of tokens equal the Megatron model's (measured 9.5e-7 at
both layouts; asserted < 1e-5), that it was stale before the sync, that a replica's TP ranks sample the same
rows and the replicas different ones, and that the sampled tokens' log-probs are the Megatron model's."""

import json

import pytest

TOL = 1e-5  # fp32; measured 9.5e-7


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--ep", "2"]], ids=["tp2", "ep2"])
def test_after_10_updates_the_engine_of_every_rank_samples_from_the_trained_weights(run_dist, layout):
    p = run_dist("vllm_layouts.py", 2, *layout, "--updates", "10", timeout=420)
    rows = [json.JSONDecoder().raw_decode(part)[0] for part in p.stdout.split("VLLM_LAYOUT ")[1:]]
    assert sorted(r["rank"] for r in rows) == [0, 1], p.stdout[-3000:] + p.stderr[-3000:]
    for r in rows:
        print(f"{layout} rank {r['rank']}: initial {r['initial']:.3g}, stale {r['stale']:.3g}, synced "
              f"{r['synced']:.3g}, sampled {r['sampled']:.3g}, sync {r['sync_bytes']} bytes")
        assert (r["tp"], r["ep"], r["dp"]) == ((2, 1, 1) if layout[0] == "--tp" else (1, 2, 2))
        assert r["initial"] < TOL
        assert r["stale"] > 0.05, f"10 updates barely moved the model ({r['stale']:.3g}): the check proves nothing"
        assert r["synced"] < TOL and r["sampled"] < TOL
        assert r["tp_same"] and r["dp_differ"]
        # TP 2: one engine, its two ranks vLLM's TP shards; EP 2: two engines of one rank each
        assert r["vllm_tp_ranks"] == ([0, 1] if layout[0] == "--tp" else [r["rank"]])
        assert "gspo-" in r["dist_ident"]  # vLLM's SHM segments are named after this job (its MASTER_PORT)
    # every rank streamed the same full model (the bucket stream is collective over TP / EP)
    assert rows[0]["sync_bytes"] == rows[1]["sync_bytes"] > 0
