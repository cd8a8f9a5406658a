"""The filesystem core: POSIX semantics over the namespace, staging, cache and store.

``Filesystem`` is FUSE-agnostic (mountpoint-s3's split): the FUSE adapter and the
control socket call it; it raises ``FsError`` with an errno.  Remote metadata steps
(mkdir, unlink, rename, publishing an entry) are awaited in the concerns; namespace
changes that belong together happen with no ``await`` between them (``@no_await``).

The façade: it builds the shared ``CoreState`` and the concern objects, each given its
collaborators explicitly (decision 0018, docs/architecture.md), runs the background
workers, and forwards the calls of the FUSE adapter, the control socket and the daemon.
It must hold no filesystem logic of its own."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..cluster.leases import LeaseManager
from ..data.cache import ChunkCache
from ..data.guarded_store import GuardedStore
from ..data.liveness import ChunkLiveness
from ..data.publish_queue import PublishQueue
from ..data.staging import Staging
from ..data.upload import ChunkUploader, UploadGate
from ..errors import FsError
from ..format.remote import FORMAT_KEY
from ..meta.namespace import Inode, Namespace
from ..meta.oplog import MetaLog
from ..procstat import Opener
from ..store import ObjectStore, StoreError
from ..store.health import StoreHealth
from .abandon import Abandon
from .attributes import Attributes
from .entries import EntryIO
from .fsync import Fsync
from .held import HeldEntries
from .moves import EntryMoves
from .metalog import MetaLogApply
from .names import Names
from .opening import Opening
from .readbehind import ReadBehind
from .removals import DirRemovals
from .publish import Publish
from .release import Release
from .read import ReadPath
from .recovery import Recovery
from .listed_dirs import ListedDirIds
from .refresh import Refresh
from .rename import Rename
from .seal import Seal
from .state import CompletenessCheck, Config, CoreState, Handle
from .status import Status
from .write import WritePath

log = logging.getLogger(__name__)


# Seconds between looks for the store's marker (one HEAD each).
MARKER_CHECK_INTERVAL = 10.0


class _Shared:
    """A façade attribute that is the shared state's (read and set through)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, fs: Filesystem | None, owner: type | None = None) -> Any:
        if fs is None:
            return self
        return getattr(fs.st, self.name)

    def __set__(self, fs: Filesystem, value: Any) -> None:
        setattr(fs.st, self.name, value)


