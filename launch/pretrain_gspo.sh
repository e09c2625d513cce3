#!/usr/bin/env bash
# launch/pretrain_gspo.sh -- start megatron_gspo training (GSPO / GRPO) on one node, several nodes
# or a SLURM allocation. Arguments: [config.yaml] [section.key=value ...] [--dry-run]; they are
# the trainer's (python -m megatron_gspo.train) and pass through unchanged.
#
# Three ways to run it
#   1. Under torchrun, exactly as written:
#        torchrun --nproc-per-node 8 [--nnodes 2 --node-rank R --master-addr H --master-port P] \
#            launch/pretrain_gspo.sh launch/recipes/gspo_qwen3_30b_a3b_8xh100.yaml train.num_steps=10
#      torchrun runs its script with the Python interpreter, so this file is a bash/Python
#      polyglot. Python reads the line below the header, three quotes then ':', as the start of a
#      string that ends at the matching three quotes after the bash part: it skips all the bash and
#      runs the Python at the bottom, which runs megatron_gspo.train as __main__ through runpy
#      (the same thing as megatron_gspo.train.main(sys.argv[1:])). Bash reads that same line as
#      the no-op command ':' (an empty quoted string glued to a quoted colon), runs the bash part
#      and never reaches the Python (it exec's torchrun or exits first). The bash part therefore
#      must never contain three quotes in a row, nor a backslash (Python would parse it as a
#      string escape); tests/test_launch.py checks both.
#   2. On one node, from bash:
#        bash launch/pretrain_gspo.sh [config.yaml] [overrides...]
#      starts `torchrun --standalone --nnodes 1 --nproc-per-node N` on this very file, with N =
#      $NPROC if set, else the GPU count (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`), else 1 (CPU).
#   3. Under SLURM (SLURM_JOB_ID is set): inside a job step (`srun --ntasks-per-node=1 bash
#      launch/pretrain_gspo.sh ...`, see launch/slurm/gspo_qwen3_30b_a3b.sbatch) it starts one
#      torchrun per node with
#        --nnodes       $SLURM_NNODES (or $SLURM_JOB_NUM_NODES)
#        --node-rank    $SLURM_NODEID
#        --master-addr  $MASTER_ADDR, else the first host of `scontrol show hostnames
#                       $SLURM_JOB_NODELIST` (a built-in parser handles node[07-08] / a,b lists
#                       when scontrol is absent, e.g. inside a container)
#        --master-port  $MASTER_PORT, else 20000 + SLURM_JOB_ID mod 20000 (same on every node,
#                       different for concurrent jobs)
#      Run directly in a multi-node batch script (`sbatch --nodes 2 launch/pretrain_gspo.sh ...`,
#      no job step yet) it re-executes itself once per node with
#      `srun --ntasks-per-node=1 --kill-on-bad-exit=1` (set GSPO_SRUN=0 to refuse instead).
#
# --dry-run (or DRY_RUN=1) prints the environment it sets and the exact torchrun (or srun) command
# line, one shell-quoted line, and exits 0 without starting anything (the config is not read). A real
# launch reads the config first, as the ranks will (layout, batch and rule checks for nodes x NPROC
# ranks, no torch, about a second): a mistake is `error: <what is wrong>`, then the closing line
# `pretrain_gspo.sh: exit 2 (user error: ...): before launch: <what is wrong>`, and exit 2 before torchrun.
# Under torchrun (way 1), or as `WORLD_SIZE=16 python launch/pretrain_gspo.sh --dry-run job.yaml`,
# the flag makes every rank load and validate the config and the parallel layout and exit 0, or
# print `error: <what is wrong>` and exit 2.
#
# Environment
#   NPROC            processes per node (default: GPUs, or 1 without GPUs)
#   TORCHRUN         launcher command (default: torchrun, else "python3 -m torch.distributed.run")
#   TORCHRUN_ARGS    extra torchrun flags, word-split (e.g. "--max-restarts 0 --log-dir logs")
#   PYTHON           interpreter of the supervisor below (default python3; standard library only)
#   MASTER_ADDR / MASTER_PORT   rendezvous host / port under SLURM (defaults above)
#   GSPO_SHUTDOWN_TIMEOUT   seconds torchrun gives the other workers after one failed (or after a
#                    SIGQUIT) before SIGKILL (default 240)
#   GSPO_ENTRY_MODULE  module run on every rank (default megatron_gspo.train)
#   GSPO_IGNORE_SLURM=1  single-node mode even inside a SLURM allocation
#
# Signals and exit codes (ways 2 and 3): the last step is `exec python3 <this file>
# --gspo-supervise <the torchrun command>`: this shell becomes a small supervisor
# (launch/supervisor.py) that runs torchrun in a session of its own and delivers every stop
# signal it gets (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2: Ctrl-C, scancel, srun passing on the sbatch
# trap's SIGUSR1) to each rank itself, once, also to ranks still starting up. torchrun runs with those
# signals ignored (SLURM signals every process of a job step: torchrun's own handling logged
# tracebacks and, on a second delivery, cut the ranks' save short); SIGQUIT is passed to torchrun, a
# hard stop. The trainer abandons the step in flight, saves the last completed step and exits 75
# (79 when no step of this run completed yet). The exit status is the ranks' own, which torchrun
# would turn into 1:
#   0 finished, 2 user error (bad config, layout, file or checkpoint), 75 preempted (checkpoint
#   written: requeue and resume), 79 preempted before a step completed (nothing new to save),
#   76 too many consecutive non-finite updates; anything else is torchrun's status after a crash.
#   Each rank records its code in a node-local temporary directory ($GSPO_EXIT_DIR); when the ranks
#   end on purpose the supervisor prints one line,
#   `pretrain_gspo.sh: exit 75 (preempted: ...): rank 0: <the rank's message>`, in place of
#   torchrun's ChildFailedError report (shown as usual after a crash). The ranks' stderr is joined
#   to their stdout. If torchrun dies before its workers, the supervisor sends them SIGTERM (they
#   checkpoint) and returns once they are gone. Nothing here SIGKILLs a process.
''':'
set -euo pipefail
# A stop signal in the instant before the supervisor's handlers exist is ignored, not fatal (the
# supervisor gets it again: SLURM and the sbatch script repeat it)
trap '' TERM INT HUP USR1 USR2

die() { echo "pretrain_gspo.sh: $*" >&2; exit 2; }

is_true() { case "${1:-}" in 1|true|TRUE|True|yes|on) return 0 ;; *) return 1 ;; esac; }

# ---- where we are: the torchrun target is this very file --------------------------------------
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
ROOT="$(dirname "$(dirname "$SELF")")"
if [ ! -d "$ROOT/megatron_gspo" ] && [ -f "${SLURM_SUBMIT_DIR:-/nonexistent}/launch/pretrain_gspo.sh" ]; then
    # `sbatch launch/pretrain_gspo.sh`: SLURM runs a spooled copy; use the submitted checkout
    SELF="$SLURM_SUBMIT_DIR/launch/pretrain_gspo.sh"
    ROOT="$SLURM_SUBMIT_DIR"
fi
TARGET=("$SELF")
if [ ! -d "$ROOT/megatron_gspo" ]; then
    # a copy of the launcher outside a checkout: run the installed package instead
    TARGET=(--module "${GSPO_ENTRY_MODULE:-megatron_gspo.train}")
fi

# ---- arguments: --dry-run is ours, everything else is the trainer's ---------------------------
DRY=0
is_true "${DRY_RUN:-0}" && DRY=1
ARGS=()
for a in "$@"; do
    case "$a" in
        --dry-run) DRY=1 ;;
        -h|--help)
            sed -n '2,/^[^#]/p' "$SELF" | sed '$d' | cut -c3-
            exit 0 ;;
        *) ARGS+=("$a") ;;
    esac
done

# ---- processes per node -----------------------------------------------------------------------
count_gpus() {
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
        case "$CUDA_VISIBLE_DEVICES" in
            ""|-1|NoDevFiles|none) echo 0 ;;
            *) local ids; IFS=, read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"; echo "${#ids[@]}" ;;
        esac
    elif command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true
    else
        echo 0
    fi
}
if [ -n "${NPROC:-}" ]; then
    NPROC_PER_NODE="$NPROC"
else
    NPROC_PER_NODE="$(count_gpus)"
    [ "${NPROC_PER_NODE:-0}" -gt 0 ] 2> /dev/null || NPROC_PER_NODE=1
fi
case "$NPROC_PER_NODE" in ''|*[!0-9]*|0) die "NPROC must be a positive integer, got '$NPROC_PER_NODE'" ;; esac

# ---- SLURM helpers ----------------------------------------------------------------------------
# First host of a SLURM node list without scontrol: node[07-08] -> node07, a1,a2 -> a1,
# gpu[3,5-6]-ib -> gpu3-ib. (No backslashes: this text is also a Python string.)
first_host_of() {
    local list="$1" lb='[' rb=']' entry prefix inner suffix
    entry="${list%%,*}"
    if [[ "$entry" == *"$lb"* ]]; then
        prefix="${list%%"$lb"*}"
        inner="${list#*"$lb"}"
        suffix="${inner#*"$rb"}"
        suffix="${suffix%%,*}"
        inner="${inner%%"$rb"*}"
        inner="${inner%%,*}"
        inner="${inner%%-*}"
        echo "${prefix}${inner}${suffix}"
    else
        echo "$entry"
    fi
}
master_host() {
    local list="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}" host=""
    [ -n "$list" ] || die "SLURM_JOB_NODELIST is not set; export MASTER_ADDR"
    if command -v scontrol > /dev/null 2>&1; then
        host="$(scontrol show hostnames "$list" 2> /dev/null | head -n 1 || true)"
    fi
    [ -n "$host" ] || host="$(first_host_of "$list")"
    echo "$host"
}

# ---- the command ------------------------------------------------------------------------------
if [ -n "${TORCHRUN:-}" ]; then
    read -r -a LAUNCHER <<< "$TORCHRUN"
elif command -v torchrun > /dev/null 2>&1; then
    LAUNCHER=(torchrun)
else
    LAUNCHER=("${PYTHON:-python3}" -m torch.distributed.run)
fi
EXTRA=()
[ -n "${TORCHRUN_ARGS:-}" ] && read -r -a EXTRA <<< "$TORCHRUN_ARGS"

# torchrun handles SIGQUIT only (a hard stop, passed to its workers): the stop signals are the
# supervisor's to deliver (see the header). Both names: PET_* is torchrun's flag default, the other
# older torch's.
SIGNALS="SIGQUIT"
ENV=(
    "PET_SIGNALS_TO_HANDLE=$SIGNALS"
    "TORCHELASTIC_SIGNALS_TO_HANDLE=$SIGNALS"
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${GSPO_SHUTDOWN_TIMEOUT:-240}"
)

SRUN_CMD=()
if [ -n "${SLURM_JOB_ID:-}" ] && ! is_true "${GSPO_IGNORE_SLURM:-0}"; then
    NNODES="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
    NODE_RANK="${SLURM_NODEID:-0}"
    case "$SLURM_JOB_ID" in
        ''|*[!0-9]*) DEFAULT_PORT=29500 ;;
        *) DEFAULT_PORT=$(( 20000 + SLURM_JOB_ID % 20000 )) ;;
    esac
    PORT="${MASTER_PORT:-$DEFAULT_PORT}"
    ADDR="${MASTER_ADDR:-$(master_host)}"
    TASKS_PER_NODE="${SLURM_STEP_TASKS_PER_NODE:-1}"
    TASKS_PER_NODE="${TASKS_PER_NODE%%[!0-9]*}"
    if [ -n "${SLURM_STEP_ID:-}" ] && [ "${TASKS_PER_NODE:-1}" -gt 1 ]; then
        die "run one task per node (srun --ntasks-per-node=1): torchrun starts the $NPROC_PER_NODE processes itself"
    fi
    if [ -z "${SLURM_STEP_ID:-}" ] && [ "$NNODES" -gt 1 ]; then
        # the batch script of a multi-node job runs on the first node only: one task per node
        [ "${GSPO_SRUN:-1}" != 0 ] || die "multi-node allocation outside a job step; start with srun --ntasks-per-node=1"
        SRUN_CMD=(srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 bash "$SELF" "${ARGS[@]}")
    fi
    CMD=("${LAUNCHER[@]}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE"
         --master-addr "$ADDR" --master-port "$PORT" "${EXTRA[@]}" "${TARGET[@]}" "${ARGS[@]}")
else
    CMD=("${LAUNCHER[@]}" --standalone --nnodes 1 --nproc-per-node "$NPROC_PER_NODE"
         "${EXTRA[@]}" "${TARGET[@]}" "${ARGS[@]}")
fi

if [ "$DRY" = 1 ]; then
    for e in "${ENV[@]}"; do echo "export $(printf '%q' "$e")"; done
    if [ "${#SRUN_CMD[@]}" -gt 0 ]; then
        line="$(printf '%q ' "${SRUN_CMD[@]}")"; echo "${line% }"
        echo "# then, on node i of $NNODES: ${CMD[*]}" | sed "s/--node-rank $NODE_RANK/--node-rank i/"
    else
        line="$(printf '%q ' "${CMD[@]}")"; echo "${line% }"
    fi
    exit 0
fi

# The job's config, read as every rank will read it (layout and batch checks for this world size), before
# torchrun starts (and before srun: a multi-node batch script refuses it once): a mistake is the trainer's
# one line and exit 2 here, in a second, not after the ranks started.
WORLD_SIZE=$(( ${NNODES:-1} * NPROC_PER_NODE )) "${PYTHON:-python3}" "$SELF" --gspo-check "${ARGS[@]}" || exit $?
for e in "${ENV[@]}"; do export "${e?}"; done
if [ "${#SRUN_CMD[@]}" -gt 0 ]; then
    exec "${SRUN_CMD[@]}"  # every node's task is this script again, supervising its own torchrun
fi
exec "${PYTHON:-python3}" "$SELF" --gspo-supervise "${CMD[@]}"
'''

