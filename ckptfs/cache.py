"""Local bytes fetched: the node's chunk cache.

``ChunkCache`` keeps fetched chunks by sha256 under ``cache/``, fetches each chunk at most
once at a time (single flight), verifies it before anyone sees it (refetching a corrupt
one by ``VERIFY_RETRY``), and evicts least recently used chunks above its size limit;
local copies of published files (``ino:<n>``) share the limit.  Knows nothing of FUSE,
of staging files, or of inodes' meaning.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import trio

from .errors import FsError
from .remote import chunk_key
from .retrypolicy import RetryPolicy
from .store import ObjectStore, StoreError

log = logging.getLogger(__name__)

# A chunk that fails its hash is fetched again at once, three tries in all.
VERIFY_RETRY = RetryPolicy(attempts=3, base_delay=0.0, max_delay=0.0)


class ChunkCache:
    """Verified chunks by sha256, fetched once per node, LRU-evicted above ``limit``."""

    def __init__(self, root: Path, store: ObjectStore, limit: int,
                 fetch_limiter: trio.CapacityLimiter, verify: RetryPolicy = VERIFY_RETRY) -> None:
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
        self.hits = self.misses = self.evictions = 0     # metrics.py reads them
        self._doomed: list[Path] = []     # evicted chunk files still to unlink
        root.mkdir(parents=True, exist_ok=True)
        for path in root.glob("*/*"):
            if path.name.startswith("."):
                path.unlink(missing_ok=True)
                continue
            size = path.stat().st_size
            self._lru[path.name] = size
            self.total += size

    def path(self, sha: str) -> Path:
        return self.root / sha[:2] / sha

    def has(self, sha: str) -> bool:
        return sha in self._lru

    def pread(self, sha: str, length: int, offset: int) -> bytes:
        """Read from a cached chunk through a small pool of open descriptors (a 1 MiB
        read request should not pay for open and close)."""
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

    def _close_fd(self, sha: str) -> None:
        fd = self._fds.pop(sha, None)
        if fd is not None:
            os.close(fd)

    def fetching(self, sha: str) -> bool:
        return sha in self._inflight

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
        else:
            self._pinned[sha] = n

    async def ensure(self, sha: str, length: int) -> Path:
        """Return the path of a verified local copy of chunk ``sha``, fetching it once."""
        while True:
            if sha in self._lru:
                self._lru.move_to_end(sha)
                self.hits += 1
                return self.path(sha)
            event = self._inflight.get(sha)
            if event is None:
                self.misses += 1
                break
            await event.wait()
            failure = self._failed.get(sha)
            if failure is not None and sha not in self._lru:
                raise FsError(errno.EIO, f"fetching chunk {sha[:12]} failed: {failure}")
        event = self._inflight[sha] = trio.Event()
        self._failed.pop(sha, None)
        try:
            path = await self._fetch(sha, length)
            self._lru[sha] = length
            self.total += length
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

    async def _fetch(self, sha: str, length: int) -> Path:
        path = self.path(sha)
        attempt = 0
        while True:
            attempt += 1
            async with self.limiter:
                try:
                    ok = await trio.to_thread.run_sync(self._fetch_sync, sha, length, path)
                except StoreError as exc:
                    raise FsError(errno.EIO, f"chunk {sha[:12]}: {exc}") from None
            if ok:
                return path
            self.corrupt_events += 1
            log.error("chunk %s from the store failed verification (attempt %d/%s)",
                      sha, attempt, self.verify.attempts or "-")
            if self.verify.gives_up(attempt):
                raise FsError(errno.EIO, f"chunk {sha} is corrupt in the store")
            await trio.sleep(self.verify.delay(attempt))

    def _fetch_sync(self, sha: str, length: int, path: Path) -> bool:
        started = time.monotonic()
        body, _ = self.store.get(chunk_key(sha))
        got = time.monotonic()
        if len(body) != length or hashlib.sha256(body).hexdigest() != sha:
            return False
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f".{sha}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
        log.debug("fetched chunk %s: GET %.3fs, verify+store %.3fs, %d in flight", sha[:12],
                  got - started, time.monotonic() - got, len(self._inflight))
        return True

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
