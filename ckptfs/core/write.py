"""The write path: write sessions and working versions (decision 0005), staging writes,
pipelined chunk uploads, the --max-staged bound.  Opening a file is ``opening.py``'s.
Must not know publishing, refresh or FUSE."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Callable

import trio

from ..errors import FsError
from ..format.remote import zero_chunk_ids
from ..meta.namespace import Inode
from ..procstat import kill_pending
from ..data.upload import ChunkTracker
from .state import MAX_STAGED_FRACTION, CoreState, Handle, Runtime, Session

KILLED_WRITER_POLL = 0.5        # s: how often a writer held by ``max_staged`` is looked at
# Writers held by ``max_staged`` are said once, then at most this often (s): a writer
# that writes in small pieces waits once per write (fsx: 15 warnings a second).
HELD_SAID_EVERY = 60.0

log = logging.getLogger(__name__)


class WritePath:
    """Write sessions and staging writes.  Owns the write counters and the --max-staged
    bound (``max_staged``, ``writers_waiting``, ``_staged_bytes``)."""

    def __init__(self, st: CoreState) -> None:
        self.st = st
        self.write_requests = 0
        # Async mode: closed bytes not yet uploaded are bounded (writers wait past it).
        self.max_staged = st.config.max_staged or \
            int(shutil.disk_usage(st.staging.root).free * MAX_STAGED_FRACTION)
        self.writers_waiting = 0
        self._said_at: float | None = None    # the last "writers wait" warning (trio time)
        self._held_since_said = 0
        self._staged_bytes = (0.0, 0)          # (when counted, bytes)
        st.ns.on_reload = self.reloaded

    def reloaded(self, inode: Inode) -> None:
        """``inode`` was read again from disk after a failed commit (no await): an open
        writer's size and mtime were never saved there -- they are its staging file's
        (soak seed 1215183: a failed rename showed a file being written as empty).  The
        staging file's mtime is the working version's: each write moves it, and an
        mtime set meanwhile is put on it (``Attributes._stamp_working_version``)."""
        rt = self.st.runtime.get(inode.ino)
        if rt is None or rt.session is None:
            return
        try:
            st = os.fstat(self.st.staging.fd(inode.ino, rt.session.ver))
        except (OSError, FsError):
            return
        inode.size = st.st_size
        inode.mtime_ns = st.st_mtime_ns

    # ------------------------------------------------------------------ open / read / write

    def _start_session(self, inode: Inode, rt: Runtime, ver: int) -> Session:
        session = rt.session = Session(ver=ver, tracker=ChunkTracker(self.st.config.chunk_size))
        current = self.st.ns.maybe_get(inode.ino) or inode
        # Saved with the session's first save of the inode (a truncating open's).
        current.closed_mtime_ns = inode.closed_mtime_ns = current.mtime_ns
        session.tracker.seq_end = -1
        return session

    async def _join_session(self, inode: Inode, truncate: bool) -> Session:
        """The write session of an inode, started if there is none: a version of its own
        (empty for O_TRUNC, else a copy of the current content), so the closed version
        stays as it was until this session's close replaces it."""
        # The last writer's close being decided at its last release: this session
        # starts after it, from the version it closes.  Joined instead, an O_TRUNC open
        # cut that version, and a writer killed then took it along.
        await self.st.until_decided_at_release(inode.ino)
        rt = self.st._rt(inode.ino)     # (after the wait: the decision drops the old one)
        async with rt.session_lock:
            session = rt.session
            if session is not None:
                if truncate:
                    self._truncate_session(inode, session, 0)
                return session
            inode = self.st.ns.get(inode.ino)
            ver = inode.max_ver + 1
            inode.max_ver = ver
            self.st.ns.save(inode)
            if truncate:
                self.st.staging.create_empty(inode.ino, ver)
            elif inode.dirty or inode.local_copy:
                if not inode.dirty and not rt.refs.get(inode.ver) and \
                        not (rt.passthrough and rt.passthrough_ver == inode.ver) and \
                        not self.st.staging.shared(inode.ino, inode.ver):
                    # A clean local copy nobody reads (not even the kernel, for a
                    # passthrough handle; nor under another name: a version a fresh
                    # inode took over beside readers, ``taken.py``): the store has it,
                    # take it over.
                    self.st.staging.rename_version(inode.ino, inode.ver, ver)
                    inode.local_copy = False
                    self.st.cache.untrack_local(inode.ino)
                    self.st.ns.save(inode)
                else:
                    self.st._ref(rt, inode.ver)
                    try:
                        await trio.to_thread.run_sync(self.st.staging.copy, inode.ino,
                                                      inode.ver, ver)
                    finally:
                        self.st._unref(inode.ino, rt, inode.ver)
            else:
                await self._materialize(inode, ver)
            session = self._start_session(inode, rt, ver)
            if truncate:
                session.tracker.reset()
            inode = self.st.ns.get(inode.ino)
            inode.size = self.st.staging.size(inode.ino, ver)
            if truncate:
                inode.mtime_ns = inode.ctime_ns = time.time_ns()
            self.st.ns.save(inode)
            return session

    def drop_unheld_session(self, ino: int) -> None:
        """A writer's open joined or started the session of ``ino`` and was then
        refused (the file lost its name meanwhile: ESTALE): where no handle holds that
        session, it goes -- its staging file, the size it gave the inode -- and readers
        that joined it read the closed version.  Left, it stayed for good, held by
        nobody, and a reader of the replaced file saw the size it set."""
        rt = self.st.runtime.get(ino)
        session = rt.session if rt is not None else None
        inode = self.st.ns.maybe_get(ino)
        if rt is None or session is None or session.handles or inode is None:
            return
        restore_closed_size(self.st, inode)
        self.st.end_session(ino, rt)
        self.st.staging.remove(ino, session.ver)
        self.st.invalidate(ino)

    async def _materialize(self, inode: Inode, ver: int) -> None:
        """Write a published file's content into staging version ``ver``."""
        self.st.staging.create_empty(inode.ino, ver)
        chunks = list(inode.chunks)
        offset = 0
        # Its own descriptor: the shared one may be evicted across the awaits below.
        with self.st.staging.owned_fd(inode.ino, ver) as fd:
            for sha, length in chunks:
                if sha not in zero_chunk_ids(length):     # a chunk of zeros stays a hole
                    # Checked as copied, every time: rot copied here would be published
                    # under the new version's own (valid) hashes.
                    data = await self.st.cache.copy_out(sha, length)
                    await trio.to_thread.run_sync(os.pwrite, fd, data, offset)
                offset += length
            os.ftruncate(fd, offset)

    def _truncate_session(self, inode: Inode, session: Session, size: int) -> None:
        try:
            os.ftruncate(self.st.staging.fd(inode.ino, session.ver), size)
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
        self.st.ns.save(inode)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self.st._handle(fh)
        if not handle.writable:
            raise FsError(errno.EBADF)
        if self.st._deferred() and self.staged_bytes() > self.max_staged:
            await self._wait_for_room(handle)
        rt = self.st._rt(handle.ino)
        session = rt.session
        if session is None or handle.session is not session:
            # The version this handle wrote was closed (e.g. a forked child writes on
            # after its parent's close): later writes start a new version.
            inode = self.st.ns.get(handle.ino)
            session = await self._join_session(inode, truncate=False)
            if not session.handles:
                # Started by writes after this handle's close: writes through a mapping
                # the program unmaps after closing the descriptor come with no close of
                # their own, so its last release decides (``Session.meant``).
                session.meant = True
            if handle.session is not None:
                handle.session.handles.discard(fh)
            handle.session = session
            session.handles.add(fh)
        inode = self.st.ns.get(handle.ino)
        try:
            written = os.pwrite(self.st.staging.fd(inode.ino, session.ver), data, offset)
        except OSError as exc:
            handle.failed = session.failed = exc.errno or errno.EIO
            log.error("write to staging of inode %d failed: %s", inode.ino, exc)
            raise FsError(exc.errno or errno.EIO, "staging write failed") from None
        handle.wrote = session.wrote = True
        self.write_requests += 1
        self.st.upload_gate.wrote()
        if offset + written > inode.size:
            inode.size = offset + written
        inode.mtime_ns = time.time_ns()
        tracker = session.tracker
        for index in tracker.note_write(offset, written):
            self.send_ahead(inode.ino, session, index)
        return written

    def send_ahead(self, ino: int, session: Session, index: int) -> None:
        """Upload complete chunk ``index`` of a working version in the background, ahead
        of its close (under the upload gate and the upload limiter, as every upload)."""
        tracker = session.tracker
        pending = tracker.start(index)

        def reading() -> bool:
            pending.read_open = not tracker.closed
            # Hashed again at publish: its pages are kept for that read.
            return tracker.verify and pending.read_open

        self.st.nursery.start_soon(self._pipeline_chunk, ino, session.ver, index, pending,
                                   reading)

    def closed(self, size: int) -> None:
        """A version of ``size`` bytes was closed: counted at once (a writer's next write
        sees it), without counting every pending file again."""
        counted_at, total = self._staged_bytes
        self._staged_bytes = (counted_at, total + size)

    def staged_bytes(self, fresh: bool = False) -> int:
        """Bytes of closed versions waiting for their upload.  Counted again (a stat of
        every pending file) only when the count so far -- the last one plus every
        version closed since, so never less than the truth -- is over ``max_staged``,
        or once a second: a copy of many small files queues thousands, and counting
        them every 50 ms was a tenth of the daemon's CPU (issue 25)."""
        counted_at, total = self._staged_bytes
        now = time.monotonic()
        if fresh or total > self.max_staged or now - counted_at > 1.0:
            total = 0
            for ino in self.st.queue.active():
                inode = self.st.ns.maybe_get(ino)
                if inode is not None and inode.dirty:
                    try:
                        total += self.st.staging.size(ino, inode.ver)
                    except (OSError, FsError):
                        pass
            self._staged_bytes = (now, total)
        return total

    async def _wait_for_room(self, handle: Handle | None = None) -> None:
        """Past ``max_staged``, a writer waits for uploads instead of filling the disk
        (while uploads are under way: a file larger than the bound still gets written).
        A writer killed meanwhile gets EINTR: the kernel waits for this answer before
        the process can die, however long the store stays away (hostile run E)."""
        if not self.writers_waiting:
            self._held_since_said += 1
            now = trio.current_time()
            if self._said_at is None or now - self._said_at >= HELD_SAID_EVERY:
                more = self._held_since_said - 1
                log.warning("%d bytes closed and not yet uploaded, over max_staged (%d): "
                            "writers wait for uploads%s", self.staged_bytes(),
                            self.max_staged,
                            f" ({more} times since this was last said)" if more else "")
                self._said_at, self._held_since_said = now, 0
        self.writers_waiting += 1
        try:
            while self.staged_bytes(fresh=True) > self.max_staged and self.st.queue.active():
                with trio.move_on_after(KILLED_WRITER_POLL):
                    await self.st.queue.wait_change()
                if handle is not None and kill_pending(handle.opener.tgid):  # (group's)
                    raise FsError(errno.EINTR, "its writer was killed while it waited "
                                  "for uploads (max_staged)")
        finally:
            self.writers_waiting -= 1

    async def _pipeline_chunk(self, ino: int, ver: int, index: int, pending,
                              reading: Callable[[], bool] | None = None) -> None:
        try:
            size = self.st.config.chunk_size
            pending.result = await self.st.uploader.upload(self.st.staging.path(ino, ver),
                                                        index * size, size, reading)
        except Exception as exc:  # flush uploads it again and reports the error
            log.debug("pipelined upload of chunk %d of inode %d failed: %s", index, ino, exc)
            pending.error = exc   # a timeout is not tried again: the close stays bounded
        finally:
            pending.done.set()


def restore_closed_size(st: CoreState, inode: Inode) -> None:
    """The size (and mtime) of ``inode``'s last closed version, saved: a write session
    that ends with nothing to close leaves no trace of its own."""
    if inode.closed_mtime_ns is not None:     # a write session's mtime goes
        inode.mtime_ns, inode.closed_mtime_ns = inode.closed_mtime_ns, None
    if inode.dirty or inode.local_copy:
        try:
            inode.size = st.staging.size(inode.ino, inode.ver)
        except FsError:
            inode.size = inode.published_size
    else:
        inode.size = inode.published_size
    st.ns.save(inode)
