"""The package's imports: a graph without a cycle, and every module importing alone in a fresh interpreter.

A cycle (config importing every section's module, each importing ConfigError back; the stop flag
loading the tests' fault injection, which imported the stop flag back) is read off the source: the
package's import graph, every import statement counted (``import_graph``). A cycle that Python happens
to survive today only shows when a module is the *first* one imported, e.g. `python -c "import
megatron_gspo.trainer.optim"`: so each module is also imported first, in an interpreter of its own
(a fork of one that loaded only third-party packages). And the config package is a leaf: importing it
loads nothing else of megatron_gspo but the leaves `errors` and `textfile` (reading files as UTF-8,
with the file and line of a bad byte).
"""

import ast
import os
import pkgutil
import subprocess
import sys
from typing import Optional

import pytest

import checkpoints_tools
import experiments
import megatron_gspo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megatron_gspo.__file__)))


# ----------------------------------------------------------------------------------------------
# The import graph (read off the source)
# ----------------------------------------------------------------------------------------------


def _module_files(root: str, package: str) -> dict[str, str]:
    """{dotted module name: file} of every .py file of ``package`` (a package is its __init__)."""
    out = {}
    for d, _, names in os.walk(os.path.join(root, package)):
        for n in names:
            if n.endswith(".py"):
                parts = os.path.relpath(os.path.join(d, n), root)[:-3].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(d, n)
    return out


def _lazy_exports(path: str) -> dict[str, str]:
    """A package's ``_EXPORTS`` (name -> submodule; megatron_gspo.lazy_exports), or {}."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def import_graph(root: str = ROOT, package: str = "megatron_gspo") -> dict[str, set[str]]:
    """{module: the package's modules it imports} (dotted names). What counts:

    * every import statement of the file: at module level, inside functions and methods (imported on
      first call), under ``if TYPE_CHECKING`` and in try / except blocks alike: a function-level import
      is still a dependency, only a later one;
    * ``import a.b`` and ``from a import b`` (b a module) name module a.b; ``from a.b import c`` (c a
      name) names a.b, or, when a.b is a lazy-export package (``_EXPORTS``), the submodule that defines c
      (importing the name imports that module); relative imports resolved the same way;
    * not counted: the parent packages Python initialises on the way (a package's ``__init__`` that
      imports its own submodules, which import their siblings, is how packages are built, not a cycle),
      and ``importlib.import_module`` with a computed name (the lazy exports, read above; a user's reward
      module)."""
    files = _module_files(root, package)
    exports = {m: _lazy_exports(p) for m, p in files.items() if p.endswith("__init__.py")}

    def target(module: str, name: Optional[str]) -> Optional[str]:
        if name is not None and f"{module}.{name}" in files:
            return f"{module}.{name}"
        if name is not None and name in exports.get(module, {}):
            return f"{module}.{exports[module][name]}"
        return module if module in files else None

    graph: dict[str, set[str]] = {}
    for mod, path in sorted(files.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_pkg = path.endswith("__init__.py")
        out: set[Optional[str]] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out.update(target(a.name, None) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                out.update(target(base, a.name) for a in node.names)
        graph[mod] = {m for m in out if m is not None and m != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each as one closed
    path through it (a -> b -> ... -> a), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(_closed_path(graph, set(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _closed_path(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``comp`` (breadth-first inside it)."""
    start = min(comp)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & comp):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


def test_the_import_graph_counts_function_level_and_lazy_imports(tmp_path):
    """A hand-made package: a cycle closed by an import inside a function, one through a lazy export, and
    a package __init__ importing its submodules (not a cycle)."""
    pkg = tmp_path / "cyc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import cyc.b\n")
    (pkg / "b.py").write_text("def f():\n    from cyc import a\n")
    (pkg / "c.py").write_text("from cyc.sub import Thing\n")
    (pkg / "sub" / "__init__.py").write_text('from cyc.sub import d\n_EXPORTS = {"Thing": "e"}\n')
    (pkg / "sub" / "d.py").write_text("X = 1\n")
    (pkg / "sub" / "e.py").write_text("from . import d\nfrom ..c import y\nThing = 2\n")
    g = import_graph(str(tmp_path), "cyc")
    assert g["cyc.c"] == {"cyc.sub.e"} and g["cyc.sub.e"] == {"cyc.sub.d", "cyc.c"} and g["cyc.sub"] == {"cyc.sub.d"}
    assert cycles(g) == [["cyc.a", "cyc.b", "cyc.a"], ["cyc.c", "cyc.sub.e", "cyc.c"]]


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 90 and "megatron_gspo.trainer.loop" in graph["megatron_gspo.train"]
    found = cycles(graph)
    assert not found, "import cycles (function-level imports counted):\n" + "\n".join(" -> ".join(c) for c in found)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to the package's top-level parts (``megatron_gspo.config``, ``megatron_gspo.train``,
    ``megatron_gspo`` for the root's own __init__): an edge wherever one of a part's modules imports another's."""
    out: dict[str, set[str]] = {_part(m): set() for m in graph}
    for m, deps in graph.items():
        out[_part(m)].update(_part(d) for d in deps if _part(d) != _part(m))
    return out


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_the_package_graph_counts_an_import_inside_a_function(tmp_path):
    """Two subpackages whose modules do not form a cycle, but whose packages do (a.x -> b.y, b.z -> a.w, the
    second inside a function)."""
    pkg = tmp_path / "cyc"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from cyc.b import y\n")
    (pkg / "a" / "w.py").write_text("W = 1\n")
    (pkg / "b" / "y.py").write_text("Y = 1\n")
    (pkg / "b" / "z.py").write_text("def f():\n    from cyc.a.w import W\n")
    g = import_graph(str(tmp_path), "cyc")
    assert cycles(g) == []
    assert cycles(package_graph(g)) == [["cyc.a", "cyc.b", "cyc.a"]]