class Filesystem:
    """Builds the core and forwards to it; see the module docstring."""

    # The shared state the daemon, the control socket and tests read or set.
    ns = _Shared()
    store = _Shared()
    staging = _Shared()
    cache = _Shared()
    config = _Shared()
    handles = _Shared()
    runtime = _Shared()
    liveness = _Shared()
    uploader = _Shared()
    upload_gate = _Shared()
    store_health = _Shared()
    oplog = _Shared()
    queue = _Shared()
    leases = _Shared()
    invalidate = _Shared()
    invalidate_entry = _Shared()
    mount_device = _Shared()
    died_unclean = _Shared()
    observe = _Shared()
    invalidate_attributes = _Shared()
    passthrough_available = _Shared()
    after_seal = _Shared()
    _held_pointers = _Shared()
    closing_at_release = _Shared()

    def __init__(self, ns: Namespace, store: ObjectStore, staging: Staging,
                 cache: ChunkCache, config: Config, nursery: trio.Nursery,
                 invalidate: Callable[[int], None] = lambda ino: None,
                 invalidate_entry: Callable[[int, bytes], Awaitable[None]] | None = None,
                 check_complete: CompletenessCheck | None = None) -> None:
        # Entry PUTs go through the gc/dedup guard (decision 0003), whatever path makes them.
        liveness = ChunkLiveness(store, config.gc_settle, ns.known_chunks())
        # Async mode: background uploads give way to a writer that is writing; what
        # background work knows of the store's health (decision 0016).
        upload_gate, health = UploadGate(config.upload_hold), StoreHealth()
        uploader = ChunkUploader(
            store, liveness, trio.CapacityLimiter(config.upload_concurrency), ns.chunk_mark,
            slot=upload_gate.slot if config.durability == "async" else None,
            buffers=cache.buffers, chunk_hash=config.chunk_hash)
        guarded = GuardedStore(store, liveness, lambda: health.marker_lost,
                               lambda: health.marker_watched)
        st = self.st = CoreState(ns, guarded, staging, cache, config, nursery, invalidate,
                                 invalidate_entry, check_complete, liveness, upload_gate,
                                 health, uploader)
        # The concerns, bottom up; the two edges that point up are callbacks.
        self.writes = WritePath(st)
        self.opening = Opening(st, writes=self.writes,
                               readbehind=ReadBehind(st, writes=self.writes))
        st.fresh_inode_for_name = self.opening._fresh_inode_for_name
        self.entries = EntryIO(st, landed=lambda key: self.removals.landed(key))  # 0028
        self.removals = DirRemovals(st, self.entries)
        self.held = HeldEntries(st, self.entries)
        self.reads, self.fsyncs = ReadPath(st), Fsync(st)
        self.refresher = Refresh(st, entries=self.entries, dir_ids=ListedDirIds(st),
                                 delete_inode=lambda inode: self.publisher._delete_inode(inode))
        self.seals = Seal(st, entries=self.entries, refresher=self.refresher,
                          journal_publish=lambda inode: self.publisher._journal_publish(inode))
        self.abandoning = abandoning = Abandon(st, self.held)
        self.publisher = publisher = Publish(st, entries=self.entries, seals=self.seals,
                                             writes=self.writes, abandoning=abandoning)
        self.releasing = Release(st, publisher=publisher, abandoning=abandoning)
        self.attrs = Attributes(st, entries=self.entries, publisher=self.publisher,
                                writes=self.writes)
        self.names = Names(st, entries=self.entries, removals=self.removals,
                           refresher=self.refresher, opening=self.opening, writes=self.writes,
                           publisher=self.publisher, delete_held=self.held.delete,
                           release_held=self.held.release, log_delete=self.held.log_delete)
        self.moves = EntryMoves(st, self.entries, self.removals)
        self.renames = Rename(st, entries=self.entries, names=self.names,
                              refresher=self.refresher, seals=self.seals,
                              publisher=self.publisher, held=self.held, moves=self.moves)
        self.metalog = MetaLogApply(st, entries=self.entries, removals=self.removals,
                                    seals=self.seals, moves=self.moves,
                                    through_link=self.publisher._save_through_link)
        self.recovery = Recovery(st, entries=self.entries, reads=self.reads, seals=self.seals,
                                 publisher=self.publisher, renames=self.renames,
                                 moves=self.moves, abandoning=self.abandoning)
        self.status = Status(st, names=self.names, writes=self.writes, reads=self.reads)
        self._background_work(store, health)

    def _background_work(self, store: ObjectStore, health: StoreHealth) -> None:
        """Async mode's metadata log (decision 0012), the publish queue, the leases."""
        st, ns, config = self.st, self.st.ns, self.st.config
        st.oplog = MetaLog(ns, on_done=lambda: st.queue.release_parked(), health=health)
        st.queue = PublishQueue(self.publisher._publish_from_queue, config.upload_concurrency,
                                ready=self.publisher._publish_ready, health=health)
        st.leases = LeaseManager(ns, store, config.lease_ttl, st._writers,
                                 lambda ino: getattr(st.runtime.get(ino), "session", None)
                                 is not None,
                                 lambda ino: ino in st.queue.queued,
                                 self.seals._seal_for_leases)
        if st._deferred():
            st.leases.open_wait = config.stale_wait

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The background workers: the publish queue and the metadata log."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.st.queue.run)
            await nursery.start(self.st.oplog.run, self.metalog._execute_meta)
            nursery.start_soon(self._watch_marker)
            await nursery.start(self.st.journal.run)
            task_status.started()

    async def _watch_marker(self) -> None:
        """Look for the store's format marker now and then, and at once when the store
        says the bucket is missing: a bucket deleted under the mount stops publishing
        (decision 0016).  A failed look says nothing (outages are seen elsewhere).  A
        store that had no marker at the first look (the core's tests over a bare
        ``MemoryStore``; a mount always has one) is not watched."""
        health = self.st.store_health
        first = True
        while True:
            if not first:
                with trio.move_on_after(MARKER_CHECK_INTERVAL):
                    await health.check_marker.wait()
            try:
                present = await trio.to_thread.run_sync(self.st.store.inner.exists, FORMAT_KEY,
                                                        abandon_on_cancel=True)
            except StoreError:
                first = False
                continue
            if first and not present:
                return
            health.marker_watched = True
            first = False
            health.marker_checked(present)

    # ------------------------------------------------------------------ forwarding

    def nlink(self, inode: Inode) -> int:
        return self.st.nlink(inode)

    def blocks(self, inode: Inode) -> int:
        return self.st.blocks(inode)

    async def lookup(self, parent: int, name: bytes) -> Inode:
        return self.opening.live_size(await self.names.lookup(parent, name))

    def getattr(self, ino: int) -> Inode:
        try:
            inode = self.names.getattr(ino)
        except FsError as exc:
            # Gone since its name moved to a fresh inode: the kernel's dentry still names
            # it (a path walk's permission check asks): ESTALE makes the kernel look the
            # name up again, where ENOENT failed the open of a name that never went.
            if exc.errno == errno.ENOENT:
                self.st.refuse_if_moved_away(ino)
            raise
        return self.opening.live_size(inode)

    async def listdir(self, ino: int) -> list[tuple[bytes, Inode]]:
        return await self.names.listdir(ino)

    def statvfs(self) -> os.statvfs_result:
        return self.names.statvfs()

    def readlink(self, ino: int) -> bytes:
        return self.names.readlink(ino)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        return await self.names.mkdir(parent, name, mode, uid, gid)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int,
                      gid: int) -> Inode:
        return await self.names.symlink(parent, name, target, uid, gid)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Inode:
        return await self.names.mknod(parent, name, mode, rdev, uid, gid)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int, opener: Opener) -> tuple[Handle, Inode]:
        return await self.names.create(parent, name, mode, flags, uid, gid, opener)

    async def unlink(self, parent: int, name: bytes) -> None:
        return await self.names.unlink(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        return await self.names.rmdir(parent, name)

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        return await self.names.link(ino, new_parent, new_name)

    async def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                      gid: int | None = None, size: int | None = None,
                      atime_ns: int | None = None, mtime_ns: int | None = None,
                      fh: int | None = None) -> Inode:
        if fh is None and size is None and ino in self.st.moved_away:
            return await self._set_where_the_name_moved(
                ino, mode=mode, uid=uid, gid=gid, atime_ns=atime_ns, mtime_ns=mtime_ns)
        if fh is None:
            self.st.refuse_if_moved_away(ino)     # a path step through a kept dentry
            if size is not None:     # a new version: not in the file a reader holds
                await self.opening.wait_for_passthrough_readers(ino, writable=True)
                await self.opening.leave_readers_their_inode(ino)
        return self.opening.live_size(await self.attrs.setattr(
            ino, mode=mode, uid=uid, gid=gid, size=size, atime_ns=atime_ns,
            mtime_ns=mtime_ns, fh=fh))

    async def _set_where_the_name_moved(self, ino: int, **change: int | None) -> Inode:
        """A chmod, chown or utime of an inode whose name moved to a fresh one beside
        its readers: ``fchmod`` through a reader's descriptor (the kernel never retries
        it: ESTALE reached the program), or a path step through a dentry the kernel
        kept.  It is the file's, wherever its name went (``CoreState.moved_to``), and
        the reader's inode shows it too."""
        await self.attrs.setattr(self._where_the_name_moved(ino), **change)
        return self.opening.live_size(await self.attrs.setattr(ino, **change))

    def _where_the_name_moved(self, ino: int) -> int:
        """The inode ``ino``'s name moved to (followed), or ESTALE where that is gone or
        ``ino`` itself is (only a dentry the kernel kept reaches it then)."""
        moved_to = self.st.moved_to(ino)
        if moved_to is None or self.st.ns.maybe_get(ino) is None:
            self.st.refuse_if_moved_away(ino)
        assert moved_to is not None
        return moved_to

    def now_at(self, ino: int) -> int:
        """``ino``, or the inode its name moved to beside readers since (followed: a
        moved file's pending publish is that inode's, ``taken.py``)."""
        if ino not in self.st.moved_away:
            return ino
        return self.st.moved_to(ino) or ino

    def getxattr(self, ino: int, name: bytes) -> bytes:
        return self.attrs.getxattr(ino, name)

    def listxattr(self, ino: int) -> list[bytes]:
        return self.attrs.listxattr(ino)

    async def setxattr(self, ino: int, name: bytes, value: bytes | None) -> None:
        """(An inode whose name moved on: the file's, as ``_set_where_the_name_moved``;
        set on the nameless inode alone, it never reached the name or the store.)"""
        if ino not in self.st.moved_away:
            return await self.attrs.setxattr(ino, name, value)
        await self.attrs.setxattr(self._where_the_name_moved(ino), name, value)
        try:
            await self.attrs.setxattr(ino, name, value)
        except FsError as exc:
            if exc.errno != errno.ENODATA:      # (removed there since: nothing to show)
                raise

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int,
                     new_name: bytes, flags: int) -> None:
        return await self.renames.rename(old_parent, old_name, new_parent, new_name, flags)

    async def open(self, ino: int, flags: int, opener: Opener) -> Handle:
        return await self.opening.open(ino, flags, opener)

    def open_flags(self, handle: Handle) -> tuple[bool, bool]:
        return self.opening.open_flags(handle)

    def backing_fd(self, handle: Handle) -> int:
        return self.opening.backing_fd(handle)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        return await self.writes.write(fh, offset, data)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        return await self.reads.read(fh, offset, size)

    def _evict_local_copy(self, ino: int) -> bool:
        return self.reads._evict_local_copy(ino)

    async def warm(self, inode: Inode, on_bytes: Callable[[int], None]) -> None:
        return await self.reads.warm(inode, on_bytes)

    async def flush(self, fh: int) -> None:
        return await self.publisher.flush(fh)

    async def fsync(self, fh: int, datasync: bool) -> None:
        return await self.fsyncs.fsync(fh, datasync)

    async def release(self, fh: int) -> None:
        return await self.releasing.release(fh)

    async def seal(self, ino: int) -> bool:
        return await self.seals.seal(ino)

    async def refresh_dir(self, ino: int, force: bool = False) -> None:
        return await self.refresher.refresh_dir(ino, force)

    async def start(self) -> None:
        return await self.recovery.start()

    async def resolve(self, relative: bytes) -> Inode:
        return await self.status.resolve(relative)

    async def files_under(self, inode: Inode, prefix: bytes = b'',
                          allowed: Callable[[Inode], bool] | None = None) -> tuple[list[tuple[bytes, Inode]],
                          int]:
        return await self.status.files_under(inode, prefix, allowed)

    def pending_uploads(self) -> int:
        return self.status.pending_uploads()

    def store_unavailable(self) -> str | None:
        return self.status.store_unavailable()

    def unfinished(self) -> int:
        return self.status.unfinished()

    async def wait_idle(self) -> None:
        return await self.status.wait_idle()

    def is_writing(self, ino: int) -> bool:
        return self.status.is_writing(ino)

    def restore_leases(self) -> None:
        """After ``start``: the previous run's seal leases and pending seals, each
        lease broken where recovery found its file's writer cut off."""
        self.st.leases.restore(self.st.cut_off)

    def state_of(self, ino: int) -> str:
        """(Of the file the name moved to, as ``now_at``: through a reader's descriptor
        after a save beside it moved the name, the reader's inode owes nothing -- its
        version is the moved file's to publish.)"""
        return self.status.state_of(self.now_at(ino))

    def stats(self) -> dict:
        return self.status.stats()
