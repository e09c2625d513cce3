"""The GSPO / GSPO-token / GRPO / GRPO+R2 comparison (experiments/compare) at a tiny scale.

One comparison (SFT warm start once, 4 variants x 3 steps, in-process to keep the start-up cost of
megatron low) is shared by the `comparison` tests; they check the artifacts, that nothing is
written outside --out (and --docs-dir), and the structural facts the comparison is meant to show.
The probe tests run the packaged Trainer with the probe as its hook, without the orchestrator.
"""

import hashlib
import json
import math
import os
import shutil

import pytest

from experiments.compare import cli, plots, report, run, variants
from experiments.compare.probe import RoutingProbe

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = 3
MINIBATCHES = 2
JOB = [
    "parallel.device=cpu",  # the CPU path on any machine (tests/conftest.py: in-process tests state their device)
    "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "generation.max_new_tokens=4",
    "train.micro_batch_size=8", f"train.num_minibatches={MINIBATCHES}", "train.sft_steps=2",
    "train.sft_batch_size=16",
    # a dense reward: non-zero advantages from the first step; a large lr so that ratios leave 1
    # enough for GRPO to clip tokens within 3 steps
    f"reward.name={HERE}/reward_plugins.py:digit_fraction", "optimizer.lr=1e-2",
]
DEFAULT = variants.DEFAULT_VARIANTS


