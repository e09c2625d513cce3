"""The docs stay true to the code: the generated configuration reference is current, and every
config override, metric name and internal link mentioned in docs/*.md and README.md exists, as does
every module and file of the repository named there or in a comment or docstring of its Python files."""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize
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


def test_readme_labels_what_has_never_run_on_a_gpu():
    """Issue 46: the README offered Transformer Engine, FP8, CUDA graphs with NCCL inside and the alltoall
    dispatcher as features; none has run on a GPU. Each is labelled untested on GPU, in the intro too,
    until a GPU run says otherwise (then move it out of the table)."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert "Transformer Engine / FP8 on GPU (**untested on GPU**" in text
    section = text.split("### What has run on a GPU", 1)[1].split("\n## ", 1)[0]
    assert "Everything below is **untested on GPU** until a GPU run says\notherwise" in section
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| feature")]
    for feature in ("Transformer Engine's kernels", "FP8 (", "CUDA graphs with NCCL inside", "alltoall token dispatcher"):
        assert sum(ln.startswith(f"| {feature}") or f"| the {feature}" in ln for ln in rows) == 1, (feature, rows)


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
            elif sub is not None and dataclasses.is_dataclass(fields[key]):  # a sub-section: rollout.vllm.<key>
                if sub not in {f.name for f in dataclasses.fields(fields[key])}:
                    bad.append(f"{where}:{n}: {m.group(0).strip()} (no key {section}.{key}.{sub})")
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
# a module path (rollout/prepare.py, data/tokenizer.py) is not a metric name
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
                LossConfig(name="cispo"), LossConfig(name="gmpo"), LossConfig(name="luspo"), LossConfig(name="vespo"),
                LossConfig(name="dppo_tv"), LossConfig(name="dppo_kl")):
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
    from megatron_gspo.algorithms.rollout_correction import CORRECTIONS

    for mode in CORRECTIONS:
        keys |= set(correction_weights(old, logp, mask, mode, "token", 0.5, 2.0, logp=logp, advantages=adv)[1])
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
    keys |= {f"perf/{name}_s" for name in re.findall(r"self\.timer(?:\.record)?\(\"(\w+)\"", src)}
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
# Module and file paths, in the docs and in the code's comments and docstrings
# ----------------------------------------------------------------------------------------------

# A line that names an old path on purpose (a map of moved modules, a table of past trees) says so.
KEEP_PATH = "keep-path"
# Files of other projects that comments and docs name by their file name, and placeholders of examples.
NOT_OURS = {"fp8_utils.py": "megatron-core", "moe_utils.py": "megatron-core", "quantization.py": "Transformer Engine",
            "core_algos.py": "verl", "moe_logging.py": "megatron-core",
            "my_losses.py": "docs/algorithms.md's plug-in loss example", "file.py": "the reward spec's path:function example",
            "x.py": "tests/test_tools.py's hand-made trees", "y.py": "(the same)", "rt.py": "(the same)"}
# ``name.attr`` references whose first part is not a module: torch.distributed imported as ``dist``; a
# variable of routing/metrics.py; placeholders ("section.field").
NOT_MODULES = {"dist", "step_stats", "section"}
_DOTTED = re.compile(r"(?<![\w.])megatron_gspo(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w.-]*/)+(?:[\w-]+\.py\b|(?=[\s`'\"):,;]|$)))")
_BARE = re.compile(r"(?<![\w./-])(\w+\.py)\b")
_SHORT = re.compile(r"(?<![\w./-])([a-z_]\w*)\.([A-Za-z_]\w*)")


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.split()
    return [os.path.relpath(os.path.join(d, n), ROOT).replace(os.sep, "/")  # not a git checkout
            for d, _, names in os.walk(ROOT) if "/." not in d for n in names]


def _comment_lines(path: str):
    """(line number, text) of the comments and docstrings (module, class, function) of a Python file."""
    with open(path, encoding="utf-8") as f:
        src = f.read()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src, path)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                for i, text in enumerate(first.value.value.splitlines()):
                    yield first.lineno + i, text


def _prose(files: list[str]):
    """(file, line number, text) of every doc line and every comment / docstring line of the Python files."""
    yield from _lines()
    for rel in files:
        if rel.endswith(".py"):
            for n, text in _comment_lines(os.path.join(ROOT, rel)):
                yield rel, n, text


class _Package:
    """What the package defines, read off its source: module -> file, and each module's top-level names."""

    def __init__(self, files: list[str]) -> None:
        self.modules = {}  # dotted name -> file
        for rel in files:
            if rel.startswith("megatron_gspo/") and rel.endswith(".py"):
                parts = rel[:-3].split("/")
                self.modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = rel
        self.names = {m: self._top_level(rel) for m, rel in self.modules.items()}
        self.defined_in: dict[str, set[str]] = {}  # a def / class / CONSTANT -> the modules that define it
        for m, (defs, _) in self.names.items():
            for name in defs:
                self.defined_in.setdefault(name, set()).add(m)

    @staticmethod
    def _top_level(rel: str) -> tuple[dict, set]:
        """({name defined here: its class body's names, or None}, {every other bound name: imports, lazy exports})."""
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), rel)
        defs, bound = {}, set()
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                defs[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} | {
                    t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs[node.name] = None
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        (defs.__setitem__(t.id, None) if t.id.isupper() else bound.add(t.id))
                        if t.id == "_EXPORTS":
                            bound |= set(ast.literal_eval(node.value))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        return defs, bound

    def resolve_dotted(self, name: str) -> bool:
        """A dotted name under megatron_gspo (a module, then perhaps a name of it and one of a class's): its
        longest prefix that is a module exists, and that module defines what follows."""
        parts = name.split(".")
        k = next((k for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in self.modules), 0)
        if k == 0:
            return False
        rest, (defs, bound) = parts[k:], self.names[".".join(parts[:k])]
        if not rest:
            return True
        if rest[0] not in defs and rest[0] not in bound:
            return False
        body = defs.get(rest[0])
        return len(rest) == 1 or body is None or rest[1] in body

    def holder(self, module: str, name: str) -> bool:
        """``module.name`` (``module`` the last part of a dotted name): it defines or binds ``name`` (or a class
        of it has a method ``name``: ``stopping.check``), or is a package one of whose modules defines it."""
        for m, (defs, bound) in self.names.items():
            if m.split(".")[-1] != module:
                continue
            if name in defs or name in bound or any(body and name in body for body in defs.values()):
                return True
            if any(d.startswith(m + ".") for d in self.defined_in.get(name, ())):
                return True
        return False


def _ours(path: str, tops: set) -> bool:
    """A path into this repository (its first part a top-level entry, a package of megatron_gspo or a
    directory of tests/), not a file of megatron-core, TE or another project."""
    return path.split("/")[0] in tops


def _path_exists(path: str, files: list[str], dirs: set) -> bool:
    path = path.rstrip("/")
    return path in dirs or any(f == path or f.endswith("/" + path) for f in files)


@functools.lru_cache(maxsize=None)
def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _config_keys() -> set:
    return {f"{s}.{k}" for s, keys in _job_fields().items() for k in keys}


def stale_module_paths() -> list[str]:
    """``file:line: name (why)`` for every module path or file named in the docs, comments and docstrings
    that does not exist: dotted names (``megatron_gspo.trainer.loop.Trainer``: the module, and the name it
    goes on to), paths into the repository (``megatron_gspo/trainer/loop.py``, ``trainer/loop.py``,
    ``dist_scripts/run_job.py``), bare file names (``loop.py``), and ``module.name`` references whose
    module does not hold the name (a constant named through the module it left)."""
    files = _tracked_files()
    pkg = _Package(files)
    dirs = {os.path.dirname(f) for f in files} | {"/".join(f.split("/")[i:-1]) for f in files for i in range(1, f.count("/"))}
    tops = {f.split("/")[0] for f in files} | {d.split("/")[-1] for d in dirs if d.count("/") == 1}
    basenames = {os.path.basename(f) for f in files}
    keys, bad = _config_keys(), []
    for where, n, line in _prose(files):
        if KEEP_PATH in line:
            continue
        line = re.sub(r"<!-- check: .*? -->", "", line)
        for m in _DOTTED.finditer(line):
            if not pkg.resolve_dotted(m.group(0)):
                bad.append(f"{where}:{n}: {m.group(0)} (no such module or name)")
        for m in _PATH.finditer(line):
            p = m.group(1)
            if _ours(p, tops) and (p.endswith(".py") or p.endswith("/")) and not _path_exists(p, files, dirs):
                bad.append(f"{where}:{n}: {p} (no such file or directory)")
        for m in _BARE.finditer(line):
            if m.group(1) not in basenames and m.group(1) not in NOT_OURS:
                bad.append(f"{where}:{n}: {m.group(1)} (no such file)")
        for m in _SHORT.finditer(line):
            module, name = m.groups()
            if (name in pkg.defined_in and module not in NOT_MODULES and module != "megatron_gspo"
                    and m.group(0) not in keys and not _importable(module)
                    and not pkg.holder(module, name)):
                bad.append(f"{where}:{n}: {m.group(0)} (no module {module!r} holding {name}: "
                           f"it is in {', '.join(sorted(pkg.defined_in[name]))})")
    return bad


def test_module_paths_named_in_docs_and_comments_exist():
    bad = stale_module_paths()
    assert not bad, "module paths named in docs, comments and docstrings that do not exist:\n" + "\n".join(bad)


def test_the_module_path_check_sees_each_kind_of_stale_name(tmp_path, monkeypatch):
    """The check on a doc page of its own: each kind of stale name is reported, the live ones are not."""
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "`megatron_gspo.trainer.loop.Trainer.run` `megatron_gspo.trainer.StoppedFor` `trainer/loop.py`",
        "`megatron_gspo.hookz` `megatron_gspo.trainer.loop.Nothing` `megatron_gspo/trainerz/loop.py` `trainer/lop.py`",
        "`loop.py` `looop.py` `comm.all_reduce` `faults.all_reduce` `rollout.world_size=2` `decode.Trainer` <!-- keep-path -->",
        "`loop.py` `looop.py` `comm.all_reduce` `faults.all_reduce` `rollout.world_size=2` `decode.Trainer`"]) + "\n")
    monkeypatch.setattr(sys.modules[__name__], "DOC_FILES", [str(page)])
    monkeypatch.setattr(sys.modules[__name__], "_tracked_files",
                        lambda: [f for f in _TRACKED if not f.endswith(".py") or f.startswith("megatron_gspo/")])
    got = [b.split(": ", 1)[1].split(" (")[0] for b in stale_module_paths() if b.startswith(os.path.relpath(page, ROOT))]
    assert got == ["megatron_gspo.hookz", "megatron_gspo.trainer.loop.Nothing", "megatron_gspo/trainerz/loop.py",
                   "trainer/lop.py", "looop.py", "faults.all_reduce", "decode.Trainer"], got


_TRACKED = _tracked_files()


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
