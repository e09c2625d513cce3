import sys

from megatron_gspo.runtime.stop import STOP_SIGNALS, PreemptionFlag  # standard library only

if __name__ == "__main__":
    # before torch is imported (seconds): a stop signal ends the preflight early with its table, not a traceback
    PreemptionFlag.install(STOP_SIGNALS)

from megatron_gspo.runtime import exit_status  # noqa: E402
from megatron_gspo.preflight.cli import main  # noqa: E402

if __name__ == "__main__":
    try:
        code = main()
    finally:
        exit_status.ignore_stop_signals()  # the code is decided: a late signal must not replace it (train.py)
    sys.exit(code)