def _digest(paths) -> dict:
    return {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    out, docs, cwd = root / "out", root / "docs", root / "cwd"
    (docs / "img").mkdir(parents=True)
    cwd.mkdir()
    # the docs copy starts as the repository's page: the run must replace its default section only
    shutil.copyfile(os.path.join(ROOT, "docs", "comparison.md"), docs / "comparison.md")
    repo_docs = [os.path.join(ROOT, "docs", "comparison.md")] + sorted(
        os.path.join(ROOT, "docs", "img", f) for f in os.listdir(os.path.join(ROOT, "docs", "img")))
    before = _digest(repo_docs)
    old = os.getcwd()
    os.chdir(cwd)  # anything written relative to the working directory would land here
    try:
        rc = cli.main(["--in-process", "--quiet", "--steps", str(STEPS), "--out", str(out), "--docs-dir", str(docs), *JOB])
    finally:
        os.chdir(old)
    assert rc == 0, (out / "gspo" / "train.log").read_text() if (out / "gspo" / "train.log").exists() else rc
    rows = {v: [json.loads(line) for line in open(out / v / "metrics.jsonl")] for v in DEFAULT}
    probe = {v: [json.loads(line) for line in open(out / v / "probe.jsonl")] for v in DEFAULT}
    summary = json.load(open(out / "summary.json"))
    return dict(out=out, docs=docs, cwd=cwd, rows=rows, probe=probe, summary=summary,
                repo_docs_unchanged=_digest(repo_docs) == before)


@pytest.mark.slow
def test_artifacts_exist_with_finite_numbers(comparison):
    out = comparison["out"]
    for name in plots.PLOTS:
        png = out / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    md = (out / "summary.md").read_text()
    assert "python -m experiments.compare" in md and "load average at the start" in md
    for name in report.FIGURES:
        assert f"](plots/{name}.png)" in md
    for v in DEFAULT:
        assert variants.VARIANTS[v]["label"] in md
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
    assert (out / run.INIT_DIR / "metadata.json").is_file()
    meta = json.load(open(out / "compare.json"))
    for v, r in meta["runs"].items():
        (entry,) = r["seeds"]
        assert f"checkpoint.load={out / run.INIT_DIR}" in entry["overrides"] and "train.sft_steps=0" in entry["overrides"]
    # the same first rollout for every variant (same weights, data and seeds)
    first = {v: comparison["rows"][v][0]["rollout/reward_mean"] for v in DEFAULT}
    assert len(set(first.values())) == 1, first


@pytest.mark.slow
def test_writes_only_into_out_and_docs_dir(comparison):
    assert os.listdir(comparison["cwd"]) == []
    assert comparison["repo_docs_unchanged"]
    page = (comparison["docs"] / "comparison.md").read_text()
    original = open(os.path.join(ROOT, "docs", "comparison.md"), encoding="utf-8").read()
    begin, end = "<!-- compare:default:begin -->", "<!-- compare:default:end -->"
    # the hand-written prose around the generated section, and the other sections, are untouched
    assert page.split(begin)[0] == original.split(begin)[0]
    assert page.split(end)[1] == original.split(end)[1]
    section = page.split(begin)[1].split(end)[0]
    assert section != original.split(begin)[1].split(end)[0]
    assert "python -m experiments.compare" in section and "--docs-dir" in section and "load average" in section
    images = [ln.split("](")[1].rstrip(")") for ln in section.splitlines() if ln.startswith("![")]
    assert images == [f"img/comparison_{name}.png" for name in report.FIGURES]
    for img in images:
        assert (comparison["docs"] / img).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_probe_in_tensorboard(comparison):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for v in DEFAULT:
        acc = EventAccumulator(str(comparison["out"] / v / "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        for tag in ("rollout/reward_mean", "loss/clip_frac", "routing/routing_change_frac",
                    "probe/routing_change_per_update", "probe/routing_change_per_update/layer_1"):
            assert tag in tags, (v, tag)
        # one point per RL step: the mean of the step's updates
        assert [e.step for e in acc.Scalars("probe/routing_change_per_update")] == list(range(1, STEPS + 1))


@pytest.mark.slow
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


@pytest.mark.slow
def test_routing_replay_zeroes_old_to_train_change_but_not_router_drift(comparison):
    rows, probe = comparison["rows"], comparison["probe"]
    for r in rows["grpo_r2"]:
        assert r["routing/routing_change_frac"] == 0.0
        assert r["routing/routing_change_frac/layer_0"] == 0.0 and r["routing/routing_change_frac/layer_1"] == 0.0
    # without replay the training forward of the later minibatch routes differently
    assert max(r["routing/routing_change_frac"] for r in rows["grpo"]) > 0
    # the router itself still moves under replay: the probe (router free) sees changes
    assert max(p["change_frac"] for p in probe["grpo_r2"]) > 0
    for v in DEFAULT:
        for p in probe[v]:
            assert 0 <= p["change_frac"] <= p["token_change_frac"] <= 1  # a changed choice changes its token's set


def _integral(x: float) -> bool:
    return abs(x - round(x)) < 1e-6


@pytest.mark.slow
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


# ----------------------------------------------------------------------------------------------
# The probe as a TrainerHook, on the packaged Trainer
# ----------------------------------------------------------------------------------------------

PROBE_STEPS = 3
PROBE_JOB = ["parallel.device=cpu", "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "generation.max_new_tokens=4",
             "train.micro_batch_size=8", f"train.num_minibatches={MINIBATCHES}", "train.sft_steps=0",
             f"train.num_steps={PROBE_STEPS}", f"reward.name={HERE}/reward_plugins.py:digit_fraction",
             "optimizer.lr=1e-2"]


def _train(out, probe_rows=None):
    """One run of the demo job (PROBE_JOB) in this process, step 2's old log-probs made non-finite (its
    updates skipped); -> (metrics rows, the first rollout)."""
    from megatron_gspo.config import load_job_config
    from megatron_gspo.testing.faults import FaultInjection
    from megatron_gspo.trainer.hooks import TrainerHook
    from megatron_gspo.train import DEMO_CONFIG, Trainer, run_trainer

    class FirstRollout(TrainerHook):
        batch = None

        def after_rollout(self, trainer, batch):
            self.batch = self.batch or batch

    first = FirstRollout()
    hooks = [FaultInjection("nan_logprob@2"), first]
    hooks += [RoutingProbe(str(out / "probe.jsonl"), probe_rows)] if probe_rows else []
    cfg = load_job_config(DEMO_CONFIG, PROBE_JOB + [f"train.output_dir={out}", "train.tensorboard=false"])
    assert run_trainer(Trainer(cfg, hooks=hooks)) == 0
    return [json.loads(line) for line in open(out / "metrics.jsonl")], first.batch


def test_probe_is_a_trainer_hook(tmp_path):
    """One probe row per APPLIED update (step 2's updates are skipped: non-finite old log-probs),
    fractions in [0, 1], the first update measured against the initial routes, only the real input
    positions of the first rows compared; and the probe does not change training."""
    rows_plain, _ = _train(tmp_path / "plain")
    rows, batch = _train(tmp_path / "probed", probe_rows=6)
    assert [r["train/skipped_updates"] for r in rows] == [0, MINIBATCHES, 0]
    probe = [json.loads(line) for line in open(tmp_path / "probed" / "probe.jsonl")]
    assert [(p["step"], p["update"]) for p in probe] == [(1, 1), (1, 2), (3, 3), (3, 4)]
    for p in probe:
        for m in (p, p["vs_init"]):
            assert 0 <= m["change_frac"] <= m["token_change_frac"] <= 1
            assert sorted(m["layers"]) == ["0", "1"]
            assert all(0 <= x["change_frac"] <= 1 for x in m["layers"].values())
        # every real input position of the 6 probe rows: prompt + response - the last token
        assert p["tokens"] == float((batch.seq_lengths[:6] - 1).sum())
    assert probe[0]["vs_init"]["change_frac"] == probe[0]["change_frac"]  # the routes before update 1 are the initial ones
    assert max(p["change_frac"] for p in probe) > 0
    # the probe's forwards do not touch training: the same numbers with and without it
    for a, b in zip(rows, rows_plain):
        assert {k: v for k, v in a.items() if not k.startswith("perf/")} == \
               {k: v for k, v in b.items() if not k.startswith("perf/")}


# ----------------------------------------------------------------------------------------------
# Overrides and the report alone
# ----------------------------------------------------------------------------------------------


def test_stress_overrides():
    from megatron_gspo.config import load_job_config
    from megatron_gspo.train import DEMO_CONFIG

    ov = variants.build_overrides(DEMO_CONFIG, [], steps=5, stress=True)
    cfg = load_job_config(DEMO_CONFIG, ov)
    assert cfg.train.num_steps == 5 and cfg.train.num_minibatches == variants.STRESS_MINIBATCHES
    assert cfg.optimizer.lr == pytest.approx(variants.STRESS_LR_MULT * load_job_config(DEMO_CONFIG).optimizer.lr)
    # a rollout not divisible by the requested count: the largest divisor below it
    ov = variants.build_overrides(DEMO_CONFIG, ["train.prompts_per_step=3", "generation.n_samples_per_prompt=2"],
                                  steps=None, stress=True, stress_minibatches=4)
    assert load_job_config(DEMO_CONFIG, ov).train.num_minibatches == 3


def test_every_variant_is_a_valid_job_with_its_loss_defaults(capsys):
    """Each variant (GSPO's successors included) loads as a job on the demo config, its loss at its
    paper's defaults even where the job set a clip range; --section names a docs section by a safe name."""
    from megatron_gspo.config import load_job_config
    from megatron_gspo.train import DEMO_CONFIG

    assert set(variants.FAMILY_VARIANTS) | set(variants.PEER_VARIANTS) <= set(variants.VARIANTS)
    for v in variants.VARIANTS:
        cfg = load_job_config(DEMO_CONFIG, ["loss.clip_ratio_high=0.3"] + variants.variant_overrides(v, {}))
        named = next(o.split("=", 1)[1] for o in variants.VARIANTS[v]["overrides"] if o.startswith("loss.name="))
        assert cfg.loss.name == named and cfg.loss.clip_ratio_high is None, v
        assert variants.clip_unit(v) != "?"
    assert cli.parse_args(["--section", "family_stress"]).section == "family_stress"
    assert variants.section_kind({"section": "family_stress", "stress": True}) == "family_stress"
    with pytest.raises(SystemExit):
        cli.parse_args(["--section", "../x"])
    assert "letters, digits, _ and - only" in capsys.readouterr().err


def test_old_docs_flag_is_refused_with_its_replacement(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--docs"])
    assert "--docs-dir" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--variants", ""], "--variants '' names no variant; give a comma-separated list from "),
    (["--variants", " , "], "--variants ' , ' names no variant"),
    (["--variants", "gspo,grpo", "--variant-override", "sapo:loss.sapo_tau_pos=2"],
     "--variant-override 'sapo:loss.sapo_tau_pos=2': variant 'sapo' is not run by this comparison (--variants "
     "gspo,grpo); add it to --variants or drop the override"),
    (["--variant-override", "gspo-optimizer.lr=1"], "--variant-override 'gspo-optimizer.lr=1': write "
                                                    "VARIANT:section.key=value"),
])
def test_variants_and_their_overrides_are_checked_before_any_work(capsys, argv, said):
    """An empty --variants ran 14 s of work, then KeyError; an override of a variant not run was ignored."""
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--steps", "0"], "train.num_steps must be an integer >= 1, got 0"),
    (["--variant-override", "grpo:optimizer.lrr=1"], "unknown config key optimizer.lrr"),
])
def test_a_refused_comparison_writes_nothing(tmp_path, capsys, argv, said):
    """Issue 47 P: refused, but an empty --out was left behind."""
    out = tmp_path / "a" / "out"
    assert cli.main([*argv, "--out", str(out), "--in-process", "--quiet"]) == 2
    assert said in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _write_seed_runs(out) -> None:
    """A finished --seeds directory (OUT/<variant>/seed_<s>/metrics.jsonl) of gspo and grpo_r2, 20 steps."""
    import random

    rng = random.Random(0)
    for v in ("gspo", "grpo_r2"):
        for seed in (1, 2, 3):
            d = out / v / f"seed_{seed}"
            d.mkdir(parents=True)
            with open(d / "metrics.jsonl", "w") as f:
                for step in range(1, 21):
                    f.write(json.dumps({
                        "step": step, "rollout/reward_mean": 0.5 + 0.01 * step + 0.05 * rng.random(),
                        "perf/gen_tokens": 100.0, "loss/loss": 0.01, "train/grad_norm": 1.0, "loss/clip_frac": 0.1,
                        "loss/seq_ratio/max": 1.01, "loss/seq_ratio/min": 0.99, "loss/entropy": 0.5,
                        "routing/routing_change_frac": 0.0 if v == "grpo_r2" else 0.02,
                        "routing/routing_change_frac/layer_0": 0.0 if v == "grpo_r2" else 0.02,
                        "train/skipped_updates": 0, "perf/step_time_s": 0.4, "rollout/response_length_mean": 2.5,
                        **({"eval/greedy_accuracy": 0.75} if step % 10 == 0 else {})}) + "\n")


