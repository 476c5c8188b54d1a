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


class _RankHandler(logging.StreamHandler):
    """distlib's stderr handler, told apart from handlers that others attach. It writes to
    whatever ``sys.stderr`` is at the time, so that a live progress display that redirects
    it (rich) prints log lines above itself, intact."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def write_line(line: str) -> None:
    """``line`` and its newline to stderr in one write, flushed. ``print`` writes the newline apart: where
    the ranks' stderr is one pipe (torchrun's console, unbuffered under PYTHONUNBUFFERED) two ranks
    failing at once could write their lines into one another."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def set_rank(rank: int) -> None:
    global _rank
    _rank = rank


def get_logger() -> logging.Logger:
    logger = logging.getLogger(_LOGGER_NAME)
    # look for our own handler: another one (a test runner's, an application's) must not stop ours
    if not any(isinstance(h, _RankHandler) for h in logger.handlers):
        handler = _RankHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[distlib rank %(rank)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
