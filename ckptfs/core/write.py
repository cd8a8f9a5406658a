"""The write path: opening, write sessions and working versions (decision 0005), staging
writes, pipelined chunk uploads, the --max-staged bound."""

from __future__ import annotations

import errno
import logging
import os
import time

import trio

from ..errors import FsError
from ..meta.namespace import Inode
from ..procstat import Opener
from ..data.upload import ChunkTracker
from .chunkmap import ChunkMap
from .state import (PAGE_VERSIONS_KEPT, Handle, Runtime, Session)

log = logging.getLogger(__name__)


class WritePath:
    """Part of ``Filesystem`` (core/filesystem.py): its state lives there."""

    def _new_handle(self, inode: Inode, opener: Opener, writable: bool) -> Handle:
        handle = Handle(fh=self._next_fh, ino=inode.ino, opener=opener, writable=writable)
        self._next_fh += 1
        self.handles[handle.fh] = handle
        rt = self._rt(inode.ino)
        rt.handles.add(handle.fh)
        if writable:
            rt.writers += 1
            handle.session = rt.session
            rt.session.handles.add(handle.fh)
        elif rt.session is None:
            handle.snapshot = self._version_of(inode)
            if handle.snapshot[0] == "staging":
                self._ref(rt, handle.snapshot[1])
        return handle

    def _version_of(self, inode: Inode) -> tuple:
        """The closed version a reader opening now gets."""
        if inode.dirty or inode.local_copy:
            return ("staging", inode.ver)
        return ("chunks", ChunkMap(inode.chunks), inode.size)

    def _ref(self, rt: Runtime, ver: int) -> None:
        rt.refs[ver] = rt.refs.get(ver, 0) + 1

    def _unref(self, ino: int, rt: Runtime, ver: int) -> None:
        n = rt.refs.get(ver, 0) - 1
        if n > 0:
            rt.refs[ver] = n
            return
        rt.refs.pop(ver, None)
        self._drop_version_if_unused(ino, ver)

    def _drop_version_if_unused(self, ino: int, ver: int) -> None:
        """Delete a staging version nobody needs any more: not the inode's current
        closed version, not a working session, not read or uploaded right now."""
        rt = self.runtime.get(ino)
        if rt is not None and (rt.refs.get(ver) or (rt.session and rt.session.ver == ver)):
            return
        inode = self.ns.maybe_get(ino)
        if inode is not None and inode.ver == ver and (inode.dirty or inode.local_copy):
            return
        self.staging.remove(ino, ver)

    # ------------------------------------------------------------------ open / read / write

    async def open(self, ino: int, flags: int, opener: Opener) -> Handle:
        """A new handle, with the page-cache flags the kernel gets for it
        (``keep_cache``, ``direct_io``) decided: the FUSE adapter needs no second call."""
        if flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
            with self.upload_gate.busy():   # a writer at work: uploads wait (decision 0015)
                handle = await self._open(ino, flags, opener)
        else:
            handle = await self._open(ino, flags, opener)
        handle.keep_cache, handle.direct_io = self._cache_flags(handle)
        return handle

    async def _open(self, ino: int, flags: int, opener: Opener) -> Handle:
        inode = self.ns.get(ino)
        if inode.type == "dir":
            raise FsError(errno.EISDIR)
        if inode.type != "file":
            raise FsError(errno.EINVAL)
        accmode = flags & os.O_ACCMODE
        writable = accmode in (os.O_WRONLY, os.O_RDWR)
        truncate = bool(flags & os.O_TRUNC) and writable
        if writable:
            session = await self._join_session(inode, truncate)
            if truncate:
                session.wrote = True
        inode = self.ns.get(ino)
        if not inode.parent:
            raise FsError.enoent("removed while opening")
        handle = self._new_handle(inode, opener, writable)
        if writable:
            await self.leases.writing(inode)
        return handle

    def open_flags(self, handle: Handle) -> tuple[bool, bool]:
        """(keep_cache, direct_io) of a handle, as ``open`` decided them."""
        return handle.keep_cache, handle.direct_io

    def _cache_flags(self, handle: Handle) -> tuple[bool, bool]:
        """(keep_cache, direct_io) for the kernel, decided once at open (it records
        the version the kernel's pages hold from now on).  The page cache of an inode is shared
        by all its handles: a reader that opens a version other than the one the cache
        may hold drops it (no keep_cache), and while readers of two versions are open,
        the newer ones bypass it (direct_io) so each reads its own version."""
        rt = self._rt(handle.ino)
        pages = self.page_versions
        if handle.writable or rt.session is not None or handle.snapshot[0] == "live":
            pages.pop(handle.ino, None)
            return False, False
        version = self._snapshot_key(handle)
        others = {self._snapshot_key(self.handles[fh]) for fh in rt.handles
                  if fh != handle.fh and fh in self.handles}
        if others - {version}:
            return False, True
        keep = pages.get(handle.ino) == version
        pages[handle.ino] = version
        pages.move_to_end(handle.ino)
        if len(pages) > PAGE_VERSIONS_KEPT:
            pages.popitem(last=False)
        return keep, False

    @staticmethod
    def _snapshot_key(handle: Handle) -> object:
        snap = handle.snapshot
        if snap[0] == "chunks":
            return ("chunks", snap[1].shas)
        return snap[:2]   # ("staging", ver) or ("live",)

    def keep_cache(self, handle: Handle) -> bool:
        return handle.keep_cache

    def _start_session(self, inode: Inode, rt: Runtime, ver: int) -> Session:
        session = rt.session = Session(ver=ver, tracker=ChunkTracker(self.config.chunk_size))
        session.tracker.seq_end = -1
        return session

    async def _join_session(self, inode: Inode, truncate: bool) -> Session:
        """The write session of an inode, started if there is none: a version of its own
        (empty for O_TRUNC, else a copy of the current content), so the closed version
        stays as it was until this session's close replaces it."""
        rt = self._rt(inode.ino)
        async with rt.session_lock:
            session = rt.session
            if session is not None:
                if truncate:
                    self._truncate_session(inode, session, 0)
                return session
            inode = self.ns.get(inode.ino)
            ver = inode.max_ver + 1
            inode.max_ver = ver
            self.ns.save(inode)
            if truncate:
                self.staging.create_empty(inode.ino, ver)
            elif inode.dirty or inode.local_copy:
                if not inode.dirty and not rt.refs.get(inode.ver):
                    # A clean local copy nobody reads: the store has it, take it over.
                    self.staging.rename_version(inode.ino, inode.ver, ver)
                    inode.local_copy = False
                    self.cache.untrack_local(inode.ino)
                    self.ns.save(inode)
                else:
                    self._ref(rt, inode.ver)
                    try:
                        await trio.to_thread.run_sync(self.staging.copy, inode.ino,
                                                      inode.ver, ver)
                    finally:
                        self._unref(inode.ino, rt, inode.ver)
            else:
                await self._materialize(inode, ver)
            session = self._start_session(inode, rt, ver)
            if truncate:
                session.tracker.reset()
            inode = self.ns.get(inode.ino)
            inode.size = self.staging.size(inode.ino, ver)
            if truncate:
                inode.mtime_ns = inode.ctime_ns = time.time_ns()
            self.ns.save(inode)
            return session

    async def _materialize(self, inode: Inode, ver: int) -> None:
        """Write a published file's content into staging version ``ver``."""
        self.staging.create_empty(inode.ino, ver)
        chunks = list(inode.chunks)
        offset = 0
        # Its own descriptor: the shared one may be evicted across the awaits below.
        with self.staging.owned_fd(inode.ino, ver) as fd:
            for sha, length in chunks:
                # Checked as copied, every time: rot copied here would be published under
                # the new version's own (valid) hashes.
                data = await self.cache.copy_out(sha, length)
                await trio.to_thread.run_sync(os.pwrite, fd, data, offset)
                offset += length

    def _truncate_session(self, inode: Inode, session: Session, size: int) -> None:
        try:
            os.ftruncate(self.staging.fd(inode.ino, session.ver), size)
        except OSError as exc:   # EFBIG: past what the staging disk's filesystem holds
            raise FsError(exc.errno or errno.EIO, f"truncate to {size}: {exc.strerror}") \
                from None
        inode.size = size
        inode.mtime_ns = inode.ctime_ns = time.time_ns()
        session.wrote = True
        if size == 0:
            session.tracker.reset()
        else:
            session.tracker.invalidate_from(size)
        self.ns.save(inode)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self._handle(fh)
        if not handle.writable:
            raise FsError(errno.EBADF)
        if self._deferred() and self.staged_bytes() > self.max_staged:
            await self._wait_for_room()
        rt = self._rt(handle.ino)
        session = rt.session
        if session is None or handle.session is not session:
            # The version this handle wrote was closed (e.g. a forked child writes on
            # after its parent's close): later writes start a new version.
            inode = self.ns.get(handle.ino)
            session = await self._join_session(inode, truncate=False)
            if handle.session is not None:
                handle.session.handles.discard(fh)
            handle.session = session
            session.handles.add(fh)
        inode = self.ns.get(handle.ino)
        try:
            written = os.pwrite(self.staging.fd(inode.ino, session.ver), data, offset)
        except OSError as exc:
            handle.failed = session.failed = exc.errno or errno.EIO
            log.error("write to staging of inode %d failed: %s", inode.ino, exc)
            raise FsError(exc.errno or errno.EIO, "staging write failed") from None
        handle.wrote = session.wrote = True
        self.write_requests += 1
        self.upload_gate.wrote()
        if offset + written > inode.size:
            inode.size = offset + written
        inode.mtime_ns = time.time_ns()
        tracker = session.tracker
        for index in tracker.note_write(offset, written):
            pending = tracker.start(index)
            self.nursery.start_soon(self._pipeline_chunk, inode.ino, session.ver, index,
                                    pending)
        return written

    def staged_bytes(self, fresh: bool = False) -> int:
        """Bytes of closed versions waiting for their upload (counted at most every
        50 ms: a write must not stat every pending file)."""
        counted_at, total = self._staged_bytes
        now = time.monotonic()
        if fresh or now - counted_at > 0.05:
            total = 0
            for ino in self.queue.active():
                inode = self.ns.maybe_get(ino)
                if inode is not None and inode.dirty:
                    try:
                        total += self.staging.size(ino, inode.ver)
                    except (OSError, FsError):
                        pass
            self._staged_bytes = (now, total)
        return total

    async def _wait_for_room(self) -> None:
        """Past ``max_staged``, a writer waits for uploads instead of filling the disk
        (while uploads are under way: a file larger than the bound still gets written)."""
        if not self.writers_waiting:
            log.warning("%d bytes closed and not yet uploaded, over max_staged (%d): "
                        "writers wait for uploads", self.staged_bytes(), self.max_staged)
        self.writers_waiting += 1
        try:
            while self.staged_bytes(fresh=True) > self.max_staged and self.queue.active():
                await self.queue.wait_change()
        finally:
            self.writers_waiting -= 1

    async def _pipeline_chunk(self, ino: int, ver: int, index: int, pending) -> None:
        try:
            size = self.config.chunk_size
            pending.result = await self.uploader.upload(self.staging.path(ino, ver),
                                                        index * size, size)
        except Exception as exc:  # flush uploads it again and reports the error
            log.debug("pipelined upload of chunk %d of inode %d failed: %s", index, ino, exc)
            pending.error = exc   # a timeout is not tried again: the close stays bounded
        finally:
            pending.done.set()
