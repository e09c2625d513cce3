"""An environment / tool module that ends the process when imported (the troubleshooting catalogue runs it): the
trainer must refuse it (exit 2, "loading ... failed: SystemExit"), not exit 0 without training (issue 47, row D)."""

import sys

sys.exit(0)


class Never:
    def reset(self, example):
        return "never"

    def step(self, response):
        return None, 0.0, True


def never_called(x: str) -> str:
    """Never called.

    Args:
        x: anything
    """
    return x
