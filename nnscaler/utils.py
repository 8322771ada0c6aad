"""Small helpers users reach for from scripts: logging set-up.

``set_default_logger_level('INFO')`` is the line nnScaler's quickstart starts with: it
makes the ``nnscaler`` loggers print at that level, with a timestamp, the level and the
logger name, to standard error.
"""

from __future__ import annotations

import logging

from nnscaler.errors import LoggerLevelError

__all__ = ["LOG_FORMAT", "set_default_logger_level"]

#: The format of the handler that `set_default_logger_level` installs.
LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"
_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
_HANDLER_FLAG = "_nnscaler_default_handler"


def _level(level: int | str) -> int:
    if isinstance(level, bool):
        raise LoggerLevelError(f"the logging level must be a name or an int, got {level!r}")
    if isinstance(level, int):
        return level
    if isinstance(level, str):
        value = logging.getLevelName(level.strip().upper())
        if isinstance(value, int):
            return value
    raise LoggerLevelError(
        f"unknown logging level {level!r}. Fix: use one of 'DEBUG', 'INFO', 'WARNING', "
        f"'ERROR', 'CRITICAL' (or an int such as logging.INFO)."
    )


def set_default_logger_level(level: int | str) -> None:
    """Set the level of the ``nnscaler`` loggers and give them a handler to stderr.

    Calling it again only changes the level (the handler is added once). Loggers of
    other libraries are left alone.
    """
    value = _level(level)
    logger = logging.getLogger("nnscaler")
    logger.setLevel(value)
    if not any(getattr(h, _HANDLER_FLAG, False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, _DATE_FORMAT))
        setattr(handler, _HANDLER_FLAG, True)
        logger.addHandler(handler)
        logger.propagate = False
