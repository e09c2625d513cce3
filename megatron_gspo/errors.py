"""The errors a user can cause, in one leaf module (it imports nothing of the package).

Each names the problem (the config field, the file and line, the sample) so that the entry point
prints one line and exits 2 instead of a traceback: ``USER_ERRORS`` is what it catches. Errors
that mean a bug in the program (RoutingReplayError, CollectiveDeviceError, ...) live next to the
code that raises them and are not in the list.
"""

from __future__ import annotations

from typing import Any, Optional


class ConfigError(ValueError):
    """A configuration value or layout is invalid; the message names the field and the numbers."""


class DataError(ValueError):
    """A dataset cannot be loaded or sampled; the message names the file, line/row and field."""


class TokenizerError(ValueError):
    """A tokenizer cannot be built or used as configured; the message names the file or the token."""


class EnvError(ValueError):
    """An environment or a tool (env.name, env.tools) cannot be loaded or used as configured; the message
    names the setting, the module and the function or class."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model."""


def a_or_an(noun: str) -> str:
    """``noun`` with its indefinite article, for a type named in a message: 'an int', 'a float', 'a type'."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def clip_repr(text: Any, limit: int = 200) -> str:
    """repr(text), cut to ``limit`` characters with the full length said."""
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 15] + f"... ({len(text)} chars)"


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not a finite number. ``index``: the sample
    (its row in the batch), or None when a batch reward failed as a whole (``batch_size`` rows; the first
    one's prompt and response are shown)."""

    def __init__(self, fn_name: str, index: Optional[int], prompt: str, response: str, problem: str,
                 batch_size: Optional[int] = None) -> None:
        self.fn_name, self.index, self.prompt, self.response, self.problem = fn_name, index, prompt, response, problem
        where = f"sample {index}" if index is not None else f"a batch of {batch_size} samples (the first shown)"
        super().__init__(
            f"reward function {fn_name!r} on {where}: {problem}\n"
            f"  prompt:   {clip_repr(prompt)}\n  response: {clip_repr(response)}"
        )


class MemoryBudgetError(RuntimeError):
    """The device ran out of memory in a phase of the step; the message names the phase, the shapes it
    ran, the config knobs that set them and the memory estimate of the config (oom.py)."""


# What the entry points report as "error: <message>" with exit code 2 (exit_status.EXIT_USER_ERROR).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, CheckpointError, DataError, EnvError, RewardError, TokenizerError, FileNotFoundError,
    MemoryBudgetError)
