"""torch.cuda.CUDAGraph's contract on the CPU, for the lean decoder's graph-ready step (tests/test_decode.py,
tests/dist_scripts/lean_layouts.py).

``capture(fn)`` runs the step once, where CUDA would record it (a host sync there fails the capture:
counted here and refused), and returns its output tensor; ``replay()`` re-runs the recorded step and
writes into that same output tensor, as a replayed graph does. The step takes no arguments: all it
may read are the decoder's buffers. Under TP / EP the step's collectives run at capture and at every
replay, as a real graph's warm-up and replays run them.
"""

from __future__ import annotations


class StandInGraph:
    """See the module docstring; ``captures`` lists the batch size of every capture."""

    captures: list = []

    def capture(self, fn):
        from host_syncs import HostSyncCounter

        with HostSyncCounter() as syncs:
            out = fn()
        assert syncs.total() == 0, f"host syncs in a captured decode step: {syncs.by_site()}"
        self.fn, self.out = fn, out
        StandInGraph.captures.append(out.shape[0])
        return out

    def replay(self):
        self.out.copy_(self.fn())
