"""The read path: reading a handle's snapshot from staging or from verified cached chunks,
read-ahead, prefetch warming, evicting local copies."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable

import trio

from ..errors import FsError
from ..format.loadorder import following
from ..meta.namespace import Inode
from .chunkmap import ChunkMap
from .state import CoreState, Handle

log = logging.getLogger(__name__)

# A directory with more entries than this is not sorted at each file's end: the next
# file in name order is warmed instead.
MAX_SCAN = 4096


class ReadPath:
    """Reads of open handles.  Owns the read counter."""

    def __init__(self, st: CoreState) -> None:
        self.st = st
        self.read_requests = 0

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self.st._handle(fh)
        inode = self.st.ns.get(handle.ino)
        snap = handle.snapshot
        if handle.writable or snap[0] == "live":
            rt = self.st._rt(inode.ino)
            if rt.session is not None:
                ver = rt.session.ver
            elif inode.dirty or inode.local_copy:
                ver = inode.ver
            else:
                return await self._read_remote(handle, self._live_chunks(handle, inode),
                                               inode.size, offset, size)
            if offset >= inode.size:
                return b""
            return os.pread(self.st.staging.fd(inode.ino, ver), min(size,
                            inode.size - offset),
                            offset)
        if snap[0] == "staging":
            if not inode.dirty and inode.ver == snap[1]:
                self.st.cache.touch_local(inode.ino)
            return os.pread(self.st.staging.fd(inode.ino, snap[1]), size, offset)
        return await self._read_remote(handle, snap[1], snap[2], offset, size)

    @staticmethod
    def _live_chunks(handle: Handle, inode: Inode) -> ChunkMap:
        """The offsets of the inode's current published chunks, computed again only
        when its chunk list is replaced (it is never changed in place)."""
        cached = handle.live_chunks
        if cached is None or cached[0] is not inode.chunks:
            cached = handle.live_chunks = (inode.chunks, ChunkMap(inode.chunks))
        return cached[1]

    async def _read_remote(self, handle: Handle, chunks: ChunkMap, total: int, offset: int,
                           size: int) -> bytes:
        self.read_requests += 1
        # Concurrent kernel read-ahead requests arrive slightly out of order: "close to
        # where the last read ended" counts as sequential.
        if abs(offset - handle.read_end) <= 4 * self.st.config.chunk_size // 2:
            handle.sequential += 1
        else:
            handle.sequential = 0
        handle.read_end = max(handle.read_end, offset + size) if handle.sequential else \
            offset + size
        window = self.st.config.readahead_chunks if handle.sequential >= 2 else 1
        if not handle.warmed_next and (
                (handle.sequential >= 2
                 and offset + size + window * self.st.config.chunk_size >= total)
                or (offset == 0 and size >= total)):
            handle.warmed_next = True
            self._warm_next_file(handle.ino)
        return await self._read_chunks(chunks, total, offset, size, window)

    def _warm_next_file(self, ino: int) -> None:
        """A reader reading a file through to its end: fetch ahead the next files of its
        directory in the order loaders read them (``format/loadorder.py``: shard index
        order), one read-ahead window's worth of bytes across as many files as it
        covers (a loader reading a checkpoint's shards one after another would
        otherwise wait for each shard's first chunks with the CPU idle, and for every
        small file in turn; decision 0015).  At most one window wasted if it never reads
        them."""
        inode = self.st.ns.maybe_get(ino)
        if inode is None or not inode.parent or inode.name is None:
            return
        budget = self.st.config.readahead_chunks * self.st.config.chunk_size
        children = self.st.ns.children(inode.parent)
        if len(children) > MAX_SCAN:
            after = self.st.ns.next_name(inode.parent, inode.name)
            children = [after] if after else []
            names = [after[0]] if after else []
        else:
            names = following([n for n, _ in children], inode.name)
        inos = dict(children)
        for name in names:
            nxt = self.st.ns.maybe_get(inos[name])
            if nxt is None or nxt.type != "file" or nxt.dirty or nxt.local_copy:
                continue
            for sha, length in nxt.chunks:
                if budget <= 0:
                    return
                budget -= length
                if not self.st.cache.ready(sha) and not self.st.cache.fetching(sha):
                    self.st.nursery.start_soon(self._readahead, sha, length)

    async def _read_chunks(self, chunks: ChunkMap, total: int, offset: int, size: int,
                           window: int = 1) -> bytes:
        end = min(offset + size, total)
        if offset >= end:
            return b""
        wanted = chunks.covering(offset, end)
        if not wanted:      # a size its chunks do not cover: never an IndexError
            raise FsError(errno.EIO, f"no chunk covers bytes {offset}-{end} of {total}")
        for _, sha, _, _ in wanted:
            self.st.cache.pin(sha)
        try:
            if len(wanted) == 1:
                await self.st.cache.ensure(wanted[0][1], wanted[0][2])
            else:
                async with trio.open_nursery() as nursery:
                    for _, sha, length, _ in wanted:
                        nursery.start_soon(self.st.cache.ensure, sha, length)
            last_index = wanted[-1][3]
            for sha, length in chunks.following(last_index, window):
                if not self.st.cache.ready(sha) and not self.st.cache.fetching(sha):
                    self.st.nursery.start_soon(self._readahead, sha, length)
            parts = []
            for pos, sha, length, _ in wanted:
                lo = max(offset, pos) - pos
                hi = min(end, pos + length) - pos
                parts.append(await self.st.cache.read(sha, length, lo, hi - lo))
            return b"".join(parts)
        finally:
            for _, sha, _, _ in wanted:
                self.st.cache.unpin(sha)

    async def _readahead(self, sha: str, length: int) -> None:
        try:
            await self.st.cache.ensure(sha, length)
        except Exception as exc:  # a reader that needs it will see the error
            log.debug("read-ahead of %s failed: %s", sha[:12], exc)

    def _evict_local_copy(self, ino: int) -> bool:
        inode = self.st.ns.maybe_get(ino)
        if inode is None:
            return True
        if inode.dirty or self.st._is_open(ino) or ino in self.st.queue.queued:
            return False
        inode.local_copy = False
        self.st.ns.save(inode)
        self.st._drop_version_if_unused(ino, inode.ver)
        return True

    async def warm(self, inode: Inode, on_bytes: Callable[[int], None]) -> None:
        """Bring every chunk of a published file into the node cache."""
        if inode.dirty or inode.local_copy:
            on_bytes(inode.size)
            return
        errors: list[BaseException] = []

        async def one(sha: str, length: int) -> None:
            try:
                await self.st.cache.ensure(sha, length)
                on_bytes(length)
            except Exception as exc:  # reported per file by the caller
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for sha, length in inode.chunks:
                nursery.start_soon(one, sha, length)
        if errors:
            raise errors[0]
