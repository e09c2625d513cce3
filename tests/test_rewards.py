"""Rewards: built-ins by hand case; the registry and plug-ins (per-sample, batch, class); a reward's settings
checked by key; what a reward returns checked; the worker pool (same numbers, in row order, in parallel);
a stop cutting scoring short, in this process and in a real training job."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron_gspo.config import RewardConfig
from megatron_gspo.data.rewards import (
    RewardError,
    build_reward,
    compute_rewards,
    digit_match,
    exact_match,
    format_reward,
    last_boxed,
    math_reward,
    registered_rewards,
    resolve_reward,
)
from megatron_gspo.errors import ConfigError
from megatron_gspo.runtime.stop import Cancelled

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGINS = os.path.join(HERE, "reward_plugins.py")
BATCH_PLUGINS = os.path.join(HERE, "reward_batch_plugins.py")


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
    """The project's own cases (fractions, roots, polynomials, units, tuples, separators, percentages, the
    last-number fallback, </think>, several boxes, GSM8K and MATH references, inputs never evaluated)."""
    assert math_reward("", response, answer) == want


# How math-verify reads answers beyond a numeric / string comparison (docs/algorithms.md lists the same rows),
# and the two cases found where its verdict is not exact arithmetic's.
MATH_VERIFY_READINGS = [
    ("0.3333333", "1/3", 1.0),  # numbers compared rounded to 6 decimals
    (r"\boxed{1/3}", "0.333333", 1.0),
    (r"\boxed{\$5}", "5", 1.0),  # a currency sign inside the box
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),  # sets, in any order
    ("it is 12 apples", "12 apples", 1.0),  # a reference with units in plain text
    (r"\boxed{a}", "A", 1.0),  # letters compare case-insensitively
    (r"\boxed{5 \text{ cm}^2}", "5", 1.0),  # units with a power
    (r"\boxed{x \in [1, 2]}", "[1,2]", 1.0),  # membership in an interval vs the interval
    (r"\boxed{1\frac{1}{2}}", "3/2", 1.0),  # a mixed number
    (r"\boxed{x=2, y=3}", "(2,3)", 1.0),  # a system's solution vs the tuple
    ("0.1234567", "0.1234568", 1.0),  # equal after rounding to 6 decimals, though they differ
    (r"\boxed{1e3}", "1000", 0.0),  # no exponent notation
]


@pytest.mark.parametrize("response,answer,mv", MATH_VERIFY_READINGS)
def test_math_verify_readings_are_the_documented_ones(response, answer, mv):
    assert math_reward("", response, answer) == mv
    doc = open(os.path.join(os.path.dirname(HERE), "docs", "algorithms.md"), encoding="utf-8").read()
    assert f"| `{response}` | `{answer}` | {mv:g} |" in doc, (response, answer)


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
    assert resolve_reward("exact_match").target is exact_match
    assert registered_rewards() == ["digit_match", "exact_match", "format", "math", "reasoning_gym"]
    with pytest.raises(ValueError, match=r"unknown reward 'exact'.*'digit_match', 'exact_match'"):
        resolve_reward("exact")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="module 'math' has no attribute 'nope'"):
        resolve_reward("math:nope")  # the stdlib module, not the registered reward
    with pytest.raises(ValueError, match="math.pi is a float, not a function"):
        resolve_reward("math:pi")
    with pytest.raises(ValueError, match="errno.EIO is an int, not a function"):  # not "a int"
        resolve_reward("errno:EIO")
    with pytest.raises(ConfigError, match="the function after ':' is missing"):
        resolve_reward("math:")


def test_plugin_module_and_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_plugin.py").write_text(
        "def length_penalty(prompt, response, answer, scale=1.0, **kwargs):\n"
        "    return -scale * len(response)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward("my_rewards_plugin:length_penalty").target
    assert fn("p", "abc", None) == -3
    assert resolve_reward(f"{tmp_path}/my_rewards_plugin.py:length_penalty").target("p", "ab", None) == -2
    combined = build_reward(RewardConfig(name="my_rewards_plugin:length_penalty", kwargs={"scale": 2.0}))
    assert compute_rewards(combined, ["p"], ["abcd"], [None]).tolist() == [-8.0]
    sys.modules.pop("my_rewards_plugin", None)


@pytest.mark.parametrize("body", ["import sys\nsys.exit(0)\n", "import sys\nsys.exit('bye')\n",
                                  "raise GeneratorExit('odd')\n", "import nonexistent_dependency_xyz\n"])
def test_a_plugin_whose_import_ends_the_process_is_refused(tmp_path, body):
    """A plug-in module that calls sys.exit (or raises any BaseException) while imported: a ConfigError
    naming it (exit 2), not a silent exit 0 before training."""
    (tmp_path / "exits.py").write_text(body + "def fn(p, r, a=None):\n    return 0.0\n")
    with pytest.raises(ConfigError, match=r"reward '.*exits.py:fn' \(reward.name\): loading .*exits.py failed: "
                                          r"(SystemExit|GeneratorExit|ModuleNotFoundError)"):
        resolve_reward(f"{tmp_path}/exits.py:fn")


def test_ctrl_c_while_a_plugin_loads_is_not_swallowed(tmp_path):
    (tmp_path / "interrupted.py").write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        resolve_reward(f"{tmp_path}/interrupted.py:fn")


def test_build_reward_with_format_weight():
    fn = build_reward(RewardConfig(name="exact_match", format_weight=0.5))
    rewards = compute_rewards(fn, ["q"] * 3, ["<think>x</think>19", "19", "<think>x</think>18"], ["19"] * 3)
    # exact_match grades the first line; with a think block that line is not the bare answer.
    assert rewards.tolist() == [0.5, 1.0, 0.5]
    math_fn = build_reward(RewardConfig(name="math", format_weight=0.1, format_kwargs={"require": "boxed"}))
    assert compute_rewards(math_fn, ["q"], [r"\boxed{19}"], ["19"]).tolist() == pytest.approx([1.1])
    math_fn.close()
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
    # finite in Python, inf in float32 (the rewards' dtype): refused like inf
    (lambda p, r, a, **k: 1e300 if r == "boom" else 0.0, r"returned 1e\+300, beyond float32's range"),
    (lambda p, r, a, **k: -3.5e38 if r == "boom" else 0.0, r"returned -3.5e\+38, beyond float32's range"),
    (lambda p, r, a, **k: sys.exit(0) if r == "boom" else 0.0, "raised SystemExit: 0"),
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
    fn = build_reward(RewardConfig(name="exact_match", format_weight=1.0))
    with pytest.raises(RewardError, match=r"'exact_match \+ 1\*format' on sample 0.*reference answer"):
        compute_rewards(fn, ["p"], ["19"], [None])


def test_length_mismatch():
    with pytest.raises(ValueError, match="same number"):
        compute_rewards(exact_match, ["p"], ["a", "b"], ["1", "2"])


def test_the_largest_float32_reward_is_accepted():
    big = float(torch.finfo(torch.float32).max)
    assert compute_rewards(lambda p, r, a: big, ["p"], ["r"]).item() == big


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


# ----------------------------------------------------------------------------------------------
# A reward's settings: declared beside it, checked by key at start-up
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, kwargs, message", [
    ("math", {"timeot_s": 5}, r"unknown config key reward.kwargs.timeot_s; did you mean \['timeout_s', "
                              r"'wall_timeout_s'\]\? \(the settings of reward 'math': \['timeout_s', 'wall_timeout_s'\]"),
    ("math", {"wall_timeout_s": 0}, r"reward.kwargs.wall_timeout_s must be a finite number > 0, got 0$"),
    ("math", {"timeout_s": -1}, r"reward.kwargs.timeout_s must be a finite number > 0, got -1$"),
    ("math", {"timeout_s": "5s"}, r"reward.kwargs.timeout_s must be a finite number > 0, got '5s'$"),
    ("exact_match", {"stop": "END"}, r"reward.kwargs.stop must be a list of strings, got 'END'$"),
    ("exact_match", {"stops": ["x"]}, r"unknown config key reward.kwargs.stops; did you mean \['stop'\]\?"),
    ("digit_match", {"scale": 2}, r"unknown config key reward.kwargs.scale \(the settings of reward 'digit_match'"),
])
def test_a_rewards_settings_are_checked_by_key(name, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build_reward(RewardConfig(name=name, kwargs=kwargs))


def test_format_settings_are_checked_by_key():
    with pytest.raises(ConfigError, match=r"reward.format_kwargs.require='json' is not one of \['think', 'boxed'"):
        build_reward(RewardConfig(format_weight=0.1, format_kwargs={"require": "json"}))
    with pytest.raises(ConfigError, match=r"unknown config key reward.format_kwargs.requires; did you mean"):
        build_reward(RewardConfig(format_kwargs={"requires": "think"}))


def test_each_builtin_declares_its_settings_with_its_signatures_defaults():
    """The declared defaults are the ones the function (or class) has: no second copy that can drift."""
    import dataclasses
    import inspect

    for name in registered_rewards():
        spec = resolve_reward(name)
        assert spec.settings is not None and not spec.any_settings, name
        params = inspect.signature(spec.target).parameters
        for f in dataclasses.fields(spec.settings):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert list(params[f.name].default) == default if isinstance(default, list) else \
                params[f.name].default == default, (name, f.name)


def test_a_plugins_settings_come_from_its_signature_or_its_declaration(tmp_path):
    (tmp_path / "plug.py").write_text(
        "from dataclasses import dataclass\n"
        "from megatron_gspo.data.rewards import reward_function, setting\n"
        "def named(p, r, a=None, *, scale=1.0, **kwargs):\n    return scale\n"
        "@reward_function(any_settings=True)\n"
        "def anything(p, r, a=None, **kwargs):\n    return float(len(kwargs))\n"
        "@dataclass\nclass S:\n    scale: float = setting(1.0, ge=0, le=10)\n"
        "@reward_function(settings=S)\n"
        "def declared(p, r, a=None, *, scale):\n    return scale\n")
    plug = f"{tmp_path}/plug.py"
    assert compute_rewards(build_reward(RewardConfig(name=f"{plug}:named", kwargs={"scale": 3})), ["p"], ["r"]).item() == 3
    # a **kwargs in the signature does not swallow a typo: the plug-in names what it takes, or says "any"
    with pytest.raises(ConfigError, match=r"unknown config key reward.kwargs.scael; did you mean \['scale'\]\? "
                                          r"\(the settings of reward '.*plug.py:named': \['scale'\]; a plug-in that "
                                          r"reads any key from \*\*kwargs declares so: @reward_function\(any_settings=True\)"):
        build_reward(RewardConfig(name=f"{plug}:named", kwargs={"scael": 3}))
    got = build_reward(RewardConfig(name=f"{plug}:anything", kwargs={"a1": 1, "b2": 2}))
    assert compute_rewards(got, ["p"], ["r"]).item() == 2
    assert compute_rewards(build_reward(RewardConfig(name=f"{plug}:declared")), ["p"], ["r"]).item() == 1.0
    with pytest.raises(ConfigError, match=r"reward.kwargs.scale must be in \[0, 10\], got 11$"):
        build_reward(RewardConfig(name=f"{plug}:declared", kwargs={"scale": 11}))


def test_a_plugin_that_cannot_take_a_row_is_refused_at_start_up(tmp_path):
    (tmp_path / "plug.py").write_text("def one_arg(response):\n    return 0.0\n")
    with pytest.raises(ConfigError, match=r"a sample reward is called as fn\(prompt, response, answer, ...\), "
                                          r"but its signature is one_arg\(response\)"):
        build_reward(RewardConfig(name=f"{tmp_path}/plug.py:one_arg"))


# ----------------------------------------------------------------------------------------------
# The batch interface: batch functions and classes (a reward model, a pool of verifiers)
# ----------------------------------------------------------------------------------------------


def test_a_batch_function_scores_the_whole_batch_with_its_settings():
    reward = build_reward(RewardConfig(name=f"{BATCH_PLUGINS}:scaled_lengths", kwargs={"scale": 0.5}))
    assert compute_rewards(reward, ["p"] * 3, ["a", "bb", "cccc"]).tolist() == [0.5, 1.0, 2.0]
    with pytest.raises(ConfigError, match=r"reward.kwargs.scale must be a finite number > 0, got 0$"):
        build_reward(RewardConfig(name=f"{BATCH_PLUGINS}:scaled_lengths", kwargs={"scale": 0}))
    broken = build_reward(RewardConfig(name=f"{BATCH_PLUGINS}:one_short"))
    with pytest.raises(RewardError, match=r"on a batch of 2 samples \(the first shown\): returned 1 rewards for 2 rows"):
        compute_rewards(broken, ["p", "q"], ["a", "b"])


def test_a_reward_class_is_built_once_scores_batches_and_is_closed():
    reward = build_reward(RewardConfig(name=f"{BATCH_PLUGINS}:LengthModel", kwargs={"offset": 1.0}, num_workers=3))
    model = reward.main
    assert (model.offset, model.num_workers) == (1.0, 3)  # reward.num_workers, since its constructor takes it
    assert compute_rewards(reward, ["p"] * 2, ["a", "bbb"]).tolist() == [2.0, 4.0]
    assert compute_rewards(reward, ["p"], ["cc"]).tolist() == [3.0]
    assert model.calls == 2 and not model.closed
    reward.close()
    assert model.closed
    with pytest.raises(ConfigError, match=r"unknown config key reward.kwargs.ofset; did you mean \['offset'\]"):
        build_reward(RewardConfig(name=f"{BATCH_PLUGINS}:LengthModel", kwargs={"ofset": 1.0}))


# ----------------------------------------------------------------------------------------------
# Scoring in worker processes (reward.num_workers); a stop cutting scoring short
# ----------------------------------------------------------------------------------------------


def _rows(n):
    return [f"prompt {i}" for i in range(n)], [f"resp{i % 7}-{i * 37 % 11}" for i in range(n)]


def test_workers_give_the_same_rewards_in_row_order_and_the_same_first_bad_row():
    prompts, responses = _rows(24)
    one = build_reward(RewardConfig(name=f"{PLUGINS}:response_hash"))
    three = build_reward(RewardConfig(name=f"{PLUGINS}:response_hash", num_workers=3))
    try:
        assert torch.equal(compute_rewards(one, prompts, responses), compute_rewards(three, prompts, responses))
        assert len(set(three.main.pool.pids)) == 3
        bad = build_reward(RewardConfig(name=f"{PLUGINS}:dies_on", num_workers=3))
        with pytest.raises(RewardError, match=r"on sample 5: its reward worker process exited with status 3"):
            compute_rewards(bad, ["p"] * 8, ["a", "b", "c", "d", "e", "die", "g", "die"])
        assert compute_rewards(bad, ["p"] * 2, ["ab", "c"]).tolist() == [2.0, 1.0]  # a new worker took its place
        bad.close()
    finally:
        one.close()
        three.close()


def test_a_reward_writing_to_fd_1_in_the_workers_scores_and_its_output_reaches_the_log(capfd):
    """Reward workers share the job's worker pool: what a reward writes to file descriptor 1 goes to the log
    (the workers' stderr), the rewards are the ones it returned."""
    reward = build_reward(RewardConfig(name=f"{PLUGINS}:noisy_length", num_workers=2))
    try:
        assert compute_rewards(reward, ["p"] * 3, ["a", "bb", "ccc"]).tolist() == [1.0, 2.0, 3.0]
    finally:
        reward.close()
    out, err = capfd.readouterr()
    assert err.count("noisy reward wrote this") == 3 and err.count("noisy reward's child") == 3, (out, err)


def test_workers_score_reasoning_gym_tasks_with_their_verifiers():
    """A reasoning_gym reference pickles with its task's verifier: worker processes score it as this one does."""
    pytest.importorskip("reasoning_gym")
    from megatron_gspo.data.reasoning_gym_tasks import build_reasoning_gym_task

    task = build_reasoning_gym_task("reasoning_gym:basic_arithmetic", 7, 8, {"max_digits": 1})
    rows = [task[i] for i in range(8)]
    answers = [r["answer"] for r in rows]
    responses = [a if i % 3 else "9" + a for i, a in enumerate(answers)]  # partial credit for some
    one, two = (build_reward(RewardConfig(name="reasoning_gym", num_workers=n)) for n in (1, 2))
    try:
        want = compute_rewards(one, [r["prompt"] for r in rows], responses, answers)
        assert 0 < want.min() < 1 and want.max() == 1
        assert torch.equal(compute_rewards(two, [r["prompt"] for r in rows], responses, answers), want)
    finally:
        two.close()


def test_workers_score_in_parallel_and_close_ends_them():
    prompts, responses = _rows(8)
    reward = build_reward(RewardConfig(name=f"{PLUGINS}:slow_reward", kwargs={"seconds": 0.5}, num_workers=4))
    compute_rewards(reward, prompts[:4], responses[:4])  # the workers are up
    t0 = time.perf_counter()
    compute_rewards(reward, prompts, responses)
    took = time.perf_counter() - t0
    pids = reward.main.pool.pids
    reward.close()
    print(f"8 rows of 0.5 s on 4 workers: {took:.2f} s")
    assert took < 3.0, took  # one at a time: 4.0 s
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_stop_cuts_scoring_short(tmp_path, workers):
    """The stop flag set while slow responses are scored: Cancelled within about one response (one
    at a time) or at once (the workers are killed), not after the whole batch."""
    marker = tmp_path / "begun"
    reward = build_reward(RewardConfig(name=f"{PLUGINS}:slow_reward", num_workers=workers,
                                       kwargs={"seconds": 1.0, "marker": str(marker)}))
    prompts, responses = _rows(12)

    def stop() -> bool:  # set once two responses were begun
        return marker.exists() and len(marker.read_text().split()) >= 2

    t0 = time.perf_counter()
    with pytest.raises(Cancelled):
        compute_rewards(reward, prompts, responses, should_stop=stop)
    took = time.perf_counter() - t0
    begun = len(marker.read_text().split())
    pids = reward.main.pool.pids if reward.main.pool is not None else []
    reward.close()
    print(f"{workers} worker(s): stopped after {took:.2f} s, {begun} of 12 responses begun")
    assert begun < 12 and took < 10, (took, begun)  # all 12: 12 s one at a time, 4 s on 3 workers (+ start-up)
    assert pids == []  # the pool's workers were killed (new ones start with the next batch)


def test_math_checks_in_parallel_processes_honour_a_stop():
    reward = build_reward(RewardConfig(name="math", num_workers=2))
    try:
        rows = [r"\boxed{19}", r"\boxed{\frac{1}{2}}", "x", r"\boxed{(1, 2)}"]
        assert compute_rewards(reward, ["q"] * 4, rows, ["19", "0.5", "1", "(1,2)"]).tolist() == [1, 1, 0, 1]
        slow = r"\boxed{10^{10^{10}}}"  # sympy evaluates the power: seconds of CPU
        t0, calls = time.perf_counter(), []
        with pytest.raises(Cancelled):
            compute_rewards(reward, ["q"] * 4, [slow] * 4, ["1"] * 4,
                            should_stop=lambda: calls.append(1) or time.perf_counter() - t0 > 1.0)
        assert time.perf_counter() - t0 < 8.0
    finally:
        reward.close()


@pytest.mark.slow
def test_a_sigterm_while_a_slow_reward_scores_ends_the_job_within_seconds(tmp_path):
    """A training job whose reward takes 1 s per response (16 of them a step): SIGTERM once scoring has
    begun. The step is abandoned within seconds (not after every response is scored): exit 79, nothing
    to save yet, the stop line saying where. One row at a time, and with a pool of worker processes."""
    from test_reliability import ENV, JOB

    for workers in (1, 2):
        marker, out = tmp_path / f"begun{workers}", tmp_path / f"run{workers}"
        cmd = [sys.executable, "-m", "megatron_gspo.train", *JOB, "eval.interval=0", "train.num_steps=2",
               f"reward.name={PLUGINS}:slow_reward", f"reward.kwargs.marker={marker}", "reward.kwargs.seconds=1",
               *([f"reward.num_workers={workers}"] if workers > 1 else []), f"train.output_dir={out}"]
        with open(tmp_path / f"log{workers}", "w") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
            try:
                deadline = time.time() + 300
                while not marker.exists():
                    assert p.poll() is None and time.time() < deadline, (tmp_path / f"log{workers}").read_text()[-3000:]
                    time.sleep(0.05)
                time.sleep(0.5)
                p.send_signal(signal.SIGTERM)
                t0 = time.time()
                rc = p.wait(timeout=60)
                took = time.time() - t0
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        text = (tmp_path / f"log{workers}").read_text()
        begun = len(marker.read_text().split())
        stop_line = [ln for ln in text.splitlines() if "preempted by signal SIGTERM in step 1" in ln]
        assert rc == 79 and stop_line and "step 1 abandoned while scoring round 1" in stop_line[0], text[-3000:]
        decided = float(re.search(r"signal received ([0-9.]+) s earlier", stop_line[0]).group(1))
        print(f"num_workers={workers}: stop decided {decided:.1f} s after the SIGTERM, exit {rc} after {took:.1f} s "
              f"(process teardown included), {begun} of 16 responses begun")
        # scoring every response would take 16 s (8 s with 2 workers) after the first one began
        assert decided < 4.0 and begun < 16 and took < 120, (decided, took, begun)
