"""When the node's LMDB journal reaches the disk: group commit of its fsyncs (issue 25).

The namespace commits every write transaction without an fsync (``sync=False``): once
committed, a record survives a crash of the daemon (it is in the page cache) but not
necessarily a power cut.  This module decides when the fsync that covers a power cut
runs, in one of two ways:

- ``now()`` — the caller waits until everything committed before the call is on disk
  (``fsync``/``fdatasync`` of a file, ``fsync`` of a directory, an explicit
  durability request).  Callers that arrive while a sync runs share the next one: one
  fsync per batch, however many ask.
- ``soon()`` — the caller does not wait; the journal is synced in the background within
  ``delay`` seconds, once for every call made meanwhile (an async-mode ``close``,
  ``mkdir``, ``rename``, ``unlink``, ``setattr``).  Those calls promise what a local
  file system's do: the change survives the daemon (a crash, a restart), and a power
  cut within ``delay`` of it may undo it, as it may undo the staged bytes themselves,
  which only ``fsync`` makes durable (decision 0001).

A background sync that fails is logged once and tried again at the next ``delay``
(``now()`` raises it to its caller).  Knows nothing of what the journal holds; the
sync itself is the callable it is given (``Namespace.sync``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

# Seconds between a ``soon()`` and the background fsync that covers it.
SYNC_DELAY = 0.2


class JournalSync:
    """``committed`` (optional) counts the journal's commits (LMDB's last transaction
    id): a ``now()`` when nothing was committed since the last fsync began returns at
    once (a file's ``fsync`` after the background sync already covered its create)."""

    def __init__(self, sync: Callable[[], None], delay: float = SYNC_DELAY,
                 committed: Callable[[], int] | None = None) -> None:
        self._sync = sync
        self._committed = committed
        self._synced_commits = -1  # commits the last finished fsync covered
        self.delay = delay
        self._lock = trio.Lock()
        self._requested = 0        # requests made so far (soon and now)
        self._synced = 0           # requests the last finished fsync covered
        self._wake = trio.Event()
        self.syncs = 0             # fsyncs run (``status``: ``journal_syncs``)
        self._failing = False

    def pending(self) -> bool:
        """Committed changes not yet known to be on disk."""
        return self._synced < self._requested

    def soon(self) -> None:
        """Sync within ``delay`` seconds; do not wait for it."""
        self._requested += 1
        self._wake.set()

    async def now(self) -> None:
        """Return once everything committed before this call is on disk."""
        self._requested += 1
        mine = self._requested
        async with self._lock:
            if self._synced >= mine:
                return              # a sync that started after this call covered it
            upto = self._requested
            commits = self._committed() if self._committed is not None else None
            if commits is not None and commits <= self._synced_commits:
                # Nothing committed since the last fsync began: every request so far
                # was made after its own commit, so that fsync covered it.
                self._synced = max(self._synced, upto)
                return
            await trio.to_thread.run_sync(self._sync)
            self.syncs += 1
            self._synced = max(self._synced, upto)
            if commits is not None:
                self._synced_commits = max(self._synced_commits, commits)

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The background syncs of ``soon()`` (a task of the core's nursery)."""
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await trio.sleep(self.delay)
            if not self.pending():
                continue
            try:
                await self.now()
            except Exception as exc:  # noqa: BLE001 - logged, tried again
                if not self._failing:
                    log.warning("the journal could not be synced to disk (tried again "
                                "every %.1f s): %s", self.delay, exc)
                self._failing = True
                self._wake.set()
            else:
                if self._failing:
                    log.warning("the journal is synced to disk again")
                self._failing = False
