"""An environment module whose import raises (the troubleshooting catalogue runs it): one line naming the module and
the error, exit 2, not a traceback (issue 47, row E)."""

raise RuntimeError("the environment's module is broken")


class Never:
    pass
