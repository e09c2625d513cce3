"""Built-in tasks: deterministic, random-access, correct answers, short prompts."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from megatron_gspo.data.tasks import ArithmeticTask, SortTask, build_task
from megatron_gspo.data.tokenizer import CharTokenizer


def test_arithmetic_answers_are_correct():
    task = ArithmeticTask(seed=3, num_digits=3, operators="+-*")
    seen_ops = set()
    for ex in itertools.islice(task, 300):
        prompt, answer = ex["prompt"], ex["answer"]
        assert prompt.endswith("=")
        op = next(c for c in "+-*" if c in prompt)
        seen_ops.add(op)
        a, b = (int(x) for x in prompt[:-1].split(op))
        assert len(str(a)) <= 3 and len(str(b)) <= 3
        assert int(answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert int(answer) >= 0  # subtraction puts the larger operand first
    assert seen_ops == {"+", "-", "*"}


def test_default_arithmetic_example_shape():
    ex = ArithmeticTask()[0]
    assert set(ex) == {"prompt", "answer", "id"}
    assert ex["id"] == "arithmetic-1234-0"
    assert all(c in "0123456789+=" for c in ex["prompt"])


def test_sort_answers_are_correct():
    task = SortTask(seed=5, min_len=2, max_len=6, max_value=20)
    for ex in itertools.islice(task, 200):
        assert ex["prompt"].startswith("sort ") and ex["prompt"].endswith(":")
        values = [int(v) for v in ex["prompt"][5:-1].split()]
        assert 2 <= len(values) <= 6 and all(0 <= v <= 20 for v in values)
        assert ex["answer"] == " ".join(map(str, sorted(values)))


@pytest.mark.parametrize("name", ["arithmetic", "sort"])
def test_deterministic_and_random_access(name):
    a, b, other = build_task(name, seed=7), build_task(name, seed=7), build_task(name, seed=8)
    first = list(itertools.islice(a, 50))
    assert first == [b[i] for i in range(50)]  # iteration == indexing, in any order
    assert b[49] == first[49] and b[3] == first[3]
    assert [e["prompt"] for e in first] != [other[i]["prompt"] for i in range(50)]
    assert len({e["id"] for e in first}) == 50


def test_same_examples_in_a_fresh_interpreter():
    # Random(str) is SHA-512 based: examples must not depend on PYTHONHASHSEED / process.
    code = "from megatron_gspo.data.tasks import build_task; print(build_task('sort', seed=11)[123])"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                           env={**os.environ, "PYTHONHASHSEED": str(s)}).stdout for s in (1, 2)}
    assert outs == {str(build_task("sort", seed=11)[123]) + "\n"}


@pytest.mark.parametrize("name", ["arithmetic", "sort"])
def test_prompts_short_and_encodable(name):
    tok = CharTokenizer()
    for ex in itertools.islice(build_task(name), 500):
        assert len(ex["prompt"]) <= 16 and len(ex["answer"]) <= 10
        tok.encode(ex["prompt"] + ex["answer"])  # every character is in the built-in table


def test_knob_validation():
    with pytest.raises(ValueError, match="operators"):
        ArithmeticTask(operators="+/")
    with pytest.raises(ValueError, match="min_digits"):
        ArithmeticTask(num_digits=2, min_digits=3)
    with pytest.raises(ValueError, match="min_len"):
        SortTask(min_len=4, max_len=2)
    with pytest.raises(ValueError, match="available: \\['arithmetic', 'sort'\\]"):
        build_task("parity")
    with pytest.raises(ValueError, match="'sort'.*num_digits"):
        build_task("sort", num_digits=3)
    with pytest.raises(IndexError):
        ArithmeticTask()[-1]
