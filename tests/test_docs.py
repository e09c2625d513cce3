"""The docs stay true to the code: the generated configuration reference is current, and every
config override, metric name and internal link mentioned in docs/*.md and README.md exists."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re
import typing

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
DOC_FILES = sorted(glob.glob(os.path.join(DOCS, "*.md"))) + [os.path.join(ROOT, "README.md")]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", os.path.join(DOCS, "gen_config_reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _lines():
    """(file relative to the repo, line number, text) of every doc line."""
    for path in DOC_FILES:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                yield os.path.relpath(path, ROOT), n, line


def test_doc_set_exists():
    names = {os.path.basename(p) for p in DOC_FILES}
    for page in ("index.md", "quickstart.md", "configuration.md", "algorithms.md", "checkpoints.md",
                 "multinode.md", "troubleshooting.md"):
        assert page in names, f"docs/{page} is missing"


def test_configuration_reference_is_current():
    gen = _load_generator()
    with open(gen.OUTPUT, encoding="utf-8") as f:
        committed = f.read()
    assert committed == gen.render(), (
        "docs/configuration.md is stale (a config field, default, comment or preset changed): "
        "run `python docs/gen_config_reference.py` and commit the result")


# ----------------------------------------------------------------------------------------------
# Overrides: section.key=value, --section.key value, section.mapping_field.sub=value
# ----------------------------------------------------------------------------------------------

# The syntax itself, written with placeholder names ("section.key=value").
PLACEHOLDERS = {"section"}
_OVERRIDE = re.compile(r"(?<![\w./-])(?:--)?([a-z_][a-z0-9_]*)\.([a-z_][a-z0-9_]*)(?:\.([a-z_][a-z0-9_]*))?(=|\s)")


def _job_fields() -> dict[str, dict[str, typing.Any]]:
    from megatron_gspo.config import JobConfig

    hints = typing.get_type_hints(JobConfig)
    out = {}
    for f in dataclasses.fields(JobConfig):
        cls = hints[f.name]
        out[f.name] = typing.get_type_hints(cls)
    return out


def test_overrides_in_docs_exist():
    sections = _job_fields()
    bad, seen = [], 0
    for where, n, line in _lines():
        # troubleshooting.md's commands give bad keys on purpose (tests/test_troubleshooting.py runs them)
        line = re.sub(r"<!-- check: .*? -->", "", line)
        for m in _OVERRIDE.finditer(line):
            section, key, sub, sep = m.groups()
            dashed = m.group(0).startswith("--")
            if sep != "=" and not dashed:
                continue  # "model.py " and the like: only key=value or --key value are overrides
            if section in PLACEHOLDERS:
                continue
            if section not in sections:
                bad.append(f"{where}:{n}: {m.group(0).strip()} (no section {section!r})")
                continue
            seen += 1
            fields = sections[section]
            if key not in fields:
                bad.append(f"{where}:{n}: {m.group(0).strip()} (no key {section}.{key})")
            elif sub is not None and typing.get_origin(fields[key]) is not dict and fields[key] is not dict:
                bad.append(f"{where}:{n}: {m.group(0).strip()} ({section}.{key} is not a mapping)")
    assert not bad, "stale config keys in the docs:\n" + "\n".join(bad)
    assert seen > 50  # the pattern still finds the docs' overrides


# ----------------------------------------------------------------------------------------------
# Metric names
# ----------------------------------------------------------------------------------------------

# Quoted log text that looks like a metric name ("non-finite loss/gradients, update skipped").
NOT_METRICS = {"loss/gradients"}
_PREFIXES = "loss|rollout|routing|perf|train|data|rollout_correction|dynamic_sampling|eval|async"
# a module path (rollout/prepare.py, data/rewards.py) is not a metric name
_METRIC = re.compile(r"(?<![\w/.-])((?:" + _PREFIXES + r")/[A-Za-z0-9_/@]*[A-Za-z0-9_])(?![A-Za-z0-9_/@])(?!\.py\b)")


def _known_metrics() -> set[str]:
    from megatron_gspo.algorithms.losses import LossConfig, compute_policy_loss, on_policy_metrics
    from megatron_gspo.routing import RoutingStats

    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    logp = (-torch.rand(B, T, generator=g)).requires_grad_()
    old, ref, ent = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g), torch.rand(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    keys: set[str] = set()
    for cfg in (LossConfig(name="gspo", kl_coef=0.1, entropy_coef=0.01), LossConfig(name="gspo_token"),
                LossConfig(name="grpo", dual_clip_c=3.0, kl_coef=0.1), LossConfig(name="sapo"),
                LossConfig(name="cispo"), LossConfig(name="gmpo"), LossConfig(name="luspo")):
        _, metrics = compute_policy_loss(cfg, logp, old, adv, mask, ref_logp=ref, entropy=ent)
        keys |= {f"loss/{k}" for k in metrics}
        keys |= {f"loss/{k}" for k in on_policy_metrics(logp, old, mask, metrics)}  # the trainer's first minibatch
    stats = RoutingStats.zeros(2, 4, 2)
    stats.num_tokens += 1
    stats.tokens_per_expert += 1
    stats.compared += 1
    keys |= set(stats.summary(prefix="routing/"))
    from megatron_gspo.algorithms.rollout_correction import correction_weights, mismatch_metrics

    keys |= set(mismatch_metrics(logp, old, mask, 0.5, 2.0))
    from megatron_gspo.algorithms.losses import on_policy_metrics

    keys |= {f"loss/{k}" for k in on_policy_metrics(logp, old, mask, metrics)}
    for mode in ("tis", "mis"):
        keys |= set(correction_weights(old, logp, mask, mode, "token", 0.5, 2.0)[1])
    keys.add("eval/pass@k")  # named by eval.k (evaluation.py)
    keys |= {f"async/staleness_frac_{j}" for j in range(2)}  # named by the staleness (rollout/remote.py)
    src = ""
    # where the trainer's, the rollout's and the evaluation's metrics are named
    for module in (os.path.join("trainer", "loop.py"), os.path.join("trainer", "evaluation.py"),
                   os.path.join("runtime", "logger.py"),  # perf/* and data/* (perf_metrics, data_metrics)
                   *(os.path.join("rollout", m) for m in ("prepare.py", "colocated.py", "remote.py"))):
        with open(os.path.join(ROOT, "megatron_gspo", module), encoding="utf-8") as f:
            src += f.read()
    keys |= set(re.findall(r"\"((?:" + _PREFIXES + r")/[A-Za-z0-9_/]+)\"", src))
    keys |= {f"perf/{name}_s" for name in re.findall(r"self\.timer\(\"(\w+)\"\)", src)}
    return keys


def test_metric_names_in_docs_exist():
    known = _known_metrics()
    assert {"loss/loss", "loss/seq_ratio/hist", "rollout/reward_mean", "routing/routing_change_frac",
            "perf/generate_s", "train/grad_norm"} <= known
    per_layer = {re.sub(r"layer_\d+$", "layer_N", k) for k in known}
    bad = []
    for where, n, line in _lines():
        for m in _METRIC.finditer(line):
            name = m.group(1)
            if name in known or re.sub(r"layer_\d+$", "layer_N", name) in per_layer or name in NOT_METRICS:
                continue
            if any(k.startswith(name + "/") for k in known):  # a family: "loss/seq_ratio/*"
                continue
            bad.append(f"{where}:{n}: {name}")
    assert not bad, "metric names in the docs that the code does not log:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------

_PYTHON_M = re.compile(r"python -m ([A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_])")


def test_python_m_modules_in_docs_exist():
    """Every `python -m <module>` the docs show runs from the repository root: a module that moved
    (the comparison went from the package to experiments/compare) leaves no stale command behind."""
    seen, bad = set(), []
    for where, n, line in _lines():
        for name in _PYTHON_M.findall(line):
            seen.add(name)
            if importlib.util.find_spec(name) is None:
                bad.append(f"{where}:{n}: python -m {name}")
    assert not bad, "commands in the docs that name no module:\n" + "\n".join(bad)
    assert {"megatron_gspo.train", "experiments.compare"} <= seen


# ----------------------------------------------------------------------------------------------
# Links between the pages
# ----------------------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    out, fence = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                fence = not fence
            elif not fence and line.startswith("#"):
                out.add(_slug(line.lstrip("#")))
    return out


@pytest.mark.parametrize("path", [p for p in DOC_FILES if p.startswith(DOCS)], ids=os.path.basename)
def test_internal_links_resolve(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            bad.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {os.path.relpath(dest, ROOT)}")
    assert not bad, f"{os.path.relpath(path, ROOT)}: broken links:\n" + "\n".join(bad)
