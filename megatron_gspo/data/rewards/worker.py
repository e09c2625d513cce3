"""A reward worker process of the pool (pool.py): ``python -m megatron_gspo.data.rewards.worker IN OUT``.

It reads pickled messages from file descriptor IN and writes to OUT: first ``("init", reward name,
settings, sys.path)``, answered ``("ready",)`` once the reward is loaded (by its name, as the trainer
loaded it) or ``("failed", why)``; then ``("score", row, prompt, response, answer)``, answered
``("scored", row, float or SampleFailed)`` (batch.score_one: the same value, or the same failure, as in
the trainer's process). It ignores the stop signals (the trainer decides when to stop, and kills the
pool's workers when it does) and exits at the end of its input.
"""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def serve(tasks: Connection, results: Connection) -> None:
    from megatron_gspo.data.rewards.batch import score_one
    from megatron_gspo.data.rewards.registry import resolve_reward

    _, name, settings, path = tasks.recv()
    sys.path[:] = path  # a plug-in importable in the trainer is importable here
    try:
        fn = resolve_reward(name).target
    except BaseException as e:  # noqa: B036 (said to the trainer, which refuses the job)
        results.send(("failed", f"{type(e).__name__}: {e}"))
        return
    results.send(("ready",))
    while True:
        try:
            _, row, prompt, response, answer = tasks.recv()
        except EOFError:
            return
        results.send(("scored", row, score_one(fn, settings, prompt, response, answer)))


def main(argv: list[str]) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    serve(Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False))


if __name__ == "__main__":
    main(sys.argv[1:])
