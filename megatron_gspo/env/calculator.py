"""The built-in tool ``calculator`` (``env.tools=[calculator]``): arithmetic on a safe-expression library.

The expression is evaluated by ``simpleeval`` (PyPI), which parses it with Python's ``ast`` and walks the
tree itself: names, attributes, calls other than the listed functions, comprehensions and lambdas are
refused, and its own limits bound the size of a power (``MAX_POWER``) and of a string. Never ``eval``:
the expression is model output. It runs in an environment worker process (env/pool.py), where
``env.tool_timeout_s`` bounds it.
"""

from __future__ import annotations

import math

# Functions an expression may call besides the operators (+ - * / // % **, comparisons, parentheses).
FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt, "floor": math.floor,
             "ceil": math.ceil}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: the expression to evaluate, e.g. "123*456" or "(7+5)/3"; operators + - * / // % **,
            parentheses and abs, round, min, max, sqrt, floor, ceil
    """
    import simpleeval

    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("the expression is empty")
    value = simpleeval.simple_eval(expression, functions=FUNCTIONS, names={})
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"the expression's value is not a number: {value!r}")
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)  # 6/3 -> "2", as a person writes it
    return str(value)
