import sys

from megatron_gspo.preflight.cli import main

if __name__ == "__main__":
    sys.exit(main())
