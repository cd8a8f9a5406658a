"""A pytest plugin: a test fails when any ckptfs daemon log it produced holds an
unexpected ``ERROR``/``CRITICAL`` record or a ``Traceback``.

Daemon logs are found as ``ckptfs.log`` files under the test's ``tmp_path`` (every
``Mount`` keeps its state dir there, and the daemon logs to ``<state_dir>/ckptfs.log``
by default).  A test that expects errors says which, as regular expressions searched
in the whole record (its first line and any traceback under it)::

    @pytest.mark.expect_log_errors(r"corrupt chunk", r"store timeout: put ")

Knows nothing of ckptfs beyond its log format.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

LOG_NAME = "ckptfs.log"
# "2026-01-01 12:00:00,123 LEVEL logger: message" (cli.run_foreground's format)
_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) ")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "expect_log_errors(*patterns): ERROR records or tracebacks matching one "
        "of these regular expressions are expected in the daemon logs of this test")


def records(text: str) -> list[tuple[str, str]]:
    """(level, text) of each record; lines before the first record, and lines that are
    not records (a traceback printed to stderr), join the record above them."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        m = _RECORD.match(line)
        if m or not out:
            out.append((m.group(1) if m else "", [line]))
        else:
            out[-1][1].append(line)
    return [(level, "\n".join(lines)) for level, lines in out]


def bad_records(text: str, allowed: list[re.Pattern]) -> list[str]:
    bad = []
    for level, record in records(text):
        if level in ("ERROR", "CRITICAL") or "Traceback (most recent call last)" in record:
            if not any(p.search(record) for p in allowed):
                bad.append(record)
    return bad


def daemon_logs(root: Path) -> list[Path]:
    """Every daemon log under ``root``, never descending into a mount point."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not os.path.ismount(os.path.join(dirpath, d))]
        if LOG_NAME in filenames:
            found.append(Path(dirpath) / LOG_NAME)
    return sorted(found)


CHECKED_DIRS = ("integration", "frameworks")


@pytest.fixture(autouse=True)
def _daemon_logs_clean(request):
    """Checked after every other fixture of the test is torn down (mounts are gone) and
    before ``tmp_path`` is removed (it is requested here, so it outlives this check)."""
    if not any(part in CHECKED_DIRS for part in request.node.path.parts):
        yield
        return
    root = request.getfixturevalue("tmp_path")
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        return          # the test failed already; its own report says more
    allowed = [re.compile(p) for mark in request.node.iter_markers("expect_log_errors")
               for p in mark.args]
    problems = []
    for log in daemon_logs(root):
        for record in bad_records(log.read_text(errors="replace"), allowed):
            problems.append(f"{log.relative_to(root)}:\n{record}")
    if problems:
        pytest.fail("unexpected ERROR/Traceback in daemon log(s) (declare expected ones "
                    "with @pytest.mark.expect_log_errors):\n" + "\n---\n".join(problems),
                    pytrace=False)


# What a failed test's report shows of each daemon log: its WARNING/ERROR records and
# traceback lines, then its last lines.  CI prints only the report, and the logs go with
# the test's tmp_path.
NOTABLE_RECORDS = 40
LAST_LINES = 25


def failure_excerpt(text: str) -> str:
    notable = [record for level, record in records(text)
               if level in ("WARNING", "ERROR", "CRITICAL") or "Traceback (most" in record]
    lines = text.splitlines()
    return ("-- warnings and errors --\n" + "\n".join(notable[-NOTABLE_RECORDS:])
            + f"\n-- last {LAST_LINES} lines --\n" + "\n".join(lines[-LAST_LINES:]))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call":
        item.rep_call = rep
    if rep.failed and rep.when in ("call", "setup"):
        root = getattr(item, "funcargs", {}).get("tmp_path")
        if isinstance(root, Path) and any(part in CHECKED_DIRS for part in item.path.parts):
            for log in daemon_logs(root):
                rep.sections.append((f"daemon log {log.relative_to(root)}",
                                     failure_excerpt(log.read_text(errors="replace"))))
    return rep
