"""The walk of the main entry by its data: how often a reader of one RL step changes file, and climbs back.

    python tools/step_walk.py [--json] [--show] [section.key=value ...]

It runs one RL step of the default job (the packaged demo config with ``DEFAULT_OVERRIDES``: one step,
no warm start, no evaluation; plus any overrides) in this process, with ``run_trainer`` traced by
``sys.setprofile``, and reads the trace the way a reader follows the step through the source:

* **The calls followed.** Only the package's own functions (files under ``megatron_gspo/``), and only
  *direct* calls: a call written in a package function (seen through the frames of ``contextlib``,
  ``functools``, ``torch.nn.Module.__call__``, ``torch.autograd.Function.apply`` and torch's
  ``no_grad`` decorator, which only forward it). A package function that megatron-core or torch calls
  back (a module's ``forward`` inside ``GPTModel``, an autograd ``backward``, a log handler) is the
  model's or the framework's internals: neither it nor what it calls is part of the walk.
* **Read once.** A function is entered at its first call only; a later call of a function already read
  (the next micro-batch, the next decode step, the next ``Metric.mean``) is not followed again.
* **Stepped over.** Calls into the runtime layer (``STEP_OVER``: collectives, the parallel state,
  metrics plumbing, logging and timers, the stop flag and fault injection, the OOM wrapper, config,
  errors) are read as one line of the caller: the data does not change hands there.
* **A stay** is a maximal stretch of the walk in one file (a call to a function of the same file, or
  the return from one, continues the stay). Entering another file, or returning into one, starts a
  new stay.
* **A climb back up** is a stay in a file that an earlier stay already visited and that is *above* the
  file of the stay before it: it imports that file, directly or not, and not the other way round (the
  package's static import graph, imports inside functions included: ``import_graph``). Returning from a
  callee into its caller is one; going back down into a file read earlier (the trainer calling into
  rollout.py a second time) or sideways (a callback's file returning into a file it does not import) is
  a re-entry, not a climb.
* **A function's own nested code** (a comprehension, a lambda or a local def that the function itself
  calls) is part of its text: its calls are the function's calls (Python 3.12 inlines comprehensions; the
  walk must not depend on the interpreter).
* Walks reported: the **full** one, and **depth 2**, which follows calls at most two files below the entry
  (run_trainer -> the trainer -> the files the trainer calls, nothing under them); each also as the
  **reading order** (a return into the caller starts no stay: the functions in the order first read, a
  stay = consecutive functions of one file), and the reading order with a **package** as the place read
  (``megatron_gspo/rollout/`` for all its files; a top-level module is its own place).

The numbers printed: stays, files, climbs back up, and how often each file was entered. The walk is
deterministic for a given tree (same config, same code, any hash seed). A reading aid: no test holds the
code to its counts.

``STEP_OVER`` names the runtime package, config, errors, the OOM wrapper and the test fault injection
(``megatron_gspo/testing/``): the same modules the walk stepped over before the package was
restructured, at their new paths, so the numbers compare like for like.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megatron_gspo"

# The runtime layer a reader steps over (paths relative to the repository, fnmatch patterns): the
# runtime package, config, errors, the OOM wrapper and the test fault injection.
STEP_OVER: tuple[str, ...] = (
    "megatron_gspo/config/*", "megatron_gspo/errors.py", "megatron_gspo/runtime/*",
    "megatron_gspo/model/oom.py", "megatron_gspo/testing/*",
)

# Frames that only forward a call (a decorator, a context manager's __enter__, nn.Module.__call__), with
# the name of the function they forward to (None: any): a package function called through them was called
# by the package function beneath them. A module's forward *hooks* are called by nn.Module.__call__ too,
# but no package line calls them: they are not forwarded calls.
TRANSPARENT: tuple[tuple[str, Optional[str]], ...] = (
    ("*/contextlib.py", None), ("*/functools.py", None), ("*/torch/utils/_contextlib.py", None),
    ("*/torch/nn/modules/module.py", "forward"), ("*/torch/autograd/function.py", "forward"),
)

# One RL step: no supervised warm start before it, no evaluation after it (a one-step run would evaluate
# at its last step), no tensorboard files.
DEFAULT_OVERRIDES = ("train.num_steps=1", "train.sft_steps=0", "eval.interval=0", "train.tensorboard=false")


# ----------------------------------------------------------------------------------------------
# The call tree of the package's own functions
# ----------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One call of a package function: its file (repository-relative), qualified name, direct calls made."""

    file: str
    name: str
    children: list["Call"] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return self.file, self.name


