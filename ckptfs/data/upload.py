"""Moving staged bytes into the store: chunk upload with dedup, the pipelined chunk
tracker of a sequential writer, and the gate that holds async mode's background uploads
while a writer writes (the background queue of async publishes is ``publish_queue.py``).

A chunk is read from a staging file into a pooled buffer (``buffers.py``), hashed and
uploaded from it in a worker thread, under a capacity limiter that bounds memory and
parallel requests; its staging pages then leave the page cache (decision 0014).  A chunk
the store already has is never uploaded again.  Knows nothing of inodes' names, of publishing, or of FUSE.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager, \
    nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import trio

from .buffers import BufferPool
from .liveness import ChunkLiveness
from ..format.chunkid import BLAKE3, chunk_id, sha256_of
from ..format.remote import chunk_key
from ..store import ObjectStore, StoreTimeout

log = logging.getLogger(__name__)


class UploadGate:
    """When async mode's background uploads may start (decision 0015).

    A writer is *active* while one of its requests is in flight (an ``fsync`` or a
    create may take long) or ended less than ``QUIET`` seconds ago.  While one is,
    uploads wait: the save that async mode keeps short has the node's CPU to itself,
    and the uploads run at full concurrency the moment it pauses.  Once a writer has
    been active for ``hold`` seconds (one that never pauses), uploads go beside it one
    at a time, so they are never starved; ``hold`` 0 trickles them from the start.  A
    writer waiting for room (``max_staged``) is not active: it waits for these uploads.
    Knows nothing of what a write is; the write path reports them."""

    QUIET = 0.1

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self._in_flight = 0                 # writer requests that may take long
        self._last = -math.inf              # when a writer request last ran or ended
        self._since = 0.0                   # when the current active stretch began
        self._trickle = trio.CapacityLimiter(1)
        # One waiting upload watches the clock; the others wait for it to say the gate
        # may have opened (a checkpoint's pipelined chunks all wait here at once).
        self._watching = False
        self._changed = trio.Event()

    def active(self) -> bool:
        return self._in_flight > 0 or trio.current_time() - self._last < self.QUIET

    def wrote(self) -> None:
        """A writer's request just ran."""
        if not self.active():
            self._since = trio.current_time()
        self._last = trio.current_time()

    @contextmanager
    def busy(self):
        """Around a writer's request that may take long (``fsync``, a create)."""
        self.wrote()
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            self._last = trio.current_time()

    def writer_opened(self) -> None:
        """A writer whose writes the daemon does not see (kernel passthrough) opened: it
        is at work from its open to its close, as a request in flight is."""
        self.wrote()
        self._in_flight += 1

    def writer_closed(self) -> None:
        self._in_flight -= 1
        self._last = trio.current_time()

    def held_for(self) -> float:
        """Seconds the writer has been active without a pause (0 if it is not)."""
        return trio.current_time() - self._since if self.active() else 0.0

    @asynccontextmanager
    async def slot(self):
        """Held around each background upload."""
        # Re-checked while waiting: uploads that waited for a writer run in parallel the
        # moment it pauses, and start trickling once it has held them for ``hold``.
        while self.active():
            if self._may_trickle():
                async with self._trickle:
                    try:
                        yield
                    finally:
                        self._wake()        # the turn is free: a waiting upload takes it
                return
            await self._until_changed()
        yield

    def _may_trickle(self) -> bool:
        return self.held_for() >= self.hold and self._trickle.available_tokens > 0

    async def _until_changed(self) -> None:
        """Until the writer pauses or an upload may trickle.  One waiting upload watches
        the clock; the others wait for it (or a trickled upload's end) to wake them:
        also while they trickle, which a save longer than ``hold`` spends waiting."""
        if self._watching:
            await self._changed.wait()
            return
        self._watching = True
        try:
            while self.active() and not self._may_trickle():
                await trio.sleep(self.QUIET / 2)
        finally:
            self._watching = False
            self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()


