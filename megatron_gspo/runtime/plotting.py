"""What the project's figures share: matplotlib without a display, saving a figure, and the trailing
moving average the reward curves are smoothed with.

Used by benchmarks/plot.py, docs/plot_reward.py and the comparison's plots. A leaf module, and
matplotlib is imported only inside the functions that draw: ``smooth`` serves tables too, and
importing matplotlib costs about half a second that a training process should not pay.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence


def smooth(y: Sequence[float], w: int) -> list[float]:
    """Trailing moving average over ``w`` points: point i is the mean of ``y[max(0, i-w+1):i+1]``
    (the first points average the shorter window that exists), as long as ``y``.

    Non-finite values (a step that logged NaN, a seed without that step) are left out of a window's
    mean rather than poisoning ``w`` points of the curve; a window with no finite value gives NaN."""
    out = []
    for i in range(len(y)):
        xs = [x for x in y[max(0, i - w + 1):i + 1] if isinstance(x, (int, float)) and math.isfinite(x)]
        out.append(sum(xs) / len(xs) if xs else math.nan)
    return out


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend: figures are written to files, no display needed
    (a headless server or CI would otherwise fail to open one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: Optional[float] = None) -> str:
    """Lay ``fig`` out tightly, write it to ``path`` (creating its directory) and close it; returns
    ``path``. ``dpi``: None keeps the figure's own. Closing matters in a loop of plots: pyplot keeps
    every open figure alive."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, **({"dpi": dpi} if dpi is not None else {}))
    plt.close(fig)
    return path
