"""The kernel told to forget an inode's cached pages and attributes, from one thread.

The core asks for it whenever a version the kernel may hold in its caches is replaced
(a close, a publish, a refresh that found a newer entry), and never waits for it.  The
call can block until the kernel takes locks that a request the daemon is serving holds,
so it must not run on the trio thread.  It went through ``trio.to_thread`` once per
call: a task and a hand-off to a worker thread each, 5% of the daemon's time in a
``cp -a`` of small files.  Here the trio thread only puts the inode on a queue, and one
thread of its own sends the queued inodes in order; an inode already waiting is not
queued twice.  Started once the FUSE session exists; closed before it goes.

Knows pyfuse3's ``invalidate_inode`` call (or the one it is given); nothing of ckptfs.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_STOP = -1


class InodeInvalidations:
    """Callable with an inode number: the kernel forgets it soon, in order."""

    def __init__(self, invalidate: Callable[[int, bool], object]) -> None:
        self._invalidate = invalidate
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._waiting: set[int] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.sent = 0

    def __call__(self, ino: int) -> None:
        with self._lock:
            if self._closed or ino in self._waiting:
                return
            self._waiting.add(ino)
        self._queue.put(ino)

    def attributes_now(self, ino: int) -> None:
        """The kernel forgets ``ino``'s cached attributes before this returns; its pages
        are left to the queue.  For a version taken behind the kernel's back (another
        node's save taken in place): the next open serves it, and the kernel's size of
        the version before would cut or stretch its reads until the queue got there
        (a reader found no zip directory at the size it was given).  Safe on the trio
        thread: an attribute-only invalidation takes no lock a request holds (the
        kernel's ``fuse_reverse_inval_inode`` with no page range; no writeback cache)."""
        if self._closed or self._thread is None:
            return
        try:
            self._invalidate(ino, True)
        except OSError:
            pass        # the kernel does not know the inode: nothing cached

    def start(self) -> None:
        """Begin sending (the FUSE session is up); what was asked before goes first."""
        thread = threading.Thread(target=self._run, name="ckptfs-invalidate", daemon=True)
        thread.start()
        self._thread = thread       # only a started thread is joined at close

    def _run(self) -> None:
        while True:
            ino = self._queue.get()
            with self._lock:
                if ino == _STOP or self._closed:
                    return
                self._waiting.discard(ino)     # asked again from here on: sent again
            try:
                self._invalidate(ino, False)
                self.sent += 1
            except OSError:
                pass        # the kernel no longer knows the inode: nothing to forget

    def close(self, timeout: float = 2.0) -> None:
        """Stop before the FUSE session goes: nothing is sent after this returns (a
        call blocked in the kernel is given ``timeout`` seconds)."""
        with self._lock:
            self._closed = True
            self._waiting.clear()
        self._queue.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("a kernel cache invalidation is still blocked after %.0f s "
                            "at unmount", timeout)
