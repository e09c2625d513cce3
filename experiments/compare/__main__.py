import sys

from experiments.compare.cli import main

sys.exit(main())
