"""Validation helpers of the config sections and the loss specs (every failure is a ConfigError naming the
field); a single field's type and bounds are declared with it instead (config/fields.py), a loss's settings with
the loss's spec (config/loss_spec.py)."""

from __future__ import annotations

import math
from typing import Any

from megatron_gspo.errors import ConfigError


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def finite(x: Any) -> bool:
    """A real (non-bool) finite number."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
