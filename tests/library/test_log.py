"""Logging: rank 0 prints information; warnings and errors come from every rank, prefixed with it."""

from __future__ import annotations

import logging

import pytest

from distlib.log import _RankHandler, get_logger, set_rank


class _Captured:
    """The handler writes to whatever sys.stderr is at the time: pytest's capture in a test."""

    def __init__(self, capsys: pytest.CaptureFixture):
        self.capsys = capsys

    def getvalue(self) -> str:
        return self.capsys.readouterr().err


@pytest.fixture
def captured(capsys):
    logger = get_logger()
    assert [h for h in logger.handlers if isinstance(h, _RankHandler)]
    yield logger, type("H", (), {"stream": _Captured(capsys)})()
    set_rank(0)


def test_rank_0_prints_information(captured):
    logger, handler = captured
    set_rank(0)
    logger.info("epoch %d", 1)
    logger.warning("slow")
    assert handler.stream.getvalue() == "[distlib rank 0] INFO epoch 1\n[distlib rank 0] WARNING slow\n"


def test_other_ranks_print_only_warnings_and_errors(captured):
    logger, handler = captured
    set_rank(3)
    logger.info("epoch %d", 1)
    logger.debug("details")
    logger.warning("slow")
    logger.error("failed")
    assert handler.stream.getvalue() == "[distlib rank 3] WARNING slow\n[distlib rank 3] ERROR failed\n"


def test_one_handler_however_often_asked():
    assert get_logger() is get_logger()
    assert sum(isinstance(h, _RankHandler) for h in get_logger().handlers) == 1


def test_a_handler_attached_by_someone_else_does_not_replace_ours():
    logger = logging.getLogger("distlib")
    saved = logger.handlers[:]
    foreign = logging.NullHandler()  # e.g. an application's, attached before distlib's first use
    logger.handlers = [foreign]
    try:
        get_logger()
        assert foreign in logger.handlers
        assert sum(isinstance(h, _RankHandler) for h in logger.handlers) == 1
    finally:
        logger.handlers = saved


def test_an_application_root_handler_prints_no_line_twice_and_no_information_of_other_ranks(captured):
    """A script that calls logging.basicConfig() (a handler on the root logger): distlib's lines
    are printed once, by distlib's handler, so rank 3's information stays silent there too."""
    logger, handler = captured
    root = logging.getLogger()
    app = logging.StreamHandler()  # writes to this test's captured stderr, like basicConfig()
    root.addHandler(app)
    try:
        set_rank(3)
        logger.info("epoch %d", 1)
        logger.warning("slow")
    finally:
        root.removeHandler(app)
    assert handler.stream.getvalue() == "[distlib rank 3] WARNING slow\n"
