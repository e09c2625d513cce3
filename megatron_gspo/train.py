"""GSPO / GRPO training entry point: ``python -m megatron_gspo.train [config.yaml] [section.key=value ...]``.

With no YAML file it runs the packaged demo job (megatron_gspo/configs/demo_gspo.yaml: GSPO on the
tiny MoE and the built-in arithmetic task). The trainer itself is megatron_gspo/trainer/loop.py; this
module turns a command line into a run and the run's outcome into the process exit code (exit_status).
Launch with torchrun for several ranks (launch/pretrain_gspo.sh).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Optional

from megatron_gspo.runtime import exit_status
from megatron_gspo.runtime.exit_status import StoppedFor
from megatron_gspo.runtime.stop import STOP_SIGNALS, PreemptionFlag  # standard library only: no torch yet

if __name__ == "__main__":
    # Before torch and megatron are imported (seconds): from here on a stop signal is kept, not fatal
    # (``python -m megatron_gspo.train``; under the launcher the ranks start with them ignored).
    PreemptionFlag.install(STOP_SIGNALS)

from megatron_gspo.runtime import comm, parallel  # noqa: E402 (after the handlers: these import torch)
from megatron_gspo.rollout.layout import ROLLOUT, check_world, role_of  # noqa: E402
from megatron_gspo.config import DEMO_CONFIG, load_job_config, split_job_args  # noqa: E402
from megatron_gspo.errors import USER_ERRORS  # noqa: E402
from megatron_gspo.runtime.logger import setup_logging  # noqa: E402
from megatron_gspo.trainer.loop import Trainer  # noqa: E402

log = logging.getLogger("megatron_gspo")
__all__ = ["DEMO_CONFIG", "Trainer", "main", "run_trainer"]


USAGE = """\
usage: python -m megatron_gspo.train [CONFIG.yaml] [section.key=value ...]

Train a Mixture-of-Experts policy with GSPO / GRPO. One process per rank: several ranks run under
torchrun or launch/pretrain_gspo.sh, which takes the same arguments.

  CONFIG.yaml         the job (YAML, one mapping per section: model, train, data, ...); without it
                      the packaged demo job: {demo}
  section.key=value   a setting over the file's, e.g. train.num_steps=10 model.preset=qwen3-moe-2b-proxy
                      (also written --section.key=value or --section.key value)

