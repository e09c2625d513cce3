"""GSPO vs GSPO-token vs GRPO vs GRPO + routing replay (and GSPO's successors SAPO, CISPO, GMPO, LUSPO, the
peers' VESPO, DPPO-TV / DPPO-KL and MaxRL's advantages), side by side, reproducibly.

    python -m experiments.compare [config.yaml] [section.key=value ...]
        [--variants gspo,gspo_token,grpo,grpo_r2,sapo,cispo,gmpo,luspo,vespo,dppo_tv,dppo_kl,dppo_tv_kl,gspo_maxrl] [--out DIR] [--steps N] [--seeds 1234,1,2]
        [--section NAME]
        [--stress [--stress-minibatches 8] [--stress-lr-mult 2]] [--nproc-per-node N] [--docs-dir DIR]
        [--no-probe] [--probe-rows 64] [--threads N] [--variant-override VARIANT:key=value]
        [--in-process] [--fresh-init] [--report-only] [--quiet]

Run from the repository root. Every variant starts from one shared initial model and sees the same
prompts; each runs the packaged ``Trainer`` unchanged, with a routing probe attached as a hook. It
writes only into ``--out`` (default ``runs/compare``): ``<variant>[/seed_<s>]/{metrics.jsonl,
tensorboard/, probe.jsonl, train.log}``, ``plots/*.png``, ``summary.md``, ``summary.json`` and
``compare.json``; ``--docs-dir docs`` also refreshes the generated parts of docs/comparison.md,
which explains the comparison and how to read it.

The modules, in the order a comparison uses them:

    cli.py       the command line; ``_worker`` and ``--report-only`` dispatch
    variants.py  the variants (overrides of one job) and the --stress knobs
    run.py       the shared initial model, then each variant x seed in a fresh process (or torchrun,
                 or in this process), compare.json
    worker.py    one run: ``Trainer(cfg, hooks=[RoutingProbe])`` + ``run_trainer``; ``--save-init``
    probe.py     RoutingProbe: routing change per optimizer update with the router free (a TrainerHook)
    results.py   the run directories -> per-run and per-variant numbers, GSPO vs GSPO-token consistency
    plots.py     the PNGs
    report.py    summary.md / summary.json, the plain observations, the --docs-dir sections
    _shared.py   machine facts, smoothing and NaN-tolerant means (to become megatron_gspo's shared helpers)
"""