@dataclass
class UploadStats:
    chunks_uploaded: int = 0
    chunks_deduplicated: int = 0
    bytes_uploaded: int = 0
    bytes_deduplicated: int = 0
    publishes: int = 0
    publish_failures: int = 0
    # CPU seconds of the upload workers (thread time) naming chunks (hashing); sending
    # them runs in the store's own threads and is counted there (StoreStats.cpu_s).
    hash_cpu: float = 0.0
    # Chunks read behind a writer the daemon does not see (kernel passthrough), hashed
    # again at publish: how many, and how many had changed since (uploaded again).
    chunks_reverified: int = 0
    chunks_changed_after_upload: int = 0


class ChunkUploader:
    """Read, hash and upload chunks of staging files.  Whether a chunk the store already
    has may be skipped is ``ChunkLiveness``'s call (decision 0003): a chunk verified
    since the last gc pass that could have collected it costs no request; one gc may
    collect costs a HEAD (and a PUT if it is gone); a candidate of a pass in its marking
    phase is PUT again."""

    def __init__(self, store: ObjectStore, liveness: ChunkLiveness,
                 limiter: trio.CapacityLimiter,
                 on_known: Callable[[str, int], None],
                 slot: Callable[[], AbstractAsyncContextManager] | None = None,
                 buffers: BufferPool | None = None, chunk_hash: str = BLAKE3) -> None:
        self.store = store
        self.chunk_hash = chunk_hash  # chunkid.ALGORITHMS: how new chunks are named
        # Chunks are read back into reused buffers (buffers.py), hashed and sent from them.
        self.buffers = buffers or BufferPool(8 << 20, keep=8)
        self.slot = slot              # held around each upload (async mode yields)
        self.liveness = liveness
        self.limiter = limiter
        self.on_known = on_known      # persists (hash, memory generation) (trio thread)
        self.stats = UploadStats()
        self._cpu_lock = threading.Lock()     # workers add to the CPU counters

    async def upload(self, path: Path, offset: int, length: int,
                     reading: Callable[[], bool] | None = None) -> tuple[str, int]:
        """``reading`` is called (on the trio thread) just before the chunk is read; it
        says whether the chunk will be read again (hashed again at publish): its pages
        then stay in the page cache for that read."""
        async with self.slot() if self.slot is not None else nullcontext():
            async with self.limiter:
                keep_pages = reading() if reading is not None else False
                sha, uploaded, generation, remembered = await trio.to_thread.run_sync(
                    self._upload_sync, path, offset, length, keep_pages)
        if not remembered:
            self.on_known(sha, self.liveness.memory.get(sha) or generation + 1)
        if uploaded:
            self.stats.chunks_uploaded += 1
            self.stats.bytes_uploaded += length
        else:
            self.stats.chunks_deduplicated += 1
            self.stats.bytes_deduplicated += length
        return sha, length

    async def rehash(self, path: Path, offset: int, length: int, last: bool = True) -> str:
        """The id of a chunk of a staging file as it is now (read and hashed, nothing
        sent), under the same slot and limiter as an upload.  ``last``: no later read
        of it is planned (its pages may leave the page cache)."""
        async with self.slot() if self.slot is not None else nullcontext():
            async with self.limiter:
                return await trio.to_thread.run_sync(self._rehash_sync, path, offset, length,
                                                     last)

    def _rehash_sync(self, path: Path, offset: int, length: int, last: bool) -> str:
        buf = self.buffers.take(length)
        view = memoryview(buf)[:length]
        try:
            _read_chunk(path, offset, length, view)
            started = time.thread_time()
            sha = chunk_id(view, self.chunk_hash)
            with self._cpu_lock:
                self.stats.hash_cpu += time.thread_time() - started
        finally:
            view.release()      # nothing else holds it: no PUT was started from it
        self.buffers.give(buf)
        if last:
            drop_staged_pages(path, offset, length)
        return sha

    def _upload_sync(self, path: Path, offset: int, length: int,
                     keep_pages: bool = False) -> tuple[str, bool, int, bool]:
        buf = self.buffers.take(length)
        view = memoryview(buf)[:length]
        # On an exception the view is left alone (not released) and the buffer dropped:
        # a timed-out PUT attempt may still be sending from it, and releasing a view a
        # send holds raises BufferError in place of the store's error (buffers.py).
        result = self._upload_from(path, offset, length, view, keep_pages)
        # Only now, the PUT returned: no attempt of it can still be reading the buffer.
        view.release()
        self.buffers.give(buf)
        return result

    def _upload_from(self, path: Path, offset: int, length: int,
                     view: memoryview, keep_pages: bool) -> tuple[str, bool, int, bool]:
        _read_chunk(path, offset, length, view)
        result = self._send(view)
        # The chunk is in the store: its staging pages need not stay in memory, unless it
        # is to be hashed again (read behind a writer the daemon does not see: dropped
        # pages would be read back from the disk).  Starts their writeback now; clean
        # ones go at once, the rest when the publish drops the file's pages again.
        if not keep_pages:
            drop_staged_pages(path, offset, length)
        return result

    def _send(self, view: memoryview) -> tuple[str, bool, int, bool]:
        started = time.thread_time()
        sha = chunk_id(view, self.chunk_hash)
        hashed = time.thread_time()
        with self._cpu_lock:
            self.stats.hash_cpu += hashed - started
        action, generation = self.liveness.plan_upload(sha)
        if action == "skip":
            return sha, False, generation, True
        key = chunk_key(sha)
        if action == "head" and self.store.exists(key):
            self.liveness.uploaded(sha, generation, action)
            return sha, False, generation, False
        # A sha256 id doubles as the transfer checksum; for others the store picks one.
        self.store.put(key, view, sha256=sha256_of(sha))
        self.liveness.uploaded(sha, generation, "put" if action == "put" else "head")
        return sha, True, generation, False


