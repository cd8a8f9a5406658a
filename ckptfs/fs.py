"""The filesystem core: POSIX semantics over the namespace, staging, cache and store.

``Filesystem`` is FUSE-agnostic (mountpoint-s3's split): the FUSE adapter and the
control socket call it; it raises ``FsError`` with an errno.  Remote metadata steps
(mkdir, unlink, rename, publishing an entry) are awaited here; namespace changes that
belong together happen with no ``await`` between them.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import trio

from .errors import FsError
from .namespace import ROOT_INO, Inode, Namespace
from .procstat import Opener, died_unclean
from .profiles import Profiles
from .publisher import ChunkTracker, ChunkUploader, PublishQueue, chunk_list
from .remote import BadEntry, Entry, check_name, decode_name, dir_prefix, entry_key
from .staging import ChunkCache, Staging
from .store import NotFound, ObjectStore, StoreError

log = logging.getLogger(__name__)

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


@dataclass
class Config:
    durability: str = "sync"
    chunk_size: int = 8 << 20
    metadata_ttl: float = 1.0
    cache_size: int = 8 << 30
    upload_concurrency: int = 8
    fetch_concurrency: int = 8
    readahead_chunks: int = 8          # window for a sequential reader
    profiles: Profiles = field(default_factory=Profiles)
    gc_grace: float = 24 * 3600.0
    readahead_kb: int = 1024           # kernel read-ahead of the mount's device
    writeback_cache: bool = False      # kernel write-back caching (experimental)


@dataclass
class Handle:
    fh: int
    ino: int
    opener: Opener
    writable: bool
    wrote: bool = False
    failed: int = 0        # errno of a failed write: this handle never publishes
    read_end: int = 0      # where the last read ended (sequential detection)
    sequential: int = 0    # consecutive sequential reads


@dataclass
class Runtime:
    """In-memory state of an inode that is open or being published."""

    handles: set[int] = field(default_factory=set)
    writers: int = 0
    lock: trio.Lock = field(default_factory=trio.Lock)
    tracker: ChunkTracker | None = None


class Filesystem:
    def __init__(self, ns: Namespace, store: ObjectStore, staging: Staging, cache: ChunkCache,
                 config: Config, nursery: trio.Nursery,
                 invalidate: Callable[[int], None] = lambda ino: None) -> None:
        self.ns = ns
        self.store = store
        self.staging = staging
        self.cache = cache
        self.config = config
        self.nursery = nursery
        self.invalidate = invalidate
        self.handles: dict[int, Handle] = {}
        self.runtime: dict[int, Runtime] = {}
        self._next_fh = 1
        self.write_requests = 0
        self.read_requests = 0
        self._dir_mutations: dict[int, int] = {}
        self._refreshing: dict[int, trio.Event] = {}
        self._corrupt: dict[int, set[bytes]] = {}   # names whose store entry is corrupt
        # Bumped by every write, truncate and abandon; kept per inode (not in Runtime,
        # which is dropped when the last handle closes) so a publish in flight can tell
        # that what it uploaded is no longer the file.
        self._write_gen: dict[int, int] = {}
        self._busy_dirs: dict[int, int] = {}        # directories a rename is changing
        self.meta_limiter = trio.CapacityLimiter(16)
        known = ns.known_chunks()
        self.last_write = 0.0
        self.uploader = ChunkUploader(
            store, known, trio.CapacityLimiter(config.upload_concurrency), ns.chunk_mark,
            slot=self._background_slot if config.durability == "async" else None)
        self._trickle = trio.CapacityLimiter(1)
        self.queue = PublishQueue(self._publish_from_queue)

    # ------------------------------------------------------------------ helpers

    def _rt(self, ino: int) -> Runtime:
        rt = self.runtime.get(ino)
        if rt is None:
            rt = self.runtime[ino] = Runtime()
        return rt

    def _bump(self, ino: int) -> None:
        self._write_gen[ino] = self._write_gen.get(ino, 0) + 1

    def _locked(self, ino: int) -> bool:
        rt = self.runtime.get(ino)
        return bool(rt and rt.lock.locked())

    def _is_open(self, ino: int) -> bool:
        rt = self.runtime.get(ino)
        return bool(rt and rt.handles)

    def _writers(self, ino: int) -> int:
        rt = self.runtime.get(ino)
        return rt.writers if rt else 0

    def _drop_rt(self, ino: int) -> None:
        rt = self.runtime.get(ino)
        if rt and not rt.handles and not rt.lock.locked():
            del self.runtime[ino]

    def _touch_dir(self, ino: int) -> None:
        self._dir_mutations[ino] = self._dir_mutations.get(ino, 0) + 1

    def _dir(self, ino: int) -> Inode:
        inode = self.ns.get(ino)
        if inode.type != "dir":
            raise FsError(errno.ENOTDIR)
        return inode

    def _entry_of(self, inode: Inode) -> Entry:
        return Entry(type=inode.type, mode=inode.mode, uid=inode.uid, gid=inode.gid,
                     mtime_ns=inode.mtime_ns,
                     size=inode.published_size if inode.type == "file" else 0,
                     chunks=list(inode.chunks),
                     id=inode.dir_id, target=inode.target,
                     staged=inode.staged and inode.type == "dir")

    async def _store(self, fn, *args):
        async with self.meta_limiter:
            try:
                return await trio.to_thread.run_sync(fn, *args)
            except NotFound:
                raise
            except StoreError as exc:
                log.error("store error: %s", exc)
                raise FsError(errno.EIO, str(exc)) from None

    async def _put_entry(self, inode: Inode) -> None:
        parent = self.ns.get(inode.parent)
        key = entry_key(parent.dir_id, inode.name)
        etag = await self._store(self.store.put, key, self._entry_of(inode).to_json())
        inode.remote_etag = etag
        inode.published = True
        self.ns.save(inode)

    # ------------------------------------------------------------------ remote listing

    async def refresh_dir(self, ino: int, force: bool = False) -> None:
        """Merge the store's listing of a directory into the namespace (TTL-limited)."""
        inode = self._dir(ino)
        if not force and time.time() - inode.listed_at < self.config.metadata_ttl:
            return
        event = self._refreshing.get(ino)
        if event is not None:
            await event.wait()
            return
        event = self._refreshing[ino] = trio.Event()
        try:
            await self._refresh_dir(inode)
        finally:
            del self._refreshing[ino]
            event.set()

    async def _refresh_dir(self, dir_inode: Inode) -> None:
        started = time.time()
        mutations = self._dir_mutations.get(dir_inode.ino, 0)
        prefix = dir_prefix(dir_inode.dir_id)
        listing = await self._store(lambda: list(self.store.list(prefix)))
        remote: dict[bytes, tuple[str, str]] = {}
        for obj in listing:
            rest = obj.key[len(prefix):]
            if "/" in rest:
                continue
            try:
                remote[decode_name(rest)] = (obj.key, obj.etag)
            except BadEntry as exc:
                log.error("ignoring bad name %r in %s: %s", rest, prefix, exc)
        # Fetch the entries that are new or changed.
        local = dict(self.ns.children(dir_inode.ino))
        to_fetch = []
        for name, (key, etag) in remote.items():
            ino = local.get(name)
            if ino is not None and self.ns.get(ino).remote_etag == etag and etag:
                continue
            to_fetch.append((name, key))
        fetched: dict[bytes, tuple[Entry, str]] = {}
        corrupt: set[bytes] = set()

        async def fetch(name: bytes, key: str) -> None:
            try:
                body, etag = await self._store(self.store.get, key)
            except NotFound:
                return
            except FsError:
                return
            try:
                fetched[name] = (Entry.from_json(body, self.config.chunk_size), etag)
            except BadEntry as exc:
                log.error("corrupt entry %s: %s (EIO for that name)", key, exc)
                corrupt.add(name)

        async with trio.open_nursery() as nursery:
            for name, key in to_fetch:
                nursery.start_soon(fetch, name, key)
        # Apply: no await from here on.
        dir_inode = self.ns.get(dir_inode.ino)
        if not dir_inode.parent and dir_inode.ino != ROOT_INO:
            return
        changed_locally = (self._dir_mutations.get(dir_inode.ino, 0) != mutations
                           or dir_inode.ino in self._busy_dirs)
        local = dict(self.ns.children(dir_inode.ino))
        for name, (entry, etag) in fetched.items():
            ino = local.get(name)
            if ino is None:
                if changed_locally:
                    continue
                self._adopt_entry(dir_inode.ino, name, entry, etag)
                continue
            inode = self.ns.get(ino)
            if inode.dirty or self._writers(ino) or changed_locally or not inode.published:
                continue
            if inode.type != entry.type or (entry.type == "dir" and inode.dir_id != entry.id):
                self._forget_subtree(inode)
                self._adopt_entry(dir_inode.ino, name, entry, etag)
                continue
            content_changed = inode.chunks != entry.chunks
            inode.mode, inode.uid, inode.gid = entry.mode, entry.uid, entry.gid
            inode.mtime_ns, inode.chunks, inode.size = entry.mtime_ns, entry.chunks, entry.size
            inode.target, inode.remote_etag = entry.target, etag
            inode.staged = entry.staged and entry.type == "dir"
            if inode.type == "symlink" and entry.target is not None:
                inode.size = len(entry.target)
            if content_changed and inode.local_copy:
                inode.local_copy = False
                self.cache.untrack_local(ino)
                if not self._is_open(ino):
                    self.staging.remove(ino)
            self.ns.save(inode)
            if content_changed:
                self.invalidate(ino)
        if not changed_locally:
            for name, ino in local.items():
                if name in remote:
                    continue
                inode = self.ns.get(ino)
                if inode.published and not inode.dirty and not self._is_open(ino) \
                        and ino not in self.queue.queued and not self._locked(ino):
                    self._forget_subtree(inode)
        self._corrupt[dir_inode.ino] = corrupt
        dir_inode.listed_at = started
        self.ns.save(dir_inode)

    def _adopt_entry(self, parent: int, name: bytes, entry: Entry, etag: str) -> Inode:
        size = len(entry.target) if entry.target is not None else entry.size
        return self.ns.new_inode(parent, name, entry.type, entry.mode, entry.uid, entry.gid,
                                 size=size, chunks=entry.chunks, published=True,
                                 remote_etag=etag, dir_id=entry.id, target=entry.target,
                                 mtime_ns=entry.mtime_ns,
                                 staged=entry.staged and entry.type == "dir")

    def _forget_subtree(self, inode: Inode) -> None:
        """Drop a name that vanished from the store (another node removed it).  What
        this node still has work for (dirty, open, queued, locked) stays."""
        if inode.type == "dir":
            for _, child in self.ns.children(inode.ino):
                child_inode = self.ns.get(child)
                if child_inode.dirty or self._is_open(child) or child in self.queue.queued:
                    continue
                self._forget_subtree(child_inode)
        self.ns.unlink(inode)
        if not self._is_open(inode.ino):
            self._delete_inode(inode)
        self.invalidate(inode.ino)

    # ------------------------------------------------------------------ lookups

    async def lookup(self, parent: int, name: bytes) -> Inode:
        if name == b".":
            return self._dir(parent)
        if name == b"..":
            return self.ns.get(self._dir(parent).parent)
        await self.refresh_dir(parent)
        ino = self.ns.lookup(parent, name)
        if ino is None:
            if name in self._corrupt.get(parent, ()):
                raise FsError(errno.EIO, f"the store's entry for {name!r} is corrupt")
            raise FsError.enoent()
        return self.ns.get(ino)

    def getattr(self, ino: int) -> Inode:
        return self.ns.get(ino)

    async def listdir(self, ino: int) -> list[tuple[bytes, Inode]]:
        """Entries of a directory, without staged (unsealed) checkpoint directories:
        those are found only by their exact name (DESIGN.md promise 4)."""
        await self.refresh_dir(ino)
        out = []
        for name, child in self.ns.children(ino):
            inode = self.ns.get(child)
            if not inode.staged:
                out.append((name, inode))
        return out

    def statvfs(self) -> os.statvfs_result:
        """Space as the writer sees it: the staging disk's."""
        return os.statvfs(self.staging.root)

    def readlink(self, ino: int) -> bytes:
        inode = self.ns.get(ino)
        if inode.type != "symlink":
            raise FsError(errno.EINVAL)
        return inode.target or b""

    # ------------------------------------------------------------------ creating names

    async def _check_absent(self, parent: int, name: bytes) -> None:
        check_name_or_raise(name)
        await self.refresh_dir(parent)
        if self.ns.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        await self._check_absent(parent, name)
        parent_inode = self._dir(parent)
        dir_id = uuid.uuid4().hex
        entry = Entry(type="dir", mode=mode & 0o7777, uid=uid, gid=gid, mtime_ns=time.time_ns(),
                      id=dir_id, staged=self.config.profiles.staged_on_create(name))
        key = entry_key(parent_inode.dir_id, name)
        created = await self._store(self.store.put_if_absent, key, entry.to_json())
        etag = ""
        if not created:
            # Another node (or process) won the race: adopt its directory.
            try:
                body, etag = await self._store(self.store.get, key)
                entry = Entry.from_json(body, self.config.chunk_size)
            except (NotFound, BadEntry) as exc:
                raise FsError(errno.EIO, f"mkdir race on {key}: {exc}") from None
            if entry.type != "dir":
                raise FsError(errno.EEXIST)
        existing = self.ns.lookup(parent, name)
        if existing is not None:
            if not created:
                inode = self.ns.get(existing)
                if inode.type == "dir" and inode.dir_id == entry.id:
                    raise FsError(errno.EEXIST)
            raise FsError(errno.EEXIST)
        self._touch_dir(parent)
        inode = self.ns.new_inode(parent, name, "dir", entry.mode, entry.uid, entry.gid,
                                  dir_id=entry.id, published=True, remote_etag=etag or None,
                                  mtime_ns=entry.mtime_ns, staged=entry.staged)
        self._mark_parent_changed(parent_inode)
        if not created:
            raise FsError(errno.EEXIST)
        return inode

    def _mark_parent_changed(self, parent: Inode) -> None:
        now = time.time_ns()
        parent.mtime_ns = parent.ctime_ns = now
        self.ns.save(parent)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        await self._check_absent(parent, name)
        self._touch_dir(parent)
        inode = self.ns.new_inode(parent, name, "symlink", 0o777, uid, gid, target=target,
                                  size=len(target))
        try:
            await self._put_entry(inode)
        except BaseException:
            self.ns.unlink(inode)
            self.ns.delete_inode(inode.ino)
            raise
        self._mark_parent_changed(self.ns.get(parent))
        return inode

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int,
                     opener: Opener) -> tuple[Handle, Inode]:
        check_name_or_raise(name)
        await self.refresh_dir(parent)
        existing = self.ns.lookup(parent, name)
        if existing is not None:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST)
            handle = await self.open(existing, flags, opener)
            return handle, self.ns.get(existing)
        self._dir(parent)
        self._touch_dir(parent)
        inode = self.ns.new_inode(parent, name, "file", mode, uid, gid, dirty=True,
                                  local_copy=True)
        self.staging.create_empty(inode.ino)
        handle = self._new_handle(inode, opener, writable=True)
        handle.wrote = True  # creating the file is a change worth publishing
        self._mark_parent_changed(self.ns.get(parent))
        return handle, inode

    def _new_handle(self, inode: Inode, opener: Opener, writable: bool) -> Handle:
        handle = Handle(fh=self._next_fh, ino=inode.ino, opener=opener, writable=writable)
        self._next_fh += 1
        self.handles[handle.fh] = handle
        rt = self._rt(inode.ino)
        rt.handles.add(handle.fh)
        if writable:
            rt.writers += 1
            if rt.tracker is None:
                rt.tracker = ChunkTracker(self.config.chunk_size)
                if inode.size == 0:
                    rt.tracker.reset()
                else:
                    rt.tracker.seq_end = -1
        return handle

    # ------------------------------------------------------------------ open / read / write

    async def open(self, ino: int, flags: int, opener: Opener) -> Handle:
        inode = self.ns.get(ino)
        if inode.type == "dir":
            raise FsError(errno.EISDIR)
        if inode.type != "file":
            raise FsError(errno.EINVAL)
        accmode = flags & os.O_ACCMODE
        writable = accmode in (os.O_WRONLY, os.O_RDWR)
        if writable:
            if flags & os.O_TRUNC:
                await self._truncate_staging(inode, 0)
            else:
                await self._materialize(inode)
        handle = self._new_handle(inode, opener, writable)
        if writable and flags & os.O_TRUNC:
            handle.wrote = True
        return handle

    def keep_cache(self, handle: Handle) -> bool:
        inode = self.ns.get(handle.ino)
        return not handle.writable and not inode.dirty and not self._writers(inode.ino)

    async def _materialize(self, inode: Inode) -> None:
        """Make sure the staging file holds the file's current content."""
        if inode.dirty or inode.local_copy:
            if self.staging.exists(inode.ino):
                return
            if inode.dirty:
                raise FsError(errno.EIO, f"staging file of inode {inode.ino} is gone")
        fd = self.staging.create_empty(inode.ino)
        offset = 0
        for sha, length in inode.chunks:
            self.cache.pin(sha)
            try:
                path = await self.cache.ensure(sha, length)
                data = path.read_bytes()
            finally:
                self.cache.unpin(sha)
            os.pwrite(fd, data, offset)
            offset += length
        inode.local_copy = True
        self.ns.save(inode)

    async def _truncate_staging(self, inode: Inode, size: int) -> None:
        if size == 0:
            self.staging.create_empty(inode.ino)
            inode.local_copy = True
        else:
            await self._materialize(inode)
            os.ftruncate(self.staging.fd(inode.ino), size)
        inode.size = size
        inode.dirty = True
        self.cache.untrack_local(inode.ino)
        inode.mtime_ns = inode.ctime_ns = time.time_ns()
        rt = self._rt(inode.ino)
        self._bump(inode.ino)
        if rt.tracker is not None:
            if size == 0:
                rt.tracker.reset()
            else:
                rt.tracker.invalidate_from(size)
        self.ns.save(inode)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handle(fh)
        inode = self.ns.get(handle.ino)
        if inode.dirty or inode.local_copy:
            if offset >= inode.size:
                return b""
            if not inode.dirty:
                self.cache.touch_local(inode.ino)
            return os.pread(self.staging.fd(inode.ino), min(size, inode.size - offset), offset)
        self.read_requests += 1
        # Concurrent kernel read-ahead requests arrive slightly out of order: "close to
        # where the last read ended" counts as sequential.
        if abs(offset - handle.read_end) <= 4 * self.config.chunk_size // 2:
            handle.sequential += 1
        else:
            handle.sequential = 0
        handle.read_end = max(handle.read_end, offset + size) if handle.sequential else \
            offset + size
        window = self.config.readahead_chunks if handle.sequential >= 2 else 1
        return await self._read_chunks(inode, offset, size, window)

    async def _read_chunks(self, inode: Inode, offset: int, size: int, window: int = 1) -> bytes:
        end = min(offset + size, inode.size)
        if offset >= end:
            return b""
        wanted = []
        pos = 0
        for index, (sha, length) in enumerate(inode.chunks):
            if pos + length > offset and pos < end:
                wanted.append((pos, sha, length, index))
            pos += length
            if pos >= end:
                break
        for _, sha, _, _ in wanted:
            self.cache.pin(sha)
        try:
            if len(wanted) == 1:
                await self.cache.ensure(wanted[0][1], wanted[0][2])
            else:
                async with trio.open_nursery() as nursery:
                    for _, sha, length, _ in wanted:
                        nursery.start_soon(self.cache.ensure, sha, length)
            last_index = wanted[-1][3]
            for sha, length in inode.chunks[last_index + 1:last_index + 1 + window]:
                if not self.cache.has(sha) and not self.cache.fetching(sha):
                    self.nursery.start_soon(self._readahead, sha, length)
            parts = []
            for pos, sha, length, _ in wanted:
                lo = max(offset, pos) - pos
                hi = min(end, pos + length) - pos
                parts.append(self.cache.pread(sha, hi - lo, lo))
            return b"".join(parts)
        finally:
            for _, sha, _, _ in wanted:
                self.cache.unpin(sha)

    async def _readahead(self, sha: str, length: int) -> None:
        try:
            await self.cache.ensure(sha, length)
        except Exception as exc:  # a reader that needs it will see the error
            log.debug("read-ahead of %s failed: %s", sha[:12], exc)

    def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self._handle(fh)
        if not handle.writable:
            raise FsError(errno.EBADF)
        inode = self.ns.get(handle.ino)
        try:
            written = os.pwrite(self.staging.fd(inode.ino), data, offset)
        except OSError as exc:
            handle.failed = exc.errno or errno.EIO
            log.error("write to staging of inode %d failed: %s", inode.ino, exc)
            raise FsError(exc.errno or errno.EIO, "staging write failed") from None
        handle.wrote = True
        self.write_requests += 1
        self.last_write = time.monotonic()
        rt = self._rt(inode.ino)
        self._bump(inode.ino)
        if not inode.dirty:
            inode.dirty = True
            self.cache.untrack_local(inode.ino)
            self.ns.save(inode)
        if offset + written > inode.size:
            inode.size = offset + written
        inode.mtime_ns = time.time_ns()
        tracker = rt.tracker
        if tracker is not None:
            for index in tracker.note_write(offset, written):
                pending = tracker.start(index)
                self.nursery.start_soon(self._pipeline_chunk, inode.ino, index, pending)
        return written

    async def _pipeline_chunk(self, ino: int, index: int, pending) -> None:
        try:
            size = self.config.chunk_size
            pending.result = await self.uploader.upload(self.staging.path(ino), index * size, size)
        except Exception as exc:  # flush uploads it again and reports the error
            log.debug("pipelined upload of chunk %d of inode %d failed: %s", index, ino, exc)
        finally:
            pending.done.set()

    @asynccontextmanager
    async def _background_slot(self):
        """Async durability: while a writer is writing (a write in the last 100 ms),
        background uploads trickle one at a time, leaving the CPU to the training step
        that async mode protects; when writers pause, they run at full concurrency."""
        # Re-checked while waiting: uploads queued during a write must not stay
        # serialized once the writer stops.
        while time.monotonic() - self.last_write < 0.1:
            if self._trickle.available_tokens:
                async with self._trickle:
                    yield
                return
            await trio.sleep(0.05)
        yield

    def _handle(self, fh: int) -> Handle:
        handle = self.handles.get(fh)
        if handle is None:
            raise FsError(errno.EBADF)
        return handle

    # ------------------------------------------------------------------ close and publish

    async def flush(self, fh: int) -> None:
        handle = self._handle(fh)
        if not handle.writable:
            return
        inode = self.ns.get(handle.ino)
        if handle.failed:
            self._abandon_if_alone(inode, handle, "a write on it failed", keep=False)
            # Report the write's own error again at close (as NFS does), e.g. ENOSPC.
            raise FsError(handle.failed, "not published: an earlier write failed")
        if not inode.dirty:
            return
        if died_unclean(handle.opener):
            if not handle.wrote:
                return  # it changed nothing: whatever is pending was closed by others
            log.warning("writer %d of %s was killed; keeping it staged, unpublished",
                        handle.opener.tgid, self._path_for_log(inode))
            self._abandon_if_alone(inode, handle, "its writer was killed")
            return
        inode.size = self.staging.size(inode.ino)
        self.ns.save(inode)
        if self.config.durability == "async":
            self._journal_publish(inode)
            self._seals_after_close(inode, wait=False)
            return
        await self.publish_now(inode.ino)
        await self._seals_after_close(inode, wait=True)

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handle(fh)
        inode = self.ns.get(handle.ino)
        if not handle.writable or not inode.dirty:
            return
        if handle.failed:
            raise FsError(handle.failed, "an earlier write failed")
        fd = self.staging.fd(inode.ino)
        await trio.to_thread.run_sync(os.fsync, fd)
        inode.size = self.staging.size(inode.ino)
        self.ns.save(inode)
        if self.config.durability == "async":
            self._journal_publish(inode)
            self.ns.sync()
            return
        await self.publish_now(inode.ino)

    def _journal_publish(self, inode: Inode) -> None:
        if inode.ino not in self.queue.queued:
            self.ns.journal_add({"op": "publish", "ino": inode.ino})
        self.queue.submit(inode.ino)

    def _abandon_if_alone(self, inode: Inode, handle: Handle, why: str, keep: bool = True) -> None:
        """Keep a torn version out of sight: move its staging file aside (for ``ckptfs
        gc``; dropped at once when ``keep`` is false, e.g. after ENOSPC) and show the last
        published version again, or nothing if there never was one."""
        rt = self._rt(inode.ino)
        if rt.writers > 1:
            return
        self._bump(inode.ino)  # a publish in flight must not write these bytes' entry
        if keep:
            kept = self.staging.abandon(inode.ino)
            log.warning("%s left unpublished because %s; staged bytes kept at %s",
                        self._path_for_log(inode), why, kept)
        else:
            self.staging.remove(inode.ino)
            log.warning("%s left unpublished because %s", self._path_for_log(inode), why)
        handle.wrote = False
        inode.dirty = False
        inode.local_copy = False
        if rt.tracker is not None:
            rt.tracker.reset()
        if inode.published:
            inode.size = inode.published_size
            self.ns.save(inode)
        elif inode.parent:
            self._touch_dir(inode.parent)
            self.ns.unlink(inode)
        self.invalidate(inode.ino)

    def _path_for_log(self, inode: Inode) -> str:
        try:
            return self.ns.path_of(inode.ino).decode(errors="replace")
        except FsError:
            return f"<inode {inode.ino}>"

    async def publish_now(self, ino: int) -> None:
        """Upload a dirty file's chunks and write its entry; on failure, queue a retry
        and raise EIO."""
        try:
            for _ in range(3):
                if await self._publish(ino):
                    return
            # Still being rewritten by another handle: its close publishes; keep it
            # queued so nothing closed is left behind.
            inode = self.ns.maybe_get(ino)
            if inode is not None and inode.dirty:
                self._journal_publish(inode)
        except FsError as exc:
            if exc.errno == errno.EIO:
                inode = self.ns.maybe_get(ino)
                if inode is not None and inode.dirty:
                    self._journal_publish(inode)
            raise

    async def _publish_from_queue(self, ino: int) -> bool:
        if not await self._publish(ino):
            return False  # changed meanwhile: the queue sends it round again
        for seq, record in self.ns.journal():
            if record.get("op") == "publish" and record.get("ino") == ino:
                self.ns.journal_done(seq)
        return True

    async def _publish(self, ino: int) -> bool:
        """Publish the staging file's current content.  True when the inode is clean
        afterwards; False when it was changed while uploading (nothing was written to
        the store then: the caller publishes again)."""
        inode = self.ns.maybe_get(ino)
        if inode is None or not inode.dirty or not inode.parent:
            return True
        rt = self._rt(ino)
        started = time.monotonic()
        generation = self._write_gen.get(ino, 0)
        tracker = rt.tracker
        size = self.staging.size(ino)
        try:
            chunks = await chunk_list(self.uploader, tracker, self.staging.path(ino), size,
                                      self.config.chunk_size)
        except StoreError as exc:
            self.uploader.stats.publish_failures += 1
            raise FsError(errno.EIO, f"upload failed: {exc}") from None
        except OSError as exc:
            self.uploader.stats.publish_failures += 1
            raise FsError(exc.errno or errno.EIO, f"upload failed: {exc}") from None
        rt = self._rt(ino)
        async with rt.lock:
            inode = self.ns.maybe_get(ino)
            if inode is None or not inode.parent or not inode.dirty:
                return True
            if self._write_gen.get(ino, 0) != generation:
                log.debug("inode %d changed while uploading; publishing again", ino)
                return False
            previous = inode.chunks
            inode.chunks = chunks
            try:
                await self._put_entry(inode)
            except BaseException:
                inode.chunks = previous
                self.uploader.stats.publish_failures += 1
                raise
            clean = self._write_gen.get(ino, 0) == generation
            if clean:
                inode.dirty = False
                inode.local_copy = self.staging.exists(ino)
                if inode.local_copy:
                    self.cache.track_local(ino, size)
            self.ns.save(inode)
        self.uploader.stats.publishes += 1
        log.debug("published inode %d (%d bytes) in %.3fs", ino, size, time.monotonic() - started)
        self._drop_rt(ino)
        return clean

    async def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is None:
            return
        rt = self._rt(handle.ino)
        rt.handles.discard(fh)
        if handle.writable:
            rt.writers -= 1
        inode = self.ns.maybe_get(handle.ino)
        if not rt.handles:
            self.staging.close_fd(handle.ino)
            if rt.writers == 0:
                rt.tracker = None
            if inode is not None and not inode.parent:
                self._delete_inode(inode)
            elif inode is not None and inode.dirty and not rt.writers \
                    and inode.ino not in self.queue.queued and handle.wrote:
                # Closed but not yet published (e.g. flush failed): keep trying.
                self._journal_publish(inode)
        self._drop_rt(handle.ino)

    def _delete_inode(self, inode: Inode) -> None:
        self.cache.untrack_local(inode.ino)
        self.staging.remove(inode.ino)
        self.ns.delete_inode(inode.ino)
        self.queue.discard(inode.ino)
        for seq, record in self.ns.journal():
            if record.get("op") == "publish" and record.get("ino") == inode.ino:
                self.ns.journal_done(seq)

    # ------------------------------------------------------------------ attributes

    async def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                      gid: int | None = None, size: int | None = None,
                      atime_ns: int | None = None, mtime_ns: int | None = None,
                      fh: int | None = None) -> Inode:
        inode = self.ns.get(ino)
        if size is not None:
            if inode.type == "dir":
                raise FsError(errno.EISDIR)
            if inode.type != "file":
                raise FsError(errno.EINVAL)
            if size != inode.size or inode.dirty:
                await self._truncate_staging(inode, size)
        if mode is not None:
            inode.mode = mode & 0o7777
        if uid is not None:
            inode.uid = uid
        if gid is not None:
            inode.gid = gid
        if atime_ns is not None:
            inode.atime_ns = atime_ns
        if mtime_ns is not None:
            inode.mtime_ns = mtime_ns
        inode.ctime_ns = time.time_ns()
        self.ns.save(inode)
        if inode.dirty and self._writers(ino):
            return inode  # the open writer's close publishes everything together
        if inode.dirty:
            await self.publish_now(ino)
        elif inode.published and inode.parent and ino != ROOT_INO:
            if mode is not None or uid is not None or gid is not None or mtime_ns is not None:
                await self._put_entry(inode)
        return inode

    # ------------------------------------------------------------------ removing names

    async def unlink(self, parent: int, name: bytes) -> None:
        inode = await self.lookup(parent, name)
        if inode.type == "dir":
            raise FsError(errno.EISDIR)
        await self._remove(inode)

    async def rmdir(self, parent: int, name: bytes) -> None:
        inode = await self.lookup(parent, name)
        if inode.type != "dir":
            raise FsError(errno.ENOTDIR)
        await self.refresh_dir(inode.ino, force=True)
        if self.ns.has_children(inode.ino):
            raise FsError(errno.ENOTEMPTY)
        await self._remove(inode)

    async def _remove(self, inode: Inode) -> None:
        # Under the inode's lock: an entry PUT in flight (a publish) lands first, then
        # its key is deleted here, instead of landing after and resurrecting the name.
        rt = self._rt(inode.ino)
        async with rt.lock:
            inode = self.ns.get(inode.ino)
            if not inode.parent:
                return
            parent = self.ns.get(inode.parent)
            if inode.published:
                await self._store(self.store.delete, entry_key(parent.dir_id, inode.name))
            self._touch_dir(parent.ino)
            self.ns.unlink(inode)
            self._mark_parent_changed(parent)
            self._bump(inode.ino)
        self._drop_rt(inode.ino)
        if not self._is_open(inode.ino):
            self._delete_inode(inode)

    # ------------------------------------------------------------------ rename

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     flags: int) -> None:
        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        check_name_or_raise(new_name)
        inode = await self.lookup(old_parent, old_name)
        new_dir = self._dir(new_parent)
        await self.refresh_dir(new_parent)
        if inode.type == "dir":
            ancestor = new_parent
            while ancestor != ROOT_INO:
                if ancestor == inode.ino:
                    raise FsError(errno.EINVAL, "cannot move a directory into itself")
                ancestor = self.ns.get(ancestor).parent
        target_ino = self.ns.lookup(new_parent, new_name)
        target = self.ns.get(target_ino) if target_ino is not None else None
        if target is not None:
            if target.ino == inode.ino:
                return
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if inode.type == "dir" and target.type != "dir":
                raise FsError(errno.ENOTDIR)
            if inode.type != "dir" and target.type == "dir":
                raise FsError(errno.EISDIR)
            if target.type == "dir":
                await self.refresh_dir(target.ino, force=True)
                if self.ns.has_children(target.ino):
                    raise FsError(errno.ENOTEMPTY)
        if inode.type == "dir":
            # The renamed tree must appear complete: let its pending uploads land first.
            while self._pending_under(inode.ino):
                await trio.sleep(0.05)
        # A listing of either directory applied while the two store steps are under way
        # would see the old name gone and forget it: mark both busy until the move.
        busy = {inode.parent, new_parent}
        for d in busy:
            self._busy_dirs[d] = self._busy_dirs.get(d, 0) + 1
        try:
            await self._rename_locked(inode, new_dir, new_parent, new_name, target)
        finally:
            for d in busy:
                self._busy_dirs[d] -= 1
                if not self._busy_dirs[d]:
                    del self._busy_dirs[d]
                self._touch_dir(d)
        self._drop_rt(inode.ino)
        # A completion mark written as a temp file and renamed into place (DCP's
        # .metadata) seals like a mark closed in place.
        if inode.type == "file" and not inode.dirty:
            await self._seals_after_close(inode, wait=True)
        elif inode.type == "file" and not self._writers(inode.ino):
            self._seals_after_close(inode, wait=False)

    async def _rename_locked(self, inode: Inode, new_dir: Inode, new_parent: int,
                             new_name: bytes, target: Inode | None) -> None:
        """The store steps and the namespace move, under the locks of the renamed inode
        and of the one it replaces (a publish of either finishes first)."""
        async with AsyncExitStack() as locks:
            await locks.enter_async_context(self._rt(inode.ino).lock)
            if target is not None and target.ino != inode.ino:
                await locks.enter_async_context(self._rt(target.ino).lock)
            inode = self.ns.get(inode.ino)
            old_dir = self.ns.get(inode.parent)
            old_key = entry_key(old_dir.dir_id, inode.name)
            new_key = entry_key(new_dir.dir_id, new_name)
            was_staged = inode.staged
            inode.staged = False  # a rename seals a staged directory
            if inode.published:
                # Journal both halves first: a crash in between is finished on restart,
                # so a reader may briefly see both names, never neither.
                body = self._entry_of(inode).to_json()
                seq = self.ns.journal_add({"op": "rename", "put": new_key,
                                           "body": body.decode(), "delete": old_key})
                self.ns.sync()
                try:
                    etag = await self._store(self.store.put, new_key, body)
                except BaseException:
                    inode.staged = was_staged
                    self.ns.journal_done(seq)
                    raise
                await self._store(self.store.delete, old_key)
                self.ns.journal_done(seq)
                inode.remote_etag = etag
            elif target is not None and target.published:
                await self._store(self.store.delete, new_key)
            target_ino = self.ns.lookup(new_parent, new_name)
            if target_ino is not None and target_ino != inode.ino:
                replaced = self.ns.get(target_ino)
                self.ns.unlink(replaced)
                self._bump(replaced.ino)
                if not self._is_open(replaced.ino):
                    self._delete_inode(replaced)
            self.ns.move(inode, new_parent, new_name)
            self._mark_parent_changed(old_dir)
            if new_parent != old_dir.ino:
                self._mark_parent_changed(self.ns.get(new_parent))
        if target is not None:
            self._drop_rt(target.ino)

    def _evict_local_copy(self, ino: int) -> bool:
        inode = self.ns.maybe_get(ino)
        if inode is None:
            return True
        if inode.dirty or self._is_open(ino) or ino in self.queue.queued:
            return False
        self.staging.remove(ino)
        inode.local_copy = False
        self.ns.save(inode)
        return True

    # ------------------------------------------------------------------ recovery

    async def start(self) -> None:
        """Finish an earlier run's work and account its local copies in the cache."""
        self.cache.evict_local = self._evict_local_copy
        for inode in self.ns.all_inodes():
            if inode.type == "file" and inode.local_copy and not inode.dirty:
                if self.staging.exists(inode.ino):
                    self.cache.track_local(inode.ino, self.staging.size(inode.ino))
                else:
                    inode.local_copy = False
                    self.ns.save(inode)
        await self.replay_journal()

    async def replay_journal(self) -> None:
        """Finish what a previous run of the daemon started (DESIGN.md "Recovery")."""
        for seq, record in self.ns.journal():
            op = record.get("op")
            if op == "rename":
                await self._store(self.store.put, record["put"], record["body"].encode())
                await self._store(self.store.delete, record["delete"])
                self.ns.journal_done(seq)
                log.info("finished an interrupted rename to %s", record["put"])
            elif op == "publish":
                inode = self.ns.maybe_get(record["ino"])
                if inode is None or not inode.dirty or not self.staging.exists(inode.ino):
                    self.ns.journal_done(seq)
                    continue
                inode.size = self.staging.size(inode.ino)
                self.queue.submit(inode.ino)
            else:
                log.error("unknown journal record %r dropped", record)
                self.ns.journal_done(seq)

    # ------------------------------------------------------------------ sealing

    def _seals_after_close(self, inode: Inode, wait: bool):
        """Seal what a closed completion mark or pointer file completes.  With ``wait``
        returns an awaitable that seals now; otherwise seals in the background once the
        pending publishes below the directory are done (async durability)."""
        targets = self._seal_targets(inode)
        if wait:
            async def seal_all() -> None:
                for ino in targets:
                    await self.seal(ino)
            return seal_all()
        for ino in targets:
            self.nursery.start_soon(self._seal_in_background, ino)
        return None

    def _seal_targets(self, inode: Inode) -> list[int]:
        if inode.type != "file" or not inode.parent:
            return []
        profiles = self.config.profiles
        parent = self.ns.get(inode.parent)
        targets = []
        if parent.staged and profiles.is_mark_for(parent.name, inode.name):
            targets.append(parent.ino)
        if profiles.is_pointer(inode.name) and inode.size <= 4096:
            try:
                content = os.pread(self.staging.fd(inode.ino), 4096, 0)
            except (OSError, FsError):
                content = b""
            for name in profiles.pointed_names(inode.name, content):
                ino = self.ns.lookup(parent.ino, name)
                if ino is not None and self.ns.get(ino).staged:
                    targets.append(ino)
        return targets

    def _pending_under(self, dir_ino: int) -> bool:
        for ino in self.queue.queued:
            cur = self.ns.maybe_get(ino)
            while cur is not None and cur.parent and cur.ino != ROOT_INO:
                if cur.parent == dir_ino:
                    return True
                cur = self.ns.maybe_get(cur.parent)
        return False

    async def _seal_in_background(self, ino: int) -> None:
        for attempt in range(10):
            try:
                await self.seal(ino)
                return
            except Exception as exc:  # a background task must never take the daemon down
                if isinstance(exc, FsError) and exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    return  # the directory is gone or replaced: nothing left to seal
                log.warning("sealing inode %d failed (%s); retrying", ino, exc)
                await trio.sleep(min(30, 2 ** attempt))
        log.error("gave up sealing inode %d; `ckptfs commit` seals it by hand", ino)

    async def seal(self, ino: int) -> bool:
        """Make a staged directory visible: after everything closed below it is in the
        store, rewrite its entry with ``staged: false`` (one PUT).  Idempotent."""
        inode = self.ns.get(ino)
        if inode.type != "dir":
            raise FsError(errno.ENOTDIR)
        while self._pending_under(ino):
            await trio.sleep(0.05)
        rt = self._rt(ino)
        async with rt.lock:
            inode = self.ns.get(ino)
            if not inode.staged or not inode.parent:
                return False
            inode.staged = False
            try:
                await self._put_entry(inode)
            except BaseException:
                inode.staged = True
                self.ns.save(inode)
                raise
        self._drop_rt(ino)
        self._touch_dir(inode.parent)
        log.info("sealed %s", self._path_for_log(inode))
        self.invalidate(inode.parent)
        return True

    # ------------------------------------------------------------------ prefetch

    async def resolve(self, relative: bytes) -> Inode:
        inode = self.ns.get(ROOT_INO)
        for part in relative.split(b"/"):
            if part in (b"", b"."):
                continue
            inode = await self.lookup(inode.ino, part)
        return inode

    async def files_under(self, inode: Inode, prefix: bytes = b"") -> list[tuple[bytes, Inode]]:
        if inode.type == "file":
            return [(prefix, inode)]
        if inode.type != "dir":
            return []
        out = []
        for name, child in await self.listdir(inode.ino):
            out += await self.files_under(child, prefix + b"/" + name if prefix else name)
        return out

    async def warm(self, inode: Inode, on_bytes: Callable[[int], None]) -> None:
        """Bring every chunk of a published file into the node cache."""
        if inode.dirty or inode.local_copy:
            on_bytes(inode.size)
            return
        errors: list[BaseException] = []

        async def one(sha: str, length: int) -> None:
            try:
                await self.cache.ensure(sha, length)
                on_bytes(length)
            except Exception as exc:  # reported per file by the caller
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for sha, length in inode.chunks:
                nursery.start_soon(one, sha, length)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ status

    def pending_uploads(self) -> int:
        return len(self.queue.queued)

    def state_of(self, ino: int) -> str:
        inode = self.ns.get(ino)
        if inode.ino in self.queue.queued:
            return "uploading"
        if inode.dirty:
            return "staged"
        if inode.type == "file" and not inode.local_copy and inode.chunks and \
                all(self.cache.has(sha) for sha, _ in inode.chunks):
            return "cached"
        if inode.type == "file" and not inode.local_copy and inode.chunks:
            return "remote"
        return "published"

    def stats(self) -> dict:
        up = self.uploader.stats
        return {"pending_uploads": self.pending_uploads(),
                "failing_uploads": dict(self.queue.failing),
                "chunks_uploaded": up.chunks_uploaded,
                "chunks_deduplicated": up.chunks_deduplicated,
                "bytes_uploaded": up.bytes_uploaded,
                "bytes_deduplicated": up.bytes_deduplicated,
                "publishes": up.publishes, "publish_failures": up.publish_failures,
                "cache_bytes": self.cache.total, "corrupt_chunks": self.cache.corrupt_events,
                "open_handles": len(self.handles), "write_requests": self.write_requests,
                "read_requests": self.read_requests}


def check_name_or_raise(name: bytes) -> None:
    if len(name) > 255:
        raise FsError(errno.ENAMETOOLONG)
    try:
        check_name(name)
    except BadEntry:
        raise FsError(errno.EINVAL, f"invalid name {name!r}") from None
