"""What the project's logger said during a block: ``with LogLines(logging.WARNING) as said: ...``.

A handler of its own on the ``megatron_gspo`` logger rather than pytest's caplog: the trainer's
``setup_logging`` calls ``logging.basicConfig(force=True)``, which removes the root logger's handlers,
caplog's among them, so a test that builds a Trainer would see nothing through caplog.
"""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    """Messages of ``level`` or above, as ``records`` ((levelno, text), in order) and ``lines`` (text)."""

    def __init__(self, level: int = logging.INFO, logger: str = "megatron_gspo") -> None:
        super().__init__(level)
        self.logger = logging.getLogger(logger)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))

    @property
    def lines(self) -> list[str]:
        return [m for _, m in self.records]

    def __enter__(self) -> "LogLines":
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
