"""benchmarks/rollout_engines.py at a toy size on the embedded engines (vLLM's side: tests/vllm/): the report's
fields agree with each other and with the work asked for, so that the runner cannot rot. No timing assertions
beyond the arithmetic that ties its numbers together."""

import pytest

from benchmarks import rollout_engines as rb

PROMPTS, G, NEW, LENS = 2, 3, 4, (3, 9)


@pytest.fixture(scope="module")
def report():
    args = rb.parse_args(["--shape", "tiny", "--engines", "lean,megatron", "--prompts", str(PROMPTS),
                          "--samples", str(G), "--prompt-lens", ",".join(map(str, LENS)), "--new-tokens", str(NEW),
                          "--rounds", "2"])
    return rb.run(args)


def test_every_engine_samples_rows_times_new_tokens(report):
    assert report["config"]["model"]["kv_channels"] == 32  # vLLM's smallest CPU head size, on every engine
    assert list(report["results"]) == [str(L) for L in LENS]
    for L, per_engine in report["results"].items():
        assert list(per_engine) == ["lean", "megatron"]
        for e, s in per_engine.items():
            assert s["rows"] == PROMPTS * G and s["tokens"] == PROMPTS * G * NEW, (L, e)
            runs = report["runs"][L][e]
            assert len(runs) == 2 and all(r["tokens"] == s["tokens"] for r in runs)
            # one prefill per prompt: its distinct prompts' tokens, not G times
            assert s["prefill_tokens"] == PROMPTS * int(L)
            assert "speed_vs_vllm" not in s  # no vLLM in this run


def test_the_summary_is_the_runs_arithmetic(report):
    for L, per_engine in report["results"].items():
        for e, s in per_engine.items():
            runs = report["runs"][L][e]
            walls = sorted(r["wall_s"] for r in runs)
            assert s["wall_s"] == pytest.approx(sum(walls) / 2, abs=1e-6) and s["wall_s_best"] == walls[0]
            assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["wall_s"], rel=1e-3)
            assert s["tokens_per_s_best"] >= s["tokens_per_s"]
            best = s["wall_s_best"] - s["ttft_s_best"]  # decode = the call less its first token (best of each)
            if best > 0:
                assert s["decode_tokens_per_s_best"] == pytest.approx((s["tokens"] - s["rows"]) / best, rel=1e-3)
            else:  # a first-token call slower than the whole call (a loaded machine): no decode figure
                assert s["decode_tokens_per_s_best"] is None
            for r in runs:
                if r["decode_s"] is not None:  # the first-token call and the decode add up to the call
                    assert r["decode_s"] == pytest.approx(r["wall_s"] - r["ttft_s"], abs=2e-6)
                    assert r["decode_tokens_per_s"] == pytest.approx((r["tokens"] - r["rows"]) / r["decode_s"], rel=1e-2)
                else:
                    assert r["ttft_s"] >= r["wall_s"]
                assert 0 < r["prefill_s"] and r["cpu_s"] > 0
                assert r["peak_rss_mb"] >= r["rss_before_mb"] > 0 and r["call_rss_mb"] >= 0
                assert r["mean_logprob"] < 0 and len(r["load_avg"]) == 3


def test_both_decoders_sample_from_the_same_model(report):
    """lean and megatron compute the same logits to rounding and draw with the same counter-based noise: the same
    mean sampled log-prob (a different model or prompt set would move it by far more)."""
    for L, per_engine in report["results"].items():
        assert per_engine["lean"]["mean_logprob"] == pytest.approx(per_engine["megatron"]["mean_logprob"], abs=1e-3)


def test_vllm_without_vllm_is_refused_in_one_line(capsys):
    if rb.vllm_available():
        pytest.skip("vLLM is importable here: tests/vllm/ runs it")
    with pytest.raises(SystemExit) as e:
        rb.parse_args(["--engines", "lean,vllm"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "vLLM is not importable" in err and ".vllm-venv/bin/python" in err
    assert rb.parse_args([]).engines == ["lean", "megatron"]  # auto: the engines this interpreter has
