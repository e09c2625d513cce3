"""The GSPO / GSPO-token / GRPO / GRPO+R2 comparison (megatron_gspo/compare.py) at a tiny scale.

One comparison (SFT warm start once, 4 variants x 3 steps, in-process to keep the start-up cost of
megatron low) is shared by the tests of this module; they check the artifacts and the structural
facts the comparison is meant to show.
"""

import json
import math
import os

import pytest

from megatron_gspo import compare

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3
MINIBATCHES = 2
JOB = [
    "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "generation.max_new_tokens=4",
    "train.micro_batch_size=8", f"train.num_minibatches={MINIBATCHES}", "train.sft_steps=2",
    "train.sft_batch_size=16",
    # a dense reward: non-zero advantages from the first step; a large lr so that ratios leave 1
    # enough for GRPO to clip tokens within 3 steps
    f"reward.name={HERE}/reward_plugins.py:digit_fraction", "optimizer.lr=1e-2",
]


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    out, docs = root / "out", root / "docs"
    rc = compare.main(["--in-process", "--quiet", "--steps", str(STEPS), "--out", str(out), "--docs",
                       "--docs-dir", str(docs), *JOB])
    assert rc == 0, (out / "gspo" / "train.log").read_text() if (out / "gspo" / "train.log").exists() else rc
    rows = {v: [json.loads(line) for line in open(out / v / "metrics.jsonl")] for v in compare.DEFAULT_VARIANTS}
    probe = {v: [json.loads(line) for line in open(out / v / "probe.jsonl")] for v in compare.DEFAULT_VARIANTS}
    summary = json.load(open(out / "summary.json"))
    return dict(out=out, docs=docs, rows=rows, probe=probe, summary=summary)


def test_artifacts_exist_with_finite_numbers(comparison):
    out = comparison["out"]
    for name in compare.PLOTS:
        png = out / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    md = (out / "summary.md").read_text()
    for v in compare.DEFAULT_VARIANTS:
        assert compare.VARIANTS[v]["label"] in md
        assert len(comparison["rows"][v]) == STEPS
        t = comparison["summary"]["table"][v]
        assert t["steps"] == STEPS and t["rc"] == 0
        for key in ("final_reward", "reward_auc", "clip_frac", "routing_change", "probe_change",
                    "probe_token_change", "probe_vs_init_final", "grad_norm", "step_time_s", "wall_s"):
            assert t[key] is not None and math.isfinite(t[key]), (v, key, t[key])
        assert t["skipped_updates"] == 0 and t["nonfinite_steps"] == 0
        # one probe row per optimizer update
        assert [r["update"] for r in comparison["probe"][v]] == list(range(1, STEPS * MINIBATCHES + 1))
    # the same initial model for every variant: one SFT, saved once
    assert (out / compare.INIT_DIR / "metadata.json").is_file()
    meta = json.load(open(out / "compare.json"))
    for v, run in meta["runs"].items():
        (entry,) = run["seeds"]
        assert f"checkpoint.load={out / compare.INIT_DIR}" in entry["overrides"] and "train.sft_steps=0" in entry["overrides"]
    # the same first rollout for every variant (same weights, data and seeds)
    first = {v: comparison["rows"][v][0]["rollout/reward_mean"] for v in compare.DEFAULT_VARIANTS}
    assert len(set(first.values())) == 1, first


