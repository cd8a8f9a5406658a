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

from ..store.retrypolicy import RetryPolicy
from ..store import store_cause
from ..store.health import StoreHealth, is_refusal

log = logging.getLogger(__name__)

# Background publishes retry a transient failure without end (nothing closed is dropped),
# 2 s after the first failure, doubling up to 30 s.
PUBLISH_RETRY = RetryPolicy(attempts=None, base_delay=2.0, max_delay=30.0)
# A publish the store refuses (a 4xx about the request itself) waits for an operator but
# is still tried again this often: nothing closed is ever given up (decision 0016).
REFUSED_RETRY = 300.0
# A ``wait_change`` caller looks again at least this often even if the queue did not
# change: what it waits for may also depend on what the queue never sees (a file below a
# directory renamed out of it or unlinked while open).  Not a poll: it is woken at once
# by every change of the queue.
WAIT_RECHECK = 1.0


class PublishQueue:
    """Background publishing for ``durability = "async"`` (and retries of failed sync
    publishes).  Records live in the namespace journal; this queue only schedules them.

    A failed publish is retried by the queue's ``RetryPolicy`` (``PUBLISH_RETRY``: 2 s
    doubling up to 30 s, without end) whatever the failure: the store away, access
    denied, the bucket gone (an outage: ``StoreHealth`` hears of it).  A publish the
    store refuses (a 4xx about the request itself), or one past a policy's ``attempts``,
    *needs an operator*: it is in ``failed`` (and ``failing`` with the reason), logged
    once at ERROR, stays staged and journaled, and is still tried again every
    ``REFUSED_RETRY`` seconds (and at once on a new close or the next mount); it is
    never given up.  ``queued`` holds every inode not yet published, failed ones
    included; ``wait_idle`` returns when nothing is left but those that need an
    operator.  ``wait_change`` returns at the next change (an inode queued, published,
    failed, dropped): a caller waiting for some inodes checks them again then."""

    def __init__(self, publish: Callable[[int], Awaitable[bool | None]], workers: int = 2,
                 policy: RetryPolicy = PUBLISH_RETRY,
                 ready: Callable[[int], bool] = lambda ino: True,
                 health: StoreHealth | None = None,
                 refused_retry: float = REFUSED_RETRY) -> None:
        # ``workers``: publishes at once.  The façade runs as many as chunk uploads
        # (decision 0029): a small file's publish is mostly waiting for round trips.
        self._publish = publish
        self.health = health if health is not None else StoreHealth()
        self.refused_retry = refused_retry
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
        self.failed: dict[int, str] = {}      # inode -> refusal: needs an operator
        self.since: dict[int, float] = {}     # inode -> when it was queued (monotonic)
        self._attempts: dict[int, int] = {}
        self._nursery: trio.Nursery | None = None
        self._idle = trio.Event()
        self._idle.set()
        self._change = trio.Event()

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
        self.changed()

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
        self.changed()

    def changed(self) -> None:
        """Wake every ``wait_change`` caller to look again.  The queue calls it at each
        of its changes; a caller whose own change a waiter may wait for calls it too."""
        self._change.set()
        self._change = trio.Event()

    async def wait_change(self, recheck: float = WAIT_RECHECK) -> None:
        """Until the next ``changed`` (or ``recheck`` seconds): the caller checks what
        it waits for again."""
        with trio.move_on_after(recheck):
            await self._change.wait()

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
            if ino not in self.queued:
                continue
            if not self._ready(ino):
                self.parked.add(ino)
                continue
            await self._send.send(ino)

    async def _retry_later(self, ino: int, delay: float) -> None:
        await trio.sleep(delay)
        if ino in self.queued:
            self._enqueue(ino)

    async def _worker(self) -> None:
        async for ino in self._recv:
            if ino not in self.queued:
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
            self.health.succeeded()
            self.failing.pop(ino, None)
            self.failed.pop(ino, None)
            self._attempts.pop(ino, None)
            self.queued.discard(ino)
            self.since.pop(ino, None)
            self._maybe_idle()
            self.changed()

    def _failed_attempt(self, ino: int, exc: Exception) -> None:
        if ino not in self.queued:
            return      # deleted while it was uploading: nothing left to publish
        attempts = self._attempts[ino] = self._attempts.get(ino, 0) + 1
        outage = self.health.failed(exc)
        if outage is None and (is_refusal(exc) or self.policy.gives_up(attempts)):
            cause = store_cause(exc) or exc
            if ino not in self.failed:
                log.error("background publish of inode %d refused (%s); kept staged and "
                          "journaled, tried again every %.0f s (and on a new close or the "
                          "next mount): needs an operator", ino, cause, self.refused_retry)
            self.failed[ino] = str(cause)
            self.failing[ino] = f"needs an operator (retried every " \
                                f"{self.refused_retry:.0f} s): {cause}"
            self._maybe_idle()
            delay = self.refused_retry
        else:
            delay = self.policy.delay(attempts)
            if ino not in self.failing and outage is None:
                log.warning("background publish of inode %d failed (%s); retrying every "
                            "%.0f s at most", ino, exc, self.policy.max_delay)
            self.failing[ino] = str(exc)
        self.changed()
        assert self._nursery is not None
        self._nursery.start_soon(self._retry_later, ino, delay)
