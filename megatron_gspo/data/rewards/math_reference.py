r"""Which reference answers the ``math`` reward can read: checked before training (check_reference_answers).

A reference's final answer is what follows a GSM8K ``####``, else the last ``\boxed{}`` of a MATH-style
solution, else the reference itself. math-verify (math.py) parses it as a boxed LaTeX answer; a final
answer that is empty, or unmarked text that is neither a number, a tuple / interval of them, a small
expression (single-letter variables, sqrt, pi) nor LaTeX, never matches a response, so every response
to its prompt would score 0: ``math_reference_problem`` says why, and the trainer counts such references
and refuses the data above ``reward.max_unreadable_reference_frac`` of them.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

from megatron_gspo.data.rewards.text import last_boxed

_PLAIN_NUMBER_RE = re.compile(r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+")


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
    r"""``\frac{a}{b}`` -> ``(a)/(b)`` etc. (sympy's spelling); None if something is left that this does not
    translate."""
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
    """Whether ``t`` (as _latex_to_sympy_text writes an expression) is a small math expression: numbers,
    single-letter variables, sqrt, pi and arithmetic, without long numbers or big or stacked powers."""
    if len(t) > 80:
        return False
    tokens = _SYMPY_TOKEN_RE.findall(t)
    if "".join(tokens) != re.sub(r"\s+", "", t):
        return False  # a character outside the whitelist
    if any(tok.isalpha() and len(tok) > 1 and tok not in _SYMPY_NAMES for tok in tokens):
        return False
    return not (any(tok.isdigit() and len(tok) > 12 for tok in tokens) or t.count("^") > 2
                or re.search(r"\^\s*\(?\d{3,}", t))


def reference_final_answer(reference: str) -> tuple[str, bool]:
    """(the final answer the math reward compares against, whether the reference marks it: GSM8K's
    ``####`` or a ``\\boxed{}``)."""
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
    ref, marked = reference_final_answer(str(answer))
    value = normalize_math(ref)
    if not value:
        return "an empty final answer" + (" after '####' / in '\\boxed{}'" if marked else "")
    if marked or "\\" in ref or _readable_value(value):  # LaTeX (\\text{Monday}) compares after normalization
        return None
    return "neither '... #### <answer>' nor '\\boxed{<answer>}', nor a number or a math expression"
