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


def set_rank(rank: int) -> None:
    global _rank
    _rank = rank


def get_logger() -> logging.Logger:
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[distlib rank %(rank)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