def test_the_packages_import_each_other_without_a_cycle():
    """config below algorithms (the loss specs the job's rules read live in config), runtime below trainer and
    rollout (the hook interface the rollout sources take: runtime/hooks.py): docs/architecture.md's layering."""
    graph = import_graph()
    found = cycles(package_graph(graph))

    def via(a: str, b: str) -> str:  # the module imports that make the edge a -> b
        return ", ".join(sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                                if _part(m) == a and _part(d) == b)[:3])

    assert not found, "package cycles (function-level imports counted):\n" + "\n".join(
        " -> ".join(c) + "".join(f"\n  {a} -> {b}: {via(a, b)}" for a, b in zip(c, c[1:])) for c in found)


def test_only_the_entry_point_imports_the_test_fault_injection():
    """testing/ is the tests' code: the entry point adds it when MEGATRON_GSPO_FAULTS is set, nothing of the
    runtime, the trainer or the rollout ranks imports it (so no production path loads it)."""
    graph = import_graph()
    users = sorted(m for m, deps in graph.items()
                   if not m.startswith("megatron_gspo.testing") and any(d.startswith("megatron_gspo.testing") for d in deps))
    assert users == ["megatron_gspo.train"], users


# ----------------------------------------------------------------------------------------------
# Each module alone, in a fresh interpreter
# ----------------------------------------------------------------------------------------------


def _modules():
    out = []
    for pkg in (megatron_gspo, checkpoints_tools, experiments):
        out.append(pkg.__name__)
        out += [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=pkg.__name__ + ".")]
    return sorted(out)


# One interpreter imports the heavy third-party packages once (torch, megatron-core, transformers: ~5 s
# of every fresh start) and nothing of ours, then forks a child per module: each child is an interpreter
# in which the module is the first of ours imported, as `python -c "import X"` would be, at a fraction
# of the cost (165 modules: ~15 s instead of ~6 min on a 2-core machine).
_IMPORT_EACH_IN_A_FORK = r"""
import importlib, json, os, sys, traceback, warnings
warnings.simplefilter("ignore")
import numpy, torch, transformers, megatron.core  # noqa: F401 (third-party only)
OURS = ("megatron_gspo", "checkpoints_tools", "experiments")
early = sorted(m for m in sys.modules if m.split(".")[0] in OURS)
assert not early, f"the parent loaded modules of ours: {early}"
failed = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: import, report any error, leave without running the parent's exit handlers
        os.close(r)
        try:
            importlib.import_module(name)
            msg = b""
        except BaseException:
            msg = traceback.format_exc()[-1500:].encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode()
    _, status = os.waitpid(pid, 0)
    if msg or status:
        failed[name] = msg or f"the child died: wait status {status}"
print(json.dumps(failed))
"""


def import_each_alone(modules: list) -> dict:
    """{module: its import error} for each module that does not import as the first of ours loaded."""
    import json

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-c", _IMPORT_EACH_IN_A_FORK, *modules], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter():
    modules = _modules()
    assert len(modules) > 30
    failed = import_each_alone(modules)
    assert not failed, "\n\n".join(f"{n}:\n{err}" for n, err in failed.items())


def test_a_module_that_imports_only_after_another_is_reported(tmp_path, monkeypatch):
    """The check itself: a package whose module b works only when module a was imported first (b reads a
    name a puts on the package) is reported for b alone, and a child's crash is reported too."""
    pkg = tmp_path / "megatron_gspo_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import megatron_gspo_probe_pkg as p\np.SHARED = 1\n")
    (pkg / "b.py").write_text("import megatron_gspo_probe_pkg as p\nVALUE = p.SHARED\n")
    (pkg / "c.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    failed = import_each_alone([f"megatron_gspo_probe_pkg.{m}" for m in "abc"])
    assert sorted(failed) == ["megatron_gspo_probe_pkg.b", "megatron_gspo_probe_pkg.c"], failed
    assert "AttributeError" in failed["megatron_gspo_probe_pkg.b"] and "SHARED" in failed["megatron_gspo_probe_pkg.b"]
    assert "wait status" in failed["megatron_gspo_probe_pkg.c"]


@pytest.mark.slow
def test_config_is_a_leaf():
    code = ("import sys, megatron_gspo.config; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron_gspo')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = eval(p.stdout.strip().splitlines()[-1])
    allowed = {"megatron_gspo", "megatron_gspo.errors", "megatron_gspo.textfile"}
    assert [m for m in loaded if m not in allowed and not m.startswith("megatron_gspo.config")] == []
