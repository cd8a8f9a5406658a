"""Longest test files first, a pytest plugin: orders the collected tests by the
recorded duration of their file (``tests/durations.json``, seconds per file from a
whole run), keeping each file's tests together and in their order.

With ``-n 2 --dist loadfile`` (tools/run-tests.sh) xdist hands out files in the order
given here -- its own reordering, by number of tests per file, is turned off: it put the
files with a few long tests (CPython's suites, the model test) last, where one worker ran
them for minutes while the other had nothing left to do.  A file missing from the table
(a new one) counts as ``UNKNOWN`` seconds, ahead of the many short files.  Regenerate the
table with ``tools/test_durations.py JUNIT_XML`` after a whole run with ``--junitxml``.

A worker that dies (a signal, the OOM killer, ``os._exit`` in the wrong process) must
end in a red run that says so, never in a hang: pytest-xdist 3.8's file scheduler put a
dead worker's finished files back on the queue as empty work, re-ran the test that
killed it on every replacement, and waited for ever on a replacement given one test
(pytest-xdist issues 1323, 1327, 1378; the CI run of stop 27 hung 80 minutes that
way).  :class:`FileScheduling` is its scheduler with those three mended, and
:func:`pytest_testnodedown` prints how the worker died.

Knows file paths, seconds and xdist's scheduler; nothing of ckptfs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:            # without xdist: ordering only
    LoadFileScheduling = object  # type: ignore[assignment,misc]

TABLE = Path(__file__).resolve().parents[1] / "durations.json"
UNKNOWN = 60.0      # seconds assumed for a file the table does not list


def load_table(path: Path = TABLE) -> dict[str, float]:
    """file path relative to the repository root -> seconds (empty without a table)."""
    try:
        return {k: float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(nodeids: list[str], table: dict[str, float]) -> list[int]:
    """Indices of ``nodeids`` in run order: files by recorded seconds, longest first
    (ties: the order they were collected in), each file's tests in their order."""
    first_seen: dict[str, int] = {}
    for index, nodeid in enumerate(nodeids):
        first_seen.setdefault(file_of(nodeid), index)

    def key(index: int) -> tuple[float, int, int]:
        name = file_of(nodeids[index])
        return (-table.get(name, UNKNOWN), first_seen[name], index)

    return sorted(range(len(nodeids)), key=key)


def pytest_configure(config: pytest.Config) -> None:
    # xdist's loadscope/loadfile would re-sort the files by their number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    table = load_table()
    if not table:
        return
    order = longest_first([item.nodeid for item in items], table)
    items[:] = [items[index] for index in order]


class FileScheduling(LoadFileScheduling):  # type: ignore[misc,valid-type]
    """xdist's ``--dist loadfile`` scheduler, safe when a worker dies."""

    def remove_node(self, node: Any) -> str | None:
        workload: dict[str, dict[str, bool]] = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items()
                      if not all(unit.values())}
        if not unfinished:
            return None
        crashed = next(nodeid for unit in unfinished.values()
                       for nodeid, done in unit.items() if not done)
        # xdist reports it failed; run again it would take the replacement down too.
        for unit in unfinished.values():
            unit.pop(crashed, None)
        for scope, unit in reversed(list(unfinished.items())):
            if unit and not all(unit.values()):     # the rest of its file, next
                self.workqueue[scope] = unit
                self.workqueue.move_to_end(scope, last=False)
        for other in list(self.assigned_work):
            self._reschedule(other)
        return crashed

    def _reschedule(self, node: Any) -> None:
        if node not in self.registered_collections:    # a replacement still collecting
            return
        super()._reschedule(node)
        # A worker runs a test once it knows the next one or that there is none: with
        # the queue empty, tell it now, or a replacement given one test waits for ever.
        if not self.workqueue and not node.shutting_down:
            node.shutdown()


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if LoadFileScheduling is object or config.getvalue("dist") != "loadfile":
        return None
    return FileScheduling(config, log)


def pytest_testnodedown(node: Any, error: object | None) -> None:
    """Says how a worker died: its exit status, and the kernel's OOM lines."""
    if error is None:
        return
    popen = getattr(getattr(node.gateway, "_io", None), "popen", None)
    try:        # its pipe closed first: give the kernel a moment to report the exit
        status = popen.wait(timeout=10) if popen is not None else None
    except subprocess.TimeoutExpired:
        status = None
    how = ("still running" if status is None else
           f"killed by signal {-status}" if status < 0 else f"exit status {status}")
    lines = [f"worker {node.gateway.id} died ({how}): {error}"]
    try:
        kernel = subprocess.run(["dmesg", "--ctime"], capture_output=True, text=True,
                                timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        kernel = []
    lines += [line for line in kernel[-400:]
              if "oom" in line.lower() or "killed process" in line.lower()][-5:]
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line)
