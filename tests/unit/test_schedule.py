"""The suite's own scheduling (tests/support/schedule.py): longest files first, each
file's tests together and in order, unknown files ahead of short ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.schedule import UNKNOWN, load_table, longest_first


def test_files_run_longest_first_with_their_tests_together_and_in_order():
    nodeids = ["tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "tests/c.py::t1",
               "tests/b.py::t2", "tests/new.py::t1"]
    table = {"tests/a.py": 5.0, "tests/b.py": UNKNOWN + 100, "tests/c.py": 1.0}
    order = [nodeids[i] for i in longest_first(nodeids, table)]
    assert order == ["tests/b.py::t1", "tests/b.py::t2", "tests/new.py::t1",
                     "tests/a.py::t1", "tests/a.py::t2", "tests/c.py::t1"]


def test_the_recorded_table_lists_existing_files_in_seconds(tmp_path):
    table = load_table()
    assert table, "tests/durations.json is missing or empty"
    assert all(name.startswith("tests/") and name.endswith(".py") for name in table)
    assert all(seconds >= 0 for seconds in table.values())
    assert load_table(tmp_path / "none.json") == {}
    (tmp_path / "t.json").write_text(json.dumps({"tests/x.py": 2}))
    assert load_table(tmp_path / "t.json") == {"tests/x.py": 2.0}


CRASHING_RUN = {
    # Files that finish first, so the dying worker has finished work of its own.
    **{f"test_f{i}.py": "def test_one(): pass\ndef test_two(): pass\n" for i in range(5)},
    "test_z.py": "import os, signal\n"
                 "def test_before(): pass\n"
                 "def test_dies(): os.kill(os.getpid(), signal.SIGKILL)\n"
                 "def test_after(): pass\n",
}


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_dead_worker_ends_in_a_red_run_that_names_it_not_a_hang(pytester, monkeypatch,
                                                                    workers):
    # pytest-xdist 3.8's own loadfile scheduler hangs here, or re-runs the test that
    # killed the worker on every replacement (it hung CI for 80 minutes).
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    pytester.makepyfile(**{name[:-3]: text for name, text in CRASHING_RUN.items()})
    result = pytester.runpytest_subprocess("-n", workers, "--dist", "loadfile",
                                           "-p", "support.schedule", "-p", "no:cacheprovider",
                                           timeout=120)
    result.assert_outcomes(passed=12, failed=1)
    result.stdout.fnmatch_lines(["*died (killed by signal 9)*",
                                 "FAILED test_z.py::test_dies*crashed*"])
