"""The process and the job's plumbing: collectives (comm), the parallel state (parallel), megatron-core
workarounds (compat), determinism, logging and timers (logger), exactly reducible metrics (metrics),
machine facts (sysinfo), plot helpers (plotting), exit codes and stop reasons (exit_status), the stop flag (stop).
Import the modules themselves: this package re-exports nothing.
"""