# ---- Python: what torchrun (or `python launch/pretrain_gspo.sh`) runs on every rank ------------
import os
import runpy
import sys


def _checkout_on_path() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isdir(os.path.join(root, "megatron_gspo")) and root not in sys.path:
        sys.path.insert(0, root)  # a checkout runs without `pip install`


def _supervise(cmd: list) -> int:
    """What the bash part exec's: torchrun under supervisor.supervise (launch/supervisor.py, beside this file)."""
    _checkout_on_path()
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        from supervisor import supervise
    except ImportError as e:  # a launcher copy with no megatron_gspo for this interpreter
        print(f"pretrain_gspo.sh: {e}; running torchrun without the exit-code supervisor", file=sys.stderr)
        import signal

        for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"):  # torchrun forwards them then
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        for var in ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
            os.environ[var] = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
        os.execvp(cmd[0], cmd)
    return supervise(cmd)


def _check_config(argv: list, world: int):
    """The job's config as the trainer reads it, its layout for ``world`` ranks and its data-parallel checks:
    (config, trainer DP size), or the ConfigError's message, printed as ``error: ...`` (one line)."""
    from megatron_gspo.config import ConfigError, load_job_config, split_job_args
    from megatron_gspo.runtime.parallel import validate_layout

    try:
        cfg = load_job_config(*split_job_args(argv))  # the trainer's reading: no YAML = the demo job
        if cfg.rollout.is_async:  # the trainer gets world - rollout.world_size ranks, the rest generate
            from megatron_gspo.rollout.layout import check_world

            dp = check_world(cfg, world).trainer_dp
        else:
            dp = validate_layout(cfg.model, cfg.parallel, world)
        cfg.check_data_parallel(dp)  # what the trainer checks with the process groups up
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return str(e)
    return cfg, dp


