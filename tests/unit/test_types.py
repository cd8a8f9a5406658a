"""mypy stays clean on ckptfs/ (issue 22): the checkout's package, checked with the
settings of pyproject.toml's [tool.mypy] (default strictness, core included since its
composition), through mypy's API on every run of the suite.  A failure lists
mypy's errors, one per line."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_reports_no_error_in_ckptfs(monkeypatch: pytest.MonkeyPatch) -> None:
    # From the root, as a developer runs `mypy`: the config's paths and the cache
    # (.mypy_cache, ignored by git) are the checkout's.
    monkeypatch.chdir(ROOT)
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                      str(ROOT / "ckptfs")])
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert status == 0 and not errors, \
        f"mypy (exit {status}) on ckptfs/:\n" + "\n".join(errors or [stdout, stderr])
