"""The environment's worker pool: runtime/workers.py's pool running env/worker.py's handler.

``WorkerPool(num_workers)`` (``env.num_workers`` processes) runs tool calls and environment steps side by
side, each request with a deadline (``env.tool_timeout_s``), all of them interruptible by a stop signal
(runtime.stop.Cancelled); a request pinned to a worker (``Request.worker``) waits for that one, since an environment
lives in the process that built it. Workers start on first use and live for the job (``close()``, also at
exit).
"""

from __future__ import annotations

from megatron_gspo.runtime import workers
from megatron_gspo.runtime.workers import Reply, Request, WorkerStartError  # noqa: F401 (the env's API)

HANDLER = "megatron_gspo.env.worker:EnvHandler"
# A result's bytes per observation token the policy may read: a text cut here still holds
# env.max_observation_tokens tokens unless its tokens average more than this many bytes.
RESULT_BYTES_PER_TOKEN = 16
MIN_RESULT_BYTES = 1 << 16


def result_byte_limit(max_observation_tokens: int) -> int:
    """The bytes of a tool result or an observation that leave a worker (env/worker.py cuts them there):
    RESULT_BYTES_PER_TOKEN per ``env.max_observation_tokens``, at least 64 KiB."""
    return max(MIN_RESULT_BYTES, RESULT_BYTES_PER_TOKEN * int(max_observation_tokens))


def WorkerPool(num_workers: int, max_result_bytes: int = MIN_RESULT_BYTES) -> workers.WorkerPool:  # noqa: N802
    """``num_workers`` environment worker processes; a tool result or observation leaves a worker cut at
    ``max_result_bytes`` (result_byte_limit)."""
    return workers.WorkerPool(num_workers, HANDLER, {"max_result_bytes": int(max_result_bytes)}, name="environment")
