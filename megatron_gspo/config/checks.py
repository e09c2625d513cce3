"""Validation helpers shared by the config sections and the loss functions (every failure is a ConfigError
naming the field); a single field's type and bounds are declared with it instead (config/fields.py)."""

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


def check_loss_range(name: str, low: float, high: float, bound: float, where: str = "loss.") -> None:
    """The clip range of loss ``name`` in that loss's own units (shared by LossConfig and the loss functions).

    gspo, gspo_token, grpo, luspo: the ratio range [1 - low, 1 + high], 0 < low < 1 (check_clip_range).
    cispo: the importance-weight truncation [1 - low, 1 + high]; low = 1 puts the lower end at 0, i.e.
        no lower bound (MiniMax-M1's setting), so 0 < low <= 1.
    gmpo: a range of each token's *log*-ratio, [-low, high] (GMPO clips in log space), low, high > 0.
    The log-ratio bound must lie outside the range: inside it, it would cut gradients the range keeps."""
    if name == "gmpo":
        check(finite(low) and low > 0, f"{where}clip_ratio_low must be a finite number > 0 (gmpo: a log-ratio width), got {low}")
        check(finite(high) and high > 0, f"{where}clip_ratio_high must be a finite number > 0 (gmpo: a log-ratio width), got {high}")
        check(finite(bound) and bound > 0, f"{where}log_ratio_bound must be a finite number > 0, got {bound}")
        check(bound > max(low, high), f"{where}log_ratio_bound={bound} must exceed gmpo's log-ratio clip range "
                                      f"(clip_ratio_low={low}, clip_ratio_high={high})")
        return
    if name == "cispo":
        check(finite(low) and 0 < low <= 1,
              f"{where}clip_ratio_low must be in (0, 1] (cispo: 1 = no lower bound on the weight), got {low}")
        check(finite(high) and high > 0, f"{where}clip_ratio_high must be a finite number > 0, got {high}")
        check(finite(bound) and bound > 0, f"{where}log_ratio_bound must be a finite number > 0, got {bound}")
        need = max(math.log1p(high), -math.log1p(-low) if low < 1 else 0.0)
        check(bound > need, f"{where}log_ratio_bound={bound} must exceed the clip range's log-width {need:.4g} "
                            f"(clip_ratio_low={low}, clip_ratio_high={high})")
        return
    check_clip_range(low, high, bound, where)