def test_report_over_several_seeds(tmp_path):
    """--seeds layout (OUT/<variant>/seed_<s>/): mean ± sd over seeds in the table, plots from the means."""
    _write_seed_runs(tmp_path)
    res = report.report(str(tmp_path), quiet=True)
    t = res["table"]["gspo"]
    assert t["seeds"] == [1, 2, 3] and t["steps"] == 20
    assert math.isfinite(t["final_reward_std"]) and t["final_reward_std"] > 0
    md = (tmp_path / "summary.md").read_text()
    assert "mean ± sd over 3 seeds" in md and "seed 3" in md and "standard error" in md
    # the last held-out evaluation and the response length are columns (LUSPO's claim is about length)
    assert t["response_length_final"] == pytest.approx(2.5) and t["heldout_accuracy"] == pytest.approx(0.75)
    assert "held-out greedy accuracy (last eval)" in md and "Mean response length over the last 10 steps" in md
    for name in plots.PLOTS:
        assert (tmp_path / "plots" / f"{name}.png").is_file()


def test_docs_dir_sections(tmp_path):
    """--report-only --docs-dir: a kind the page lacks is appended under a heading; reporting again
    replaces the section between its markers and nothing else (the same page twice)."""
    out, docs = tmp_path / "out", tmp_path / "docs"
    _write_seed_runs(out)
    meta = {"command": "python -m experiments.compare --stress --seeds 1,2,3", "config": "job.yaml", "stress": True,
            "stress_minibatches": 4, "stress_lr_mult": 3.0, "num_minibatches": 4, "num_steps": 20, "lr": 3e-3,
            "model": "tiny: 2 layers", "rollout": "4 prompts x 4 samples", "overrides": [], "seeds": [1, 2, 3],
            "variants": ["gspo", "grpo_r2"], "init": {"how": "seeded initialization"}, "threads": 1,
            "total_wall_s": 90.0, "date": "2026-01-01T00:00:00+00:00", "machine": {"cpus": 2, "gpus": "none (CPU)"}}
    (out / "compare.json").write_text(json.dumps(meta))
    docs.mkdir()
    (docs / "comparison.md").write_text("# Hand-written title\n\nProse.\n")
    assert cli.main(["--report-only", "--quiet", "--out", str(out), "--docs-dir", str(docs)]) == 0
    page = (docs / "comparison.md").read_text()
    assert page.startswith("# Hand-written title\n\nProse.\n\n## Stress comparison: job.yaml (--stress: 4 minibatches")
    assert page.count("<!-- compare:stress_4mb_lr3x:begin -->") == 1 and page.rstrip().endswith(
        "<!-- compare:stress_4mb_lr3x:end -->")
    assert "| seeds (train.seed and generation.seed) | 1, 2, 3 |" in page
    for name in report.FIGURES:
        assert f"](img/comparison_stress_4mb_lr3x_{name}.png)" in page
        assert (docs / "img" / f"comparison_stress_4mb_lr3x_{name}.png").is_file()
    # hand edits around the section survive a new report; the section is replaced in place
    (docs / "comparison.md").write_text(page.replace("Prose.", "Prose, edited."))
    assert cli.main(["--report-only", "--quiet", "--out", str(out), "--docs-dir", str(docs)]) == 0
    assert (docs / "comparison.md").read_text() == page.replace("Prose.", "Prose, edited.")


def test_runs_as_a_module_from_the_repository_root():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "experiments.compare", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "--docs-dir" in p.stdout and "--variant-override" in p.stdout, p.stderr
