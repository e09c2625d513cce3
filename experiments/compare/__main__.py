import sys

from experiments.compare.cli import main

# Guarded: importing the package's __main__ (tests/test_imports.py imports every module alone) must
# not start a comparison.
if __name__ == "__main__":
    sys.exit(main())
