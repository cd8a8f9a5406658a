"""Local bytes fetched: the node's chunk cache.

``ChunkCache`` keeps fetched chunks by chunk id under ``cache/``, fetches each chunk at most
once at a time (single flight), verifies it before anyone sees it (refetching a corrupt
one by ``VERIFY_RETRY``), and evicts least recently used chunks above its size limit;
local copies of published files (``ino:<n>``) share the limit.

A freshly fetched chunk is also held in memory until each of its bytes has been served
once (bounded by ``hot_limit``): a cold read is answered from the buffer the GET filled (a
pooled one, ``buffers.py``, given back once served), and the cache file is written with
``O_DIRECT`` straight from it, so a cold read allocates no page cache and no fresh memory
of its own (decisions 0011, 0014: on this machine first-touch pages cost more CPU than
the copy).

A cache file can rot on disk after it was written.  This daemon serves a cache file's
bytes only once it has read the file back and checked its hash (``_read_back``: once per
chunk per daemon lifetime, single flight, in a worker thread, into a pooled buffer that
then serves the reads like a fresh fetch; the fetch checked what came over the wire, not
what landed on disk).  A copy into a new version (``copy_out``) checks the bytes it
copies every time.  A mismatch logs one WARNING naming the chunk, removes the cache file
and fetches the chunk again; if that fails, ``EIO`` (never the bad bytes).
A chunk may come from somewhere nearer than the store: ``source`` (a ``ChunkSource``,
e.g. the cluster's peers; None: the store only) is asked first and its bytes pass the
same check as the store's before anyone sees them; when it has nothing good, the store.

Knows nothing of FUSE, of staging files, of peers, or of inodes' meaning.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import trio

from .buffers import BufferPool
from ..errors import FsError
from ..format.chunkid import chunk_ok, digest_hex
from ..format.remote import chunk_key
from ..store.retrypolicy import RetryPolicy
from ..store import ObjectStore, StoreError

log = logging.getLogger(__name__)

# A chunk that fails its hash is fetched again at once, three tries in all.
VERIFY_RETRY = RetryPolicy(attempts=3, base_delay=0.0, max_delay=0.0)


def cache_file(root: Path, sha: str) -> Path:
    """Where a chunk cache rooted at ``root`` keeps chunk ``sha`` (read by ``ckptfs fsck
    --repair`` too, from outside the daemon)."""
    return root / digest_hex(sha)[:2] / sha


DIRECT_ALIGN = 4096        # O_DIRECT: buffer address, offset and length in these units


def write_file_direct(path: Path, view: memoryview) -> bool:
    """Write ``view`` (a page-aligned buffer's first bytes) as the whole new file ``path``
    with ``O_DIRECT`` (no page cache): True if done, False if not possible here (length
    not aligned, or the file system refuses ``O_DIRECT``): the caller writes it the
    ordinary way."""
    n = len(view)
    if n == 0 or n % DIRECT_ALIGN:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:       # tmpfs and friends
            return False
        raise
    done = 0
    try:
        while done < n:
            written = os.pwrite(fd, view[done:], done)
            if written <= 0 or written % DIRECT_ALIGN:
                raise OSError(errno.EIO, f"short O_DIRECT write to {path.name}")
            done += written
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL and done == 0:
            return False
        raise
    finally:
        os.close(fd)


class ChunkSource(Protocol):
    """Somewhere else a chunk may come from before the store (the cache's one seam for
    it).  ``fetch`` fills ``buf`` with chunk ``sha`` (``length`` bytes) and returns True
    only if ``check`` (the cache's verification of those bytes) passed; False sends the
    cache to the store.  It must bound its own time and never raise for a bad source."""

    async def fetch(self, sha: str, length: int, buf: mmap.mmap,
                    check: Callable[[memoryview], bool]) -> bool: ...


class ChunkCache:
    """Verified chunks by chunk id (``chunkid.py``), fetched once per node, LRU-evicted above ``limit``."""

    def __init__(self, root: Path, store: ObjectStore, limit: int,
                 fetch_limiter: trio.CapacityLimiter, verify: RetryPolicy = VERIFY_RETRY,
                 hot_limit: int = 96 << 20, buffers: BufferPool | None = None) -> None:
        self.root = root
        self.store = store
        self.limit = limit
        self.limiter = fetch_limiter
        self.verify = verify
        self._inflight: dict[str, trio.Event] = {}
        self._failed: dict[str, Exception] = {}
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._pinned: dict[str, int] = {}
        self._fds: OrderedDict[str, int] = OrderedDict()
        self.total = 0
        self.corrupt_events = 0
        # Chunks whose cache file this daemon has read back and found good: served from
        # the file without another check (one hash per chunk per daemon lifetime).
        self._verified: set[str] = set()
        self.read_backs = 0          # cache files read back and hashed (tests read it)
        self.rotten = 0              # cache files that failed their check
        self.hits = self.misses = self.evictions = 0     # metrics.py reads them
        self._doomed: list[Path] = []     # evicted chunk files still to unlink
        # Freshly fetched chunks in memory: sha -> [buffer, bytes served, length]; dropped
        # (the buffer back to the pool) once every byte was served (the kernel page cache
        # has them then), oldest first above ``hot_limit`` bytes.  The cache file always
        # has the chunk too.
        self.hot_limit = hot_limit
        self._hot: OrderedDict[str, list] = OrderedDict()
        self.hot_bytes = 0
        self.served_from_memory = 0
        # Chunks are received into reused buffers (buffers.py), shared with the uploader.
        self.buffers = buffers or BufferPool(8 << 20, keep=int(fetch_limiter.total_tokens))
        # Where chunks come from before the store (None: the store only), and the bytes
        # each way brought (status and metrics read them).
        self.source: ChunkSource | None = None
        # Fetches from the source have slots of their own: a node waiting for a peer
        # must never hold the slot that peer's request to it needs for the store.
        self.source_limiter = trio.CapacityLimiter(fetch_limiter.total_tokens)
        self.bytes_from_source = 0
        self.bytes_from_store = 0
        root.mkdir(parents=True, exist_ok=True)
        for path in root.glob("*/*"):
            if path.name.startswith("."):
                path.unlink(missing_ok=True)
                continue
            size = path.stat().st_size
            self._lru[path.name] = size
            self.total += size

    def path(self, sha: str) -> Path:
        return cache_file(self.root, sha)

    def has(self, sha: str) -> bool:
        return sha in self._lru

    def ready(self, sha: str) -> bool:
        """Cached and servable without another check: freshly fetched (in memory) or
        read back and verified by this daemon."""
        return sha in self._lru and (sha in self._hot or sha in self._verified)

    async def read(self, sha: str, length: int, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of chunk ``sha`` (``length`` bytes), from a copy
        checked by this daemon: one not checked yet is checked (or fetched) first."""
        while not self.ready(sha):
            await self.ensure(sha, length)
        return self.pread(sha, size, offset)

    def pread(self, sha: str, length: int, offset: int) -> bytes:
        """Read from a cached chunk: from memory while it is freshly fetched, else through
        a small pool of open descriptors (a 1 MiB read request should not pay for open
        and close)."""
        hot = self._hot.get(sha)
        if hot is not None:
            buf, _, size = hot
            piece = buf[offset:min(offset + length, size)]
            hot[1] += len(piece)
            self.served_from_memory += len(piece)
            if hot[1] >= size:
                self._drop_hot(sha)
            return piece
        fd = self._fds.get(sha)
        if fd is None:
            fd = os.open(self.path(sha), os.O_RDONLY)
            self._fds[sha] = fd
            if len(self._fds) > 64:
                _, old = self._fds.popitem(last=False)
                os.close(old)
        else:
            self._fds.move_to_end(sha)
        return os.pread(fd, length, offset)

    def _keep_hot(self, sha: str, buf, size: int) -> None:
        if size > self.hot_limit or sha in self._hot:
            self.buffers.give(buf)
            return
        self._hot[sha] = [buf, 0, size]
        self.hot_bytes += size
        while self.hot_bytes > self.hot_limit:
            self._drop_hot(next(iter(self._hot)))

    def _drop_hot(self, sha: str) -> None:
        hot = self._hot.pop(sha, None)
        if hot is not None:
            self.hot_bytes -= hot[2]
            self.buffers.give(hot[0])

    def _close_fd(self, sha: str) -> None:
        fd = self._fds.pop(sha, None)
        if fd is not None:
            os.close(fd)

    def fetching(self, sha: str) -> bool:
        return sha in self._inflight

    @property
    def fetches_in_flight(self) -> int:
        return len(self._inflight)

    # Local copies (staging files of published files, kept to serve reads on the node
    # that wrote them) share the LRU and the size limit with fetched chunks.  Their key
    # is "ino:<n>"; ``evict_local`` decides whether one can go now.
    evict_local: "Callable[[int], bool] | None" = None

    def track_local(self, ino: int, size: int) -> None:
        key = f"ino:{ino}"
        self.total += size - self._lru.get(key, 0)
        self._lru[key] = size
        self._lru.move_to_end(key)
        self._evict()

    def touch_local(self, ino: int) -> None:
        key = f"ino:{ino}"
        if key in self._lru:
            self._lru.move_to_end(key)

    def untrack_local(self, ino: int) -> None:
        size = self._lru.pop(f"ino:{ino}", None)
        if size is not None:
            self.total -= size

    def pin(self, sha: str) -> None:
        self._pinned[sha] = self._pinned.get(sha, 0) + 1

    def unpin(self, sha: str) -> None:
        n = self._pinned.get(sha, 0) - 1
        if n <= 0:
            self._pinned.pop(sha, None)
            # Let go at last: what the limit could not take while it was in use goes now
            # (else an idle node stayed over --cache-size by a read-ahead window); its
            # file goes with the next ``collect``.
            self._evict()
        else:
            self._pinned[sha] = n

    async def ensure(self, sha: str, length: int, use_source: bool = True) -> Path:
        """Return the path of a verified local copy of chunk ``sha``, fetching it once.
        A cache file this daemon has not checked yet is read back and checked first
        (and fetched again if it rotted).  ``use_source=False``: a fetch this call
        starts goes to the store only (a peer serving another peer)."""
        while True:
            if self.ready(sha):
                self._lru.move_to_end(sha)
                self.hits += 1
                return self.path(sha)
            event = self._inflight.get(sha)
            if event is None:
                break
            await event.wait()
            failure = self._failed.get(sha)
            if failure is not None and sha not in self._lru:
                raise FsError(errno.EIO, f"fetching chunk {sha[:12]} failed: {failure}")
        event = self._inflight[sha] = trio.Event()
        self._failed.pop(sha, None)
        try:
            if sha in self._lru:
                if await self._check(sha, length):
                    self._lru.move_to_end(sha)
                    self.hits += 1
                    return self.path(sha)
            self.misses += 1
            path, buf = await self._fetch(sha, length, use_source)
            self._lru[sha] = length
            self.total += length
            self._keep_hot(sha, buf, length)
            self._evict()
            await self.collect()
            return path
        except Exception as exc:
            # A cancelled fetch is not a failed chunk: waiters simply fetch again.
            self._failed[sha] = exc
            raise
        finally:
            del self._inflight[sha]
            event.set()

    async def _check(self, sha: str, length: int) -> bool:
        """Read a cache file back and check it (the caller holds the chunk's flight):
        True if good (kept in memory to serve the reads that asked for it), else the
        file is gone and the chunk must be fetched again."""
        async with self.limiter:
            buf = await trio.to_thread.run_sync(self._read_back, sha, length)
        self.read_backs += 1
        if isinstance(buf, mmap.mmap):
            self._verified.add(sha)
            self._keep_hot(sha, buf, length)
            return True
        self._bad_copy(sha, buf)
        return False

    def _read_back(self, sha: str, length: int) -> mmap.mmap | str:
        """Read chunk ``sha``'s cache file into a pool buffer and hash it: the buffer if
        the file holds the chunk, else why not ("missing", "rotten": then the file is
        removed)."""
        path = self.path(sha)
        buf = self.buffers.take(length)
        try:
            with open(path, "rb", buffering=0) as f, memoryview(buf) as whole, \
                    whole[:length] as view:
                got = 0
                while got < length:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
                good = got == length and not f.read(1) and chunk_ok(view, sha)
        except FileNotFoundError:
            self.buffers.give(buf)
            return "missing"
        if good:
            return buf
        self.buffers.give(buf)
        path.unlink(missing_ok=True)
        return "rotten"

    def _bad_copy(self, sha: str, why: str) -> None:
        """Say so and forget a chunk whose cache file was bad (and is removed) or gone."""
        if why == "rotten":
            self.rotten += 1
            log.warning("cached chunk %s failed verification (disk rot?): cache file "
                        "removed, fetching it again from the store", sha)
        else:
            log.warning("cached chunk %s: its cache file is missing; fetching it again",
                        sha)
        size = self._lru.pop(sha, None)
        if size is not None:
            self.total -= size
        self._verified.discard(sha)
        self._drop_hot(sha)
        self._close_fd(sha)

    async def copy_out(self, sha: str, length: int) -> bytes:
        """The whole chunk, for a copy into a new version: the bytes returned are the
        ones hashed, every time (a version written from them is published under new
        hashes, so rot copied here would spread)."""
        for _ in range(VERIFY_RETRY.attempts or 3):
            self.pin(sha)
            try:
                await self.ensure(sha, length)
                hot = self._hot.get(sha)
                if hot is not None:
                    return hot[0][:length]        # checked in memory, not on disk
                async with self.limiter:
                    data = await trio.to_thread.run_sync(self._read_checked, sha, length)
            finally:
                self.unpin(sha)
            self.read_backs += 1
            if isinstance(data, bytes):
                return data
            if sha not in self._inflight and sha in self._lru:
                self._bad_copy(sha, data)
        raise FsError(errno.EIO, f"chunk {sha[:12]}: the cache copy keeps failing its check")

    def _read_checked(self, sha: str, length: int) -> bytes | str:
        """The cache file's bytes if they are the chunk, else why not (as ``_read_back``)."""
        path = self.path(sha)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return "missing"
        if len(data) == length and chunk_ok(data, sha):
            return data
        path.unlink(missing_ok=True)
        return "rotten"

    async def _fetch(self, sha: str, length: int,
                     use_source: bool = True) -> tuple[Path, mmap.mmap]:
        path = self.path(sha)
        if use_source and self.source is not None:
            got = await self._from_source(self.source, sha, length, path)
            if got is not None:
                return path, got
        attempt = 0
        while True:
            attempt += 1
            async with self.limiter:
                try:
                    buf = await trio.to_thread.run_sync(self._fetch_sync, sha, length, path)
                except StoreError as exc:
                    raise FsError(errno.EIO, f"chunk {sha[:12]}: {exc}") from None
            if buf is not None:
                self.bytes_from_store += length
                return path, buf
            self.corrupt_events += 1
            log.error("chunk %s from the store failed verification (attempt %d/%s)",
                      sha, attempt, self.verify.attempts or "-")
            if self.verify.gives_up(attempt):
                raise FsError(errno.EIO, f"chunk {sha} is corrupt in the store")
            await trio.sleep(self.verify.delay(attempt))

    async def _from_source(self, source: ChunkSource, sha: str, length: int,
                           path: Path) -> mmap.mmap | None:
        """The chunk from ``source``, checked and written to its cache file, or None."""
        async with self.source_limiter:
            buf = self.buffers.take(length)
            try:
                good = await source.fetch(sha, length, buf,
                                          lambda view: chunk_ok(view, sha))
                if good:
                    await trio.to_thread.run_sync(self._write_file, path, sha, buf, length)
            except BaseException:
                self.buffers.give(buf)
                raise
        if not good:
            self.buffers.give(buf)
            return None
        self.bytes_from_source += length
        return buf

    def _write_file(self, path: Path, sha: str, buf: mmap.mmap, length: int) -> None:
        """Write the checked chunk in ``buf`` as its cache file (atomically)."""
        with memoryview(buf) as whole, whole[:length] as view:
            path.parent.mkdir(exist_ok=True)
            tmp = path.parent / f".{sha}.{os.getpid()}.tmp"
            if not write_file_direct(tmp, view):
                with open(tmp, "wb") as f:
                    f.write(view)
            os.replace(tmp, path)

    def _fetch_sync(self, sha: str, length: int, path: Path) -> mmap.mmap | None:
        """GET, verify and store one chunk: the pool buffer holding it verified, or None
        if it was corrupt.  If the GET fails the buffer is dropped, not given back: an
        attempt that timed out may still be writing into it (buffers.py)."""
        started = time.monotonic()
        buf = self.buffers.take(length)
        received, _ = self.store.get_into(chunk_key(sha), buf)
        got = time.monotonic()
        with memoryview(buf) as whole, whole[:length] as view:
            good = received == length and chunk_ok(view, sha)
        if good:
            self._write_file(path, sha, buf, length)
        if not good:
            self.buffers.give(buf)
            return None
        log.debug("fetched chunk %s: GET %.3fs, verify+store %.3fs, %d in flight", sha[:12],
                  got - started, time.monotonic() - got, len(self._inflight))
        return buf

    def counters(self) -> dict[str, int]:
        """What metrics.py reads at each scrape."""
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "corrupt_events": self.corrupt_events, "total": self.total,
                "limit": self.limit, "from_store": self.bytes_from_store,
                "from_peers": self.bytes_from_source}

    def _evict(self) -> None:
        if self.total <= self.limit:
            return
        for sha in list(self._lru):
            if self.total <= self.limit:
                break
            if sha in self._pinned or sha in self._inflight:
                continue
            if sha.startswith("ino:"):
                if self.evict_local is None or not self.evict_local(int(sha[4:])):
                    continue
                self.total -= self._lru.pop(sha)
                self.evictions += 1
                continue
            size = self._lru.pop(sha)
            self.evictions += 1
            self.total -= size
            self._verified.discard(sha)
            self._drop_hot(sha)
            self._close_fd(sha)
            self._doomed.append(self.path(sha))

    async def collect(self) -> None:
        """Unlink evicted chunk files in a worker thread (never on the trio loop)."""
        if self._doomed:
            doomed, self._doomed = self._doomed, []
            await trio.to_thread.run_sync(_unlink_all, doomed)


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
