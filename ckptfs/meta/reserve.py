"""Room kept aside on the state dir's file system, given up so that a removal can be
committed when another program (or the node's own staging) has filled the disk.

A write that abandons a file that never had a closed version must also remove its
name: otherwise an empty file stays in sight that nobody closed, and a reader takes it
for a checkpoint (soak seed 1215133).  That removal is an LMDB commit, and LMDB needs
new pages even to delete, so on a full disk it fails like any other write.  The node
therefore holds a file of ``RESERVE_BYTES`` (``reserve`` in the state dir), allocated at
mount; a removal that fails for want of space deletes it and is tried once more
(``Transactions.with_room``).  The room is taken again once the disk has
``REARM_FACTOR`` times as much free, at the next commit.

Knows nothing of LMDB, of inodes or of what the removals remove: only a file, its size
and the free space beside it.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# LMDB writes 4 KiB pages; a removal touches a few dozen (the inode, the dentry, the
# journal, the free list), so 2 MiB lets hundreds of removals land on a full disk, and
# costs a 32 MiB state dir (the model test's) little of its room.
RESERVE_BYTES = 2 << 20
# Taken again only with this many times its size free, so that it does not take the
# last bytes a writer is waiting for.
REARM_FACTOR = 4
# After a try that found no room (or a quota, which ``statvfs`` does not show), the
# next waits this long: ``arm`` is called after every commit while the reserve is out.
RETRY_SECONDS = 5.0


class RoomReserve:
    """The reserve file at ``path`` (``size`` bytes), held or given up."""

    def __init__(self, path: Path, size: int = RESERVE_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.size = size
        self.given_up = 0          # times it was given up (``status``)
        self._clock = clock
        self._next_try = -float("inf")

    def held(self) -> bool:
        """Never raises: a state dir that cannot be looked at holds no reserve."""
        try:
            return self.path.stat().st_size >= self.size
        except OSError:
            return False

    def describe(self) -> str:
        """``status``'s one line: ``held``, or why not."""
        if self.held():
            return "held"
        return "given up: the disk was full" if self.given_up else "not held: no room at mount"

    def arm(self) -> bool:
        """Hold the room if the disk has ``REARM_FACTOR`` times it free (True if held
        afterwards).  Allocated for real (``posix_fallocate``), not a sparse file.
        Never raises; after an allocation that failed (a quota), the next try waits
        ``RETRY_SECONDS``."""
        if self.held():
            return True
        if self._clock() < self._next_try:
            return False
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return False
        if st.f_bavail * st.f_frsize < REARM_FACTOR * self.size:
            return False
        self._next_try = self._clock() + RETRY_SECONDS
        partial = self.path.with_name(self.path.name + ".new")
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
            finally:
                os.close(fd)
            os.replace(partial, self.path)
        except OSError as exc:
            try:
                partial.unlink(missing_ok=True)
            except OSError:
                pass
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.warning("cannot hold the state dir's reserve %s: %s", self.path, exc)
            return False
        self._next_try = -float("inf")
        if self.given_up:
            log.warning("the state dir's disk has room again: its reserve (%d bytes) is "
                        "held again", self.size)
        return True

    def give_up(self) -> bool:
        """Free the room (True if there was any to free)."""
        try:
            self.path.unlink()
        except OSError:
            return False
        self.given_up += 1
        self._next_try = -float("inf")
        log.warning("the state dir's disk is full: its reserve (%d bytes) is given up so "
                    "that a removal lands; it is held again once the disk has room",
                    self.size)
        return True
