"""Small-file workloads of everyday tools (issue 25 item 4): a tree of many small files,
and the tools run on it into a target directory — ``cp -a``, ``tar x``, ``rsync -a``,
``git add`` and an sqlite database in DELETE journal mode.  Each returns the seconds the
tool took (wall clock, from its start to its exit).  ``ckptfs bench`` runs ``cp -a`` and
``tar x``; ``tools/small_files.py`` runs them all.  Knows nothing of ckptfs: a target is
any directory (local disk, a passthrough mount, a ckptfs mount).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

KiB = 1 << 10


def make_tree(root: Path, files: int = 1000, size: int = 4 * KiB, per_dir: int = 100) -> Path:
    """``files`` files of ``size`` distinct bytes, ``per_dir`` to a directory, under
    ``root/tree``; returns that directory (the tools copy it as a whole)."""
    tree = root / "tree"
    for i in range(files):
        d = tree / f"d{i // per_dir:03d}"
        if i % per_dir == 0:
            d.mkdir(parents=True, exist_ok=True)
        seed = hashlib.sha256(f"small/{i}".encode()).digest()
        (d / f"f{i:05d}.bin").write_bytes((seed * (size // 32 + 1))[:size])
    return tree


def make_tar(tree: Path, archive: Path) -> Path:
    subprocess.run(["tar", "cf", str(archive), "-C", str(tree.parent), tree.name], check=True)
    return archive


def _timed(argv: list[str], cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, errors="replace")
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["(no output)"]
        raise ToolFailed(f"{argv[0]} exited with status {proc.returncode}: {lines[0]}"
                         + (f" (and {len(lines) - 1} more line(s))" if len(lines) > 1 else ""))
    return seconds


class ToolFailed(RuntimeError):
    """A tool exited non-zero: one line naming it and its first error."""


def cp_a(tree: Path, archive: Path, target: Path) -> float:
    return _timed(["cp", "-a", str(tree), str(target / "cp")])


def tar_x(tree: Path, archive: Path, target: Path) -> float:
    (target / "tar").mkdir()
    return _timed(["tar", "xf", str(archive), "-C", str(target / "tar")])


def rsync_a(tree: Path, archive: Path, target: Path) -> float:
    return _timed(["rsync", "-a", str(tree) + "/", str(target / "rsync")])


def git_add(tree: Path, archive: Path, target: Path) -> float:
    """``git add -A`` of the tree already in the target (the copy is not timed)."""
    repo = target / "git"
    shutil.copytree(tree, repo)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    return _timed(["git", "-c", "core.fsync=none", "add", "-A"], cwd=repo)


SQLITE_TRANSACTIONS = 200


def sqlite_delete(tree: Path, archive: Path, target: Path) -> float:
    """``SQLITE_TRANSACTIONS`` one-row transactions in DELETE journal mode (the rollback
    journal is created, written, fsynced and deleted each time), synchronous=FULL."""
    t0 = time.perf_counter()
    db = sqlite3.connect(target / "db.sqlite", isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=DELETE")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v BLOB)")
        for i in range(SQLITE_TRANSACTIONS):
            db.execute("BEGIN")
            db.execute("INSERT INTO t VALUES (?, ?)", (i, os.urandom(512)))
            db.execute("COMMIT")
    finally:
        db.close()
    return time.perf_counter() - t0


Tool = Callable[[Path, Path, Path], float]
TOOLS: dict[str, Tool] = {"cp_a": cp_a, "tar_x": tar_x, "rsync_a": rsync_a,
                          "git_add": git_add, "sqlite_delete": sqlite_delete}


def available(name: str) -> bool:
    binary = {"cp_a": "cp", "tar_x": "tar", "rsync_a": "rsync", "git_add": "git"}.get(name)
    return binary is None or shutil.which(binary) is not None
