"""Several runs of the dist scripts one after another in one torchrun: one start-up, one rendezvous.

    torchrun --nproc-per-node N jobs.py JOBS.json

JOBS.json: a list of [script, arg, ...] (a script of this directory and its arguments). Each runs as its own
``__main__`` (runpy: fresh module globals), as under a torchrun of its own, except that torch.distributed's
default group stays up between them: ``parallel.destroy`` keeps the world (its rendezvous cannot be done again
on torchrun's store), megatron's groups and globals are torn down and set up again by the next job for its
layout. What job I prints (sys.stdout) goes to JOBS.json.<I>.rank<R>.out: one file per rank and job, so no
two ranks' lines meet in one pipe (tests/conftest.py torchrun_jobs reads them back). The first job that exits
non-zero ends the run with its code (the rest do not run). Synchronous jobs of one world size only: a script
that signals itself, kills a rank or ends its process early is not for this.
"""

import contextlib
import json
import logging
import os
import runpy
import sys

from megatron_gspo.runtime import parallel

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    spec = sys.argv[1]
    with open(spec, encoding="utf-8") as f:
        jobs = json.load(f)
    destroy = parallel.destroy
    parallel.destroy = lambda keep_world=True: destroy(keep_world=keep_world)
    try:
        for i, (script, *args) in enumerate(jobs):
            path = os.path.join(HERE, script)
            sys.argv = [path, *args]
            print(f"jobs.py: {script} {' '.join(args)}", flush=True)
            with open(f"{spec}.{i}.rank{os.environ.get('RANK', '0')}.out", "w", encoding="utf-8") as out:
                try:
                    with contextlib.redirect_stdout(out):
                        runpy.run_path(path, run_name="__main__")
                except SystemExit as e:
                    if e.code not in (None, 0):
                        print(f"jobs.py: {script} exited {e.code}", file=sys.stderr, flush=True)
                        raise
                finally:  # a log handler the job set up on its stdout (runtime/logger.setup_logging) ends with it
                    for h in [h for h in logging.root.handlers if getattr(h, "stream", None) is out]:
                        logging.root.removeHandler(h)
    finally:
        parallel.destroy = destroy
        destroy()


if __name__ == "__main__":
    main()
