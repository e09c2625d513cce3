r"""Reward functions: a registry of built-ins, plug-ins by import path, and validated batch scoring.

A reward function has the signature::

    fn(prompt: str, response: str, answer: str | None, **kwargs) -> float

* ``prompt``: the text the model was conditioned on (after the chat template, if any).
* ``response``: the decoded completion. It may end with (or contain) the end-of-sequence token text,
  e.g. ``<eos>`` or ``<|im_end|>``; built-ins cut at the first one.
* ``answer``: the example's reference answer, or None for data without answers.
* ``kwargs``: ``reward.kwargs`` from the config, passed through unchanged.

It returns a finite number (bool and 0-d tensors/arrays count). Anything else -- an exception, NaN,
inf, None, a string -- stops training with a :class:`RewardError` that names the function, the
sample and a piece of the prompt and response: a reward silently coerced to 0 would teach the policy
from a bug.

Select a function with ``reward.name``: a registered name (:func:`registered_rewards`), or
``package.module:function`` (or ``path/to/file.py:function``) for your own.

Built-ins:

* ``exact_match``: 1.0 when the response's first line (leading whitespace stripped, cut at the first
  end-of-sequence marker) equals ``answer.strip()``, else 0.0. The reward of the built-in tasks.
* ``digit_match``: the fraction of character positions (left-aligned) at which that first line agrees
  with the answer, over the longer of the two. A denser signal for tiny models that rarely hit an
  exact answer early on: "18" for "19" earns 0.5 instead of 0.
* ``math``: 1.0 when math-verify (the checker of TRL and open-r1) finds the response's answer equal to
  the reference's final answer. The reference may be a ``\boxed{}`` solution (its last box is the
  final answer), a GSM8K ``... #### 72`` (what follows ``####``) or the answer itself; the response is
  read after ``</think>`` if it has one, by math-verify's own extraction (its last ``\boxed{}`` first,
  then LaTeX and plain expressions). math-verify runs in a child process with a CPU-time limit per
  check (``timeout_s``, default 10 s) and a wall-clock backstop (``wall_timeout_s``, default 600 s);
  past either the response scores 0: math_verify_worker explains why.
  Where it disagrees with ``math_builtin`` on the project's own cases: docs/algorithms.md.
* ``math_builtin``: the project's own checker, no dependency: the final answer is the last
  ``\boxed{...}`` (nested braces fine) of the response, after ``</think>`` if it has one, else the
  last number there. Equality is numeric where both sides parse (integers, decimals, ``1,234``,
  ``a/b``, ``\frac{a}{b}``, ``50%`` = 50 or 0.5), else symbolic with sympy (``\frac{\sqrt{2}}{2}``
  = ``1/\sqrt{2}``) if it is installed, else normalized-string equality; references as for ``math``.
* ``reasoning_gym``: the task's own verifier, for prompts of a ``data.source=reasoning_gym:<task>``
  source: the task's ``score_answer`` (in [0, 1]; many tasks give partial credit) on the response's
  last ``<answer>...</answer>``, else its first line (extract_task_answer).
* ``format``: 1.0 when the response has the required shape, else 0.0. ``require="think"`` (default):
  one ``<think>...</think>`` block with non-empty reasoning, at the start, followed by a non-empty
  answer (a prompt that ends in ``<think>`` counts as having opened the block). ``require="boxed"``:
  the answer part contains a ``\boxed{}``. ``require="think+boxed"``: both. Mostly used as an
  additive shaping term (``reward.format_weight``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import numbers
import os
import re
import string
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence, Union

import torch

from megatron_gspo.config import RewardConfig
from megatron_gspo.errors import ConfigError, DataError, RewardError
from megatron_gspo.errors import clip_repr as _clip

RewardFn = Callable[..., float]
log = logging.getLogger("megatron_gspo")


# ----------------------------------------------------------------------------------------------
# Registry and lookup
# ----------------------------------------------------------------------------------------------

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as ``reward.name=<name>``."""

    def wrap(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered (by {_REGISTRY[name].__module__})")
        _REGISTRY[name] = fn
        return fn

    return wrap


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward_fn(name_or_path: str) -> RewardFn:
    """A registered reward by name, or ``module.path:function`` / ``file.py:function``.

    A name that resolves to nothing is a configuration mistake: ConfigError (a ValueError), which
    the trainer reports as one line and exit 2, like every other bad ``reward.name``.
    """
    if name_or_path in _REGISTRY:
        return _REGISTRY[name_or_path]
    where = f"reward {name_or_path!r} (reward.name)"
    if ":" not in name_or_path:
        raise ConfigError(
            f"unknown reward {name_or_path!r} (reward.name); registered: {registered_rewards()}, "
            "or give your own as 'package.module:function'"
        )
    module_name, _, fn_name = name_or_path.rpartition(":")
    if not module_name or not fn_name:
        raise ConfigError(f"{where}: expected 'package.module:function'")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise ConfigError(f"{where}: file {module_name} not found")
        plugin_name = "_reward_plugin_" + re.sub(r"\W", "_", os.path.abspath(module_name))
        spec = importlib.util.spec_from_file_location(plugin_name, module_name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the plug-in's own code failed while loading (syntax, imports, ...)
            raise ConfigError(f"{where}: loading {module_name} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"{where}: cannot import module {module_name!r}: {e}") from None
        except Exception as e:
            raise ConfigError(f"{where}: importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ConfigError(f"{where}: module {module_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise ConfigError(f"{where}: {module_name}.{fn_name} is a {type(fn).__name__}, not a function")
    return fn


def reward_name(fn: RewardFn) -> str:
    """How error messages and logs name ``fn``."""
    name = getattr(fn, "reward_name", None)
    if name:
        return str(name)
    for key, registered in _REGISTRY.items():
        if registered is fn:
            return key
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


# ----------------------------------------------------------------------------------------------
# Shared text helpers
# ----------------------------------------------------------------------------------------------

# End-of-sequence token texts of the supported tokenizers (built-in, Qwen, Llama, SentencePiece).
EOS_MARKERS = ("<eos>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


def cut_at_eos(response: str, extra_stops: Sequence[str] = ()) -> str:
    """The response up to its first end-of-sequence marker (the text after it was never "said")."""
    end = len(response)
    for marker in (*EOS_MARKERS, *extra_stops):
        i = response.find(marker)
        if 0 <= i < end:
            end = i
    return response[:end]


def first_line(response: str, extra_stops: Sequence[str] = ()) -> str:
    """What the built-in tasks grade: up to the first eos marker and the first newline, stripped."""
    return cut_at_eos(response, extra_stops).lstrip().split("\n", 1)[0].strip()


def _require_answer(answer: Optional[str], fn: str) -> str:
    if answer is None:
        raise ValueError(f"{fn} needs a reference answer but the example has none (check data.answer_key)")
    return str(answer)


def _stops(kwargs: dict[str, Any]) -> tuple[str, ...]:
    stop = kwargs.get("stop", ())
    return (stop,) if isinstance(stop, str) else tuple(stop)


# ----------------------------------------------------------------------------------------------
# Built-in tasks: exact and partial match
# ----------------------------------------------------------------------------------------------


@register_reward("exact_match")
def exact_match(prompt: str, response: str, answer: Optional[str], **kwargs: Any) -> float:
    """1.0 if the first line of the response equals the answer (both stripped); ``stop=[...]`` adds stop strings."""
    return float(first_line(response, _stops(kwargs)) == _require_answer(answer, "exact_match").strip())


@register_reward("digit_match")
def digit_match(prompt: str, response: str, answer: Optional[str], **kwargs: Any) -> float:
    """Fraction of left-aligned character positions where response and answer agree (see module doc)."""
    got, want = first_line(response, _stops(kwargs)), _require_answer(answer, "digit_match").strip()
    if not got and not want:
        return 1.0
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))


# ----------------------------------------------------------------------------------------------
# Math
# ----------------------------------------------------------------------------------------------


def last_boxed(text: str) -> Optional[str]:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` (balanced braces), or of ``\boxed 5``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # "\boxed 5": the argument runs to the next space or $
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m and text[i - 1] == " " else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None  # unbalanced: the response was cut off inside the box


# An integer with optional thousands separators, or a decimal; then an optional "/denominator" and "%".
# No exponent notation: Fraction("1e999999999") would try to build that integer.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(rf"(?:{_NUMBER})(?:\s*/\s*(?:\d+))?\s*%?")
_PLAIN_NUMBER_RE = re.compile(r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+")


def extract_math_answer(response: str) -> Optional[str]:
    """The final answer of a solution: last ``\\boxed{}`` after ``</think>``, else the last number there."""
    text = cut_at_eos(response)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers_found = _NUMBER_RE.findall(text)
    return numbers_found[-1].strip() if numbers_found else None


def _unwrap_command(s: str, command: str) -> str:
    r"""Replace ``\command{x}`` by ``x`` (balanced braces)."""
    while True:
        i = s.find(command + "{")
        if i < 0:
            return s
        depth, j = 0, i + len(command)
        for j in range(i + len(command), len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                break
        else:
            return s  # unbalanced; leave it
        s = s[:i] + s[i + len(command) + 1: j] + s[j + 1:]


def normalize_math(s: str) -> str:
    """Canonical spelling of a final answer: no $, spacing, \\left/\\right, units text, ``x=`` prefix."""
    s = s.strip().strip("$").strip()
    for cmd in ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ "):
        s = s.replace(cmd, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\%", "%")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "")
    # Units/words in \text{}: drop them when a value remains ("5\text{ cm}" -> "5"), else keep the words.
    without_text = re.sub(r"\\(?:text|mbox|mathrm)\{[^{}]*\}", "", s)
    s = without_text if without_text.strip() else s
    for cmd in ("\\text", "\\textbf", "\\mathrm", "\\mbox", "\\mathbf"):
        s = _unwrap_command(s, cmd)
    s = re.sub(r"\s+", "", s).rstrip(".")
    m = re.fullmatch(r"[a-zA-Z]=(.+)", s)  # "x=5" -> "5" (one assignment only)
    if m and "=" not in m.group(1):
        s = m.group(1)
    return s


def _to_number(s: str) -> Optional[tuple[Fraction, bool]]:
    """(value, had_percent) of a normalized numeric answer, or None if it is not one."""
    pct = s.endswith("%")
    s = s[:-1] if pct else s
    sign = -1 if s.startswith("-") else 1
    body = s[1:] if sign < 0 else s
    if len(body) > 100:
        return None
    # \frac{a}{b}, its \frac12 shorthand (single digits only), or a/b, or a plain number.
    m = re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}|\\frac(\d)(\d)", body)
    parts = [g for g in m.groups() if g is not None] if m else body.split("/")
    if len(parts) > 2 or not all(_PLAIN_NUMBER_RE.fullmatch(p) for p in parts):
        return None
    num, den = Fraction(parts[0].replace(",", "")), Fraction(parts[1].replace(",", "") if len(parts) == 2 else 1)
    if den == 0:
        return None
    return sign * num / den, pct


def _unbracket(s: str) -> tuple[str, str]:
    """("()", "1,2") for "(1,2)"; ("", s) when s is not wrapped in (), [] or a mix (intervals)."""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        return s[0] + s[-1], s[1:-1]
    return "", s


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


_SYMPY_NAMES = {"sqrt", "pi"}
_SYMPY_TOKEN_RE = re.compile(r"\d+(?:\.\d+)?|[a-zA-Z]+|[-+*/^()]")


def _latex_to_sympy_text(s: str) -> Optional[str]:
    r"""``\frac{a}{b}`` -> ``(a)/(b)`` etc.; None if something is left that we do not translate."""
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/").replace("\\pi", " pi ")
    s = re.sub(r"\\sqrt(\d|[a-zA-Z](?![a-zA-Z]))", r"\\sqrt{\1}", s)  # \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    for _ in range(20):  # innermost first, so nested \frac/\sqrt translate
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        new = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", new)
        if new == s:  # only then are the braces left plain grouping, e.g. x^{2}
            new = re.sub(r"(?<!\\frac)(?<!\\sqrt)(?<!\})\{([^{}]*)\}", r"(\1)", s)
        if new == s:
            break
        s = new
    return None if "\\" in s or "{" in s else s


def _sympy_tokens_ok(t: str) -> bool:
    """Whether the sympy-ready text ``t`` holds only what ``_sympy_equal`` lets through (numbers,
    single-letter variables, sqrt, pi, arithmetic) at a size it evaluates."""
    if len(t) > 80:
        return False
    tokens = _SYMPY_TOKEN_RE.findall(t)
    if "".join(tokens) != re.sub(r"\s+", "", t):
        return False  # a character outside the whitelist
    if any(tok.isalpha() and len(tok) > 1 and tok not in _SYMPY_NAMES for tok in tokens):
        return False
    return not (any(tok.isdigit() and len(tok) > 12 for tok in tokens) or t.count("^") > 2
                or re.search(r"\^\s*\(?\d{3,}", t))


def _sympy_equal(a: str, b: str) -> bool:
    """Symbolic equality of two small expressions; False whenever sympy is missing or unsure.

    The strings come from model output and ``parse_expr`` evaluates Python, so only a whitelist of
    tokens gets through (numbers, single-letter variables, sqrt, pi, arithmetic), and inputs that
    could make sympy compute for minutes (long numbers, big or stacked powers) are skipped.
    """
    try:
        import sympy
        from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application, parse_expr,
                                                standard_transformations)
    except ImportError:
        return False
    exprs = []
    for s in (a, b):
        t = _latex_to_sympy_text(s)
        if t is None or not _sympy_tokens_ok(t):
            return False
        local = {c: sympy.Symbol(c) for c in string.ascii_letters}
        local.update(sqrt=sympy.sqrt, pi=sympy.pi)
        try:
            exprs.append(parse_expr(t, local_dict=local, transformations=(
                *standard_transformations, implicit_multiplication_application, convert_xor)))
        except Exception:  # sympy raises many types (SyntaxError, TypeError, TokenError, ...)
            return False
    try:
        return bool(sympy.simplify(exprs[0] - exprs[1]) == 0)
    except Exception:
        return False


def math_equal(prediction: str, reference: str) -> bool:
    """Whether two final answers are the same value (see the module docstring for the rules)."""
    ref, _ = _reference_final_answer(reference)  # GSM8K's "<solution> #### 72", or the last \boxed{}
    p, r = normalize_math(prediction), normalize_math(ref)
    if not p or not r:
        return False
    if p == r:
        return True
    pn, rn = _to_number(p), _to_number(r)
    if pn is not None and rn is not None:
        # A percent may be written as its number or as a fraction of 1: "50%" matches 50 and 0.5.
        p_vals = {pn[0], pn[0] / 100} if pn[1] else {pn[0]}
        r_vals = {rn[0], rn[0] / 100} if rn[1] else {rn[0]}
        return bool(p_vals & r_vals)
    (p_brackets, p_inner), (r_brackets, r_inner) = _unbracket(p), _unbracket(r)
    p_parts, r_parts = _split_top_level(p_inner), _split_top_level(r_inner)
    if len(p_parts) > 1 or len(r_parts) > 1:  # tuples, intervals, lists: same brackets, equal elements
        return (p_brackets == r_brackets and len(p_parts) == len(r_parts)
                and all(math_equal(x, y) for x, y in zip(p_parts, r_parts)))
    return _sympy_equal(p, r)


def _reference_final_answer(reference: str) -> tuple[str, bool]:
    """(the final answer math_equal compares against, whether the reference marks it: GSM8K's ``####``
    or a ``\\boxed{}``)."""
    ref, marked = reference, False
    if "####" in ref:
        ref, marked = ref.rsplit("####", 1)[1], True
    boxed = last_boxed(ref)
    if boxed is not None:
        ref, marked = boxed, True
    return ref, marked


def _readable_value(s: str) -> bool:
    """A normalized final answer a prediction can equal: a number, a tuple / interval of them, a small
    expression (single-letter variables, sqrt, pi), or LaTeX (compared after normalization)."""
    if _to_number(s) is not None or "\\" in s:
        return True
    brackets, inner = _unbracket(s)
    parts = _split_top_level(inner)
    if len(parts) > 1:
        return all(p and _readable_value(p) for p in parts)
    t = _latex_to_sympy_text(s)
    return t is not None and _sympy_tokens_ok(t)


def math_reference_problem(answer: Optional[str]) -> Optional[str]:
    """Why the ``math`` reward cannot read the reference ``answer`` (every response to its prompt would
    score 0), or None when it can: a ``... #### x`` or ``\\boxed{x}`` reference with a non-empty x, or
    an unmarked one that is a number, a tuple of numbers, a small math expression or LaTeX."""
    if answer is None:
        return "no reference answer"
    ref, marked = _reference_final_answer(str(answer))
    value = normalize_math(ref)
    if not value:
        return "an empty final answer" + (" after '####' / in '\\boxed{}'" if marked else "")
    if marked or "\\" in ref or _readable_value(value):  # LaTeX (\\text{Monday}) compares after normalization
        return None
    return "neither '... #### <answer>' nor '\\boxed{<answer>}', nor a number or a math expression"


@register_reward("math_builtin")
def builtin_math_reward(prompt: str, response: str, answer: Optional[str], **kwargs: Any) -> float:
    """1.0 if the response's final answer equals the reference answer by this module's own extraction and
    equality (extract_math_answer, math_equal; no math-verify). ``math`` uses math-verify instead."""
    reference = _require_answer(answer, "math_builtin")
    predicted = extract_math_answer(response)
    return float(predicted is not None and math_equal(predicted, reference))


# A math-verify check's limits (reward.kwargs.timeout_s / wall_timeout_s): the CPU time it may use (load-
# independent; a normal answer needs milliseconds to a second), and a wall-clock backstop for what no
# Python-level timer interrupts (generous: on a shared machine a second of CPU can take a minute).
MATH_VERIFY_CPU_TIMEOUT_S = 10.0
MATH_VERIFY_WALL_TIMEOUT_S = 600.0


@register_reward("math")
def math_reward(prompt: str, response: str, answer: Optional[str], *, timeout_s: float = MATH_VERIFY_CPU_TIMEOUT_S,
                wall_timeout_s: float = MATH_VERIFY_WALL_TIMEOUT_S, **kwargs: Any) -> float:
    """1.0 if math-verify finds the response's answer equal to the reference's final answer (see module
    docstring); 0.0 past ``timeout_s`` seconds of CPU time or ``wall_timeout_s`` of waiting
    (math_verify_worker: a child process, no signals here)."""
    from megatron_gspo.data.math_verify_worker import MathVerifyTimeout, process_checker

    gold, _ = _reference_final_answer(_require_answer(answer, "math"))
    text = cut_at_eos(response)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if not gold.strip() or not text.strip():
        return 0.0
    try:
        return float(process_checker().equal(text, gold.strip(), timeout_s, wall_timeout_s))
    except MathVerifyTimeout as e:
        log.warning("math reward: %s on a response (scored 0); the response starts %s", e, _clip(text, 80))
        return 0.0


# ----------------------------------------------------------------------------------------------
# Format
# ----------------------------------------------------------------------------------------------

_FORMAT_REQUIREMENTS = ("think", "boxed", "think+boxed")


@register_reward("format")
def format_reward(prompt: str, response: str, answer: Optional[str] = None, *, require: str = "think",
                  **kwargs: Any) -> float:
    """1.0 if the response has the shape ``require`` asks for (see module docstring), else 0.0."""
    if require not in _FORMAT_REQUIREMENTS:
        raise ValueError(f"format reward: require={require!r} is not one of {list(_FORMAT_REQUIREMENTS)}")
    text = cut_at_eos(response, _stops(kwargs))
    if prompt.rstrip().endswith("<think>"):  # the generation prompt opened the block for the model
        text = "<think>" + text
    answer_part = text
    if "think" in require:
        m = re.fullmatch(r"\s*<think>(.*?)</think>(.*)", text, flags=re.S)
        if m is None or not m.group(1).strip() or not m.group(2).strip():
            return 0.0
        if "<think>" in m.group(2) or "</think>" in m.group(2):
            return 0.0  # a second block: the model is not following the format
        answer_part = m.group(2)
    if "boxed" in require and last_boxed(answer_part) is None:
        return 0.0
    return 1.0


# ----------------------------------------------------------------------------------------------
# Task verifiers (reasoning-gym)
# ----------------------------------------------------------------------------------------------


def extract_task_answer(response: str, extra_stops: Sequence[str] = ()) -> str:
    """What a response answers for a verifier: the last ``<answer>...</answer>`` (reasoning-gym's
    convention) after ``</think>`` if it has one, else its first line (cut at the first end-of-sequence
    marker, stripped), as the built-in tasks are graded."""
    text = cut_at_eos(response, extra_stops)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    return tagged[-1].strip() if tagged else first_line(text)


@register_reward("reasoning_gym")
def reasoning_gym_reward(prompt: str, response: str, answer: Optional[str], **kwargs: Any) -> float:
    """The task's own verifier (``score_answer``) on the response's answer (extract_task_answer), in [0, 1].
    The reference must come from a ``data.source=reasoning_gym:<task>`` source (reasoning_gym_tasks.TaskAnswer)."""
    verify = getattr(answer, "verify", None)
    if verify is None:
        raise ValueError("reward.name=reasoning_gym scores prompts of data.source=reasoning_gym:<task> only; this "
                         f"example's reference {_clip(answer, 40)} carries no task verifier")
    return verify(extract_task_answer(response, _stops(kwargs)))


def task_reference_problem(answer: Optional[str]) -> Optional[str]:
    """Why reward.name=reasoning_gym cannot score against ``answer``, or None."""
    return None if hasattr(answer, "verify") else "not a reasoning_gym:<task> example (no task verifier)"


# ----------------------------------------------------------------------------------------------
# Reference answers a reward cannot read
# ----------------------------------------------------------------------------------------------

# Rewards that can tell, before training, a reference answer they will never match: name -> problem(answer).
REFERENCE_CHECKS: dict[str, Callable[[Optional[str]], Optional[str]]] = {
    "math": math_reference_problem, "math_builtin": math_reference_problem, "reasoning_gym": task_reference_problem}


def check_reference_answers(cfg: RewardConfig, references: Sequence[tuple[str, Optional[str]]], source: str) -> int:
    """Count the references ``[(where, answer)]`` of ``source`` that ``reward.name`` cannot read
    (REFERENCE_CHECKS; other rewards are not checked): said with examples when any, refused (DataError)
    above reward.max_unreadable_reference_frac of them. Returns the count."""
    problem = REFERENCE_CHECKS.get(cfg.name)
    if problem is None or not references:
        return 0
    bad = [(where, answer, why) for where, answer in references if (why := problem(answer)) is not None]
    if not bad:
        return 0
    share = len(bad) / len(references)
    reasons: dict[str, list[str]] = {}
    for where, answer, why in bad[:3]:  # a few examples, grouped by what is wrong with them
        reasons.setdefault(why, []).append(f"{where} {_clip(answer, 60)}")
    examples = "; ".join(f"{why}, e.g. {', '.join(found)}" for why, found in reasons.items())
    what = (f"{source}: the {cfg.name} reward cannot read {len(bad)} of {len(references)} reference answers "
            f"({share:.1%}): {examples}")
    if share > cfg.max_unreadable_reference_frac:
        raise DataError(f"{what}; every response to such a prompt scores 0. Give the references as "
                        "'... #### <answer>', '\\boxed{<answer>}' or a plain number or expression, or allow "
                        f"more than reward.max_unreadable_reference_frac={cfg.max_unreadable_reference_frac:g}")
    log.warning("%s; every response to such a prompt scores 0 (allowed: at most reward.max_unreadable_reference_frac"
                "=%g of them)", what, cfg.max_unreadable_reference_frac)
    return len(bad)


# ----------------------------------------------------------------------------------------------
# Config and batch scoring
# ----------------------------------------------------------------------------------------------


def build_reward_fn(cfg: RewardConfig) -> RewardFn:
    """The reward a ``reward:`` section describes, with its kwargs bound (one callable for the trainer)."""
    main = get_reward_fn(cfg.name)
    main_kwargs, fmt_kwargs, weight = dict(cfg.kwargs), dict(cfg.format_kwargs), float(cfg.format_weight)

    def reward(prompt: str, response: str, answer: Optional[str], **kwargs: Any) -> float:
        raw = main(prompt, response, answer, **{**main_kwargs, **kwargs})
        value = _as_float(raw)
        if value is None:  # checked here too, so the message blames the main function, not the sum
            raise TypeError(f"{cfg.name} returned {type(raw).__name__} {_clip(raw, 60)}, not a number")
        if weight:
            value += weight * format_reward(prompt, response, answer, **fmt_kwargs)
        return value

    reward.reward_name = cfg.name + (f" + {weight:g}*format" if weight else "")  # type: ignore[attr-defined]
    return reward


def _as_float(value: Any) -> Optional[float]:
    """A Python float for a number-like reward (bool, int, float, numpy scalar, 1-element tensor)."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and getattr(value, "size", None) == 1:  # numpy 0-d / 1-element arrays
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def compute_rewards(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                    answers: Optional[Sequence[Optional[str]]] = None, *, device: Union[str, torch.device] = "cpu",
                    **kwargs: Any) -> torch.Tensor:
    """Score every (prompt, response, answer) with ``fn``; a float32 tensor of shape [len(responses)]
    on ``device`` (the trainer passes the parallel state's device: rewards meet log-probs there).

    Raises :class:`RewardError` (naming the function and the sample) when ``fn`` raises or returns
    anything but a finite number.
    """
    n = len(responses)
    if answers is None:
        answers = [None] * n
    if len(prompts) != n or len(answers) != n:
        raise ValueError(f"compute_rewards: {len(prompts)} prompts, {n} responses and {len(answers)} answers "
                         "must be the same number")
    name = reward_name(fn)
    out = []
    for i, (prompt, response, answer) in enumerate(zip(prompts, responses, answers)):
        try:
            raw = fn(prompt, response, answer, **kwargs)
        except Exception as e:
            raise RewardError(name, i, prompt, response, f"raised {type(e).__name__}: {e}") from e
        value = _as_float(raw)
        if value is None:
            raise RewardError(name, i, prompt, response, f"returned {type(raw).__name__} {_clip(raw, 60)}, not a number")
        if not math.isfinite(value):
            raise RewardError(name, i, prompt, response, f"returned {value}, not a finite number")
        out.append(value)
    return torch.tensor(out, dtype=torch.float32, device=device)

