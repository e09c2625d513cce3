"""benchmarks/run.py --smoke runs end to end (subprocess) and writes the documented JSON fields;
benchmarks/plot.py draws the scaling plot. No timing assertions: only that the numbers exist and
that both implementations ran on the same weights."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # runs the benchmark runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("train_step", "logprob_pass", "generation")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    # a fresh process group: not the rendezvous variables earlier in-process tests left in os.environ
    dist_vars = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}
    env = {**{k: v for k, v in os.environ.items() if k not in dist_vars}, "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--smoke", "--threads", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert "ratio vs transformers" in p.stdout  # the table was printed
    with open(out) as f:
        return json.load(f)


def test_smoke_json_fields(smoke):
    m = smoke["machine"]
    for k in ("cpu_model", "cpu_cores", "torch", "megatron_core", "transformers", "device", "python"):
        assert m.get(k), k
    assert m["device"] == "cpu" and smoke["torch_threads"] == 1
    assert smoke["date"] and smoke["command"].startswith("python benchmarks/run.py")
    assert len(smoke["load_avg_start"]) == 3 and len(smoke["load_avg_end"]) == 3
    cfg = smoke["config"]
    assert cfg["smoke"] and cfg["model"]["num_moe_experts"] == 4 and cfg["precision"] == "fp32"
    assert cfg["expert_impls"] == ["batched", "sequential"]
    assert smoke["flops_per_token"]["logprob"] == pytest.approx(smoke["flops_per_token"]["train"] / 3)
    sides = ["ours_batched", "ours_sequential", "hf"]
    for sec in SECTIONS:
        d = smoke["results"][sec]
        for s in sides:
            assert d[s]["tokens_per_s"] > 0 and d[s]["tflops_per_device"] > 0, (sec, s)
            assert len(d[s]["seconds_all"]) == cfg["iters"] == 1
            assert d[s]["mfu"] is None  # no known peak on a CPU
        assert set(d["ratio_vs_hf"]) == {"ours_batched", "ours_sequential"}
        assert all(r > 0 for r in d["ratio_vs_hf"].values())
    lp = smoke["results"]["logprob_pass"]
    for s in sides:
        assert lp[s]["peak_memory"]["peak_bytes"] >= 0
    assert set(lp["peak_memory_ratio_vs_hf"]) == {"ours_batched", "ours_sequential"}
    gen = smoke["results"]["generation"]
    assert gen["hf"]["tokens"] == gen["ours_batched"]["tokens"] == cfg["batch"] * cfg["gen_new"]
    # same weights on both sides (through the HF -> megatron converter)
    assert all(v < 1e-4 for v in smoke["weights_check"].values()), smoke["weights_check"]
    assert gen["ours_batched"]["greedy_token_match_vs_hf"] == 1.0
    # the expert layer alone: megatron's loop and every grouped-GEMM variant, train and decode shapes
    for shape in ("train", "decode"):
        d = smoke["expert_layer"][shape]
        assert d["rows"] > 0
        assert {"sequential", "batched_grouped_mm", "batched_loop", "batched_bmm"} <= set(d)
        assert all(v["ms_median"] > 0 for k, v in d.items() if k != "rows")
    # smoke runs skip the sweep and the 2.5 GB log-prob memory benchmark
    assert "scaling" not in smoke and "logprob_memory" not in smoke
    # the decode step against its weight-read floor: the bytes a step must read, counted from the model's own
    # parameters (every weight but the input embedding; of the experts, those some of the rows route to:
    # E (1 - (1 - k/E)^rows) per layer; fp32: 4 bytes each) and its KV cache at the mean context length
    d = smoke["decode_step"]
    assert d["rows"] == cfg["decode_rows"] and d["step_ms_median"] > 0 and d["copy_bandwidth_gb_s"] > 0
    from megatron_gspo.config import ModelConfig

    m, rows, bpp = ModelConfig(**cfg["model"]), d["rows"], 4
    E, h, L = m.num_moe_experts, m.hidden_size, m.num_layers
    untouched = E * (1 - m.moe_router_topk / E) ** rows
    embedding = m.vocab_size * h if m.untie_embeddings_and_output_weights else 0  # tied: it is the output layer
    weights = m.num_parameters() - embedding - L * untouched * 3 * h * m.moe_ffn_hidden_size
    assert d["bytes_per_step"]["weights"] == pytest.approx(weights * bpp, rel=0.01)
    kv = rows * (d["prompt"] + d["new_tokens"] / 2) * L * 2 * m.num_query_groups * m.kv_channels * bpp
    assert d["bytes_per_step"]["kv_cache"] == pytest.approx(kv, rel=1e-9)
    assert d["bytes_per_step"]["total"] == d["bytes_per_step"]["weights"] + d["bytes_per_step"]["kv_cache"]
    # the floor is those bytes at the measured bandwidth; the steps are timed inside the generate() call
    assert d["floor_ms"] == pytest.approx(1e3 * d["bytes_per_step"]["total"] / (d["copy_bandwidth_gb_s"] * 1e9), rel=1e-6)
    assert d["step_ms_median"] * (d["new_tokens"] - 1) <= 1e3 * d["call_s_median"]


def test_gpu_shapes_parse_to_the_presets():
    """--shape 2b-proxy / 30b-cut: the presets' widths and vocabulary (no run: they do not fit here),
    with the GPU defaults (256 decode rows x 64 tokens, 576-token training rows)."""
    from benchmarks.run import model_config, parse_args

    a = parse_args(["--device", "cpu", "--shape", "2b-proxy", "--no-hf"])
    cfg = model_config(a)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_moe_experts, cfg.vocab_size) == (2048, 8, 32, 151936)
    assert (a.decode_rows, a.decode_new, a.seq, a.no_hf, a.scaling, a.profile) == (256, 64, 576, True, False, False)
    a = parse_args(["--shape", "30b-cut"])
    cfg = model_config(a)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_moe_experts, cfg.moe_router_topk) == (2048, 2, 128, 8)
    assert model_config(parse_args(["--shape", "30b-cut", "--layers", "1"])).num_layers == 1
    assert model_config(parse_args([])).hidden_size == 256  # the CPU default is unchanged


def test_plot_writes_png(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_plot", os.path.join(ROOT, "benchmarks", "plot.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [{"axis": axis, "batch": b, "seq": s, "kind": kind, "side": side, "tokens_per_s": 100.0 * b * s / 256 + (side == "hf")}
            for axis, pts in (("batch", [(1, 256), (2, 256), (4, 256)]), ("seq", [(4, 64), (4, 128), (4, 256)]))
            for b, s in pts for kind in ("train_step", "logprob_pass") for side in ("ours", "hf")]
    out = mod.plot({"scaling": rows, "machine": {"device": "cpu", "cpu_model": "x"}, "config": {"model": {}}},
                   str(tmp_path / "p.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        mod.plot({"scaling": []}, str(tmp_path / "q.png"))


def test_runs_as_a_module():
    """`python -m benchmarks.run` from the repository root: the package is imported as installed,
    no sys.path edit (here: the Markdown tables of the committed CPU result)."""
    p = subprocess.run([sys.executable, "-m", "benchmarks.run", "--markdown",
                        os.path.join("benchmarks", "results", "cpu_latest.json")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| training step |" in p.stdout and "| log-prob pass |" in p.stdout


def _module(argv: list, timeout: int = 600) -> subprocess.CompletedProcess:
    dist_vars = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}
    env = {**{k: v for k, v in os.environ.items() if k not in dist_vars}, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_long_tail_generation_runner(tmp_path):
    """Every variant gives the same tokens (the runner exits non-zero otherwise); compaction does
    less decode work than the static batch on the long-tailed workload."""
    out = tmp_path / "lt.json"
    p = _module(["benchmarks.long_tail_generation", "--shape", "tiny", "--max-new", "20", "--rounds", "1",
                 "--stop-prob", "0.08", "--json", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    L = res["lengths"]
    assert L["rows"] == 64 and L["median"] < L["max"] == 20 and 0 < L["share_at_max"] < 0.5  # long-tailed
    r = res["results"]
    assert r["static_megatron"]["decode_row_steps"] == r["static_lean"]["decode_row_steps"] == 64 * 19
    assert r["compact_lean"]["decode_row_steps"] == r["compact_megatron"]["decode_row_steps"] < 64 * 19
    # refill (max_batch_rows=16, the same tokens: checked by the runner): never more than 16 rows, fuller
    assert r["refill_lean"]["decode_row_steps"] <= 16 * (r["refill_lean"]["runs"][0]["forwards"] - 1)
    assert r["refill_lean"]["decode_batch_fill"] > r["compact_lean"]["decode_batch_fill"]
    # the same cap without refill: successive batches of 16 rows, each until its longest row ends
    assert r["waves_lean"]["runs"][0]["forwards"] > r["refill_lean"]["runs"][0]["forwards"]
    assert r["static_lean"]["decode_batch_fill"] == pytest.approx((L["tokens"] - 64) / (64 * 19), abs=1e-4)
    assert all(v["tokens_per_s"] > 0 for v in r.values())
    assert all(v["wall_s"] > 0 and v["cpu_s"] > 0 for v in r.values())
    # the two decode paths: the same logits to rounding, so (almost) the same draws
    lv = res["lean_vs_megatron"]
    assert lv["draws"] == L["tokens"] and lv["rows_diverged"] <= 1 and lv["max_logprob_diff_before"] < 1e-5


def _side_by_side(tmp_path, sides: str) -> dict:
    out = tmp_path / "sbs.json"
    p = _module(["benchmarks.trl_side_by_side", "--shape", "tiny", "--prompts", "2", "--samples", "2",
                 "--new-tokens", "4", "--prompt-len", "4", "--warmup", "0", "--steps", "2", "--rounds", "1",
                 "--threads", "1", "--sides", sides, "--json", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    res = json.loads(out.read_text())
    for side in sides.split(","):
        s = res[side]
        assert s["steps"] == 2 and s["wall_s"] >= s["rollout_wall_s"] > 0 and s["update_wall_s"] > 0, (side, s)
        assert 0 < s["generate_wall_s"] <= s["rollout_wall_s"], (side, s)
        # the same work on each side: 2 prompts x 2 samples x 4 forced new tokens sampled every step
        assert [r["gen_tokens"] for run in res["runs"][side] for r in run] == [2 * 2 * 4] * 2, (side, res["runs"])
    return res


def test_trl_side_by_side_runner(tmp_path):
    """The side-by-side runner on the tiny shape, our side (TRL's: the test below)."""
    from benchmarks.trl_side_by_side import even_token_reward, even_token_reward_trl

    assert even_token_reward("w1", "w4 w5 x w6", None) == pytest.approx(2 / 3)  # non-words ignored
    assert even_token_reward_trl(["w3 w8", ""]) == [0.5, 0.0]
    _side_by_side(tmp_path, "ours")


def test_trl_side_by_side_against_trl(tmp_path):
    """Both sides when the bench extra is installed (pip install -e '.[bench]'): the same work per step, and
    the speedup is TRL's median RL step over ours, from the steps each side recorded."""
    import importlib.util
    import statistics

    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed here (a benchmark-only extra: pip install -e '.[bench]')")
    res = _side_by_side(tmp_path, "ours,trl")
    # the benchmark reports the medians to 1e-4 s and the speedup to 1e-3: the same rounding here, or a fast
    # step (a median near 0.05 s) misses by the medians' rounding alone
    median = {s: round(statistics.median(r["wall_s"] for run in res["runs"][s] for r in run), 4) for s in ("ours", "trl")}
    assert res["speedup"] == pytest.approx(median["trl"] / median["ours"], abs=6e-4)
