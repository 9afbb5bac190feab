"""Logging of the ``msquant`` command: one handler on the ``msquant`` logger, writing to the current
``sys.stderr``.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["configure_logging"]


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (it may be replaced after set-up)."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _: object) -> None:
        pass


def configure_logging(level: str) -> None:
    """Send the ``msquant`` loggers, at ``level``, to stderr with time, level and logger name."""
    handler = _CurrentStderrHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("msquant")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
