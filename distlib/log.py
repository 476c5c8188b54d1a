"""Rank-aware logging: rank 0 prints information; warnings and errors come from
every rank, prefixed with it."""

from __future__ import annotations

import logging
import sys

_LOGGER_NAME = "distlib"
_rank = 0


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank
        return _rank == 0 or record.levelno >= logging.WARNING


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time, so that a live progress
    display that redirects it (rich) prints log lines above itself, intact."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def set_rank(rank: int) -> None:
    global _rank
    _rank = rank


def get_logger() -> logging.Logger:
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers:
        handler = _StderrHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[distlib rank %(rank)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
