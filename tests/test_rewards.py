"""Reward functions: built-ins by hand case, plug-ins, and validation of what a reward returns."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

from megatron_gspo.data.rewards import (
    RewardConfig,
    RewardError,
    build_reward_fn,
    builtin_math_reward,
    compute_rewards,
    digit_match,
    exact_match,
    extract_math_answer,
    format_reward,
    get_reward_fn,
    last_boxed,
    math_equal,
    math_reward,
    registered_rewards,
)


@pytest.mark.parametrize("response,answer,want", [
    ("19", "19", 1.0),
    (" 19<eos>garbage", "19", 1.0),
    ("19\n20", "19", 1.0),
    ("\n19", "19", 1.0),  # leading whitespace is not the end of the answer
    ("19<|im_end|>", "19", 1.0),
    ("190", "19", 0.0),
    ("1 2 3", "1 2 3", 1.0),
    ("1 2 3 ", " 1 2 3", 1.0),
    ("", "19", 0.0),
])
def test_exact_match(response, answer, want):
    assert exact_match("12+7=", response, answer) == want


def test_exact_match_needs_an_answer_and_accepts_stops():
    with pytest.raises(ValueError, match="reference answer"):
        exact_match("p", "19", None)
    assert exact_match("p", "19 END 5", "19", stop=[" END"]) == 1.0


def test_digit_match():
    assert digit_match("", "19<eos>", "19") == 1.0
    assert digit_match("", "18", "19") == 0.5
    assert digit_match("", "1", "19") == 0.5  # too short: the missing digit is wrong
    assert digit_match("", "1999", "19") == 0.5  # too long: extra digits are wrong
    assert digit_match("", "xx", "19") == 0.0


def test_last_boxed_nesting():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{a}{\sqrt{b}}}") == r"\frac{a}{\sqrt{b}}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed 42$") == "42"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # cut off inside the box
    assert last_boxed("no box") is None


@pytest.mark.parametrize("response,answer,want", [
    (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    (r"\boxed{\frac34}", "0.75", 1.0),
    (r"so \boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),  # sympy
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{2\pi}", r"\pi \cdot 2", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),
    (r"\boxed{(1, 2)}", "[1,2]", 0.0),
    ("She has 1,234 apples", "1234", 1.0),
    ("The price rose by 50%", "50", 1.0),
    ("The price rose by 50%", "0.5", 1.0),
    ("I get 3 then 7.", "7", 1.0),  # last-number fallback
    ("I get 3 then 7.", "3", 0.0),
    ("answer: -2/4", "-0.5", 1.0),
    ("answer: .5", r"\frac{1}{2}", 1.0),
    ("<think>it is 8?</think> It is 9", "9", 1.0),  # only after </think>
    ("<think>it is 8?</think> It is 9", "8", 0.0),
    (r"\boxed{7} \boxed{8}", "7", 0.0),  # the last box counts
    ("no number here", "1", 0.0),
    ("x is 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K reference
    (r"\boxed{4}", r"the answer is \boxed{4}", 1.0),  # MATH-style reference
    (r"\boxed{9^9^9^9^9}", "1", 0.0),  # refused, not computed
    (r"\boxed{__import__('os').system('true')}", "0", 0.0),  # never evaluated
])
def test_math(response, answer, want):
    """The project's own cases: math-verify (reward.name=math) and the former checker (math_builtin)
    give the same verdict on every one of them."""
    assert math_reward("", response, answer) == want
    assert builtin_math_reward("", response, answer) == want


# Where math-verify and the former checker disagree (found by probing beyond the cases above; none of
# those disagree): math-verify's verdict first. docs/algorithms.md lists the same rows.
DISAGREEMENTS = [
    ("0.3333333", "1/3", 1.0, 0.0),  # math-verify compares numbers rounded to 6 decimals
    (r"\boxed{1/3}", "0.333333", 1.0, 0.0),
    (r"\boxed{\$5}", "5", 1.0, 0.0),  # a currency sign inside the box
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0, 0.0),  # sets, in any order
    ("it is 12 apples", "12 apples", 1.0, 0.0),  # a reference with units in plain text
    (r"\boxed{a}", "A", 1.0, 0.0),  # letters compare case-insensitively
    (r"\boxed{5 \text{ cm}^2}", "5", 1.0, 0.0),  # units with a power
    (r"\boxed{x \in [1, 2]}", "[1,2]", 1.0, 0.0),  # membership in an interval vs the interval
]


@pytest.mark.parametrize("response,answer,mv,builtin", DISAGREEMENTS)
def test_math_verify_disagreements_are_the_documented_ones(response, answer, mv, builtin):
    assert math_reward("", response, answer) == mv
    assert builtin_math_reward("", response, answer) == builtin
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "algorithms.md"),
               encoding="utf-8").read()
    assert f"| `{response}` | `{answer}` | {mv:g} | {builtin:g} |" in doc, (response, answer)


def test_math_helpers():
    assert extract_math_answer(r"so \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_math_answer("3 apples and 4 pears") == "4"
    assert extract_math_answer("none") is None
    assert math_equal("1/3", r"\frac{1}{3}") and not math_equal("0.333", "1/3")


def test_format_reward():
    assert format_reward("", "<think>add them</think>19") == 1.0
    assert format_reward("", "<think>add them</think>") == 0.0  # no answer
    assert format_reward("", "<think></think>19") == 0.0  # no reasoning
    assert format_reward("", "19") == 0.0
    assert format_reward("", "<think>a</think>1<think>b</think>2") == 0.0
    assert format_reward("...<|im_start|>assistant\n<think>\n", "add</think>\n19<|im_end|>") == 1.0
    assert format_reward("", r"<think>x</think>\boxed{19}", require="think+boxed") == 1.0
    assert format_reward("", r"<think>x</think>19", require="think+boxed") == 0.0
    assert format_reward("", r"so \boxed{19}", require="boxed") == 1.0
    with pytest.raises(ValueError, match="require"):
        format_reward("", "x", require="json")


# ----------------------------------------------------------------------------------------------
# Lookup, plug-ins, config
# ----------------------------------------------------------------------------------------------


def test_lookup_builtins_and_unknown_names():
    assert get_reward_fn("exact_match") is exact_match
    assert {"exact_match", "digit_match", "math", "format"} <= set(registered_rewards())
    with pytest.raises(ValueError, match=r"unknown reward 'exact'.*'digit_match', 'exact_match'"):
        get_reward_fn("exact")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_reward_fn("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="module 'math' has no attribute 'nope'"):
        get_reward_fn("math:nope")  # the stdlib module, not the registered reward
    with pytest.raises(ValueError, match="math.pi is a float, not a function"):
        get_reward_fn("math:pi")


def test_plugin_module_and_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_plugin.py").write_text(
        "def length_penalty(prompt, response, answer, scale=1.0, **kwargs):\n"
        "    return -scale * len(response)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("my_rewards_plugin:length_penalty")
    assert fn("p", "abc", None) == -3
    assert get_reward_fn(f"{tmp_path}/my_rewards_plugin.py:length_penalty")("p", "ab", None) == -2
    combined = build_reward_fn(RewardConfig(name="my_rewards_plugin:length_penalty", kwargs={"scale": 2.0}))
    assert compute_rewards(combined, ["p"], ["abcd"], [None]).tolist() == [-8.0]
    sys.modules.pop("my_rewards_plugin", None)


def test_build_reward_fn_with_format_weight():
    fn = build_reward_fn(RewardConfig(name="exact_match", format_weight=0.5))
    rewards = compute_rewards(fn, ["q"] * 3, ["<think>x</think>19", "19", "<think>x</think>18"], ["19"] * 3)
    # exact_match grades the first line; with a think block that line is not the bare answer.
    assert rewards.tolist() == [0.5, 1.0, 0.5]
    math_fn = build_reward_fn(RewardConfig(name="math", format_weight=0.1, format_kwargs={"require": "boxed"}))
    assert compute_rewards(math_fn, ["q"], [r"\boxed{19}"], ["19"]).tolist() == pytest.approx([1.1])
    with pytest.raises(ValueError, match="format_weight"):
        RewardConfig(format_weight=-1.0)


# ----------------------------------------------------------------------------------------------
# compute_rewards validation
# ----------------------------------------------------------------------------------------------


def test_compute_rewards_values():
    r = compute_rewards(exact_match, ["a", "b", "c"], ["1", "2<eos>", "x"], ["1", "2", "3"])
    assert r.dtype == torch.float32 and r.tolist() == [1.0, 1.0, 0.0]
    numeric = [lambda *a, **k: True, lambda *a, **k: np.float64(0.25), lambda *a, **k: torch.tensor(0.5),
               lambda *a, **k: np.array(2.0), lambda *a, **k: 3]
    assert [compute_rewards(f, ["p"], ["r"]).item() for f in numeric] == [1.0, 0.25, 0.5, 2.0, 3.0]


def _raises(prompt, response, answer, **kwargs):
    if response == "boom":
        raise KeyError("missing")
    return 1.0


@pytest.mark.parametrize("fn,problem", [
    (_raises, "raised KeyError"),
    (lambda p, r, a, **k: float("nan") if r == "boom" else 0.0, "returned nan"),
    (lambda p, r, a, **k: math.inf if r == "boom" else 0.0, "returned inf"),
    (lambda p, r, a, **k: "1.0" if r == "boom" else 0.0, "returned str '1.0', not a number"),
    (lambda p, r, a, **k: None if r == "boom" else 0.0, "returned NoneType"),
    (lambda p, r, a, **k: [1.0] if r == "boom" else 0.0, "returned list"),
])
def test_bad_rewards_raise_reward_error_naming_the_sample(fn, problem):
    prompts = ["ok prompt", "the failing prompt " + "x" * 500]
    with pytest.raises(RewardError, match=problem) as info:
        compute_rewards(fn, prompts, ["fine", "boom"], [None, None])
    err = info.value
    assert err.index == 1 and err.response == "boom"
    msg = str(err)
    assert "sample 1" in msg and "the failing prompt" in msg and "'boom'" in msg
    assert len(msg) < 800  # the prompt is clipped, not dumped
    assert err.fn_name.startswith(("tests.test_rewards:", "test_rewards:"))


def test_reward_error_names_configured_function():
    fn = build_reward_fn(RewardConfig(name="exact_match", format_weight=1.0))
    with pytest.raises(RewardError, match=r"'exact_match \+ 1\*format' on sample 0.*reference answer"):
        compute_rewards(fn, ["p"], ["19"], [None])


def test_length_mismatch():
    with pytest.raises(ValueError, match="same number"):
        compute_rewards(exact_match, ["p"], ["a", "b"], ["1", "2"])


# ----------------------------------------------------------------------------------------------
# Reference answers the math reward cannot read: counted before training, refused above a share
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer, readable", [
    ("Kofi has 40 stamps.\n#### 40", True), ("The answer is $\\boxed{40}$.", True), ("42", True),
    ("1,234", True), ("-3.5", True), ("50%", True), ("\\frac{1}{2}", True), ("2\\sqrt{2}", True),
    ("x+1", True), ("(1, 2)", True), ("\\text{Monday}", True),
    ("forty-two", False), ("The answer is 42.", False), ("Monday", False), ("#### ", False),
    ("\\boxed{}", False), (None, False),
])
def test_math_reference_problem(answer, readable):
    from megatron_gspo.data.rewards import math_reference_problem

    problem = math_reference_problem(answer)
    assert (problem is None) == readable, problem
    if readable:  # a response saying the reference's final answer scores 1
        final = answer.rsplit("####", 1)[-1] if "####" in answer else (last_boxed(answer) or answer)
        assert math_reward("", f"\\boxed{{{final.strip()}}}", answer) == 1.0


def test_unreadable_references_are_counted_said_and_refused_above_the_share(caplog):
    import logging

    from megatron_gspo.config import RewardConfig
    from megatron_gspo.errors import DataError
    from megatron_gspo.data.rewards import check_reference_answers

    refs = [(f"f.jsonl:{i}", f"... #### {i}") for i in range(1, 39)] + [("f.jsonl:39", "forty-two"),
                                                                           ("f.jsonl:40", None)]
    with caplog.at_level(logging.WARNING, logger="megatron_gspo"):
        assert check_reference_answers(RewardConfig(name="math"), refs, "f.jsonl") == 2  # 5% is allowed
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "the math reward cannot read 2 of 40 reference answers (5.0%)" in said[0]
    assert ("(5.0%): neither '... #### <answer>' nor '\\boxed{<answer>}', nor a number or a math expression, "
            "e.g. f.jsonl:39 'forty-two'; no reference answer, e.g. f.jsonl:40 None; every response") in said[0]
    with pytest.raises(DataError, match=r"f.jsonl: the math reward cannot read 2 of 40 reference answers \(5.0%\): "
                                        r".* or allow more than reward.max_unreadable_reference_frac=0.04"):
        check_reference_answers(RewardConfig(name="math", max_unreadable_reference_frac=0.04), refs, "f.jsonl")
    # rewards without a reference check (exact_match, plug-ins) are not judged
    assert check_reference_answers(RewardConfig(name="exact_match"), [("x", "forty-two")], "x") == 0
