"""The converters' one error type, in a leaf module that every other module of the package imports."""


class ConversionError(RuntimeError):
    """Bad input or refused operation; the message names the file / key and the numbers.

    Raised before anything is written (everything is validated first) or while the output is still
    a temp directory (which is then deleted); the commands print it as ``error: ...`` and exit 2."""


class ConversionStopped(Exception):
    """A stop signal (SIGTERM, SIGINT / Ctrl-C, SIGHUP) ended the conversion at a point where stopping loses
    nothing but the partial output (cli.stop_point); the command removes that output and exits 128 + signal."""

    def __init__(self, signum: int):
        import signal

        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
