"""Small validation helpers shared by the config sections (every failure is a ConfigError naming the field)."""

from __future__ import annotations

import math
from typing import Any

from megatron_gspo.errors import ConfigError


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def choice(name: str, value: Any, allowed: tuple) -> None:
    check(value in allowed, f"{name}={value!r} is not one of {list(allowed)}")


def finite(x: Any) -> bool:
    """A real (non-bool) finite number."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_clip_range(low: float, high: float, bound: float, where: str = "loss.") -> None:
    """Ranges shared by LossConfig and the loss functions' keyword arguments."""
    check(finite(low) and 0 < low < 1, f"{where}clip_ratio_low must be in (0, 1), got {low}")
    check(finite(high) and high > 0, f"{where}clip_ratio_high must be a finite number > 0, got {high}")
    check(finite(bound) and bound > 0, f"{where}log_ratio_bound must be a finite number > 0, got {bound}")
    # A bound inside the clip range would cut gradients that clipping means to keep.
    need = max(math.log1p(high), -math.log1p(-low))
    check(
        bound > need,
        f"{where}log_ratio_bound={bound} must exceed the clip range's log-width {need:.4g} "
        f"(clip_ratio_low={low}, clip_ratio_high={high})",
    )