def trace(fn: Callable[[], object], root: str = ROOT, package: str = PACKAGE,
          transparent: Iterable[tuple[str, Optional[str]]] = TRANSPARENT) -> Call:
    """Run ``fn()`` under sys.setprofile; the tree of direct package calls it made (root: ``fn`` itself,
    named "<traced>"). Calls from outside the package (callbacks) and their subtrees are left out."""
    pkg_dir = os.path.join(os.path.abspath(root), package) + os.sep
    transparent = tuple(transparent)
    # code file -> ("pkg", repository-relative path) | ("fwd", forwarded name or None) | None (elsewhere)
    kinds: dict[str, Optional[tuple[str, Optional[str]]]] = {}

    def kind(filename: str) -> Optional[tuple[str, Optional[str]]]:
        k = kinds.get(filename, False)
        if k is False:
            path = os.path.abspath(filename)
            k = None
            if path.startswith(pkg_dir):
                k = ("pkg", os.path.relpath(path, root).replace(os.sep, "/"))
            else:
                for pattern, name in transparent:
                    if fnmatch.fnmatch(path, pattern):
                        k = ("fwd", name)
                        break
            kinds[filename] = k
        return k

    def forwards(frame, callee: str) -> bool:
        k = kind(frame.f_code.co_filename)
        return k is not None and k[0] == "fwd" and k[1] in (None, callee)

    top = Call("<traced>", "<traced>")
    active: dict[int, Optional[Call]] = {}  # id(frame) -> its Call (None: a package frame outside the walk)
    me = sys._getframe()

    def profile(frame, event, arg) -> None:
        if event == "call":
            k = kind(frame.f_code.co_filename)
            if k is None or k[0] != "pkg":
                return
            parent = frame.f_back
            while parent is not None and forwards(parent, frame.f_code.co_name):
                parent = parent.f_back
            if parent is me or (parent is not None and parent.f_code is fn_code and parent.f_back is me):
                owner: Optional[Call] = top
            elif parent is not None and id(parent) in active:
                owner = active[id(parent)]
            else:
                owner = None
            node = None
            if owner is not None:
                node = Call(k[1], getattr(frame.f_code, "co_qualname", frame.f_code.co_name))  # 3.10: the name
                owner.children.append(node)
            active[id(frame)] = node
        elif event == "return":
            active.pop(id(frame), None)

    fn_code = getattr(fn, "__code__", None)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return top


# ----------------------------------------------------------------------------------------------
# The static import graph ("above")
# ----------------------------------------------------------------------------------------------


