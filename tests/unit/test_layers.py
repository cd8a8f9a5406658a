"""The layering is a contract (pyproject.toml, [tool.importlinter]) over the packages:
cli | testing -> node | bench -> fuse -> core -> cluster -> meta | data -> format -> store; nothing
below the node and the FUSE adapter imports pyfuse3, and nothing but the S3 store imports
boto3.  ``lint-imports`` checks it on every run of the suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lint_imports() -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or \
        shutil.which("lint-imports")
    assert exe, "lint-imports is not installed (pip install -e '.[test]')"
    # The package under test is the one in this checkout, whatever is installed.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_layering_contract_holds():
    proc = lint_imports()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 0 kept, 0 broken" not in proc.stdout      # contracts were read
    assert " broken" in proc.stdout and ", 0 broken" in proc.stdout
