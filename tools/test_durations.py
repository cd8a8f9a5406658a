#!/usr/bin/env python3
"""Seconds per test file from a pytest ``--junitxml`` report of a whole run, written as
tests/durations.json (the table tests/support/schedule.py orders files by), and the
top files printed.  Usage: tools/test_durations.py JUNIT_XML [OUT_JSON]"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def file_of(classname: str) -> str:
    """``tests.unit.test_x.TestY`` -> ``tests/unit/test_x.py`` (the longest prefix that
    is a file of the repository)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).exists():
            return path
    return "/".join(parts) + ".py"


def per_file(junit: Path) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        totals[file_of(case.get("classname", ""))] += float(case.get("time", 0))
    return dict(totals)


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    totals = per_file(Path(sys.argv[1]))
    out = Path(sys.argv[2]) if len(sys.argv) == 3 else ROOT / "tests" / "durations.json"
    ordered = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
    out.write_text(json.dumps({k: round(v, 1) for k, v in ordered.items()}, indent=1) + "\n")
    for name, seconds in list(ordered.items())[:20]:
        print(f"{seconds:8.1f}  {name}")
    print(f"{sum(totals.values()):8.1f}  all {len(totals)} files (sum of test times)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
