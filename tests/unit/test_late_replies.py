"""pyfuse3's ERROR line for a reply the kernel no longer waited for (fuse/late_replies.py):
found by the CI check of stop 34, where a Ray Train test's daemon log held
``ERROR pyfuse3: fuse_releasedir(): fuse_reply_* failed with No such file or directory``
(a releasedir answered after the kernel had ended it at unmount) and failed the test."""

from __future__ import annotations

import logging

import pytest

from ckptfs.fuse import late_replies


@pytest.fixture
def pyfuse3_log(caplog):
    logger = logging.getLogger("pyfuse3")
    saved = list(logger.filters)
    late_replies.install()
    late_replies.install()          # once per daemon, however often it is called
    assert sum(isinstance(f, late_replies.LateReplies) for f in logger.filters) == 1
    caplog.set_level(logging.DEBUG, logger="pyfuse3")
    yield logger, caplog
    logger.filters[:] = saved


@pytest.mark.parametrize("op", ["release", "releasedir", "flush", "fsync", "fsyncdir"])
def test_a_late_reply_to_a_request_that_ends_a_use_is_info_and_says_why(pyfuse3_log, op):
    logger, caplog = pyfuse3_log
    # pyfuse3's own call (handlers.pxi): log.error('fuse_%s(): fuse_reply_* failed with %s')
    logger.error(f"fuse_{op}(): fuse_reply_* failed with %s", "No such file or directory")
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.levelname == "INFO"
    assert record.getMessage().startswith(f"fuse_{op}(): the kernel no longer waited")


@pytest.mark.parametrize("line", [
    "fuse_create(): fuse_reply_* failed with No such file or directory",  # a lost handle
    "fuse_open(): fuse_reply_* failed with No such file or directory",
    "fuse_release(): fuse_reply_* failed with Invalid argument",           # not the kernel
])
def test_every_other_failed_reply_stays_an_error(pyfuse3_log, line):
    logger, caplog = pyfuse3_log
    logger.error("%s", line)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.getMessage() == line