def _read_chunk(path: Path, offset: int, length: int, view: memoryview) -> None:
    """Fill ``view`` with ``length`` bytes of a staging file at ``offset`` (blocking).
    Opened here, not shared: a handle's descriptor may be closed (and its number reused)
    while a background publish is still reading.  Not held during the PUT: a staging
    file removed meanwhile must give its space back at once."""
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < length:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                break
            got += n
    finally:
        os.close(fd)
    if got != length:
        raise OSError(5, f"staging file shorter than expected at {offset}")


def drop_staged_pages(path: Path, offset: int = 0, length: int = 0) -> None:
    """Drop clean pages of a staging file (a range of it; all with ``length`` 0) from the
    page cache and start writeback of the dirty ones (blocking: run it in a thread).  A
    checkpoint is written once and read rarely on the node that wrote it; its pages would
    push the training job's own out of memory, and pages freed here are what the next
    checkpoint's writes reuse (decision 0014).  A file already gone is fine."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass
class _Pending:
    gen: int
    done: trio.Event = field(default_factory=trio.Event)
    result: tuple[str, int] | None = None
    error: BaseException | None = None      # why the pipelined upload failed
    # Its bytes were read before the version was closed (a verifying tracker hashes it
    # again at publish); False once read after the close, from the closed bytes.
    read_open: bool = True


class ChunkTracker:
    """Chunks of one staging file uploaded ahead of ``flush`` while a writer is still
    writing sequentially.  A write into a chunk already sent invalidates it."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.pending: dict[int, _Pending] = {}
        self.seq_end = 0
        self.next_index = 0
        self.gen = 0
        # Chunks were sent while writes the daemon does not see could still change them
        # (read behind a passthrough writer, core/readbehind.py): each is hashed again
        # when the file is published, and sent again under its new id if it changed.
        self.verify = False
        self.closed = False     # the version was closed: it changes no more

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
        if pending is not None and tracker is not None and length == chunk_size:
            await pending.done.wait()
            if pending.result is not None and tracker.pending.get(index) is pending:
                if not tracker.verify or not pending.read_open:
                    result[index] = pending.result
                    return
                try:
                    now = await uploader.rehash(path, offset, length, last=tracker.closed)
                except Exception as exc:  # collected: the first one is raised below
                    errors.append(exc)
                    return
                uploader.stats.chunks_reverified += 1
                if now == pending.result[0]:
                    result[index] = pending.result
                    return
                # Written again after it was sent (a header patched in place, an mmap
                # store): the entry names only what the bytes are now.
                uploader.stats.chunks_changed_after_upload += 1
                log.info("chunk %d of %s changed after its early upload; uploading it "
                         "again", index, path.name)
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
