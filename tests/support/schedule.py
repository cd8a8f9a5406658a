"""Longest test files first, a pytest plugin: orders the collected tests by the
recorded duration of their file (``tests/durations.json``, seconds per file from a
whole run), keeping each file's tests together and in their order.

With ``-n 2 --dist loadfile`` (tools/run-tests.sh) xdist hands out files in the order
given here -- its own reordering, by number of tests per file, is turned off: it put the
files with a few long tests (CPython's suites, the model test) last, where one worker ran
them for minutes while the other had nothing left to do.  A file missing from the table
(a new one) counts as ``UNKNOWN`` seconds, ahead of the many short files.  Regenerate the
table with ``tools/test_durations.py JUNIT_XML`` after a whole run with ``--junitxml``.

Knows file paths and seconds; nothing of ckptfs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
