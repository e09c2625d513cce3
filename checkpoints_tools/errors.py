"""The converters' one error type, in a leaf module that every other module of the package imports."""


class ConversionError(RuntimeError):
    """Bad input or refused operation; the message names the file / key and the numbers.

    Raised before anything is written (everything is validated first) or while the output is still
    a temp directory (which is then deleted); the commands print it as ``error: ...`` and exit 2."""
