"""What the project's logger said during a block: ``with LogLines(logging.WARNING) as said: ...``.

A handler of its own on the ``megatron_gspo`` logger rather than pytest's caplog: an entry point run in
the test process (``train.main``) configures logging with ``logging.basicConfig(force=True)``, which
removes the root logger's handlers, caplog's among them. The library configures no logging, so the
logger's level decides what reaches a handler: for the block, it is lowered to ``level`` if it is above.
"""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    """Messages of ``level`` or above, as ``records`` ((levelno, text), in order) and ``lines`` (text)."""

    def __init__(self, level: int = logging.INFO, logger: str = "megatron_gspo") -> None:
        super().__init__(level)
        self.logger = logging.getLogger(logger)
        self.records: list[tuple[int, str]] = []
        self._level = self.logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))

    @property
    def lines(self) -> list[str]:
        return [m for _, m in self.records]

    def __enter__(self) -> "LogLines":
        self._level = self.logger.level
        if self.logger.getEffectiveLevel() > self.level:
            self.logger.setLevel(self.level)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)
