"""tools/step_walk.py (the walk of one RL step through the source) and tools/compare_metrics.py (two runs'
metrics.jsonl, bit for bit): their rules on hand-made inputs, and the walk of the real default step."""

import json
import sys
import textwrap

import pytest

from tools import compare_metrics, step_walk
from tools.step_walk import Call


# ----------------------------------------------------------------------------------------------
# step_walk: the counting rule
# ----------------------------------------------------------------------------------------------


def _tree() -> Call:
    """a.run calls b.f (which calls c.g), its own a.h, b.f again, c.g2 and the runtime's rt.x."""
    f = Call("p/b.py", "f", [Call("p/c.py", "g")])
    run = Call("p/a.py", "run", [f, Call("p/a.py", "h"), Call("p/b.py", "f", [Call("p/c.py", "g")]),
                                 Call("p/c.py", "g2"), Call("p/rt.py", "x", [Call("p/b.py", "f2")])])
    return Call("<traced>", "<traced>", [run])


ABOVE = {"p/a.py": {"p/b.py", "p/c.py", "p/rt.py"}, "p/b.py": {"p/c.py"}, "p/c.py": set(), "p/rt.py": set()}


def test_walk_counts_stays_climbs_and_entries_of_a_hand_made_tree():
    stays = step_walk.walk(_tree(), step_over=("p/rt.py",))
    # the second b.f is not read again; rt.py is stepped over with what it calls
    assert [str(s) for s in stays] == ["p/a.py:run", "p/b.py:f", "p/c.py:g", "p/b.py:f", "p/a.py:run,h,run",
                                       "p/c.py:g2", "p/a.py:run"]
    s = step_walk.summarize(stays, ABOVE)
    # climbs: back into b from c (b imports c), into a from b, into a from c; entering c from a again
    # goes down (c is below a): a re-entry, not a climb
    assert [str(stays[i]) for i in s.climbs] == ["p/b.py:f", "p/a.py:run,h,run", "p/a.py:run"]
    assert s.entries == {"p/a.py": 3, "p/b.py": 2, "p/c.py": 2}
    assert s.files == ["p/a.py", "p/b.py", "p/c.py"]
    assert step_walk.line(s) == "7 stays in 3 files, 3 climbs back up; entries: a.py 3, b.py 2, c.py 2"


def test_walk_depth_limit_counts_files_below_the_entry():
    stays = step_walk.walk(_tree(), step_over=("p/rt.py",), max_depth=1)
    assert [str(s) for s in stays] == ["p/a.py:run", "p/b.py:f", "p/a.py:run,h,run", "p/c.py:g2", "p/a.py:run"]
    assert len(step_walk.summarize(stays, ABOVE).climbs) == 2


def test_a_sibling_file_is_a_re_entry_not_a_climb():
    # x.py and y.py do not import each other: going back to x from y is no climb, whatever the order
    top = Call("<traced>", "<traced>", [Call("p/x.py", "a"), Call("p/y.py", "b"), Call("p/x.py", "c")])
    s = step_walk.summarize(step_walk.walk(top, step_over=()), {"p/x.py": set(), "p/y.py": set()})
    assert (len(s.stays), len(s.climbs), s.entries["p/x.py"]) == (3, 0, 2)


def test_reading_order_counts_no_return_into_the_caller():
    # returns=False: the functions in the order first read; a.h after c.g is a re-entry into a (a climb:
    # a imports c), c.g2 after a.h goes down again
    stays = step_walk.walk(_tree(), step_over=("p/rt.py",), returns=False)
    assert [str(s) for s in stays] == ["p/a.py:run", "p/b.py:f", "p/c.py:g", "p/a.py:h", "p/c.py:g2"]
    s = step_walk.summarize(stays, ABOVE)
    assert [str(stays[i]) for i in s.climbs] == ["p/a.py:h"]
    assert s.entries == {"p/a.py": 2, "p/c.py": 2, "p/b.py": 1}


