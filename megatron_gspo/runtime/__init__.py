"""The process and the job's plumbing: collectives (comm), the parallel state (parallel), megatron-core
workarounds (compat), determinism, logging and timers (logger), exactly reducible metrics (metrics),
machine facts (sysinfo), plot helpers (plotting), exit codes and stop reasons (exit_status), the stop flag (stop),
whether a path can be written and why not (writable), who owns a file a command leaves while it works (owner),
the hooks that run at fixed points of the RL loop (hooks: below the trainer and the rollout sources that attach them).
Import the modules themselves: this package re-exports nothing.
"""

