"""Moving staged bytes into the store: chunk upload with dedup, the pipelined chunk
tracker of a sequential writer, and the background queue of async publishes.

A chunk is read from a staging file, hashed and uploaded in a worker thread, under a
capacity limiter that bounds memory and parallel requests.  A chunk the store already
has is never uploaded again.  Knows nothing of inodes' names or of FUSE; what
"publishing an inode" means is the caller's callback.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import trio

from .liveness import ChunkLiveness
from .remote import chunk_key
from .retrypolicy import RetryPolicy
from .store import ObjectStore, StoreTimeout, is_permanent

log = logging.getLogger(__name__)

# Background publishes retry a transient failure without end (nothing closed is dropped),
# 2 s after the first failure, doubling up to 30 s.
PUBLISH_RETRY = RetryPolicy(attempts=None, base_delay=2.0, max_delay=30.0)


@dataclass
class UploadStats:
    chunks_uploaded: int = 0
    chunks_deduplicated: int = 0
    bytes_uploaded: int = 0
    bytes_deduplicated: int = 0
    publishes: int = 0
    publish_failures: int = 0


class ChunkUploader:
    """Read, hash and upload chunks of staging files.  Whether a chunk the store already
    has may be skipped is ``ChunkLiveness``'s call (decision 0003): a chunk verified
    since the last gc pass that could have collected it costs no request; one gc may
    collect costs a HEAD (and a PUT if it is gone); a candidate of a pass in its marking
    phase is PUT again."""

    def __init__(self, store: ObjectStore, liveness: ChunkLiveness,
                 limiter: trio.CapacityLimiter,
                 on_known: Callable[[str, int], None],
                 slot: Callable[[], AbstractAsyncContextManager] | None = None) -> None:
        self.store = store
        self.slot = slot              # held around each upload (async mode yields)
        self.liveness = liveness
        self.limiter = limiter
        self.on_known = on_known      # persists (hash, memory generation) (trio thread)
        self.stats = UploadStats()

    async def upload(self, path: Path, offset: int, length: int) -> tuple[str, int]:
        async with self.slot() if self.slot is not None else nullcontext():
            async with self.limiter:
                sha, uploaded, generation, remembered = await trio.to_thread.run_sync(
                    self._upload_sync, path, offset, length)
        if not remembered:
            self.on_known(sha, self.liveness.memory.get(sha) or generation + 1)
        if uploaded:
            self.stats.chunks_uploaded += 1
            self.stats.bytes_uploaded += length
        else:
            self.stats.chunks_deduplicated += 1
            self.stats.bytes_deduplicated += length
        return sha, length

    def _upload_sync(self, path: Path, offset: int, length: int) -> tuple[str, bool, int, bool]:
        # Opened here, not shared: a handle's descriptor may be closed (and its number
        # reused) while a background publish is still reading.
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        if len(data) != length:
            raise OSError(5, f"staging file shorter than expected at {offset}")
        sha = hashlib.sha256(data).hexdigest()
        action, generation = self.liveness.plan_upload(sha)
        if action == "skip":
            return sha, False, generation, True
        key = chunk_key(sha)
        if action == "head" and self.store.exists(key):
            self.liveness.uploaded(sha, generation, action)
            return sha, False, generation, False
        self.store.put(key, data, sha256=sha)
        self.liveness.uploaded(sha, generation, "put" if action == "put" else "head")
        return sha, True, generation, False


@dataclass
class _Pending:
    gen: int
    done: trio.Event = field(default_factory=trio.Event)
    result: tuple[str, int] | None = None
    error: BaseException | None = None      # why the pipelined upload failed


class ChunkTracker:
    """Chunks of one staging file uploaded ahead of ``flush`` while a writer is still
    writing sequentially.  A write into a chunk already sent invalidates it."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.pending: dict[int, _Pending] = {}
        self.seq_end = 0
        self.next_index = 0
        self.gen = 0

    def invalidate_range(self, start: int, end: int) -> None:
        if not self.pending or end <= start:
            return
        first, last = start // self.chunk_size, (end - 1) // self.chunk_size
        for index in [i for i in self.pending if first <= i <= last]:
            del self.pending[index]

    def invalidate_from(self, offset: int) -> None:
        first = offset // self.chunk_size
        for index in [i for i in self.pending if i >= first]:
            del self.pending[index]
        self.next_index = min(self.next_index, first)
        self.seq_end = min(self.seq_end, first * self.chunk_size)

    def reset(self) -> None:
        self.pending.clear()
        self.seq_end = 0
        self.next_index = 0
        self.gen += 1

    def note_write(self, offset: int, length: int) -> list[int]:
        """Record a write; return indexes of chunks that just became complete."""
        self.invalidate_range(offset, offset + length)
        if offset != self.seq_end:
            self.seq_end = -1  # no longer sequential: stop pipelining for this file
            return []
        self.seq_end = offset + length
        ready = []
        while self.seq_end >= (self.next_index + 1) * self.chunk_size:
            ready.append(self.next_index)
            self.next_index += 1
        return ready

    def start(self, index: int) -> _Pending:
        pending = _Pending(gen=self.gen)
        self.pending[index] = pending
        return pending


async def chunk_list(uploader: ChunkUploader, tracker: ChunkTracker | None, path: Path,
                     size: int, chunk_size: int) -> list[tuple[str, int]]:
    """Upload whatever is not yet uploaded and return the file's chunk list."""
    count = math.ceil(size / chunk_size)
    result: list[tuple[str, int] | None] = [None] * count
    errors: list[Exception] = []

    async def one(index: int) -> None:
        offset = index * chunk_size
        length = min(chunk_size, size - offset)
        pending = tracker.pending.get(index) if tracker else None
        if pending is not None and length == chunk_size:
            await pending.done.wait()
            if pending.result is not None and tracker.pending.get(index) is pending:
                result[index] = pending.result
                return
            if isinstance(pending.error, StoreTimeout) and tracker.pending.get(index) is pending:
                # The store did not answer within store_timeout just now: uploading the
                # chunk again would double the writer's wait.  Reported once: the next
                # attempt (a background retry) uploads it afresh.
                del tracker.pending[index]
                errors.append(pending.error)
                return
        try:
            result[index] = await uploader.upload(path, offset, length)
        except Exception as exc:  # collected: the first one is raised below
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for index in range(count):
            nursery.start_soon(one, index)
    if errors:
        raise errors[0]
    return [r for r in result if r is not None]


def store_cause(exc: BaseException) -> BaseException | None:
    """The store error behind ``exc``: the filesystem turns store errors into ``EIO``
    (``raise FsError(...) from None`` keeps the original as ``__context__``)."""
    from .store import StoreError

    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, StoreError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


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
