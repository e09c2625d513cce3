"""Run ``python -m megatron_gspo.train ARGS`` inside the test process, as a user would type it: its exit code,
its ``error: ...`` lines and every line it logged, with the process left as it was (the stop-signal
handlers it installs, its stop flag, the launcher's environment)."""

from __future__ import annotations

import logging
import os
import signal

from log_capture import LogLines

HERE = os.path.dirname(os.path.abspath(__file__))

# A tiny job that trains a step in seconds on the CPU: no SFT warm start, no evaluation, no tensorboard.
TINY_JOB = [
    "parallel.device=cpu", "train.sft_steps=0", "eval.interval=0", "train.prompts_per_step=4",
    "generation.n_samples_per_prompt=4", "generation.max_new_tokens=4", "train.micro_batch_size=8",
    "train.num_minibatches=2", f"reward.name={HERE}/reward_plugins.py:digit_fraction", "optimizer.lr=1e-3",
    "train.tensorboard=false",
]


def run_main(argv: list[str], exit_dir: str | None = None) -> tuple[int, list[str], list[str]]:
    """(exit code, the ``error: ...`` lines, every line logged) of ``megatron_gspo.train.main(argv)``.
    ``exit_dir``: the launcher's $GSPO_EXIT_DIR, where the rank records its code."""
    from megatron_gspo.runtime.exit_status import EXIT_DIR_ENV, GRACEFUL
    from megatron_gspo.runtime.stop import PreemptionFlag
    from megatron_gspo.train import main

    handlers = {s: signal.getsignal(s) for s in GRACEFUL}
    flag_before = PreemptionFlag.of_process()
    saved_env = {k: os.environ.pop(k, None) for k in (EXIT_DIR_ENV, "TORCHELASTIC_ERROR_FILE")}
    if exit_dir is not None:
        os.environ[EXIT_DIR_ENV] = exit_dir
    try:
        with LogLines(logging.INFO) as said:
            code = main(list(argv))
    finally:
        flag = PreemptionFlag.of_process()
        if flag is not None and flag is not flag_before:  # as in a new process next time
            flag.release()
        for s, h in handlers.items():
            signal.signal(s, h)
        os.environ.pop(EXIT_DIR_ENV, None)
        for k, v in saved_env.items():
            if v is not None:
                os.environ[k] = v
    return code, [ln for ln in said.lines if ln.startswith("error: ")], said.lines


def run_preflight(argv: list[str]) -> tuple[int, list[str]]:
    """(exit code, ``error: ...`` lines) of ``megatron_gspo.preflight.cli.main(argv)`` in this process."""
    from megatron_gspo.preflight.cli import main

    with LogLines(logging.ERROR) as said:
        code = main(list(argv))
    return code, [ln for ln in said.lines if ln.startswith("error: ")]
