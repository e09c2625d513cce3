"""Several runs of the dist scripts one after another in one torchrun: one start-up, one rendezvous.

    torchrun --nproc-per-node N jobs.py JOBS.json

JOBS.json: a list of [script, arg, ...] (a script of this directory and its arguments). Each runs as its own
``__main__`` (runpy: fresh module globals), as under a torchrun of its own, except that torch.distributed's
default group stays up between them: ``parallel.destroy`` keeps the world (its rendezvous cannot be done again
on torchrun's store), megatron's groups and globals are torn down and set up again by the next job for its
layout. The first job that exits non-zero ends the run with its code (the rest do not run). Synchronous jobs of
one world size only: a script that signals itself, kills a rank or ends its process early is not for this.
"""

import json
import os
import runpy
import sys

from megatron_gspo.runtime import parallel

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        jobs = json.load(f)
    destroy = parallel.destroy
    parallel.destroy = lambda keep_world=True: destroy(keep_world=keep_world)
    try:
        for script, *args in jobs:
            path = os.path.join(HERE, script)
            sys.argv = [path, *args]
            print(f"jobs.py: {script} {' '.join(args)}", flush=True)
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                if e.code not in (None, 0):
                    print(f"jobs.py: {script} exited {e.code}", file=sys.stderr, flush=True)
                    raise
    finally:
        parallel.destroy = destroy
        destroy()


if __name__ == "__main__":
    main()
