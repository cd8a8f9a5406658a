"""The daemon-log check (tests/logcheck.py): which records count as unexpected."""

import re

from support.logcheck import bad_records

LOG = """\
2026-01-01 10:00:00,001 INFO ckptfs.node.daemon: mounted file:///s on /m
2026-01-01 10:00:01,002 WARNING ckptfs.store: store put k failed (x); retry 1 in 0.1s
2026-01-01 10:00:02,003 ERROR ckptfs.data.staging: chunk abc from the store failed verification
2026-01-01 10:00:03,004 ERROR ckptfs.fuse.ops: flush failed unexpectedly
Traceback (most recent call last):
  File "x.py", line 1, in f
OSError: [Errno 36] File name too long
2026-01-01 10:00:04,005 INFO ckptfs.fs: done
"""


def test_errors_and_tracebacks_are_reported_with_their_traceback():
    bad = bad_records(LOG, [])
    assert len(bad) == 2
    assert "failed verification" in bad[0]
    assert "flush failed unexpectedly" in bad[1] and "File name too long" in bad[1]


def test_expected_patterns_allow_records():
    assert bad_records(LOG, [re.compile("failed verification")]) == \
        [r for r in bad_records(LOG, []) if "flush failed" in r]
    # A pattern may match the traceback under the record.
    assert bad_records(LOG, [re.compile("failed verification"),
                             re.compile("Errno 36")]) == []


def test_a_traceback_printed_outside_logging_is_reported():
    text = "Traceback (most recent call last):\n  File \"x\"\nRuntimeError: boom\n"
    assert len(bad_records(text, [])) == 1
    assert bad_records("2026-01-01 10:00:00,001 INFO x: fine\n", []) == []
