"""All-or-nothing LMDB writes for the node-local state: nested writes share one
transaction (``batch``), work promised for after the commit (``after_commit``) runs only
once the transaction is committed, and a write the state dir cannot hold (its disk
full, or the LMDB map full) is ``FsError(ENOSPC)`` with nothing changed; a removal that
must land even then gives up the state dir's reserve (``with_room``).  Knows nothing
of inodes, of the namespace's tables, of files or of the store.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb

from ..errors import FsError
from .reserve import RoomReserve

T = TypeVar("T")


class Transactions:
    """A base for an owner of one LMDB environment (``env``, at ``path``)."""

    env: lmdb.Environment
    path: Path

    def _init_transactions(self, reserve: RoomReserve | None = None) -> None:
        self._txn: lmdb.Transaction[bytes] | None = None    # the open ``batch``, if any
        self._txn_thread = 0                          # (the thread that opened it)
        self._after_commit: list[Callable[[], None]] = []
        self._on_rollback: list[Callable[[], None]] = []
        self.reserve = reserve
        # The reserve is not held: try to take it again after each commit.
        self._reserve_out = reserve is not None and not reserve.arm()
        self._map_full = False      # the last failed write found the LMDB map full

    def with_room(self, write: Callable[[], T]) -> T:
        """``write()`` -- a removal that must land on a full disk: when it fails for
        want of space, the reserve is given up and it is tried once more.  Outside a
        batch only (a batch's other writes would take the room)."""
        assert self._txn is None, "with_room inside a batch"
        try:
            return write()
        except FsError as exc:
            # A full map is not helped by room on the disk: ENOSPC as it is.
            if exc.errno != errno.ENOSPC or self._map_full or self.reserve is None or \
                    not self.reserve.give_up():
                raise
        self._reserve_out = True
        return write()

    @contextmanager
    def _read(self) -> Iterator[lmdb.Transaction[bytes]]:
        """A read transaction; inside a ``batch``, in the thread that opened it, the
        batch's own, so that a read sees what the batch wrote.  (A read transaction
        of its own sees only what is committed: a name the batch removed was still
        found, and a name the batch added was not.)"""
        if self._txn is not None and self._txn_thread == threading.get_ident():
            yield self._txn
            return
        with self.env.begin() as txn:
            yield txn

    @contextmanager
    def _write(self) -> Iterator[lmdb.Transaction[bytes]]:
        """A write transaction, or the open ``batch``'s."""
        with self.batch() as txn:
            yield txn

    @contextmanager
    def batch(self) -> Iterator[lmdb.Transaction[bytes]]:
        """Every write inside is one transaction: all or nothing.  When it fails,
        ``_rolled_back`` is told (to drop in-memory copies of what it wrote), the
        ``on_rollback`` calls made inside run (latest first) and the ``after_commit``
        calls are not run."""
        if self._txn is not None:
            yield self._txn
            return
        self._after_commit.clear()
        self._on_rollback.clear()
        try:
            with self.env.begin(write=True) as txn:
                self._txn, self._txn_thread = txn, threading.get_ident()
                try:
                    yield txn
                finally:
                    self._txn = None
        except BaseException as exc:
            self._after_commit.clear()
            self._rolled_back()
            undo, self._on_rollback = self._on_rollback, []
            for call in reversed(undo):
                call()
            self._map_full = isinstance(exc, lmdb.MapFullError)
            if self._map_full:
                raise FsError(errno.ENOSPC, f"{self.path}: the LMDB map is full") from None
            if isinstance(exc, lmdb.Error) and out_of_space(exc, free_bytes(self.path)):
                raise FsError(errno.ENOSPC, f"{self.path}: {exc}") from None
            raise
        self._committed()
        self._on_rollback.clear()
        calls, self._after_commit = self._after_commit, []
        failed: Exception | None = None
        for call in calls:      # each runs, whatever an earlier one raised: all is committed
            try:
                call()
            except Exception as exc:
                failed = failed or exc
        if self._reserve_out and self.reserve is not None and self.reserve.arm():
            self._reserve_out = False     # (``arm`` never raises)
        if failed is not None:
            raise failed

    def commits(self) -> int:
        """LMDB's last committed transaction id: grows with every commit, whichever
        code path made it (a count of changes for ``JournalSync``)."""
        return int(self.env.info()["last_txnid"])

    def after_commit(self, call: Callable[[], None]) -> None:
        """Run ``call`` once the current write is committed (at once outside a batch)."""
        if self._txn is None:
            call()
        else:
            self._after_commit.append(call)

    def on_rollback(self, call: Callable[[], None]) -> None:
        """Run ``call`` if the open ``batch`` fails: it undoes an in-memory change made
        beside the batch's writes.  Call it inside a ``batch``; outside one it does
        nothing (a lone write that fails raises before the caller goes on)."""
        if self._txn is not None:
            self._on_rollback.append(call)

    def _rolled_back(self) -> None:
        """A write transaction failed: nothing it wrote is on disk."""

    def _committed(self) -> None:
        """A write transaction is on disk."""


# Below this much free space, an I/O error from LMDB's commit is taken for a full disk:
# LMDB reports a short write (what a nearly full disk gives) as EIO, not ENOSPC.
NEARLY_FULL = 16 << 20


def out_of_space(exc: lmdb.Error, free: int | None = None) -> bool:
    """LMDB says a write failed for want of disk space (its errors carry no errno, only
    the C library's message): ENOSPC or EDQUOT, or EIO (a short write) while the disk
    has less than ``NEARLY_FULL`` bytes free (``free``, None if unknown)."""
    text = str(exc)
    if any(os.strerror(code) in text for code in (errno.ENOSPC, errno.EDQUOT)):
        return True
    return os.strerror(errno.EIO) in text and free is not None and free < NEARLY_FULL


def free_bytes(path: Path) -> int | None:
    """Bytes free for this process on the file system of ``path`` (None if unknown)."""
    try:
        st = os.statvfs(path if path.is_dir() else path.parent)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