def _check_before_launch(argv: list) -> int:
    """What the bash part runs before torchrun (``--gspo-check``, WORLD_SIZE = nodes x processes per node):
    a config every rank would refuse is refused here, in a second and without torch, not once the ranks
    have started. 0 when this interpreter cannot import the trainer (then the ranks check it)."""
    _checkout_on_path()
    if os.environ.get("GSPO_ENTRY_MODULE", "megatron_gspo.train") != "megatron_gspo.train" or \
            "-h" in argv or "--help" in argv:
        return 0  # another entry point's arguments, or the trainer's usage
    try:
        import megatron_gspo.config  # noqa: F401
    except ImportError:
        return 0
    refused = _check_config(argv, int(os.environ["WORLD_SIZE"]))
    if not isinstance(refused, str):
        return 0
    from megatron_gspo.runtime.exit_status import EXIT_USER_ERROR, describe

    # the same closing line as when a rank refuses the job (launch/supervisor.py), so a log reads alike either way
    print(f"pretrain_gspo.sh: {describe(EXIT_USER_ERROR)}: before launch: {refused}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def _run(argv: list) -> int:
    _checkout_on_path()
    entry = os.environ.get("GSPO_ENTRY_MODULE", "megatron_gspo.train")
    dry = "--dry-run" in argv or os.environ.get("DRY_RUN", "0").lower() in ("1", "true", "yes", "on")
    argv = [a for a in argv if a != "--dry-run"]
    if dry and ("-h" in argv or "--help" in argv):  # the trainer's usage: the arguments are its own
        from megatron_gspo.train import usage

        print(usage(), end="")
        return 0
    if dry:
        # validate what this rank would run, start nothing; a mistake is one line and exit 2,
        # as in the trainer
        from megatron_gspo.runtime import exit_status

        world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        checked = _check_config(argv, world)
        if isinstance(checked, str):
            exit_status.record(exit_status.EXIT_USER_ERROR, checked)
            return exit_status.EXIT_USER_ERROR
        cfg, dp = checked
        if rank == 0:
            p = cfg.parallel
            print(f"dry run: {world} ranks would run {entry} {' '.join(argv)}: TP {p.tensor_model_parallel_size} "
                  f"x PP {p.pipeline_model_parallel_size} x DP {dp} (EP {p.expert_model_parallel_size}, "
                  f"ETP {p.etp}), {cfg.train.num_steps} steps -> {cfg.train.output_dir}", flush=True)
        return 0
    import signal

    from megatron_gspo.runtime import exit_status

    # First thing, before torch is imported (seconds). The trainer keeps a stop signal that comes
    # during start-up (under the supervisor it was ignored until now) and acts on it once it can;
    # another entry point gets Python's own signal behaviour back. Then this rank is registered:
    # the supervisor delivers the stop signals to registered ranks (one that came earlier, too).
    if entry == "megatron_gspo.train":
        from megatron_gspo.runtime.stop import STOP_SIGNALS, PreemptionFlag

        PreemptionFlag.install(STOP_SIGNALS)
    else:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    exit_status.rank_started()
    sys.argv = [sys.argv[0]] + argv
    runpy.run_module(entry, run_name="__main__", alter_sys=True)  # sys.exit(main()) inside
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--gspo-supervise"]:
        sys.exit(_supervise(sys.argv[2:]))
    if sys.argv[1:2] == ["--gspo-check"]:
        sys.exit(_check_before_launch(sys.argv[2:]))
    sys.exit(_run(sys.argv[1:]))
