"""The core-coverage gate, a pytest plugin: statement coverage of ``ckptfs/core/``
from the tests that drive the core in the test process, without FUSE (tests/unit: the
daemons of the integration tests run in processes of their own and are not measured).

``start()`` is called by tests/conftest.py before anything imports ``ckptfs.core``;
every process of the run (the xdist controller and each worker) measures into a data
file of its own in one directory, which the process that reports (the controller, or
the only process) combines at the end.  The figure is printed in the terminal summary
as ``core coverage without FUSE: NN%``; a run that asked for the whole of tests/unit
(or all tests) and passed fails below :data:`FLOOR`.  Without coverage.py installed
(the ``test`` extra) the figure says it was not measured.

Knows where the core lives and which directory holds the tests without FUSE; nothing
of ckptfs's code.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

FLOOR = 80.0
CORE = Path(__file__).resolve().parents[2] / "ckptfs" / "core"
TESTS = Path(__file__).resolve().parents[1]
UNIT = TESTS / "unit"
# Not CKPTFS_*: every daemon a test starts inherits the environment, and ckptfs refuses
# CKPTFS_* settings it does not know.
DIR_VAR = "CORE_COVERAGE_DIR_CKPTFS_TESTS"
OWNER_VAR = "CORE_COVERAGE_OWNER_CKPTFS_TESTS"
LINE = "core coverage without FUSE"

_figure = pytest.StashKey[str]()


def start() -> None:
    """Measure this process from here on (a no-op without coverage.py, or when a
    measurement already runs)."""
    try:
        import coverage
    except ImportError:
        return
    if coverage.Coverage.current() is not None:
        return
    if DIR_VAR not in os.environ:      # the first process of the run owns the directory
        os.environ[DIR_VAR] = tempfile.mkdtemp(prefix="ckptfs-core-coverage-")
        os.environ[OWNER_VAR] = str(os.getpid())
    cov = coverage.Coverage(data_file=os.path.join(os.environ[DIR_VAR], "data"),
                            data_suffix=True, source=[str(CORE)], branch=False,
                            config_file=False)
    cov.start()


def _owner() -> bool:
    return os.environ.get(OWNER_VAR) == str(os.getpid())


def _whole_unit_run(config: pytest.Config) -> bool:
    """The run asked for all of tests/unit (or a directory above it), unfiltered."""
    if config.getoption("keyword", "") or config.getoption("markexpr", ""):
        return False
    if config.getoption("deselect", None) or config.getoption("lf", False):
        return False
    root = Path(config.invocation_params.dir)
    for arg in config.args:
        if "::" in arg:
            continue
        path = (root / arg).resolve()
        if path == UNIT or path in UNIT.parents:
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every process saves what it measured; the owner then combines and judges."""
    try:
        import coverage
    except ImportError:
        session.config.stash[_figure] = (f"{LINE}: not measured (coverage.py is not "
                                         "installed: the test extra)")
        return
    cov = coverage.Coverage.current()
    if cov is None:
        return
    cov.stop()
    cov.save()
    if not _owner():
        return
    directory = os.environ[DIR_VAR]
    combined = coverage.Coverage(data_file=os.path.join(directory, "data"),
                                 source=[str(CORE)], config_file=False)
    combined.combine([directory], keep=False)
    with open(os.devnull, "w") as sink:
        percent = combined.report(file=sink)
    shutil.rmtree(directory, ignore_errors=True)
    whole = _whole_unit_run(session.config)
    failed = whole and exitstatus == 0 and percent < FLOOR
    verdict = ("below the floor" if failed else "floor held" if whole
               else "floor not checked: only part of tests/unit ran")
    session.config.stash[_figure] = f"{LINE}: {percent:.0f}% (floor {FLOOR:.0f}%: {verdict})"
    if failed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    figure = config.stash.get(_figure, None)
    if figure is not None:
        terminalreporter.write_sep("-", figure)