Every section, key, default and meaning: docs/configuration.md. Validate a job without running it:
python launch/pretrain_gspo.sh --dry-run CONFIG.yaml [section.key=value ...].
Exit status:
{codes}
"""


def usage() -> str:
    codes = "\n".join(f"  {code:<3d} {meaning}" for code, meaning in sorted(exit_status.MEANING.items()))
    return USAGE.format(demo=DEMO_CONFIG, codes=codes)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(usage(), end="")
        return 0
    # First: a stop signal from now on is kept (the trainer acts on it as soon as it can, at the
    # latest when start-up ends), then the launcher learns this rank's pid (it waits for the rank,
    # reads its exit code and delivers it a signal that came before).
    stop = PreemptionFlag.install(STOP_SIGNALS)  # (the one ``__main__`` or the launcher installed, if any)
    exit_status.rank_started()
    # no YAML: the built-in demo job (tiny MoE, arithmetic task), overrides still apply
    path, argv = split_job_args(argv)
    try:
        cfg = load_job_config(path, argv)
        configure_logging(cfg)
        faults = injected_faults()
        if role_of(cfg) == ROLLOUT:  # rollout.mode=async: this rank generates (rollout/worker.py)
            from megatron_gspo.rollout.worker import run_rollout_rank

            return run_rollout_rank(cfg, faults=faults)
        trainer = Trainer(cfg, hooks=[faults] if faults else [], stop=stop)
    except exit_status.StoppedFor as e:  # a stop signal while start-up made the data: nothing to save (79)
        if comm.is_distributed():
            parallel.destroy()
        log.error("%s", e)
        exit_status.record(e.exit_code, str(e))
        return e.exit_code
    except USER_ERRORS as e:
        # a wrong config, layout, file or checkpoint: the message names it; no traceback. The process
        # groups (if any were made) go first: tearing them down imports more of megatron, whose
        # import-time notices would otherwise follow, and bury, the error line
        if comm.is_distributed():
            parallel.destroy()
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        log.error("error: %s", e)
        exit_status.record(exit_status.EXIT_USER_ERROR, str(e))
        return exit_status.EXIT_USER_ERROR
    log.info("config: %s %s", path, " ".join(argv))
    return run_trainer(trainer)


def configure_logging(cfg) -> None:
    """This process's logging and warning filters (the library only logs to the ``megatron_gspo`` logger):
    INFO on the first rank of the trainer's world, and of the rollout ranks' world of an async job, whose
    lines name the rank ("rollout rank N"); WARNING elsewhere (runtime/logger.setup_logging)."""
    rank = int(os.environ.get("RANK", "0"))
    if role_of(cfg) == ROLLOUT:
        split = check_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        setup_logging(split.side_rank(rank), prefix=f"rollout rank {rank}")
    else:
        setup_logging(rank)


def injected_faults():
    """The tests' fault injection (megatron_gspo/testing/faults.py: a trainer hook, which a rollout rank
    calls too) when MEGATRON_GSPO_FAULTS is set, else None: without it that module is never imported."""
    if not os.environ.get("MEGATRON_GSPO_FAULTS", "").strip():
        return None
    from megatron_gspo.testing.faults import FaultInjection

    return FaultInjection.from_env()


def run_trainer(trainer: Trainer, on_exit: Optional[Callable[[], None]] = None) -> int:
    """Run the loop and return the process exit code: 0, a StoppedFor code (preemption, too
    many skipped updates) or 2 for a user error, recorded for the launcher (exit_status). ``on_exit``,
    the logger and the process groups are closed whatever happens."""
    try:
        result = trainer.run()
        if trainer.state.is_main and result["history"]:
            log.info(summarize(*run_history(trainer.cfg.train.output_dir, result["history"], trainer.step),
                               trainer.cfg.loss.name))
    except StoppedFor as e:  # a stop (trainer/stopping.py), or a checkpoint the disk refused (checkpoint/space.py)
        # every rank stops for the same reason: one line (rank 0's), the launcher repeats it
        (log.error if trainer.state.is_main else log.info)("%s", e)
        exit_status.record(e.exit_code, str(e))
        return e.exit_code
    except USER_ERRORS as e:
        log.error("error: %s", e)
        exit_status.record(exit_status.EXIT_USER_ERROR, str(e))
        return exit_status.EXIT_USER_ERROR
    finally:
        if on_exit is not None:
            on_exit()
        trainer.close()
        parallel.destroy()
    exit_status.record(0, "finished")
    return 0


def run_history(output_dir: str, segment: list[dict], last_step: int) -> tuple[list[dict], int]:
    """(rows, the step of the first row): the metrics of the whole run, resumed segments included,
    from the run's metrics.jsonl (one row per step, a re-run step logged once) when it holds every step
    up to ``last_step``; else ``segment``, this process's rows (steps last_step - len + 1 .. last_step)."""
    import json

    try:
        with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
            rows = [r for r in (json.loads(line) for line in f if line.strip()) if "rollout/reward_mean" in r]
    except (OSError, ValueError):
        rows = []
    if [r.get("step") for r in rows] == list(range(1, last_step + 1)):
        return rows, 1
    return segment, last_step - len(segment) + 1


def summarize(history: list[dict], first_step: int, loss_name: str) -> str:
    """Mean reward of the first and last (up to) 10 steps of ``history`` (rows of consecutive steps
    from ``first_step``), naming the steps: after a resume the rows may be this segment's only."""
    r = [h["rollout/reward_mean"] for h in history]
    k = min(10, max(1, len(r) // 2))
    first, last = sum(r[:k]) / k, sum(r[-k:]) / k
    end = first_step + len(r) - 1
    part = "" if first_step == 1 else f" of this run segment (the run resumed at step {first_step - 1})"
    # a built-in loss by its name (GSPO, GRPO); a plug-in's module:function path as written (a file path)
    label = loss_name if ":" in loss_name else loss_name.upper()
    return (f"mean reward of the first {k} {label} steps ({first_step}-{first_step + k - 1}) {first:.3f} -> "
            f"last {k} steps ({end - k + 1}-{end}) {last:.3f} ({last - first:+.3f}){part}")


if __name__ == "__main__":
    try:
        code = main()
    finally:
        # The exit code is decided (and recorded for the launcher): a stop signal from now on must not
        # replace it. Python's finalization puts SIG_DFL back for every signal with a Python handler,
        # so a second SIGTERM / SIGINT landing there killed the process (143 / 130) after "exiting with
        # 75"; an ignored signal stays ignored through it.
        exit_status.ignore_stop_signals()
    exit_status.leave(code)
