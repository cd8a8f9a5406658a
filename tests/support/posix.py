"""POSIX calls Python's os module lacks, users to run tests as, and directories every
user may enter.

Knows nothing of ckptfs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def renameat2(src: str | os.PathLike, dst: str | os.PathLike, flags: int) -> int:
    """``renameat2(2)``: 0, or the errno it failed with."""
    libc = ctypes.CDLL(None, use_errno=True)
    r = libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags)
    return 0 if r == 0 else ctypes.get_errno()


def system_user(name: str) -> pwd.struct_passwd:
    """The user ``name``, made (a system user with no home) if it is not there yet."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh",
                        name], check=True)
        return pwd.getpwnam(name)


@contextmanager
def open_dir(prefix: str) -> Iterator[Path]:
    """A directory every user may enter (tmp_path's parents are root's only), removed
    afterwards."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def fill_file_system(directory) -> None:
    """Another program's file (``directory/filler``) takes every byte of ``directory``'s
    file system; what is left is what the file system keeps for itself.  Remove the
    file to give the space back."""
    fd = os.open(Path(directory) / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for piece in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * piece)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)



@dataclass
class Opens:
    """What a reader looping over one path saw: whole reads and ENOENT answers."""

    reads: int = 0
    missed: int = 0


@contextmanager
def reading_in_a_loop(path: Path, prefix: bytes) -> Iterator[Opens]:
    """A thread opens and reads ``path`` over and over while the block runs; each read
    must start with ``prefix`` (one version of the file, whole), and each ENOENT is
    counted as a miss; any other error fails the block."""
    stop, seen, failures = threading.Event(), Opens(), []

    def loop() -> None:
        while not stop.is_set():
            try:
                with open(path, "rb") as f:
                    data = f.read()
                if not data.startswith(prefix):
                    failures.append(data[:80])
                seen.reads += 1
            except FileNotFoundError:
                seen.missed += 1
            except OSError as exc:      # (ESTALE: the thread died quietly before)
                failures.append(f"open or read failed: {exc}".encode())
    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()
    assert not failures, f"read something else than a version, or failed: {failures[:3]}"