def test_docs_and_tensorboard(comparison):
    doc = (comparison["docs"] / "comparison.md").read_text()
    assert "python -m megatron_gspo.compare" in doc and "load average" in doc
    images = [ln.split("](")[1].rstrip(")") for ln in doc.splitlines() if ln.startswith("![")]
    assert len(images) == 7
    for img in images:
        assert img.startswith("img/comparison_") and (comparison["docs"] / img).is_file()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for v in compare.DEFAULT_VARIANTS:
        acc = EventAccumulator(str(comparison["out"] / v / "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        for tag in ("rollout/reward_mean", "loss/clip_frac", "routing/routing_change_frac",
                    "probe/routing_change_per_update", "probe/routing_change_per_update/layer_1"):
            assert tag in tags, (v, tag)


def test_gspo_and_gspo_token_are_the_same_run(comparison):
    """Same value and gradient for per-sequence advantages. Measured: the loss agrees to ~1e-7
    (float32 rounding) and the grad norm to ~1e-6 relative at step 1; afterwards Adam's
    per-parameter normalization amplifies the rounding difference of near-zero gradients, so the
    grad norms drift to ~1e-3 relative by step 3 at lr 1e-2 while the sampled rollouts, rewards and
    clip decisions stay identical."""
    a, b = comparison["rows"]["gspo"], comparison["rows"]["gspo_token"]
    for x, y in zip(a, b):
        assert x["rollout/reward_mean"] == y["rollout/reward_mean"], x["step"]
        assert x["loss/clip_frac_low"] == y["loss/clip_frac_low"] and x["loss/clip_frac_high"] == y["loss/clip_frac_high"]
        assert abs(x["loss/loss"] - y["loss/loss"]) < 1e-4
        assert abs(x["train/grad_norm"] - y["train/grad_norm"]) <= 1e-2 * x["train/grad_norm"]
    assert abs(a[0]["loss/loss"] - b[0]["loss/loss"]) < 1e-6
    assert abs(a[0]["train/grad_norm"] - b[0]["train/grad_norm"]) <= 1e-5 * a[0]["train/grad_norm"]
    cons = comparison["summary"]["consistency"]["gspo_vs_gspo_token"]
    assert cons["step1_rel_diff_grad_norm"] <= 1e-5 and len(cons["divergence_steps"]) == 1


def test_routing_replay_zeroes_old_to_train_change_but_not_router_drift(comparison):
    rows, probe = comparison["rows"], comparison["probe"]
    for r in rows["grpo_r2"]:
        assert r["routing/routing_change_frac"] == 0.0
        assert r["routing/routing_change_frac/layer_0"] == 0.0 and r["routing/routing_change_frac/layer_1"] == 0.0
    # without replay the training forward of the later minibatch routes differently
    assert max(r["routing/routing_change_frac"] for r in rows["grpo"]) > 0
    # the router itself still moves under replay: the probe (router free) sees changes
    assert max(p["change_frac"] for p in probe["grpo_r2"]) > 0
    for v in compare.DEFAULT_VARIANTS:
        for p in probe[v]:
            assert 0 <= p["change_frac"] <= p["token_change_frac"] <= 1  # a changed choice changes its token's set


def _integral(x: float) -> bool:
    return abs(x - round(x)) < 1e-6


def test_clip_fraction_units(comparison):
    """GSPO clips sequences: its clip fractions are multiples of 1 / (sequences of the step); GRPO
    clips tokens: multiples of 1 / (response tokens of the step), and not of 1 / sequences."""
    rows = comparison["rows"]
    for v in ("gspo", "gspo_token"):
        for r in rows[v]:
            n = r["loss/num_sequences"]
            assert n == 16
            for key in ("loss/clip_frac_low", "loss/clip_frac_high"):
                assert _integral(r[key] * n), (v, r["step"], key, r[key])
    token_only = 0
    for v in ("grpo", "grpo_r2"):
        for r in rows[v]:
            n_seq, n_tok = r["loss/num_sequences"], r["loss/num_tokens"]
            for key in ("loss/clip_frac_low", "loss/clip_frac_high"):
                assert _integral(r[key] * n_tok), (v, r["step"], key, r[key])
                token_only += not _integral(r[key] * n_seq)
    assert token_only > 0, "GRPO never clipped a token count that is not a whole number of sequences"
    units = {v: t["clip_unit"] for v, t in comparison["summary"]["table"].items()}
    assert units == {"gspo": "sequences", "gspo_token": "sequences", "grpo": "tokens", "grpo_r2": "tokens"}


def test_stress_overrides():
    from megatron_gspo.config import load_job_config
    from megatron_gspo.train import DEMO_CONFIG

    ov = compare.build_overrides(DEMO_CONFIG, [], steps=5, stress=True)
    cfg = load_job_config(DEMO_CONFIG, ov)
    assert cfg.train.num_steps == 5 and cfg.train.num_minibatches == compare.STRESS_MINIBATCHES
    assert cfg.optimizer.lr == pytest.approx(compare.STRESS_LR_MULT * load_job_config(DEMO_CONFIG).optimizer.lr)
    # a rollout not divisible by the requested count: the largest divisor below it
    ov = compare.build_overrides(DEMO_CONFIG, ["train.prompts_per_step=3", "generation.n_samples_per_prompt=2"],
                                 steps=None, stress=True, stress_minibatches=4)
    assert load_job_config(DEMO_CONFIG, ov).train.num_minibatches == 3


def test_report_over_several_seeds(tmp_path):
    """--seeds layout (OUT/<variant>/seed_<s>/): mean ± sd over seeds in the table, plots from the means."""
    import random

    rng = random.Random(0)
    for v in ("gspo", "grpo_r2"):
        for seed in (1, 2, 3):
            d = tmp_path / v / f"seed_{seed}"
            d.mkdir(parents=True)
            with open(d / "metrics.jsonl", "w") as f:
                for step in range(1, 21):
                    f.write(json.dumps({
                        "step": step, "rollout/reward_mean": 0.5 + 0.01 * step + 0.05 * rng.random(),
                        "perf/gen_tokens": 100.0, "loss/loss": 0.01, "train/grad_norm": 1.0, "loss/clip_frac": 0.1,
                        "loss/seq_ratio/max": 1.01, "loss/seq_ratio/min": 0.99, "loss/entropy": 0.5,
                        "routing/routing_change_frac": 0.0 if v == "grpo_r2" else 0.02,
                        "routing/routing_change_frac/layer_0": 0.0 if v == "grpo_r2" else 0.02,
                        "train/skipped_updates": 0, "perf/step_time_s": 0.4}) + "\n")
    res = compare.report(str(tmp_path), quiet=True)
    t = res["table"]["gspo"]
    assert t["seeds"] == [1, 2, 3] and t["steps"] == 20
    assert math.isfinite(t["final_reward_std"]) and t["final_reward_std"] > 0
    md = (tmp_path / "summary.md").read_text()
    assert "mean ± sd over 3 seeds" in md and "seed 3" in md and "standard error" in md
    for name in compare.PLOTS:
        assert (tmp_path / "plots" / f"{name}.png").is_file()