def test_a_functions_own_nested_code_is_read_with_it():
    # a comprehension / lambda / local def that run calls itself is part of run's text (Python 3.12 inlines
    # comprehensions: the walk must not depend on that); its calls are run's calls
    comp = Call("p/a.py", "run.<locals>.<listcomp>", [Call("p/b.py", "f")])
    top = Call("<traced>", "<traced>", [Call("p/a.py", "run", [comp, Call("p/a.py", "h")])])
    assert [str(s) for s in step_walk.walk(top, step_over=())] == ["p/a.py:run", "p/b.py:f", "p/a.py:run,h,run"]


def test_the_package_grain_reads_a_package_as_one_place():
    run = Call("p/x/a.py", "run", [Call("p/x/b.py", "f"), Call("p/y/c.py", "g"), Call("p/x/b.py", "f2")])
    top = Call("<traced>", "<traced>", [run])
    above = step_walk.by_unit({"p/x/a.py": {"p/x/b.py", "p/y/c.py"}, "p/x/b.py": {"p/y/c.py"}, "p/y/c.py": set()},
                              step_walk.package_of)
    assert above == {"p/x/": {"p/y/"}, "p/y/": set()}
    stays = step_walk.walk(top, step_over=(), returns=False, unit=step_walk.package_of)
    assert [str(s) for s in stays] == ["p/x/:run,f", "p/y/:g", "p/x/:f2"]
    s = step_walk.summarize(stays, above)
    assert [str(stays[i]) for i in s.climbs] == ["p/x/:f2"] and s.entries == {"p/x/": 2, "p/y/": 1}
    assert step_walk.package_of("megatron_gspo/train.py") == "megatron_gspo/train.py"


