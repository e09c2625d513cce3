"""``python fault_job.py FAULT CALL STEP [train overrides...]``: megatron_gspo.train's job with a fault inside a vLLM
generation, for tests/vllm/test_vllm_stops.py. At engine step STEP (1-based) of the CALL-th generation call
(VllmEngine._run), FAULT happens inside the decode loop, whatever the load: ``sigterm`` (this process sends
itself SIGTERM; the time goes to $FAULT_LOG) or ``raise`` (the engine's step raises, as a dead engine or an
out-of-memory kernel does). Every engine step after the signal is counted in $FAULT_LOG too."""

import json
import os
import signal
import sys
import time


def main() -> int:
    fault, call, step, argv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    from megatron_gspo.rollout import vllm_engine
    from megatron_gspo.train import main as train

    calls, log = [0], os.environ["FAULT_LOG"]
    run = vllm_engine.VllmEngine._run

    def faulty_run(self, requests, should_stop, **kw):
        calls[0] += 1
        if calls[0] != call:
            return run(self, requests, should_stop, **kw)
        engine = self.llm.llm_engine
        inner, steps, after = engine.step, [0], [0]

        def step_():
            steps[0] += 1
            if steps[0] == step:
                if fault == "raise":
                    raise RuntimeError("CUDA error: out of memory (injected)")
                with open(log, "w") as f:
                    json.dump({"sent_at": time.time()}, f)
                os.kill(os.getpid(), signal.SIGTERM)
            elif steps[0] > step:
                after[0] += 1
                with open(log) as f:
                    record = json.load(f)
                with open(log, "w") as f:
                    json.dump({**record, "steps_after": after[0]}, f)
            return inner()

        engine.step = step_
        try:
            return run(self, requests, should_stop, **kw)
        finally:
            engine.step = inner

    vllm_engine.VllmEngine._run = faulty_run
    return train(argv)


if __name__ == "__main__":
    from megatron_gspo.runtime import exit_status

    code = main()
    exit_status.ignore_stop_signals()  # as megatron_gspo.train's __main__ ends a rank
    exit_status.leave(code)
