"""The package's functions read in one sitting: none over LIMIT lines unless a ``# long: <why>`` comment
on its ``def`` (the line above it, or a line of its signature / right below it, before the body) says
why; ``generation.generator.generate``, the sampling loop, stays a short loop (<= 80 lines)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_gspo"
LIMIT = 60



def functions():
    """(package-relative path:qualified name, lines, whether a ``# long:`` comment marks it) of every function."""
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        rel = path.relative_to(PACKAGE).as_posix()

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    # the line above the def through the last line before the body (signature, comments)
                    head = lines[max(first - 2, 0):child.body[0].lineno - 1]
                    marked = any("# long:" in line for line in head)
                    yield f"{rel}:{name}", child.end_lineno - child.lineno + 1, marked
                    yield from visit(child, f"{name}.")
                elif isinstance(child, ast.ClassDef):
                    yield from visit(child, f"{prefix}{child.name}.")

        yield from visit(ast.parse("\n".join(lines)), "")


def test_no_long_function_without_a_reason():
    found = {name: n for name, n, marked in functions() if n > LIMIT and not marked}
    assert not found, ("functions over %d lines without a '# long: <why>' comment (split them, or say why "
                       "they are one piece): %s" % (LIMIT, found))


def test_generate_is_a_short_loop():
    lengths = {name: n for name, n, _ in functions()}
    assert lengths["generation/generator.py:generate"] <= 80, lengths["generation/generator.py:generate"]


def test_the_check_sees_a_long_function_and_its_comment(tmp_path, monkeypatch):
    """The scan itself: a 61-line function is found, and a ``# long:`` comment above it marks it."""
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"def long_one():\n{body}\n\n\n# long: one table\ndef marked():\n{body}\n"
                                   f"\n\ndef short():\n    pass\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    got = {name: (n, marked) for name, n, marked in functions()}
    assert got == {"m.py:long_one": (61, False), "m.py:marked": (61, True), "m.py:short": (2, False)}
