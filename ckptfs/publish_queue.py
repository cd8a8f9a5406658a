"""The background queue of async publishes (and retries of failed sync publishes):
which inode is published when, by how many workers, with what back-off, and what failed
for good.  What "publishing an inode" means is the caller's callback; knows nothing of
chunks, entries or FUSE.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from .retrypolicy import RetryPolicy
from .store import is_permanent, store_cause

log = logging.getLogger(__name__)

# Background publishes retry a transient failure without end (nothing closed is dropped),
# 2 s after the first failure, doubling up to 30 s.
PUBLISH_RETRY = RetryPolicy(attempts=None, base_delay=2.0, max_delay=30.0)


class PublishQueue:
    """Background publishing for ``durability = "async"`` (and retries of failed sync
    publishes).  Records live in the namespace journal; this queue only schedules them.

    A failed publish is retried by the queue's ``RetryPolicy`` (``PUBLISH_RETRY``: 2 s
    doubling up to 30 s, without end) while the failure is transient; a permanent store
    error (a 4xx such as an invalid or too long key), or the last of a policy's
    ``attempts``, is not retried: the inode is marked failed for good
    (``failed``, and in ``failing`` with the reason), logged once at ERROR, and stays
    staged and journaled: a new close of the file or the next mount tries again.
    ``queued`` holds every inode not yet published, failed ones included; ``wait_idle``
    returns when nothing is left but failures."""

    def __init__(self, publish: Callable[[int], Awaitable[bool | None]], workers: int = 2,
                 policy: RetryPolicy = PUBLISH_RETRY,
                 ready: Callable[[int], bool] = lambda ino: True) -> None:
        self._publish = publish
        self.workers = workers
        self.policy = policy
        # Workers take inodes from a zero-capacity channel (real back-pressure: the
        # feeder hands one over only when a worker is free); what waits is the backlog,
        # at most one entry per queued inode.  ``ready`` gates an inode (async mode's
        # metadata log: not before the records its epoch names); a gated inode is
        # parked until ``release_parked``.
        self._send, self._recv = trio.open_memory_channel[int](0)
        self._backlog: deque[int] = deque()
        self._backlog_changed = trio.Event()
        self._ready = ready
        self.parked: set[int] = set()
        self.queued: set[int] = set()
        self.failing: dict[int, str] = {}     # inode -> last error (retried, or for good)
        self.failed: dict[int, str] = {}      # inode -> permanent error: not retried
        self.since: dict[int, float] = {}     # inode -> when it was queued (monotonic)
        self._attempts: dict[int, int] = {}
        self._nursery: trio.Nursery | None = None
        self._idle = trio.Event()
        self._idle.set()

    def submit(self, ino: int) -> None:
        if ino in self.failed:
            # Closed again (or asked again): a new chance.
            del self.failed[ino]
            self.failing.pop(ino, None)
            self._attempts.pop(ino, None)
        elif ino in self.queued:
            return
        self.queued.add(ino)
        self.since.setdefault(ino, time.monotonic())
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._enqueue(ino)

    def _enqueue(self, ino: int) -> None:
        self._backlog.append(ino)
        self._backlog_changed.set()

    def release_parked(self) -> None:
        """The gate may have opened: parked inodes go round again."""
        parked, self.parked = self.parked, set()
        for ino in sorted(parked):
            self._enqueue(ino)

    def discard(self, ino: int) -> None:
        self.queued.discard(ino)
        self.since.pop(ino, None)
        self.failing.pop(ino, None)
        self.failed.pop(ino, None)
        self._attempts.pop(ino, None)
        self._maybe_idle()

    def active(self) -> set[int]:
        """Inodes still being published or waiting for a retry (not failed for good)."""
        return self.queued - self.failed.keys()

    def _maybe_idle(self) -> None:
        if not self.active():
            self._idle.set()

    async def wait_idle(self) -> None:
        while self.active():
            await self._idle.wait()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for _ in range(self.workers):
                nursery.start_soon(self._worker)
            nursery.start_soon(self._feed)
            task_status.started()

    async def _feed(self) -> None:
        while True:
            if not self._backlog:
                self._backlog_changed = trio.Event()
                await self._backlog_changed.wait()
                continue
            ino = self._backlog.popleft()
            if ino not in self.queued or ino in self.failed:
                continue
            if not self._ready(ino):
                self.parked.add(ino)
                continue
            await self._send.send(ino)

    async def _retry_later(self, ino: int, delay: float) -> None:
        await trio.sleep(delay)
        if ino in self.queued and ino not in self.failed:
            self._enqueue(ino)

    async def _worker(self) -> None:
        async for ino in self._recv:
            if ino not in self.queued or ino in self.failed:
                continue
            try:
                done = await self._publish(ino)
            except Exception as exc:  # noqa: BLE001 - kept queued, retried or failed for good
                self._failed_attempt(ino, exc)
                continue
            if done is False:
                # Rewritten while uploading: go again, after a breath so a file that is
                # written continuously does not spin this worker.
                await trio.sleep(0.1)
                self._enqueue(ino)
                continue
            self.failing.pop(ino, None)
            self._attempts.pop(ino, None)
            self.queued.discard(ino)
            self.since.pop(ino, None)
            self._maybe_idle()

    def _failed_attempt(self, ino: int, exc: Exception) -> None:
        if ino not in self.queued:
            return      # deleted while it was uploading: nothing left to publish
        cause = store_cause(exc)
        if cause is not None and is_permanent(cause):
            self.failed[ino] = str(cause)
            self.failing[ino] = f"failed for good (not retried): {cause}"
            log.error("background publish of inode %d failed for good: %s; not retried, "
                      "kept staged and journaled (a new close or the next mount tries again)",
                      ino, cause)
            self._maybe_idle()
            return
        attempts = self._attempts[ino] = self._attempts.get(ino, 0) + 1
        if self.policy.gives_up(attempts):
            self.failed[ino] = str(exc)
            self.failing[ino] = f"failed for good after {attempts} attempts: {exc}"
            log.error("background publish of inode %d failed %d times (%s); not retried, "
                      "kept staged and journaled (a new close or the next mount tries "
                      "again)", ino, attempts, exc)
            self._maybe_idle()
            return
        delay = self.policy.delay(attempts)
        self.failing[ino] = str(exc)
        log.warning("background publish of inode %d failed (%s); retry %d in %.0fs",
                    ino, exc, attempts, delay)
        assert self._nursery is not None
        self._nursery.start_soon(self._retry_later, ino, delay)
