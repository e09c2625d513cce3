"""A reward plug-in module that ends the process when imported (the catalogue runs it): the trainer
must refuse it (exit 2, "loading ... failed: SystemExit"), not exit 0 without training."""

import sys

sys.exit(0)


def never_reached(prompt, response, answer=None):
    return 0.0
