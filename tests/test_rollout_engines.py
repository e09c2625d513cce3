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


# ----------------------------------------------------------------------------------------------
# --turns: multi-turn conversations
# ----------------------------------------------------------------------------------------------

TURNS, OBS = 3, 2


@pytest.fixture(scope="module")
def turns_report():
    args = rb.parse_args(["--shape", "tiny", "--engines", "lean,megatron", "--prompts", str(PROMPTS),
                          "--samples", str(G), "--prompt-lens", ",".join(map(str, LENS)), "--new-tokens", str(NEW),
                          "--rounds", "2", "--turns", str(TURNS), "--obs-tokens", str(OBS)])
    return rb.run(args)


def test_turns_sample_rows_times_new_tokens_every_turn(turns_report):
    rows = PROMPTS * G
    assert turns_report["config"]["turns"] == TURNS and turns_report["config"]["obs_tokens"] == OBS
    for L, per_engine in turns_report["results"].items():
        L = int(L)
        for e, s in per_engine.items():
            assert s["turn_tokens"] == [rows * NEW] * TURNS and s["tokens"] == rows * NEW * TURNS, (L, e)
            assert s["stream_lengths"] == [L + TURNS * NEW + (TURNS - 1) * OBS]
            assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["wall_s"], rel=1e-3)
            assert s["tokens_per_s_best"] == pytest.approx(s["tokens"] / s["wall_s_best"], rel=1e-3)
            for r in turns_report["runs"][str(L)][e]:  # the turns are the conversation's parts
                assert 0 < sum(r["turn_s"]) <= r["wall_s"]
            assert "prefix_cache_hit_rate" not in s
        # turn 1: one prefill per distinct prompt; then the lean decoder prefills each row's last sampled token and its
        # observation onto the KV it kept, megatron's path each row's whole stream again
        assert per_engine["lean"]["prefill_tokens"] == [PROMPTS * L] + [rows * (1 + OBS)] * (TURNS - 1)
        assert per_engine["megatron"]["prefill_tokens"] == [PROMPTS * L] + [
            rows * (L + t * (NEW + OBS)) for t in range(1, TURNS)]


@pytest.fixture(scope="module")
def conversations():
    """Each embedded engine's three-turn streams and outputs, the same prompts and seed."""
    import torch

    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model.gpt import build_model
    from megatron_gspo.runtime import parallel

    args = rb.parse_args(["--shape", "tiny", "--prompts", str(PROMPTS), "--samples", str(G), "--prompt-lens", str(LENS[1]),
                          "--new-tokens", str(NEW), "--turns", str(TURNS), "--obs-tokens", str(OBS)])
    torch.set_num_threads(1)
    cfg, par = rb.model_config(args), ParallelConfig(device="cpu", seed=0)
    st = parallel.initialize(cfg, par)
    try:
        model = build_model(cfg, par, st)
        prompts, gen = rb.workload(args, cfg.vocab_size)
        prompts = prompts[LENS[1]]
        talks = {e: rb.converse(rb.Embedded(e, model, st, cfg.vocab_size), prompts, gen, TURNS, OBS, cfg.vocab_size)
                 for e in ("lean", "megatron")}
        return prompts, cfg.vocab_size, talks
    finally:
        parallel.destroy()


def test_turns_streams_hold_prompt_responses_and_observations(conversations):
    prompts, V, talks = conversations
    L = LENS[1]
    for e, (streams, walls, outs) in talks.items():
        assert len(streams) == PROMPTS * G and len(walls) == TURNS and len(outs) == TURNS
        for j, s in enumerate(streams):
            assert s[:L] == prompts[j // G], (e, j)  # row j: sample j % G of prompt j // G
            at = L
            for t in range(TURNS):
                assert s[at:at + NEW] == outs[t].responses()[j], (e, j, t)  # this turn's sampled tokens
                at += NEW
                if t < TURNS - 1:
                    assert s[at:at + OBS] == rb.observation(j, t, OBS, V), (e, j, t)  # then the row's observation
                    at += OBS
            assert at == len(s)


def test_turns_lean_and_megatron_sample_the_same_tokens(conversations):
    """The counter-based sampler draws the same noise for a row's turn on both paths, and their log-probs agree to
    rounding (the lean decoder's resumed turns attend to the KV it kept, megatron's prefill it again): the same
    tokens over the three turns."""
    _, _, talks = conversations
    lean, meg = talks["lean"], talks["megatron"]
    assert lean[0] == meg[0]
    for t in range(TURNS):
        a, b = lean[2][t], meg[2][t]
        assert a.kept is not None and b.kept is None  # the lean decoder kept the KV, megatron's path nothing
        assert (a.logprobs[a.response_mask] - b.logprobs[b.response_mask]).abs().max() < 1e-4
    # the rows differ from each other: the G samples of a prompt are not one sample repeated
    assert len({tuple(s) for s in lean[0]}) == PROMPTS * G