def import_graph(root: str = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """{file: the package files it imports, directly or not} (repository-relative paths). Every import
    statement of the file counts, those inside functions included; a statement imports the module it
    names (``from a.b import c``: a/b/c.py when c is a module, else a/b.py or a/b/__init__.py), not the
    parent packages Python initialises on the way (a module importing a sibling does not thereby sit
    above its own package's ``__init__``)."""
    files = {}
    for d, _, names in os.walk(os.path.join(root, package)):
        for n in names:
            if n.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")
                files[rel] = os.path.join(d, n)

    def resolve(module: str) -> Optional[str]:
        base = module.replace(".", "/")
        return next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in files), None)

    direct: dict[str, set[str]] = {}
    for rel, path in sorted(files.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        out: set[Optional[str]] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:  # ``from pkg import module`` names the module, else pkg itself
                    out.add(resolve(f"{node.module}.{a.name}") or resolve(node.module))
        direct[rel] = {p for p in out if p is not None and p != rel}
    closure: dict[str, set[str]] = {}
    for f in sorted(direct):  # breadth-first from each file: the same answer whatever the order (cycles too)
        seen, todo = set(), sorted(direct[f])
        while todo:
            g = todo.pop()
            if g not in seen:
                seen.add(g)
                todo.extend(sorted(direct.get(g, ())))
        closure[f] = seen - {f}
    return closure


# ----------------------------------------------------------------------------------------------
# The walk
# ----------------------------------------------------------------------------------------------


@dataclass
class Stay:
    file: str
    functions: list[str]  # in the order first read in this stay (a return into a function repeats it)

    def __str__(self) -> str:
        return f"{self.file}:{','.join(self.functions)}"


def package_of(file: str) -> str:
    """The package a file belongs to: ``megatron_gspo/rollout/`` for megatron_gspo/rollout/prepare.py; a
    top-level module (train.py, errors.py) is its own."""
    parts = file.split("/")
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else file


def by_unit(above: dict[str, set[str]], unit: Callable[[str], str]) -> dict[str, set[str]]:
    """The import graph between units: U imports V if a file of U imports a file of V (V != U)."""
    out: dict[str, set[str]] = {}
    for f, imported in above.items():
        u = unit(f)
        out.setdefault(u, set()).update(unit(g) for g in imported if unit(g) != u)
    return out


def walk(top: Call, step_over: Iterable[str] = STEP_OVER, max_depth: Optional[int] = None,
         returns: bool = True, unit: Callable[[str], str] = lambda f: f) -> list[Stay]:
    """The stays of a reader following ``top``'s calls (see the module doc: read once, runtime stepped over).

    ``max_depth``: follow calls at most that many files below the entry (a call into another file is one
    level; None: no limit). 2 is the trainer's own collaborators: run_trainer -> Trainer -> what it calls.
    ``returns``: a return into the caller's file starts a stay (True), or the walk is the reading order
    alone (False: the functions in the order first read, a stay = consecutive functions of one file).
    ``unit``: what a stay is in (the file; ``package_of``: the package)."""
    patterns = tuple(step_over)
    read: set[tuple[str, str]] = set()
    stays: list[Stay] = []

    def skipped(c: Call) -> bool:
        return c.key in read or any(fnmatch.fnmatch(c.file, p) for p in patterns)

    def at(file: str, name: str) -> None:
        if stays and stays[-1].file == file:
            if stays[-1].functions[-1] != name:
                stays[-1].functions.append(name)
        else:
            stays.append(Stay(file, [name]))

    def calls(node: Call) -> Iterable[Call]:
        """node's calls, with those of its own nested code (a comprehension, a lambda or a local def that it
        calls itself) as its own: they are lines of its text (Python 3.12 inlines comprehensions)."""
        for c in node.children:
            if c.file == node.file and c.name.startswith(node.name + ".<locals>."):
                yield from calls(c)
            else:
                yield c

    def visit(node: Call, depth: int) -> None:
        at(unit(node.file), node.name)
        for c in calls(node):
            d = depth + (c.file != node.file)
            if skipped(c) or (max_depth is not None and d > max_depth):
                continue
            read.add(c.key)
            visit(c, d)
            if returns:
                at(unit(node.file), node.name)  # back in the caller

    for r in top.children:
        if not skipped(r):
            read.add(r.key)
            visit(r, 0)
    return stays


@dataclass
class Summary:
    stays: list[Stay]
    files: list[str]  # in the order first entered
    entries: dict[str, int]  # file -> stays in it
    climbs: list[int]  # indices of the stays that climb back up

    def as_dict(self) -> dict:
        return {"stays": len(self.stays), "files": len(self.files), "climbs_back_up": len(self.climbs),
                "entries": self.entries, "walk": [str(s) for s in self.stays],
                "climbs": [f"stay {i + 1}: {self.stays[i - 1].file} -> {self.stays[i].file}" for i in self.climbs]}


def summarize(stays: list[Stay], above: dict[str, set[str]]) -> Summary:
    """Count the walk: ``above[f]`` = the files f imports (directly or not)."""
    files: list[str] = []
    entries: dict[str, int] = {}
    climbs: list[int] = []
    for i, s in enumerate(stays):
        if s.file in entries:
            prev = stays[i - 1].file
            if prev in above.get(s.file, set()) and s.file not in above.get(prev, set()):
                climbs.append(i)
        else:
            files.append(s.file)
        entries[s.file] = entries.get(s.file, 0) + 1
    return Summary(stays, files, dict(sorted(entries.items(), key=lambda kv: (-kv[1], kv[0]))), climbs)


# ----------------------------------------------------------------------------------------------
# One RL step of the default job
# ----------------------------------------------------------------------------------------------


def trace_default_step(overrides: Iterable[str] = ()) -> Call:
    """Build the default job's Trainer (untraced), then trace ``train.run_trainer`` over one RL step."""
    import logging

    from megatron_gspo.config import DEMO_CONFIG, load_job_config
    from megatron_gspo.train import run_trainer
    from megatron_gspo.trainer.loop import Trainer

    logger = logging.getLogger("megatron_gspo")
    level = logger.level
    with tempfile.TemporaryDirectory(prefix="step-walk-") as out:
        cfg = load_job_config(DEMO_CONFIG, [*DEFAULT_OVERRIDES, f"train.output_dir={out}", *overrides])
        logger.setLevel(logging.WARNING)  # the job's progress lines are not the tool's output
        try:
            trainer = Trainer(cfg)

            def main_entry() -> None:
                rc = run_trainer(trainer)  # closes the trainer and the process groups
                if rc != 0:
                    raise RuntimeError(f"the traced step exited with {rc}")

            return trace(main_entry)
        finally:
            logger.setLevel(level)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides of the default job")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--show", action="store_true", help="print every stay of the full walk")
    a = ap.parse_args(argv)
    top = trace_default_step(a.overrides)
    above = import_graph()
    walks = {"full": summarize(walk(top), above), "depth 2": summarize(walk(top, max_depth=2), above),
             "reading order": summarize(walk(top, returns=False), above),
             "reading order, depth 2": summarize(walk(top, max_depth=2, returns=False), above)}
    pkg_above = by_unit(above, package_of)
    for name, depth in (("packages, reading order", None), ("packages, reading order, depth 2", 2)):
        walks[name] = summarize(walk(top, max_depth=depth, returns=False, unit=package_of), pkg_above)
    if a.json:
        print(json.dumps({k: s.as_dict() for k, s in walks.items()}, indent=1))
        return 0
    if a.show:
        s = walks["full"]
        for i, st in enumerate(s.stays):
            print(f"{i + 1:3d} {st}" + ("  ^ climb back up" if i in s.climbs else ""))
    for name, s in walks.items():
        print(f"{name}: {line(s)}")
    return 0


def line(s: Summary) -> str:
    """``N stays in F files, C climbs back up; entries: trainer/hooks.py 6, ...`` (files entered more than once)."""
    return (f"{len(s.stays)} stays in {len(s.files)} files, {len(s.climbs)} climbs back up; entries: "
            + ", ".join(f"{f.split('/', 1)[1]} {n}" for f, n in s.entries.items() if n > 1))


if __name__ == "__main__":
    sys.exit(main())