@pytest.fixture
def tiny_package(tmp_path, monkeypatch):
    """A package ``walkpkg`` on disk: a.run calls b through a context manager, a decorator, a torch module
    and directly, and hands b.cb to a function outside the package (a callback: not part of the walk)."""
    pkg = tmp_path / "walkpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(textwrap.dedent("""\
        import torch
        from walkpkg import b

        def run(outside):
            with b.ctx():
                b.f(1)
            outside(b.cb)
            m = b.M()
            m.register_forward_hook(b.hook)
            m(torch.zeros(1))
            return b.wrapped(2)
        """))
    (pkg / "b.py").write_text(textwrap.dedent("""\
        import contextlib
        import functools
        import torch

        @contextlib.contextmanager
        def ctx():
            yield

        def f(x):
            return g(x)

        def g(x):
            return x

        def cb():
            return g(0)

        def hook(module, args, out):
            return None

        def deco(fn):
            @functools.wraps(fn)
            def inner(*a):
                return fn(*a)
            return inner

        @deco
        def wrapped(x):
            return g(x)

        class M(torch.nn.Module):
            def forward(self, x):
                return g(x)

        def late():
            from walkpkg import c
            return c
        """))
    (pkg / "c.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "walkpkg" or m.startswith("walkpkg.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def test_trace_keeps_direct_calls_through_forwarding_frames_and_drops_callbacks(tiny_package):
    import importlib

    a = importlib.import_module("walkpkg.a")

    def outside(fn):  # not the package's: what it calls back is the caller's business, not the walk's
        return fn()

    top = step_walk.trace(lambda: a.run(outside), root=str(tiny_package), package="walkpkg")
    (run,) = top.children
    assert run.key == ("walkpkg/a.py", "run")

    def names(node):
        return [(c.name, names(c)) for c in node.children]

    # ctx twice (entered, then resumed by __exit__), f -> g, forward -> g (nn.Module.__call__
    # forwards it), wrapped (through functools.wraps' inner, which is the package's own) -> g; no cb, no hook
    assert names(run) == [("ctx", []), ("f", [("g", [])]), ("ctx", []),
                          ("M.forward", [("g", [])]), ("deco.<locals>.inner", [("wrapped", [("g", [])])])]


def test_import_graph_reads_imports_inside_functions_and_is_transitive(tiny_package):
    g = step_walk.import_graph(root=str(tiny_package), package="walkpkg")
    assert g["walkpkg/b.py"] == {"walkpkg/c.py"}  # ``late`` imports c
    assert g["walkpkg/a.py"] == {"walkpkg/b.py", "walkpkg/c.py"}  # through b; not the package's __init__
    assert g["walkpkg/c.py"] == set()


def test_import_graph_of_a_cycle_is_the_same_from_every_file(tmp_path):
    """x -> y -> z -> x: every file reaches the two others (so none is above another: no climb)."""
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for a, b in (("x", "y"), ("y", "z"), ("z", "x")):
        (pkg / f"{a}.py").write_text(f"def f():\n    from cyc import {b}\n")
    g = step_walk.import_graph(root=str(tmp_path), package="cyc")
    assert g == {"cyc/__init__.py": set(), "cyc/x.py": {"cyc/y.py", "cyc/z.py"}, "cyc/y.py": {"cyc/x.py", "cyc/z.py"},
                 "cyc/z.py": {"cyc/x.py", "cyc/y.py"}}


# ----------------------------------------------------------------------------------------------
# compare_metrics
# ----------------------------------------------------------------------------------------------


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"step": 1, "loss/loss": 0.1 + 0.2, "perf/step_time_s": 4.2, "perf/gen_tokens": 626.0,
         "train/grad_norm": float("nan")},
        {"step": 2, "loss/loss": 0.25, "perf/step_time_s": 3.9, "perf/gen_tokens": 600.0, "train/grad_norm": 1.5}]


def test_compare_metrics_identical_apart_from_timings(tmp_path, capsys):
    other = [{**r, "perf/step_time_s": r["perf/step_time_s"] * 2, "perf/rss_mb": 1.0} for r in ROWS]
    a, b = _write(tmp_path / "a.jsonl", ROWS), _write(tmp_path / "b.jsonl", other)
    assert compare_metrics.main([a, b]) == 0
    assert "identical" in capsys.readouterr().out


def test_compare_metrics_finds_one_ulp_a_missing_key_and_a_count(tmp_path, capsys):
    import math

    other = json.loads(json.dumps(ROWS))
    other[0]["loss/loss"] = math.nextafter(ROWS[0]["loss/loss"], 1.0)  # one ulp
    other[1]["perf/gen_tokens"] = 601.0  # a count under perf/ is compared: it is no timing
    del other[1]["train/grad_norm"]
    a, b = _write(tmp_path / "a.jsonl", ROWS), _write(tmp_path / "b.jsonl", other)
    assert compare_metrics.main([a, b]) == 1
    out = capsys.readouterr().out
    assert "3 difference(s)" in out
    assert "step 1: loss/loss 0.30000000000000004 before, 0.3000000000000001 after" in out
    assert "step 2: perf/gen_tokens 600.0 before, 601.0 after" in out
    assert "step 2: train/grad_norm only before (1.5)" in out
    # and a run cut short
    assert compare_metrics.differences(ROWS, ROWS[:1]) == ["2 rows before, 1 after"]


@pytest.mark.slow
def test_compare_metrics_runs_the_default_job_twice_the_same(tmp_path, capsys):
    """--run: a short default job as the baseline, then again compared with it: the same run, bit for bit."""
    short = ["train.num_steps=2", "train.sft_steps=2", "train.prompts_per_step=4", "generation.n_samples_per_prompt=2",
             "train.micro_batch_size=4", "eval.interval=0", "train.tensorboard=false"]
    assert compare_metrics.main(["--run", str(tmp_path / "a"), *short]) == 0
    assert compare_metrics.main(["--run", str(tmp_path / "b"), str(tmp_path / "a" / "metrics.jsonl"), *short]) == 0
    assert "identical" in capsys.readouterr().out
    assert len(compare_metrics.read_rows(str(tmp_path / "b" / "metrics.jsonl"))) == 2
    # the same directory again would continue that run: refused
    assert compare_metrics.main(["--run", str(tmp_path / "b"), *short]) == 2


def test_compare_metrics_refuses_what_is_not_a_metrics_file(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\nnot json\n')
    assert compare_metrics.main([_write(tmp_path / "a.jsonl", ROWS), str(bad)]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err
