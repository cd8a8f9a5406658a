"""Local bytes being written: staging files.

``Staging`` keeps one sparse file per version of an inode under ``staging/`` with a
shared descriptor, and moves versions nobody will publish to ``abandoned/``.  The chunk
cache (fetched bytes) is ``cache.py``.  Knows nothing of FUSE, of the store, or of
inodes' meaning.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from .errors import FsError


class Staging:
    """Sparse staging files, one per *version* of an inode: ``<ino>.<ver>``.

    A write session works on a version of its own, so a closed version is never
    changed again (it uploads, or serves reads, while the next save writes beside it).
    Version 0 is the name older state dirs used (``<ino>``).  One descriptor per version
    is opened on demand and shared by the handles reading or writing it."""

    def __init__(self, root: Path, abandoned: Path) -> None:
        self.root = root
        self.abandoned = abandoned
        root.mkdir(parents=True, exist_ok=True)
        abandoned.mkdir(parents=True, exist_ok=True)
        self._fds: dict[tuple[int, int], int] = {}

    def path(self, ino: int, ver: int) -> Path:
        return self.root / (f"{ino}.{ver}" if ver else str(ino))

    @staticmethod
    def parse_name(name: str) -> tuple[int, int] | None:
        ino, _, ver = name.partition(".")
        try:
            return int(ino), int(ver or 0)
        except ValueError:
            return None

    def versions(self) -> list[tuple[int, int]]:
        """Every (ino, ver) with a staging file on disk."""
        out = []
        for entry in os.scandir(self.root):
            parsed = self.parse_name(entry.name)
            if parsed is not None:
                out.append(parsed)
        return out

    def exists(self, ino: int, ver: int) -> bool:
        return (ino, ver) in self._fds or self.path(ino, ver).exists()

    def fd(self, ino: int, ver: int, create: bool = False) -> int:
        fd = self._fds.get((ino, ver))
        if fd is None:
            flags = os.O_RDWR | (os.O_CREAT if create else 0)
            try:
                fd = os.open(self.path(ino, ver), flags, 0o600)
            except FileNotFoundError:
                raise FsError(errno.EIO, f"staging file {ino}.{ver} is missing") from None
            self._fds[(ino, ver)] = fd
        return fd

    def create_empty(self, ino: int, ver: int) -> int:
        fd = self.fd(ino, ver, create=True)
        os.ftruncate(fd, 0)
        return fd

    def size(self, ino: int, ver: int) -> int:
        fd = self._fds.get((ino, ver))
        if fd is not None:
            return os.fstat(fd).st_size
        try:
            return os.stat(self.path(ino, ver)).st_size
        except FileNotFoundError:
            raise FsError(errno.EIO, f"staging file {ino}.{ver} is missing") from None

    def copy(self, ino: int, src: int, dst: int) -> None:
        """Copy version ``src`` into a new version ``dst`` (blocking: run in a thread)."""
        with open(self.path(ino, src), "rb") as fin, open(self.path(ino, dst), "wb") as fout:
            remaining = os.fstat(fin.fileno()).st_size
            while remaining > 0:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), min(remaining, 1 << 30))
                if n == 0:
                    break
                remaining -= n

    def rename_version(self, ino: int, src: int, dst: int) -> None:
        self.close_fd(ino, src)
        os.replace(self.path(ino, src), self.path(ino, dst))

    def close_fd(self, ino: int, ver: int) -> None:
        fd = self._fds.pop((ino, ver), None)
        if fd is not None:
            os.close(fd)

    def remove(self, ino: int, ver: int) -> None:
        self.close_fd(ino, ver)
        try:
            self.path(ino, ver).unlink()
        except FileNotFoundError:
            pass

    def abandon(self, ino: int, ver: int) -> Path | None:
        """Move a staging file aside (kept for ``ckptfs gc``) and forget it."""
        self.close_fd(ino, ver)
        src = self.path(ino, ver)
        if not src.exists():
            return None
        dst = self.abandoned / f"{time.time_ns()}-{src.name}"
        os.replace(src, dst)
        return dst

    def close_all(self) -> None:
        for key in list(self._fds):
            self.close_fd(*key)


def sweep_abandoned(directory: Path, cutoff: float, dry_run: bool) -> list[str]:
    """Staged bytes of killed writers older than ``cutoff`` (blocking: run in a thread)."""
    out = []
    for path in sorted(directory.iterdir()):
        if path.stat().st_mtime < cutoff:
            out.append(path.name)
            if not dry_run:
                path.unlink()
    return out
