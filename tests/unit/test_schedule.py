"""The suite's own scheduling (tests/support/schedule.py): longest files first, each
file's tests together and in order, unknown files ahead of short ones."""

from __future__ import annotations

import json

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
