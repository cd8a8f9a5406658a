"""The filesystem core: POSIX semantics over the namespace, staging, cache and store.

``Filesystem`` is FUSE-agnostic (mountpoint-s3's split): the FUSE adapter and the
control socket call it; it raises ``FsError`` with an errno.  Remote metadata steps
(mkdir, unlink, rename, publishing an entry) are awaited here; namespace changes that
belong together happen with no ``await`` between them.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import trio

from .errors import FsError
from .leases import LeaseManager
from .namespace import ROOT_INO, Inode, Namespace
from .oplog import MetaLog, OpDropped
from .procstat import Opener, died_unclean, holds_for_writing
from .profiles import Profiles
from .liveness import ChunkLiveness, GuardedStore
from .publisher import ChunkTracker, ChunkUploader, PublishQueue, chunk_list
from .remote import (MAX_CHUNK_SIZE, MAX_RDEV, SPECIAL_TYPES, TYPE_OF_BITS, XATTR_TOTAL_MAX,
                     BadEntry, Entry, KeyTooLong, check_key_fits, check_name,
                     check_xattr_name, decode_name, dir_prefix, entry_key, inode_key,
                     xattrs_size)
from .cache import ChunkCache
from .staging import Staging
from .store import NotFound, ObjectStore, PreconditionFailed, StoreClosed, StoreError

log = logging.getLogger(__name__)

RENAME_NOREPLACE = 1
MAX_STAGED_FRACTION = 0.5     # default --max-staged: this much of the free state space
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
    gc_settle: float = 600.0           # the store's (ckptfs.json), decision 0003
    readahead_kb: int = 1024           # kernel read-ahead of the mount's device
    writeback_cache: bool = False      # kernel write-back caching (experimental)
    rename_claim_ttl: float = 60.0     # a rename claim older than this was abandoned
    stale_wait: float = 2.0            # a slow listing is answered from local metadata
    # Formats whose structure is checked before a close publishes (formats.FORMATS).
    checkpoint_formats: tuple[str, ...] = ("torch", "safetensors", "npy", "pickle")
    lease_ttl: float = 30.0            # cluster seal leases (docs/decisions/0004)
    stale_staged_after: float = 600.0  # report a staged dir nobody writes or seals (stale.py)
    store_timeout: float = 60.0        # overall bound of one store call (store.RetryPolicy)
    stop_timeout: float = 600.0        # unmount/SIGTERM: wait this long for uploads
    max_staged: int | None = None      # async: closed, unuploaded bytes before writers wait


@dataclass
class Session:
    """A write session: the working version every writable handle of an inode on this
    node writes into, from the first writable open until a close that meant it
    (``flush``) makes it the inode's closed version, or until it is abandoned."""

    ver: int
    tracker: ChunkTracker
    handles: set[int] = field(default_factory=set)
    wrote: bool = False     # anything to publish (a write, O_TRUNC, a create)
    failed: int = 0         # errno of a failed write: this session never publishes


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
    session: Session | None = None          # writable handles: the session they joined
    # What a read-only handle reads until it closes (promise: a reader keeps the version
    # it opened): ("live",) the working/current content on this node; ("staging", ver)
    # a closed local version; ("chunks", chunks, size) a published version.
    snapshot: tuple = ("live",)


@dataclass
class Runtime:
    """In-memory state of an inode that is open or being published."""

    handles: set[int] = field(default_factory=set)
    writers: int = 0
    lock: trio.Lock = field(default_factory=trio.Lock)        # entry writes of the inode
    session_lock: trio.Lock = field(default_factory=trio.Lock)
    session: Session | None = None
    trackers: dict[int, ChunkTracker] = field(default_factory=dict)   # closed ver -> chunks sent
    refs: dict[int, int] = field(default_factory=dict)        # staging ver -> users
    page_version: object = None     # the version the kernel page cache may hold


class Filesystem:
    def __init__(self, ns: Namespace, store: ObjectStore, staging: Staging, cache: ChunkCache,
                 config: Config, nursery: trio.Nursery,
                 invalidate: Callable[[int], None] = lambda ino: None,
                 invalidate_entry: Callable[[int, bytes], Awaitable[None]] | None = None,
                 check_complete: Callable[[int, int], str | None] | None = None) -> None:
        self.ns = ns
        self.store = store
        self.staging = staging
        self.cache = cache
        self.config = config
        self.nursery = nursery
        self.invalidate = invalidate
        self.invalidate_entry = invalidate_entry
        self._stale_entries: list[tuple[int, bytes]] = []   # names to drop from the kernel
        # Structural check of a closed file (formats.check_complete): a reason if the
        # bytes are an incomplete checkpoint, None otherwise.
        self.check_complete = check_complete
        # ``major:minor`` of the mount, set by the daemon once mounted: lets flush ask
        # whether the opener still holds the file (procstat.holds_for_writing).
        self.mount_device: bytes | None = None
        self.handles: dict[int, Handle] = {}
        self.runtime: dict[int, Runtime] = {}
        self._next_fh = 1
        self.write_requests = 0
        self.read_requests = 0
        self._dir_mutations: dict[int, int] = {}
        self._refreshing: dict[int, trio.Event] = {}
        self._refresh_failed: dict[int, FsError] = {}
        self._refresh_started: dict[int, float] = {}
        self._serving_stale = False
        self._held_pointers: dict[int, set[int]] = {}   # pointer inode -> staged targets
        self._corrupt: dict[int, set[bytes]] = {}   # names whose store entry is corrupt
        self._busy_dirs: dict[int, int] = {}        # directories a rename is changing
        self.meta_limiter = trio.CapacityLimiter(16)
        self.observe: Callable[[str, float], None] = lambda what, seconds: None  # metrics
        self.after_seal: Callable[[Inode], None] = lambda inode: None
        self.last_write = 0.0
        # Entry PUTs go through the gc/dedup guard (decision 0003), whatever path makes them.
        self.liveness = ChunkLiveness(store, config.gc_settle, ns.known_chunks())
        self.store = GuardedStore(store, self.liveness)
        self.uploader = ChunkUploader(
            store, self.liveness, trio.CapacityLimiter(config.upload_concurrency),
            ns.chunk_mark,
            slot=self._background_slot if config.durability == "async" else None)
        self._trickle = trio.CapacityLimiter(1)
        # Async mode's metadata log (decision 0012) and the epochs of pending publishes.
        self.oplog = MetaLog(ns, on_done=self._meta_done)
        self._publish_epoch: dict[int, int] = {}
        self._recovered = trio.Event()     # set by start(): the log replays after recovery
        # Async mode: closed bytes not yet uploaded are bounded (writers wait past it).
        self.max_staged = config.max_staged or \
            int(shutil.disk_usage(staging.root).free * MAX_STAGED_FRACTION)
        self.writers_waiting = 0
        self._staged_bytes = (0.0, 0)          # (when counted, bytes)
        self.queue = PublishQueue(self._publish_from_queue, ready=self._publish_ready)
        self.leases = LeaseManager(ns, store, config.lease_ttl, self._writers,
                                   lambda ino: getattr(self.runtime.get(ino), "session", None)
                                   is not None,
                                   lambda ino: ino in self.queue.queued,
                                   self._seal_for_leases)
        if self._deferred():
            self.leases.open_wait = config.stale_wait

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The background workers: the publish queue and the metadata log."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.queue.run)
            await nursery.start(self.oplog.run, self._execute_meta)
            task_status.started()

    def _deferred(self) -> bool:
        """Async mode: metadata changes are local first, the store follows in order."""
        return self.config.durability == "async"

    def _meta_done(self) -> None:
        self.queue.release_parked()

    def _publish_ready(self, ino: int) -> bool:
        return self.oplog.done_through(self._publish_epoch.get(ino, 0))

    # ------------------------------------------------------------------ helpers

    def _rt(self, ino: int) -> Runtime:
        rt = self.runtime.get(ino)
        if rt is None:
            rt = self.runtime[ino] = Runtime()
        return rt

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
        if rt and not rt.handles and not rt.lock.locked() and not rt.refs \
                and rt.session is None and not rt.session_lock.locked() and not rt.trackers:
            del self.runtime[ino]

    def _touch_dir(self, ino: int) -> None:
        self._dir_mutations[ino] = self._dir_mutations.get(ino, 0) + 1

    def _dir(self, ino: int) -> Inode:
        inode = self.ns.get(ino)
        if inode.type != "dir":
            raise FsError(errno.ENOTDIR)
        return inode

    def _entry_of(self, inode: Inode) -> Entry:
        """The entry a name of ``inode`` has in its directory: the whole object, or for
        a hard-linked inode a "link" entry naming its shared inode object (0008)."""
        if inode.link_id:
            return Entry(type="link", mode=0, link=inode.link_id)
        return self._content_entry(inode)

    def _content_entry(self, inode: Inode) -> Entry:
        return Entry(type=inode.type, mode=inode.mode, uid=inode.uid, gid=inode.gid,
                     mtime_ns=inode.mtime_ns,
                     size=inode.published_size if inode.type == "file" else 0,
                     chunks=list(inode.chunks),
                     id=inode.dir_id, target=inode.target,
                     staged=inode.staged and inode.type == "dir",
                     rdev=inode.rdev, xattrs=dict(inode.xattrs),
                     nlink=max(1, inode.remote_nlink) if inode.link_id else 1,
                     sealed_at=inode.sealed_at)

    def nlink(self, inode: Inode) -> int:
        """st_nlink: a directory has 2 + its subdirectories; anything else its names."""
        if inode.type == "dir":
            return 2 + self.ns.subdirs(inode.ino)
        return inode.nlink

    async def _store(self, fn, *args, abandon_on_cancel: bool = False):
        async with self.meta_limiter:
            try:
                return await trio.to_thread.run_sync(fn, *args,
                                                     abandon_on_cancel=abandon_on_cancel)
            except (NotFound, PreconditionFailed):
                raise
            except StoreClosed as exc:   # unmounting: calls in flight are given up
                log.info("store call given up: %s", exc)
                raise FsError(errno.EIO, str(exc)) from None
            except StoreError as exc:
                log.error("store error: %s", exc)
                raise FsError(errno.EIO, str(exc)) from None

    def _key_of(self, inode: Inode) -> str:
        """Where ``inode``'s content entry lives: its shared inode object once it is
        hard-linked (decision 0008), else the entry of its name."""
        if inode.link_id:
            return inode_key(inode.link_id)
        return entry_key(self.ns.get(inode.parent).dir_id, inode.name)

    async def _put_entry(self, inode: Inode) -> None:
        if inode.link_id:
            await self._put_linked(inode)
            return
        parent = self.ns.get(inode.parent)
        key = entry_key(parent.dir_id, inode.name)
        etag = await self._store(self.store.put, key, self._entry_of(inode).to_json())
        inode.remote_etag = etag
        inode.published = True
        self.ns.save(inode)

    async def _put_linked(self, inode: Inode) -> None:
        """Publish a hard-linked inode: one PUT of its inode object (the content of
        every name at once), then — the first time — the link entries of its names."""
        key = inode_key(inode.link_id)
        if inode.links_pending and not inode.published:
            inode.remote_nlink = len(inode.names)
            etag = await self._store(self.store.put_if_absent, key,
                                     self._content_entry(inode).to_json())
            if not etag:
                raise FsError(errno.EIO, f"{key} exists already")
            inode.remote_etag = etag
            inode.published = True
            self.ns.save(inode)
        else:
            await self._rewrite_entry(inode)
        if inode.links_pending:
            body = self._entry_of(inode).to_json()
            for parent, name in inode.names:
                await self._store(self.store.put, entry_key(self.ns.get(parent).dir_id, name),
                                  body)
            inode.links_pending = False
            self.ns.save(inode)

    async def _change_nlink(self, inode: Inode, delta: int) -> None:
        """Count a name more or less in a hard-linked inode's object (compare-and-swap
        on its ETag); the object goes with its last name."""
        key = inode_key(inode.link_id)
        etag = inode.remote_etag
        for _ in range(8):
            if etag is None:
                try:
                    entry, etag = await self._current_entry(inode, key)
                except FsError as exc:
                    if exc.errno == errno.ENOENT and delta < 0:
                        return   # gone already
                    raise
                self._adopt_newer(inode, entry, etag)
            n = inode.remote_nlink + delta
            try:
                if n <= 0:
                    await self._store(functools.partial(self.store.delete, key, if_match=etag))
                    inode.remote_nlink, inode.remote_etag = 0, None
                else:
                    entry = self._content_entry(inode)
                    entry.nlink = n
                    inode.remote_etag = await self._store(
                        functools.partial(self.store.put, key, entry.to_json(),
                                          if_match=etag))
                    inode.remote_nlink = n
                self.ns.save(inode)
                return
            except PreconditionFailed:
                etag = None
        raise FsError(errno.EIO, f"{key} keeps changing; link count not changed")

    async def _make_linked(self, inode: Inode) -> None:
        """The first hard link of a published inode: its content moves into a shared
        inode object (written first, If-None-Match), then its name's entry becomes a
        link to it (If-Match the entry we read: a newer version another node
        published meanwhile is adopted first, never lost)."""
        key = entry_key(self.ns.get(inode.parent).dir_id, inode.name)
        for _ in range(8):
            entry, etag = await self._current_entry(inode, key, allow_link=True)
            if entry.claim_is_live(time.time(), self.config.rename_claim_ttl):
                raise FsError.enoent(f"{key} is being renamed by another node")
            if entry.type == "link":   # another node linked it meanwhile
                self._adopt_link(inode, entry.link)
                inode.remote_etag = None
                return
            self._adopt_newer(inode, entry, etag)
            link_id = uuid.uuid4().hex
            content = self._content_entry(inode)
            obj = inode_key(link_id)
            obj_etag = await self._store(self.store.put_if_absent, obj, content.to_json())
            try:
                await self._store(functools.partial(
                    self.store.put, key, Entry(type="link", mode=0, link=link_id).to_json(),
                    if_match=etag))
            except PreconditionFailed:
                await self._store(self.store.delete, obj)
                continue
            self.ns.set_link_id(inode, link_id)
            inode.remote_etag, inode.remote_nlink = obj_etag or None, 1
            self.ns.save(inode)
            return
        raise FsError(errno.EIO, f"{key} keeps changing; not linked")

    def _adopt_link(self, inode: Inode, link_id: str) -> None:
        self.ns.set_link_id(inode, link_id)

    # ------------------------------------------------------------------ remote listing

    async def refresh_dir(self, ino: int, force: bool = False) -> None:
        """Merge the store's listing of a directory into the namespace (TTL-limited).

        Stale is better than hung: when this node has listed the directory before and
        the store does not answer within ``stale_wait``, the caller goes on with what
        the node knows (said once in the log) while the refresh finishes in the
        background.  A directory never listed, or a ``force`` refresh (rmdir, rename
        over a directory), waits for the store and fails with its error."""
        inode = self._dir(ino)
        if not force and time.time() - inode.listed_at < self.config.metadata_ttl:
            return
        if self.oplog.is_busy(ino) or (not inode.published and ino != ROOT_INO):
            # Changes of this node are on their way to the store (oplog.py), or the
            # directory is not there yet: this node's view is the newer one.
            return
        event = self._refreshing.get(ino)
        if event is None:
            event = self._refreshing[ino] = trio.Event()
            self._refresh_started[ino] = trio.current_time()
            self.nursery.start_soon(self._refresh_in_background, ino, event)
        if force or not inode.listed_at:
            await event.wait()
            error = self._refresh_failed.get(ino)
            if error is not None:
                raise FsError(error.errno, error.reason)
            return
        # One wait per slow listing, not one per request: once a refresh has been
        # pending for ``stale_wait``, later requests answer at once.
        waited = trio.current_time() - self._refresh_started.get(ino, trio.current_time())
        with trio.move_on_after(max(0.0, self.config.stale_wait - waited)):
            await event.wait()
            return
        if not self._serving_stale:
            log.warning("the store is slow to list %s: answering from this node's metadata "
                        "(said once)", self._path_for_log(inode))
        self._serving_stale = True

    async def _refresh_in_background(self, ino: int, event: trio.Event) -> None:
        try:
            inode = self.ns.maybe_get(ino)
            if inode is not None and inode.type == "dir":
                await self._refresh_dir(inode)
            self._refresh_failed.pop(ino, None)
            self._serving_stale = False
        except FsError as exc:
            if ino not in self._refresh_failed:   # once per outage, not every TTL
                log.warning("listing directory inode %d failed: %s", ino, exc)
            self._refresh_failed[ino] = exc
        except Exception as exc:  # a background task must never take the daemon down
            self._refresh_failed[ino] = FsError(errno.EIO, str(exc))
            log.exception("listing inode %d failed", ino)
        finally:
            del self._refreshing[ino]
            self._refresh_started.pop(ino, None)
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
                fetched[name] = (Entry.from_json(body, MAX_CHUNK_SIZE), etag)
            except BadEntry as exc:
                log.error("corrupt entry %s: %s (EIO for that name)", key, exc)
                corrupt.add(name)

        async with trio.open_nursery() as nursery:
            for name, key in to_fetch:
                nursery.start_soon(fetch, name, key)
        await self._resolve_links(fetched, corrupt)
        # Apply: no await from here on.
        dir_inode = self.ns.get(dir_inode.ino)
        if not dir_inode.parent and dir_inode.ino != ROOT_INO:
            return
        changed_locally = (self._dir_mutations.get(dir_inode.ino, 0) != mutations
                           or dir_inode.ino in self._busy_dirs)
        local = dict(self.ns.children(dir_inode.ino))
        if not changed_locally:
            self._drop_hostile_dir_ids(dir_inode, fetched, remote, local, corrupt)
        for name, (entry, etag) in fetched.items():
            ino = local.get(name)
            if ino is None:
                if changed_locally:
                    continue
                holder = self._holder_of(entry)
                if holder is None:
                    self._adopt_entry(dir_inode.ino, name, entry, etag)
                    continue
                # Another name of a hard-linked inode this node knows already.
                self.ns.add_name(holder, dir_inode.ino, name)
                ino = holder.ino
            inode = self.ns.get(ino)
            if inode.dirty or self._writers(ino) or changed_locally or not inode.published:
                continue
            if inode.type != entry.type or (entry.type == "dir" and inode.dir_id != entry.id) \
                    or (inode.link_id != entry.link and
                        (inode.link_id is not None or self._holder_of(entry) is not None)):
                self._forget_subtree(inode, dir_inode.ino, name)
                holder = self._holder_of(entry)
                if holder is None:
                    self._adopt_entry(dir_inode.ino, name, entry, etag)
                    continue
                self.ns.add_name(holder, dir_inode.ino, name)
                inode = holder
                ino = holder.ino
            if entry.link and inode.link_id is None:   # another node linked it
                self.ns.set_link_id(inode, entry.link)
            inode.remote_nlink = entry.nlink if entry.link else 0
            content_changed = inode.chunks != entry.chunks
            inode.mode, inode.uid, inode.gid = entry.mode, entry.uid, entry.gid
            inode.mtime_ns, inode.chunks, inode.size = entry.mtime_ns, entry.chunks, entry.size
            inode.target, inode.remote_etag = entry.target, etag
            inode.rdev, inode.xattrs = entry.rdev, dict(entry.xattrs)
            inode.staged = entry.staged and entry.type == "dir"
            if inode.type == "symlink" and entry.target is not None:
                inode.size = len(entry.target)
            if content_changed and inode.local_copy:
                inode.local_copy = False
                self.cache.untrack_local(ino)
                self._drop_version_if_unused(ino, inode.ver)
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
                    self._forget_subtree(inode, dir_inode.ino, name)
        self._corrupt[dir_inode.ino] = corrupt
        dir_inode.listed_at = started
        self.ns.save(dir_inode)

    async def _resolve_links(self, fetched: dict[bytes, tuple[Entry, str]],
                             corrupt: set[bytes]) -> None:
        """Replace each fetched "link" entry by its shared inode object (one GET per
        object, decision 0008), with the object's ETag.  A link whose object is
        missing or malformed answers EIO for that name."""
        ids = {entry.link for entry, _ in fetched.values() if entry.type == "link"}
        objects: dict[str, tuple[Entry, str]] = {}

        async def fetch(link_id: str) -> None:
            key = inode_key(link_id)
            try:
                body, etag = await self._store(self.store.get, key)
            except (NotFound, FsError):
                return
            try:
                obj = Entry.from_json(body, MAX_CHUNK_SIZE)
                if obj.type in ("dir", "link"):
                    raise BadEntry(f"an inode object of type {obj.type}")
            except BadEntry as exc:
                log.error("corrupt inode object %s: %s", key, exc)
                return
            obj.link = link_id
            objects[link_id] = (obj, etag)

        async with trio.open_nursery() as nursery:
            for link_id in ids:
                nursery.start_soon(fetch, link_id)
        for name, (entry, _) in list(fetched.items()):
            if entry.type != "link":
                continue
            if entry.link in objects:
                fetched[name] = objects[entry.link]
            else:
                log.error("link %r names a missing inode object %s (EIO for that name)",
                          name, entry.link)
                corrupt.add(name)
                del fetched[name]

    def _holder_of(self, entry: Entry) -> Inode | None:
        """The inode this node holds, under another name, for a linked entry."""
        if not entry.link:
            return None
        ino = self.ns.ino_of_link_id(entry.link)
        holder = self.ns.maybe_get(ino) if ino is not None else None
        return holder if holder is not None and holder.parent else None

    def _drop_hostile_dir_ids(self, dir_inode: Inode, fetched: dict, remote: dict,
                              local: dict, corrupt: set[bytes]) -> None:
        """Directory ids must form a tree: an entry naming the id of this directory or
        of one of its ancestors (an endless tree), or an id another name of this
        listing already has (one directory twice), answers EIO for that name.  An id
        this node knows under a name elsewhere is a directory another node moved here:
        the old place is forgotten.  (Part of the apply phase: no await.)"""
        ancestors = set()
        cur = dir_inode
        while True:
            ancestors.add(cur.dir_id)
            if cur.ino == ROOT_INO or not cur.parent:
                break
            cur = self.ns.get(cur.parent)
        claimed: dict[str, bytes] = {}
        for name in sorted(fetched):
            entry, _ = fetched[name]
            if entry.type != "dir":
                continue
            reason = None
            if entry.id in ancestors:
                reason = "names its own ancestor (a directory loop)"
            elif entry.id in claimed:
                reason = f"has the same directory id as {claimed[entry.id]!r}"
            else:
                claimed[entry.id] = name
                holder = self.ns.ino_of_dir_id(entry.id)
                holder_inode = self.ns.maybe_get(holder) if holder is not None else None
                if holder_inode is not None and holder != local.get(name) \
                        and holder_inode.parent:
                    if holder_inode.parent == dir_inode.ino and holder_inode.name in remote:
                        # Both names listed: an alias, unless the other one is the
                        # claimed source of a rename to this name (decision 0006).
                        other = fetched.get(holder_inode.name)
                        if other is None or other[0].moving_to != \
                                entry_key(dir_inode.dir_id, name):
                            reason = f"has the same directory id as {holder_inode.name!r}"
                    elif holder_inode.parent != dir_inode.ino and \
                            not self._is_open(holder) and holder not in self._busy_dirs:
                        self._forget_subtree(holder_inode)   # moved here by another node
            if reason is not None:
                log.error("corrupt entry %r in %s: %s (EIO for that name)", name,
                          dir_prefix(dir_inode.dir_id), reason)
                corrupt.add(name)
                del fetched[name]

    def _adopt_entry(self, parent: int, name: bytes, entry: Entry, etag: str) -> Inode:
        size = len(entry.target) if entry.target is not None else entry.size
        return self.ns.new_inode(parent, name, entry.type, entry.mode, entry.uid, entry.gid,
                                 size=size, chunks=entry.chunks, published=True,
                                 remote_etag=etag, dir_id=entry.id, target=entry.target,
                                 mtime_ns=entry.mtime_ns, rdev=entry.rdev,
                                 xattrs=dict(entry.xattrs), link_id=entry.link,
                                 remote_nlink=entry.nlink if entry.link else 0,
                                 staged=entry.staged and entry.type == "dir",
                                 sealed_at=entry.sealed_at)

    def _forget_subtree(self, inode: Inode, parent: int | None = None,
                        name: bytes | None = None) -> None:
        """Drop a name that vanished from the store (another node removed it); by
        default the inode's first name.  What this node still has work for (dirty,
        open, queued, locked) stays; a hard-linked inode stays while it has a name."""
        if inode.type == "dir":
            for child_name, child in self.ns.children(inode.ino):
                child_inode = self.ns.get(child)
                if child_inode.dirty or self._is_open(child) or child in self.queue.queued:
                    continue
                self._forget_subtree(child_inode, inode.ino, child_name)
        if parent is None:
            parent, name = inode.parent, inode.name
        self.ns.unlink(inode, parent, name)
        if not inode.parent and not self._is_open(inode.ino):
            self._delete_inode(inode)
        self.invalidate(inode.ino)

    # ------------------------------------------------------------------ lookups

    async def lookup(self, parent: int, name: bytes) -> Inode:
        if len(name) > 255:
            raise FsError(errno.ENAMETOOLONG)
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
        if not self._deferred():
            return await self._mkdir_in_store(parent_inode, name, mode, uid, gid, dir_id)
        if not self.oplog.pending:
            # Async mode with nothing journaled ahead: try the store first, briefly, so
            # two nodes making one directory share it from the start (their leases
            # then guard its seal); local-first if the store does not answer.
            try:
                with trio.move_on_after(self.config.stale_wait):
                    return await self._mkdir_in_store(parent_inode, name, mode, uid, gid,
                                                      dir_id, abandon_on_cancel=True)
            except FsError as exc:
                if exc.errno != errno.EIO:
                    raise
        return await self._mkdir_local(parent_inode, name, mode, uid, gid, dir_id)

    async def _mkdir_in_store(self, parent_inode: Inode, name: bytes, mode: int, uid: int,
                              gid: int, dir_id: str, abandon_on_cancel: bool = False) -> Inode:
        parent = parent_inode.ino
        entry = Entry(type="dir", mode=mode & 0o7777, uid=uid, gid=gid, mtime_ns=time.time_ns(),
                      id=dir_id, staged=self.config.profiles.staged_on_create(name))
        key = entry_key(parent_inode.dir_id, name)
        created = await self._store(self.store.put_if_absent, key, entry.to_json(),
                                    abandon_on_cancel=abandon_on_cancel)
        etag = created or ""
        if not created:
            # Another node (or process) won the race: adopt its directory.
            try:
                body, etag = await self._store(self.store.get, key,
                                               abandon_on_cancel=abandon_on_cancel)
                entry = Entry.from_json(body, MAX_CHUNK_SIZE)
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

    async def _mkdir_local(self, parent: Inode, name: bytes, mode: int, uid: int,
                           gid: int, dir_id: str) -> Inode:
        """Async mode: the directory exists here at once; the store gets it in log
        order (``_exec_mkdir``)."""
        self._touch_dir(parent.ino)
        inode = self.ns.new_inode(parent.ino, name, "dir", mode & 0o7777, uid, gid,
                                  dir_id=dir_id, published=False,
                                  mtime_ns=time.time_ns(),
                                  staged=self.config.profiles.staged_on_create(name))
        self._mark_parent_changed(parent)
        self.oplog.add({"kind": "mkdir", "ino": inode.ino, "parent_id": parent.dir_id,
                        "name": name.hex()}, dirs=[parent.ino])
        await self._sync_journal()
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
        return await self._publish_new_name(inode, parent)

    async def _publish_new_name(self, inode: Inode, parent: int) -> Inode:
        """Put the entry of a name that has no data (symlink, special file, empty file):
        if the store refuses, the name goes again."""
        try:
            await self._put_entry(inode)
        except BaseException:
            self.ns.unlink(inode)
            self.ns.delete_inode(inode.ino)
            raise
        self._mark_parent_changed(self.ns.get(parent))
        return inode

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Inode:
        """A FIFO, device node or socket: a metadata-only entry (the kernel does their
        I/O itself); or, for S_IFREG, an empty regular file published at once."""
        check_name_or_raise(name)   # ENAMETOOLONG before anything about the type
        fmt = stat.S_IFMT(mode)
        kind = "file" if fmt == 0 else TYPE_OF_BITS.get(fmt)
        if kind != "file" and kind not in SPECIAL_TYPES:
            raise FsError(errno.EINVAL, f"mknod of file type {fmt:o}")
        if kind not in ("chr", "blk"):
            rdev = 0
        if not 0 <= rdev <= MAX_RDEV:
            raise FsError(errno.EINVAL, f"device number {rdev} out of range")
        await self._check_absent(parent, name)
        self._dir(parent)
        self._touch_dir(parent)
        inode = self.ns.new_inode(parent, name, kind, mode, uid, gid, rdev=rdev)
        return await self._publish_new_name(inode, parent)

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
        # A new name has no closed version until its writer's close: if the writer is
        # killed, the name goes again.
        inode = self.ns.new_inode(parent, name, "file", mode, uid, gid, max_ver=1)
        rt = self._rt(inode.ino)
        session = self._start_session(inode, rt, 1)
        self.staging.create_empty(inode.ino, 1)
        session.tracker.reset()
        session.wrote = True  # creating the file is a change worth publishing
        handle = self._new_handle(inode, opener, writable=True)
        await self.leases.writing(inode)
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
        return ("chunks", list(inode.chunks), inode.size)

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
        """(keep_cache, direct_io) for the kernel.  The page cache of an inode is shared
        by all its handles: a reader that opens a version other than the one the cache
        may hold drops it (no keep_cache), and while readers of two versions are open,
        the newer ones bypass it (direct_io) so each reads its own version."""
        rt = self._rt(handle.ino)
        if handle.writable or rt.session is not None or handle.snapshot[0] == "live":
            rt.page_version = None
            return False, False
        version = self._snapshot_key(handle)
        others = {self._snapshot_key(self.handles[fh]) for fh in rt.handles
                  if fh != handle.fh and fh in self.handles}
        if others - {version}:
            return False, True
        keep = rt.page_version == version
        rt.page_version = version
        return keep, False

    @staticmethod
    def _snapshot_key(handle: Handle) -> object:
        snap = handle.snapshot
        if snap[0] == "chunks":
            return ("chunks", tuple(sha for sha, _ in snap[1]))
        return snap[:2]   # ("staging", ver) or ("live",)

    def keep_cache(self, handle: Handle) -> bool:
        return self.open_flags(handle)[0]

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
        fd = self.staging.create_empty(inode.ino, ver)
        chunks = list(inode.chunks)
        offset = 0
        for sha, length in chunks:
            self.cache.pin(sha)
            try:
                path = await self.cache.ensure(sha, length)
                data = await trio.to_thread.run_sync(path.read_bytes)
            finally:
                self.cache.unpin(sha)
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

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handle(fh)
        inode = self.ns.get(handle.ino)
        snap = handle.snapshot
        if handle.writable or snap[0] == "live":
            rt = self._rt(inode.ino)
            if rt.session is not None:
                ver = rt.session.ver
            elif inode.dirty or inode.local_copy:
                ver = inode.ver
            else:
                return await self._read_remote(handle, list(inode.chunks), inode.size,
                                               offset, size)
            if offset >= inode.size:
                return b""
            return os.pread(self.staging.fd(inode.ino, ver), min(size, inode.size - offset),
                            offset)
        if snap[0] == "staging":
            if not inode.dirty and inode.ver == snap[1]:
                self.cache.touch_local(inode.ino)
            return os.pread(self.staging.fd(inode.ino, snap[1]), size, offset)
        return await self._read_remote(handle, snap[1], snap[2], offset, size)

    async def _read_remote(self, handle: Handle, chunks: list, total: int, offset: int,
                           size: int) -> bytes:
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
        return await self._read_chunks(chunks, total, offset, size, window)

    async def _read_chunks(self, chunks: list, total: int, offset: int, size: int,
                           window: int = 1) -> bytes:
        end = min(offset + size, total)
        if offset >= end:
            return b""
        wanted = []
        pos = 0
        for index, (sha, length) in enumerate(chunks):
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
            for sha, length in chunks[last_index + 1:last_index + 1 + window]:
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
        self.last_write = time.monotonic()
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
                await trio.sleep(0.05)
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
        """Every ``close()`` of a descriptor.  The working version becomes the file's
        closed version only at a close its writer meant (DESIGN.md promise 2): not a
        killed or failing writer's, not a forked child's or a subprocess's copy while
        the opener still holds the file, not a structurally incomplete checkpoint."""
        handle = self._handle(fh)
        if not handle.writable:
            return
        rt = self._rt(handle.ino)
        session = handle.session
        if session is None or rt.session is not session:
            return  # that version was closed (or abandoned) by an earlier close
        inode = self.ns.get(handle.ino)
        if session.failed:
            self._abandon(inode, "a write on it failed", keep=False)
            await self.drop_stale_entries()
            # Report the write's own error again at close (as NFS does), e.g. ENOSPC.
            raise FsError(session.failed, "not published: an earlier write failed")
        if died_unclean(handle.opener):
            if len(session.handles) > 1:
                return  # other handles still write: their close decides
            log.warning("writer %d of %s was killed; nothing published",
                        handle.opener.tgid, self._path_for_log(inode))
            self._abandon(inode, "its writer was killed")
            await self.drop_stale_entries()
            return
        if self._opener_still_holds(handle):
            return  # a copy's close (fork, subprocess, dup): the opener's close decides
        if len(session.handles) > 1:
            return  # another open writable handle: the last one's close decides
        if not session.wrote:
            self._end_session_unchanged(inode, rt, session)
            return
        size = self.staging.size(inode.ino, session.ver)
        reason = await self._incomplete_reason(inode, session.ver, size)
        if rt.session is not session:
            return
        if reason is not None:
            log.error("%s not published: incomplete %s", self._path_for_log(inode), reason)
            self._abandon(inode, f"it is incomplete ({reason})")
            await self.drop_stale_entries()
            raise FsError(errno.EIO, f"incomplete checkpoint file: {reason}")
        self._commit(inode, rt, session, size)
        self._hold_pointer(inode)
        if self.config.durability == "async":
            self._journal_publish(inode)
            self._seals_after_close(inode, wait=False)
            await self._sync_journal()
            return
        await self.publish_now(inode.ino)
        await self._seals_after_close(inode, wait=True)
        if inode.ino in self._held_pointers:
            self._release_pointers()
            if inode.ino not in self._held_pointers:
                await self.publish_now(inode.ino)   # its checkpoint sealed at once

    # A pointer file (`latest`, a Ray snapshot, ...) naming a checkpoint directory whose
    # seal is still pending (another node's writers hold leases on it) is held back: a
    # loader that follows the pointer by name must not reach an incomplete checkpoint.
    # It publishes (in the background) once every directory it names is sealed or gone.

    def _hold_pointer(self, inode: Inode) -> None:
        targets = {t for t in self._seal_targets(inode) if t != inode.parent}
        if targets:
            self._held_pointers[inode.ino] = targets
            self._persist_held_pointers()

    def _release_pointers(self) -> None:
        released = []
        for ptr, targets in list(self._held_pointers.items()):
            for t in list(targets):
                target = self.ns.maybe_get(t)
                if target is None or not target.parent or not target.staged:
                    targets.discard(t)
            if not targets:
                del self._held_pointers[ptr]
                released.append(ptr)
        if not released:
            return
        self._persist_held_pointers()
        for ptr in released:
            inode = self.ns.maybe_get(ptr)
            if inode is not None and inode.dirty and inode.parent:
                self._journal_publish(inode)

    def _persist_held_pointers(self) -> None:
        self.ns.meta_put("held_pointers", json.dumps(
            {str(k): sorted(v) for k, v in self._held_pointers.items()}))

    def _restore_held_pointers(self) -> None:
        raw = self.ns.meta_get("held_pointers")
        if raw:
            self._held_pointers = {int(k): set(v) for k, v in json.loads(raw).items()}

    async def drop_stale_entries(self) -> None:
        """Tell the kernel to forget names this node removed by itself (a killed
        writer's new file), before the request that removed them returns: re-creating
        the name at once must not meet a cached dentry of the dead inode."""
        while self._stale_entries:
            parent, name = self._stale_entries.pop()
            if self.invalidate_entry is not None:
                await self.invalidate_entry(parent, name)

    def _opener_still_holds(self, handle: Handle) -> bool:
        if self.mount_device is None:
            return False
        return holds_for_writing(handle.opener.tgid, handle.ino, self.mount_device)

    async def _incomplete_reason(self, inode: Inode, ver: int, size: int) -> str | None:
        if self.check_complete is None or size == 0:
            return None
        fd = self.staging.fd(inode.ino, ver)
        return await trio.to_thread.run_sync(self.check_complete, fd, size)

    def _commit(self, inode: Inode, rt: Runtime, session: Session, size: int) -> None:
        """The working version becomes the closed version (no await: one step)."""
        old = inode.ver if (inode.dirty or inode.local_copy) else None
        rt.trackers.pop(inode.ver, None)
        inode.ver = session.ver
        inode.dirty = True
        inode.local_copy = True
        inode.size = size
        self.cache.untrack_local(inode.ino)
        rt.session = None
        rt.trackers[session.ver] = session.tracker
        self.ns.save(inode)
        if old is not None and old != inode.ver:
            self._drop_version_if_unused(inode.ino, old)
        self.invalidate(inode.ino)

    def _end_session_unchanged(self, inode: Inode, rt: Runtime, session: Session) -> None:
        """Opened for writing, nothing written: the closed version stays as it was."""
        rt.session = None
        self.staging.remove(inode.ino, session.ver)
        self._restore_size(inode)

    def _restore_size(self, inode: Inode) -> None:
        if inode.dirty or inode.local_copy:
            try:
                inode.size = self.staging.size(inode.ino, inode.ver)
            except FsError:
                inode.size = inode.published_size
        else:
            inode.size = inode.published_size
        self.ns.save(inode)

    async def fsync(self, fh: int, datasync: bool) -> None:
        """Durability of the bytes written so far, never a publish: the name changes at
        the close (sync: the chunks are in the store; async: staged on local disk)."""
        handle = self._handle(fh)
        if not handle.writable:
            return
        session = handle.session
        rt = self._rt(handle.ino)
        if session is None or rt.session is not session:
            return
        if session.failed:
            raise FsError(session.failed, "an earlier write failed")
        fd = self.staging.fd(handle.ino, session.ver)
        await trio.to_thread.run_sync(os.fsync, fd)
        await self._sync_journal()
        if self.config.durability == "sync":
            size = self.staging.size(handle.ino, session.ver)
            self._ref(rt, session.ver)
            try:
                await chunk_list(self.uploader, session.tracker,
                                 self.staging.path(handle.ino, session.ver), size,
                                 self.config.chunk_size)
            except StoreError as exc:
                raise FsError(errno.EIO, f"upload failed: {exc}") from None
            finally:
                self._unref(handle.ino, rt, session.ver)

    def _journal_publish(self, inode: Inode) -> None:
        if inode.ino in self._held_pointers:
            return   # published when the checkpoints it names are sealed
        if inode.ino not in self.queue.queued:
            epoch = self._publish_epoch[inode.ino] = self.oplog.epoch()
            self.ns.publish_pending_add(inode.ino, epoch)
        self.queue.submit(inode.ino)
        self._staged_bytes = (0.0, 0)     # counted again at the next write

    async def _sync_journal(self) -> None:
        """Make the journal durable against a power cut (fsync of LMDB, in a thread)."""
        await trio.to_thread.run_sync(self.ns.sync)

    def _abandon(self, inode: Inode, why: str, keep: bool = True) -> None:
        """Keep a working version out of sight: move its staging file aside (for
        ``ckptfs gc``; dropped at once when ``keep`` is false, e.g. after ENOSPC) and
        show the last closed version again, or nothing if there never was one."""
        rt = self._rt(inode.ino)
        session = rt.session
        if session is None:
            return
        self.leases.abandoned(inode)
        rt.session = None
        if keep:
            kept = self.staging.abandon(inode.ino, session.ver)
            log.warning("%s left unpublished because %s; staged bytes kept at %s",
                        self._path_for_log(inode), why, kept)
        else:
            self.staging.remove(inode.ino, session.ver)
            log.warning("%s left unpublished because %s", self._path_for_log(inode), why)
        for fh in session.handles:
            handle = self.handles.get(fh)
            if handle is not None:
                handle.wrote = False
        if inode.published or inode.dirty:
            self._restore_size(inode)
        elif inode.parent:
            for parent, name in inode.names:   # every name: it never had a closed version
                self._touch_dir(parent)
                self._stale_entries.append((parent, name))
            self.ns.unlink(inode, all_names=True)
        self.invalidate(inode.ino)

    def _path_for_log(self, inode: Inode) -> str:
        try:
            return self.ns.path_of(inode.ino).decode(errors="replace")
        except FsError:
            return f"<inode {inode.ino}>"

    async def publish_now(self, ino: int) -> None:
        """Upload a closed version's chunks and write its entry; on failure, queue a
        retry and raise EIO."""
        if ino in self._held_pointers:
            return   # a pointer waits for the checkpoints it names
        try:
            for _ in range(3):
                if await self._publish(ino):
                    return
            # Closed again meanwhile: keep it queued so nothing closed is left behind.
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
        self._journal_done_publish(ino)
        return True

    def _journal_done_publish(self, ino: int) -> None:
        self.ns.publish_pending_done(ino)
        self._publish_epoch.pop(ino, None)

    async def _publish(self, ino: int) -> bool:
        """Publish the inode's closed version.  True when the inode is clean afterwards;
        False when a newer version was closed while uploading (nothing was written to
        the store then: the caller publishes again)."""
        inode = self.ns.maybe_get(ino)
        if inode is None or not inode.dirty or not inode.parent:
            self._forget_trackers(ino)
            return True
        rt = self._rt(ino)
        started = time.monotonic()
        ver = inode.ver
        tracker = rt.trackers.get(ver)
        self._ref(rt, ver)
        try:
            size = self.staging.size(ino, ver)
            chunks = await chunk_list(self.uploader, tracker, self.staging.path(ino, ver),
                                      size, self.config.chunk_size)
        except StoreError as exc:
            self.uploader.stats.publish_failures += 1
            raise FsError(errno.EIO, f"upload failed: {exc}") from None
        except OSError as exc:
            self.uploader.stats.publish_failures += 1
            raise FsError(exc.errno or errno.EIO, f"upload failed: {exc}") from None
        finally:
            self._unref(ino, rt, ver)
        rt = self._rt(ino)
        async with rt.lock:
            inode = self.ns.maybe_get(ino)
            if inode is None or not inode.parent or not inode.dirty:
                rt.trackers.clear()
                return True
            if inode.ver != ver:
                log.debug("inode %d closed again while uploading; publishing again", ino)
                return False
            previous = inode.chunks
            inode.chunks = chunks
            try:
                await self._put_entry(inode)
            except BaseException:
                inode.chunks = previous
                self.uploader.stats.publish_failures += 1
                raise
            inode.dirty = False
            rt.trackers.pop(ver, None)
            inode.local_copy = self.staging.exists(ino, ver)
            if inode.local_copy and rt.session is None:
                self.cache.track_local(ino, size)
            self.ns.save(inode)
        await self.cache.collect()
        self.uploader.stats.publishes += 1
        self.observe("publish", time.monotonic() - started)
        log.debug("published inode %d (%d bytes) in %.3fs", ino, size, time.monotonic() - started)
        self._drop_rt(ino)
        self.leases.settle(ino)
        return True

    def _forget_trackers(self, ino: int) -> None:
        rt = self.runtime.get(ino)
        if rt is not None:
            rt.trackers.clear()
            self._drop_rt(ino)

    async def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is None:
            return
        rt = self._rt(handle.ino)
        rt.handles.discard(fh)
        inode = self.ns.maybe_get(handle.ino)
        if handle.writable:
            rt.writers -= 1
            session = handle.session
            if session is not None:
                session.handles.discard(fh)
                if rt.session is session and not session.handles and inode is not None:
                    # No close meant it (every flush passed it on): never published.
                    self._abandon(inode, "no writer closed it for good")
                    await self.drop_stale_entries()
        elif handle.snapshot[0] == "staging":
            self._unref(handle.ino, rt, handle.snapshot[1])
        if not rt.handles and inode is not None:
            if not inode.parent:
                self._delete_inode(inode)
            elif inode.dirty and inode.ino not in self.queue.queued and handle.wrote \
                    and rt.session is None:
                # Closed but not yet published (e.g. the publish failed): keep trying.
                self._journal_publish(inode)
        self._drop_rt(handle.ino)
        self.leases.settle(handle.ino)

    def _delete_inode(self, inode: Inode) -> None:
        self.cache.untrack_local(inode.ino)
        rt = self.runtime.get(inode.ino)
        if rt is not None:
            rt.trackers.clear()
        for ino, ver in self.staging.versions():
            if ino == inode.ino and not (rt and (rt.refs.get(ver) or
                                                 (rt.session and rt.session.ver == ver))):
                self.staging.remove(ino, ver)
        self.ns.delete_inode(inode.ino)
        self.queue.discard(inode.ino)
        if self._held_pointers:
            self._held_pointers.pop(inode.ino, None)
            self._release_pointers()
        self._journal_done_publish(inode.ino)
        self.leases.settle(inode.ino)

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
            await self._set_size(inode, size)
        rt = self._rt(ino)
        async with rt.lock:
            inode = self.ns.get(ino)
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
            # Attributes ride with the next publish of a closed version; a working
            # version is never published by a metadata change.
            metadata = mode is not None or uid is not None or gid is not None \
                or mtime_ns is not None
            if metadata and inode.published and not inode.dirty and inode.parent \
                    and ino != ROOT_INO:
                await self._rewrite_entry(inode)
        self._drop_rt(ino)
        inode = self.ns.get(ino)
        if inode.dirty and self.config.durability == "sync" and rt.session is None \
                and ino not in self.queue.queued:
            await self.publish_now(ino)
        return inode

    # ------------------------------------------------------------------ extended attributes

    def getxattr(self, ino: int, name: bytes) -> bytes:
        value = self.ns.get(ino).xattrs.get(name)
        if value is None:
            raise FsError(errno.ENODATA)
        return value

    def listxattr(self, ino: int) -> list[bytes]:
        return sorted(self.ns.get(ino).xattrs)

    async def setxattr(self, ino: int, name: bytes, value: bytes | None) -> None:
        """Set (or with ``value`` None remove) a ``user.*`` attribute.  It is kept with
        the entry and published like a chmod: at once for a published entry, else with
        the next publish of the file's closed version."""
        if not name.startswith(b"user."):
            raise FsError(errno.ENOTSUP, "only user.* extended attributes are stored")
        try:
            check_xattr_name(name)
        except BadEntry:
            raise FsError(errno.EINVAL, f"invalid attribute name {name!r}") from None
        if ino == ROOT_INO:
            raise FsError(errno.ENOTSUP, "the root directory has no entry to keep them in")
        rt = self._rt(ino)
        async with rt.lock:
            inode = self.ns.get(ino)
            before = dict(inode.xattrs)
            after = dict(before)
            if value is None:
                if after.pop(name, None) is None:
                    raise FsError(errno.ENODATA)
            else:
                after[name] = bytes(value)
                if xattrs_size(after) > XATTR_TOTAL_MAX:
                    raise FsError(errno.ENOSPC, f"extended attributes over "
                                                f"{XATTR_TOTAL_MAX} bytes")
            inode.xattrs = after
            inode.ctime_ns = time.time_ns()
            self.ns.save(inode)
            if inode.published and not inode.dirty and inode.parent:
                try:
                    await self._rewrite_entry(inode)
                except BaseException:
                    inode = self.ns.get(ino)
                    inode.xattrs = before
                    self.ns.save(inode)
                    raise
        self._drop_rt(ino)

    async def _set_size(self, inode: Inode, size: int) -> None:
        """truncate/ftruncate: inside an open write session it changes the working
        version; otherwise it is a whole change of its own (a new closed version)."""
        rt = self._rt(inode.ino)
        if rt.session is not None:
            self._truncate_session(inode, rt.session, size)
            return
        if size == inode.size and not inode.dirty:
            return
        session = await self._join_session(inode, truncate=(size == 0))
        inode = self.ns.get(inode.ino)
        if rt.session is not session:
            return
        if size:
            try:
                self._truncate_session(inode, session, size)
            except FsError:
                if not session.handles and rt.session is session:
                    self._end_session_unchanged(inode, rt, session)
                raise
        session.wrote = True
        if session.handles:
            return  # a writer joined meanwhile: its close publishes
        self._commit(inode, rt, session, size)
        if self.config.durability == "async":
            self._journal_publish(inode)
        else:
            await self.publish_now(inode.ino)

    # ------------------------------------------------------------------ removing names

    async def unlink(self, parent: int, name: bytes) -> None:
        inode = await self.lookup(parent, name)
        if inode.type == "dir":
            raise FsError(errno.EISDIR)
        await self._remove(inode, parent, name)
        if self._deferred():
            await self._sync_journal()

    async def rmdir(self, parent: int, name: bytes) -> None:
        inode = await self.lookup(parent, name)
        if inode.type != "dir":
            raise FsError(errno.ENOTDIR)
        await self.refresh_dir(inode.ino, force=not self._deferred())
        if self.ns.has_children(inode.ino):
            raise FsError(errno.ENOTEMPTY)
        await self._remove(inode, parent, name)
        if self._deferred():
            await self._sync_journal()

    async def _remove(self, inode: Inode, parent_ino: int, name: bytes) -> None:
        # Under the inode's lock: an entry PUT in flight (a publish) lands first, then
        # its key is deleted here, instead of landing after and resurrecting the name.
        rt = self._rt(inode.ino)
        async with rt.lock:
            inode = self.ns.get(inode.ino)
            if self.ns.lookup(parent_ino, name) != inode.ino:
                return
            parent = self.ns.get(parent_ino)
            if inode.published and not inode.links_pending and self._deferred() \
                    and not inode.link_id:
                self._log_delete(inode, parent, name)
            elif inode.published and not inode.links_pending:
                await self._store(self.store.delete, entry_key(parent.dir_id, name))
                if inode.link_id:
                    await self._change_nlink(inode, -1)
            self._touch_dir(parent.ino)
            self.ns.unlink(inode, parent_ino, name)
            self._mark_parent_changed(parent)
        self._drop_rt(inode.ino)
        if not inode.parent and not self._is_open(inode.ino):
            self._delete_inode(inode)

    def _log_delete(self, inode: Inode, parent: Inode, name: bytes) -> None:
        """Async mode: the store's entry of a removed name goes in log order, if it is
        still the object this node removed (``_exec_delete``)."""
        self.oplog.add({"kind": "delete", "ino": inode.ino, "parent_id": parent.dir_id,
                        "name": name.hex(), **self._identity(inode)}, dirs=[parent.ino])

    def _identity(self, inode: Inode) -> dict:
        """What tells that the store's entry of a name is still ``inode``'s, whatever
        this node rewrote or moved meanwhile: a directory's id, else the content."""
        return {"ident": entry_identity(self._content_entry(inode))}

    # ------------------------------------------------------------------ hard links

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        """A further name for a non-directory (decision 0008).  The first link moves
        the content into a shared inode object; each name is a "link" entry to it."""
        check_name_or_raise(new_name)
        inode = self.ns.get(ino)
        if inode.type == "dir":
            raise FsError(errno.EPERM, "hard links to directories")
        await self._check_absent(new_parent, new_name)
        new_dir = self._dir(new_parent)
        rt = self._rt(ino)
        async with rt.lock:
            inode = self.ns.get(ino)
            if not inode.parent:
                raise FsError.enoent("the file was removed")
            if self.ns.lookup(new_parent, new_name) is not None:
                raise FsError(errno.EEXIST)
            if inode.published and not inode.links_pending:
                if not inode.link_id:
                    await self._make_linked(inode)
                await self._change_nlink(inode, +1)
                key = entry_key(new_dir.dir_id, new_name)
                created = await self._store(self.store.put_if_absent, key,
                                            self._entry_of(inode).to_json())
                if not created:
                    await self._change_nlink(inode, -1)
                    raise FsError(errno.EEXIST)
            else:
                # Not published yet (a first version still being written, or queued in
                # async mode): its first publish writes the object and every name.
                if not inode.link_id:
                    self.ns.set_link_id(inode, uuid.uuid4().hex)
                inode.links_pending = True
            self._touch_dir(new_parent)
            self.ns.add_name(inode, new_parent, new_name)
            self._mark_parent_changed(self.ns.get(new_parent))
        self._drop_rt(ino)
        return self.ns.get(ino)

    # ------------------------------------------------------------------ rename

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     flags: int) -> None:
        if flags & RENAME_EXCHANGE:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EINVAL, "RENAME_EXCHANGE with RENAME_NOREPLACE")
            await self._exchange(old_parent, old_name, new_parent, new_name)
            return
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
                await self.refresh_dir(target.ino, force=not self._deferred())
                if self.ns.has_children(target.ino):
                    raise FsError(errno.ENOTEMPTY)
        if self._deferred() and not inode.link_id and \
                not (target is not None and target.link_id):
            await self._rename_local(inode, old_parent, old_name, new_parent, new_name)
            return
        if inode.type == "dir":
            # The renamed tree must appear complete: let its pending uploads land first.
            await self._wait_uploads_under(inode.ino)
        # Renaming a staged directory seals it, unless other nodes still write below it
        # (leases): then it moves, stays staged, and its seal is pending (0004).
        seals = inode.type != "dir" or not inode.staged or await self.leases.may_seal(inode.ino)
        # A listing of either directory applied while the two store steps are under way
        # would see the old name gone and forget it: mark both busy until the move.
        with self._dirs_busy({old_parent, new_parent}):
            await self._rename_locked(inode, new_dir, new_parent, new_name, target, seals,
                                      old=(old_parent, old_name))
        self._drop_rt(inode.ino)
        # A completion mark written as a temp file and renamed into place (DCP's
        # .metadata) seals like a mark closed in place.
        if inode.type == "file" and not inode.dirty:
            await self._seals_after_close(inode, wait=True)
        elif inode.type == "file" and not self._writers(inode.ino):
            self._seals_after_close(inode, wait=False)

    async def _rename_local(self, inode: Inode, old_parent: int, old_name: bytes,
                            new_parent: int, new_name: bytes) -> None:
        """Async mode: the rename happens here at once and never waits for uploads; the
        store follows in log order (``_exec_move``), after the uploads below a renamed
        directory, so other nodes see the tree complete under its new name.  Renaming a
        staged directory seals it there, when the cluster allows (leases)."""
        target_ino = self.ns.lookup(new_parent, new_name)
        # The moved inode needs no lock: its record is applied after whatever store step
        # of it is in flight, and looks at the store then.  The replaced one's publish
        # in flight lands first, so the record knows to delete it.
        inos = [target_ino] if target_ino is not None and target_ino != inode.ino else []
        async with AsyncExitStack() as locks:
            for ino in inos:
                await locks.enter_async_context(self._rt(ino).lock)
            inode = self.ns.get(inode.ino)
            if not inode.parent or self.ns.lookup(old_parent, old_name) != inode.ino:
                raise FsError.enoent("removed while renaming")
            if self.ns.lookup(new_parent, new_name) != target_ino:
                raise FsError(errno.EAGAIN, "the target changed while renaming")
            old_dir, new_dir = self.ns.get(old_parent), self._dir(new_parent)
            record = {"kind": "move", "ino": inode.ino, "parent_id": old_dir.dir_id,
                      "name": old_name.hex(), "to_id": new_dir.dir_id,
                      "to_name": new_name.hex(), "type": inode.type,
                      "seals": inode.type == "dir" and inode.staged,
                      **self._identity(inode), "replaced": None}
            target_ino = self.ns.lookup(new_parent, new_name)
            if target_ino is not None and target_ino != inode.ino:
                replaced = self.ns.get(target_ino)
                if replaced.published:
                    record["replaced"] = self._identity(replaced)
                self.ns.unlink(replaced, new_parent, new_name)
                if not replaced.parent and not self._is_open(replaced.ino):
                    self._delete_inode(replaced)
            self._touch_dir(old_parent)
            self._touch_dir(new_parent)
            self.ns.move(inode, new_parent, new_name, old=(old_parent, old_name))
            self._mark_parent_changed(old_dir)
            if new_parent != old_parent:
                self._mark_parent_changed(self.ns.get(new_parent))
            self.oplog.add(record, dirs=[old_parent, new_parent])
        for ino in inos + [inode.ino]:
            self._drop_rt(ino)
        await self._sync_journal()
        if inode.type == "file" and not self._writers(inode.ino):
            self._seals_after_close(inode, wait=False)

    async def _exchange(self, a_parent: int, a_name: bytes, b_parent: int,
                        b_name: bytes) -> None:
        """RENAME_EXCHANGE: two existing names trade their objects.  Both entries are
        claimed as in a rename (decision 0006), the swap is journaled, then each key
        gets the other's entry (If-Match its claim)."""
        a = await self.lookup(a_parent, a_name)
        b = await self.lookup(b_parent, b_name)
        self._dir(a_parent)
        self._dir(b_parent)
        if a.ino == b.ino:
            return
        for moving, dest in ((a, b_parent), (b, a_parent)):
            if moving.type != "dir":
                continue
            ancestor = dest
            while ancestor != ROOT_INO:
                if ancestor == moving.ino:
                    raise FsError(errno.EINVAL, "cannot move a directory into itself")
                ancestor = self.ns.get(ancestor).parent
        for inode in (a, b):
            if inode.type == "dir":
                await self._wait_uploads_under(inode.ino)
        with self._dirs_busy({a_parent, b_parent}):
            async with AsyncExitStack() as locks:
                for ino in sorted((a.ino, b.ino)):
                    await locks.enter_async_context(self._rt(ino).lock)
                a, b = self.ns.get(a.ino), self.ns.get(b.ino)
                if self.ns.lookup(a_parent, a_name) != a.ino or \
                        self.ns.lookup(b_parent, b_name) != b.ino:
                    raise FsError.enoent("changed while exchanging")
                key_a = entry_key(self.ns.get(a_parent).dir_id, a_name)
                key_b = entry_key(self.ns.get(b_parent).dir_id, b_name)
                a_remote = a.published and not a.links_pending
                b_remote = b.published and not b.links_pending
                claim_a = await self._claim(a, key_a, key_b) if a_remote else None
                try:
                    claim_b = await self._claim(b, key_b, key_a) if b_remote else None
                except BaseException:
                    if claim_a is not None:   # give the first name back its entry
                        with trio.CancelScope(shield=True):
                            await self._put_quietly(key_a, self._entry_of(a), claim_a)
                    raise
                steps = [(key_b, self._entry_of(a).to_json().decode() if a_remote
                          else None, claim_b),
                         (key_a, self._entry_of(b).to_json().decode() if b_remote
                          else None, claim_a)]
                seq = self.ns.journal_add({"op": "exchange", "steps": steps})
                await self._sync_journal()
                await self._finish_exchange(steps)
                self.ns.journal_done(seq)
                self.ns.exchange(a, (a_parent, a_name), b, (b_parent, b_name))
                for ino in (a.ino, b.ino):
                    inode = self.ns.get(ino)
                    if inode.published and not inode.link_id:
                        inode.remote_etag = None   # read again before the next rewrite
                        self.ns.save(inode)
                self._mark_parent_changed(self.ns.get(a_parent))
                if b_parent != a_parent:
                    self._mark_parent_changed(self.ns.get(b_parent))
        self._drop_rt(a.ino)
        self._drop_rt(b.ino)

    async def _finish_exchange(self, steps: list) -> None:
        """Write each key's new entry (or delete it when its new object was never
        published), conditional on our claim; also the journal replay."""
        for key, body, claim in steps:
            try:
                if body is not None:
                    await self._store(functools.partial(self.store.put, key, body.encode(),
                                                        if_match=claim))
                elif claim is not None:
                    await self._store(functools.partial(self.store.delete, key,
                                                        if_match=claim))
            except PreconditionFailed:
                log.warning("%s was written again by another node during an exchange: "
                            "that newer version stays", key)

    async def _put_quietly(self, key: str, entry: Entry, if_match: str) -> None:
        try:
            await self._store(functools.partial(self.store.put, key, entry.to_json(),
                                                if_match=if_match))
        except (FsError, PreconditionFailed) as exc:
            log.warning("could not release the claim on %s (%s): it expires", key, exc)

    @contextmanager
    def _dirs_busy(self, dirs: set[int]):
        """Directories a rename is changing: a listing applied while its store steps
        are under way would see a name gone and forget it, so refresh leaves them alone
        (and sees them changed afterwards)."""
        for d in dirs:
            self._busy_dirs[d] = self._busy_dirs.get(d, 0) + 1
        try:
            yield
        finally:
            for d in dirs:
                self._busy_dirs[d] -= 1
                if not self._busy_dirs[d]:
                    del self._busy_dirs[d]
                self._touch_dir(d)

    async def _rename_locked(self, inode: Inode, new_dir: Inode, new_parent: int,
                             new_name: bytes, target: Inode | None, seals: bool = True,
                             old: tuple[int, bytes] | None = None) -> None:
        """The store steps and the namespace move, under the locks of the renamed inode
        and of the one it replaces (a publish of either finishes first), taken in inode
        order so two crossing renames cannot deadlock."""
        inos = sorted({inode.ino} | ({target.ino} if target is not None else set()))
        async with AsyncExitStack() as locks:
            for ino in inos:
                await locks.enter_async_context(self._rt(ino).lock)
            inode = self.ns.get(inode.ino)
            old = old or (inode.parent, inode.name)
            if not inode.parent or self.ns.lookup(*old) != inode.ino:
                raise FsError.enoent("removed while renaming")
            old_dir = self.ns.get(old[0])
            old_key = entry_key(old_dir.dir_id, old[1])
            new_key = entry_key(new_dir.dir_id, new_name)
            target_remote = target is not None and target.published and \
                not target.links_pending
            if inode.published and not inode.links_pending:
                await self._move_entry(inode, old_key, new_key, seals)
            elif target_remote:
                await self._store(self.store.delete, new_key)
            if target_remote and target.link_id:
                # The replaced name was one link of a shared inode: count it out.
                await self._change_nlink(self.ns.get(target.ino), -1)
            inode.staged = inode.staged and not seals  # a rename seals a staged directory
            target_ino = self.ns.lookup(new_parent, new_name)
            if target_ino is not None and target_ino != inode.ino:
                replaced = self.ns.get(target_ino)
                self.ns.unlink(replaced, new_parent, new_name)
                if not replaced.parent and not self._is_open(replaced.ino):
                    self._delete_inode(replaced)
            self.ns.move(inode, new_parent, new_name, old=old)
            self._mark_parent_changed(old_dir)
            if new_parent != old_dir.ino:
                self._mark_parent_changed(self.ns.get(new_parent))
        if target is not None:
            self._drop_rt(target.ino)

    async def _move_entry(self, inode: Inode, old_key: str, new_key: str,
                          seals: bool = True) -> None:
        """Move a published entry between keys, safe against other nodes (decision
        0003): read the entry as the store has it, *claim* it with a compare-and-swap on
        its ETag (of two nodes renaming it, one wins; the other gets ENOENT), write it
        under the new key, then delete the old key only if it is still our claim (a
        newer version another node wrote there meanwhile stays)."""
        claim_etag = await self._claim(inode, old_key, new_key)
        moved = self._entry_of(inode)
        moved.staged = moved.staged and not seals
        body = moved.to_json()
        # Journal the rest: a crash from here on is finished on restart, so a reader may
        # briefly see both names, never neither.
        seq = self.ns.journal_add({"op": "rename", "put": new_key, "body": body.decode(),
                                   "delete": old_key, "claim": claim_etag})
        await self._sync_journal()
        try:
            new_etag = await self._store(self.store.put, new_key, body)
        except BaseException:
            self.ns.journal_done(seq)  # the claim expires; the old name stays valid
            raise
        await self._delete_claimed(old_key, claim_etag)
        self.ns.journal_done(seq)
        if not inode.link_id:   # a linked inode's ETag is its inode object's
            inode.remote_etag = new_etag

    async def _claim(self, inode: Inode, old_key: str, new_key: str) -> str:
        """Steps 1-2 of decision 0006: read the entry at ``old_key``, adopt a newer
        version, and mark it as moving to ``new_key`` (compare-and-swap).  Returns the
        claim's ETag."""
        for _ in range(8):
            entry, etag = await self._current_entry(inode, old_key)
            if entry.claim_is_live(time.time(), self.config.rename_claim_ttl):
                raise FsError.enoent(f"{old_key} is being renamed by another node")
            if not inode.link_id:
                self._adopt_newer(inode, entry, etag)
            claim = self._entry_of(inode)
            claim.moving_to, claim.moving_at = new_key, time.time()
            try:
                return await self._store(
                    functools.partial(self.store.put, old_key, claim.to_json(),
                                      if_match=etag))
            except PreconditionFailed:
                continue  # changed under us: read it again
        raise FsError(errno.EIO, f"{old_key} keeps changing; rename not done")

    async def _delete_claimed(self, old_key: str, claim_etag: str) -> None:
        try:
            await self._store(functools.partial(self.store.delete, old_key,
                                                if_match=claim_etag))
        except PreconditionFailed:
            log.info("%s was written again by another node during a rename: that newer "
                     "version stays under the old name", old_key)

    async def _current_entry(self, inode: Inode, key: str,
                             allow_link: bool = False) -> tuple[Entry, str]:
        """The store's entry for a name this node has, checked to be the same object
        (a directory with the same id, an entry of the same type, a link to the same
        inode object; with ``allow_link`` any link, for an inode not linked here yet)."""
        try:
            body, etag = await self._store(self.store.get, key)
        except NotFound:
            self._touch_dir(inode.parent)
            raise FsError.enoent(f"{key} was renamed or removed by another node") from None
        try:
            entry = Entry.from_json(body, MAX_CHUNK_SIZE)
        except BadEntry as exc:
            raise FsError(errno.EIO, f"corrupt entry {key}: {exc}") from None
        if entry.type == "link":
            if (inode.link_id and entry.link == inode.link_id) or \
                    (allow_link and not inode.link_id):
                return entry, etag
            self._touch_dir(inode.parent)
            raise FsError.enoent(f"{key} now names another object")
        if entry.type != inode.type or (inode.type == "dir" and entry.id != inode.dir_id):
            self._touch_dir(inode.parent)
            raise FsError.enoent(f"{key} now names another object")
        return entry, etag

    def _adopt_newer(self, inode: Inode, entry: Entry, etag: str) -> None:
        """Take the store's version of a file another node published after our view of
        it (never move or rewrite a stale version).  A version closed here and not yet
        published stays: its publish comes later and is the newest."""
        if etag == inode.remote_etag:
            return
        inode.remote_etag = etag
        if inode.link_id:
            inode.remote_nlink = entry.nlink
        if inode.type == "file" and not inode.dirty and inode.chunks != entry.chunks:
            inode.chunks, inode.size = list(entry.chunks), entry.size
            inode.mtime_ns = entry.mtime_ns
            if inode.local_copy:
                inode.local_copy = False
                self.cache.untrack_local(inode.ino)
                self._drop_version_if_unused(inode.ino, inode.ver)
            self.invalidate(inode.ino)
        self.ns.save(inode)

    async def _rewrite_entry(self, inode: Inode, key: str | None = None) -> None:
        """Rewrite a published entry's metadata (attributes, seal) as a compare-and-swap
        on the ETag we know: if another node changed it meanwhile we take its version
        and apply ours again; if it was renamed or removed, ENOENT — never resurrect an
        old name, never overwrite a newer file version with a stale one."""
        key = key or self._key_of(inode)
        etag = inode.remote_etag
        for _ in range(8):
            if etag is None:
                entry, etag = await self._current_entry(inode, key)
                if entry.claim_is_live(time.time(), self.config.rename_claim_ttl):
                    raise FsError.enoent(f"{key} is being renamed by another node")
                self._adopt_newer(inode, entry, etag)
            try:
                inode.remote_etag = await self._store(
                    functools.partial(self.store.put, key,
                                      self._content_entry(inode).to_json(), if_match=etag))
                inode.published = True
                self.ns.save(inode)
                return
            except PreconditionFailed:
                etag = None
        raise FsError(errno.EIO, f"{key} keeps changing; not rewritten")

    def _evict_local_copy(self, ino: int) -> bool:
        inode = self.ns.maybe_get(ino)
        if inode is None:
            return True
        if inode.dirty or self._is_open(ino) or ino in self.queue.queued:
            return False
        inode.local_copy = False
        self.ns.save(inode)
        self._drop_version_if_unused(ino, inode.ver)
        return True

    # ------------------------------------------------------------------ recovery

    async def start(self) -> None:
        """Finish an earlier run's work and account its local copies in the cache.

        A working version that was open for writing when the daemon stopped was never
        closed: it is abandoned (kept under ``abandoned/``), and a name that had no
        closed version at all goes, so nothing unclosed can be published later."""
        self.cache.evict_local = self._evict_local_copy
        closed: set[tuple[int, int]] = set()
        for inode in self.ns.all_inodes():
            if inode.type != "file":
                continue
            if inode.dirty or inode.local_copy:
                if self.staging.exists(inode.ino, inode.ver):
                    closed.add((inode.ino, inode.ver))
                    if not inode.dirty:
                        self.cache.track_local(inode.ino,
                                               self.staging.size(inode.ino, inode.ver))
                    self._restore_size(inode)
                    continue
                if inode.dirty:
                    log.error("closed version of %s is missing from staging",
                              self._path_for_log(inode))
                inode.dirty = inode.local_copy = False
            if not inode.published and inode.parent:
                log.warning("%s was open for writing when the daemon stopped and never "
                            "closed: removed", self._path_for_log(inode))
                self.ns.unlink(inode, all_names=True)
            self._restore_size(inode)
        for ino, ver in self.staging.versions():
            if (ino, ver) not in closed:
                kept = self.staging.abandon(ino, ver)
                log.warning("staging version %d.%d was open for writing when the daemon "
                            "stopped: not published, kept at %s", ino, ver, kept)
        await self.replay_journal()
        self._recovered.set()

    async def replay_journal(self) -> None:
        """Finish what a previous run of the daemon started (DESIGN.md "Recovery")."""
        self._restore_held_pointers()
        self._release_pointers()
        for ino, epoch in self.ns.publish_pending().items():
            inode = self.ns.maybe_get(ino)
            if inode is None or not inode.dirty or \
                    not self.staging.exists(inode.ino, inode.ver):
                self.ns.publish_pending_done(ino)
                continue
            self._publish_epoch[ino] = epoch
            self.queue.submit(ino)
        for seq, record in self.ns.journal():
            op = record.get("op")
            if op == "rename":
                await self._store(self.store.put, record["put"], record["body"].encode())
                if record.get("claim"):
                    await self._delete_claimed(record["delete"], record["claim"])
                else:
                    await self._store(self.store.delete, record["delete"])
                self.ns.journal_done(seq)
                log.info("finished an interrupted rename to %s", record["put"])
            elif op == "exchange":
                await self._finish_exchange(record["steps"])
                self.ns.journal_done(seq)
                log.info("finished an interrupted exchange")
            elif op == "meta":
                continue   # async mode's metadata log: its own worker replays it
            elif op == "publish":   # written by versions before the pending index
                self.ns.journal_done(seq)
                inode = self.ns.maybe_get(record["ino"])
                if inode is not None and inode.dirty and \
                        self.staging.exists(inode.ino, inode.ver):
                    self.ns.publish_pending_add(inode.ino)
                    self.queue.submit(inode.ino)
            else:
                log.error("unknown journal record %r dropped", record)
                self.ns.journal_done(seq)

    # ------------------------------------------------------------------ sealing

    def _seals_after_close(self, inode: Inode, wait: bool):
        """Seal what a closed completion mark or pointer file completes.  With ``wait``
        returns an awaitable that seals now; otherwise seals in the background once the
        pending publishes below the directory are done (async durability)."""
        unknown: list[bytes] = []
        targets = self._seal_targets(inode, unknown)
        for name in unknown:
            # Made by another node since this one listed the parent (a Ray worker's
            # checkpoint, recorded by the controller here): look, then seal.
            self.nursery.start_soon(self._seal_pointed_later, inode.parent, name)
        if wait:
            async def seal_all() -> None:
                for ino in targets:
                    await self.seal(ino)
            return seal_all()
        for ino in targets:
            self.nursery.start_soon(self._seal_in_background, ino)
        return None

    def _seal_targets(self, inode: Inode, unknown: list[bytes] | None = None) -> list[int]:
        """Staged directories a closed mark or pointer seals; names a pointer gives that
        this node does not know go to ``unknown``."""
        if inode.type != "file" or not inode.parent:
            return []
        profiles = self.config.profiles
        parent = self.ns.get(inode.parent)
        targets = []
        if parent.staged and profiles.is_mark_for(parent.name, inode.name):
            targets.append(parent.ino)
        limit = profiles.pointer_size_limit(inode.name)   # 0: not a pointer
        if limit and inode.size <= limit:
            try:
                with open(self.staging.path(inode.ino, inode.ver), "rb") as f:
                    content = f.read(limit)
            except (OSError, FsError):
                content = b""
            for name in profiles.pointed_names(inode.name, content):
                ino = self.ns.lookup(parent.ino, name)
                if ino is None:
                    if unknown is not None:
                        unknown.append(name)
                elif self.ns.get(ino).staged:
                    targets.append(ino)
        return targets

    async def _seal_pointed_later(self, parent: int, name: bytes) -> None:
        try:
            await self.refresh_dir(parent, force=True)
        except FsError as exc:
            log.warning("pointer names %r: listing its directory failed (%s)", name, exc)
            return
        ino = self.ns.lookup(parent, name)
        if ino is not None and self.ns.get(ino).staged:
            await self._seal_in_background(ino)

    def _pending_under(self, dir_ino: int, inos=None) -> bool:
        for ino in self.queue.queued if inos is None else inos:
            cur = self.ns.maybe_get(ino)
            while cur is not None and cur.parent and cur.ino != ROOT_INO:
                if cur.parent == dir_ino:
                    return True
                cur = self.ns.maybe_get(cur.parent)
        return False

    async def _wait_uploads_under(self, dir_ino: int) -> None:
        """Until every closed file below a directory is in the store (a sealed or
        renamed tree appears complete).  An upload that failed for good below it makes
        the tree incomplete for good: EIO, never a wait without end."""
        while True:
            if self._pending_under(dir_ino, list(self.queue.failed)):
                raise FsError(errno.EIO, "a file below failed to upload for good (see "
                                         "`ckptfs status`): the tree is incomplete")
            if not self._pending_under(dir_ino, self.queue.active()):
                return
            await trio.sleep(0.05)

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
        started = time.monotonic()
        inode = self.ns.get(ino)
        if inode.type != "dir":
            raise FsError(errno.ENOTDIR)
        if self._deferred():
            return await self._seal_later(inode)
        if not await self.leases.may_seal(ino):
            return False  # other nodes still write below it: pending (leases.py)
        await self._wait_uploads_under(ino)
        rt = self._rt(ino)
        async with rt.lock:
            inode = self.ns.get(ino)
            if not inode.staged or not inode.parent:
                return False
            inode.staged, inode.sealed_at = False, time.time()
            try:
                await self._rewrite_entry(inode)
            except BaseException:
                inode.staged = True
                self.ns.save(inode)
                raise
        self._drop_rt(ino)
        self._sealed(inode)
        self.observe("seal", time.monotonic() - started)
        return True

    async def _seal_for_leases(self, ino: int) -> bool:
        """A pending seal's retry (leases.py): True only once sealed.  In async mode it
        journals a seal record and answers False: the pending seal stays until the
        record finds the way clear and seals (or records it pending again)."""
        sealed = await self.seal(ino)
        return sealed and not self._deferred()

    def _sealed(self, inode: Inode) -> None:
        self._touch_dir(inode.parent)
        log.info("sealed %s", self._path_for_log(inode))
        self.after_seal(inode)          # retention (retention.py)
        self.invalidate(inode.parent)
        self._release_pointers()

    async def _seal_later(self, inode: Inode) -> bool:
        """Async mode: journal the seal; the store gets it in log order, after every
        upload below the directory (``_exec_seal``).  True if a seal is on its way."""
        if not inode.staged or not inode.parent:
            return False
        if self._pending_under(inode.ino, list(self.queue.failed)):
            raise FsError(errno.EIO, "a file below failed to upload for good (see "
                                     "`ckptfs status`): the tree is incomplete")
        if not self.oplog.pending_of("seal", inode.ino):
            parent = self.ns.get(inode.parent)
            self.oplog.add({"kind": "seal", "ino": inode.ino, "parent_id": parent.dir_id,
                            "name": inode.name.hex()}, dirs=[inode.parent])
            await self._sync_journal()
        return True

    # ------------------------------------------------------------------ the metadata log

    async def _execute_meta(self, seq: int, record: dict) -> None:
        """Apply one record of the metadata log to the store (oplog.py)."""
        await self._recovered.wait()
        kind = record.get("kind")
        if kind == "mkdir":
            await self._exec_mkdir(record)
        elif kind == "move":
            await self._exec_move(seq, record)
        elif kind == "delete":
            await self._delete_if_same(self._logged_key(record), record.get("ident"))
        elif kind == "seal":
            await self._exec_seal(seq, record)
        else:
            raise OpDropped(f"unknown record kind {kind!r}")

    def _logged_key(self, record: dict, dir_field: str = "parent_id",
                    name_field: str = "name") -> str:
        return entry_key(self.oplog.resolve(record[dir_field]),
                         bytes.fromhex(record[name_field]))

    async def _exec_mkdir(self, record: dict) -> None:
        ino = record["ino"]
        key = self._logged_key(record)
        async with self._rt(ino).lock:      # an rmdir meanwhile waits, then sees it
            inode = self.ns.maybe_get(ino)
            if inode is None or inode.type != "dir" or inode.published or not inode.parent:
                return   # removed here before it reached the store: nothing to create
            created = await self._store(self.store.put_if_absent, key,
                                        self._content_entry(inode).to_json())
            if created is not None:
                inode.published, inode.remote_etag = True, created
                inode.listed_at = time.time()
                self.ns.save(inode)
            else:
                await self._join_dir(inode, key)
        self._drop_rt(ino)

    async def _join_dir(self, inode: Inode, key: str) -> None:
        """The name was taken in the store meanwhile (two ranks' ``makedirs``, or this
        node's own put before a restart): a directory there is joined, with its id."""
        try:
            body, etag = await self._store(self.store.get, key)
        except NotFound:
            raise FsError(errno.EIO, f"{key} vanished while creating it") from None
        try:
            other = Entry.from_json(body, MAX_CHUNK_SIZE)
        except BadEntry as exc:
            raise OpDropped(f"the store's entry {key} is corrupt ({exc})") from None
        if other.type != "dir":
            raise OpDropped(f"another node made {key} a {other.type}; this directory "
                            f"stays on this node only")
        old_id = inode.dir_id
        if other.id != old_id:
            log.info("%s was created by another node too: joined its directory",
                     self._path_for_log(inode))
            await self.leases.dir_id_changed(inode.ino, other.id)
            self.oplog.alias(old_id, other.id)
            self.ns.change_dir_id(inode, other.id)
            inode.staged = other.staged
        inode.published, inode.remote_etag, inode.listed_at = True, etag, 0.0
        self.ns.save(inode)
        if other.id != old_id:
            await self._rehome_children(inode, old_id)

    async def _rehome_children(self, inode: Inode, old_id: str) -> None:
        """Entries already published under a joined directory's old id move to its
        new one (files renamed into it before it reached the store)."""
        for name, child in self.ns.children(inode.ino):
            async with self._rt(child).lock:
                child_inode = self.ns.maybe_get(child)
                if child_inode is None or not child_inode.published:
                    continue
                old_key = entry_key(old_id, name)
                try:
                    body, _ = await self._store(self.store.get, old_key)
                except NotFound:
                    continue
                new_etag = await self._store(self.store.put, entry_key(inode.dir_id, name),
                                             body)
                await self._store(self.store.delete, old_key)
                if not child_inode.link_id:
                    child_inode.remote_etag = new_etag
                    self.ns.save(child_inode)
            self._drop_rt(child)

    async def _wait_publishes_before(self, seq: int, dir_ino: int) -> None:
        """Until the uploads below a directory closed before record ``seq`` are in the
        store (failed-for-good ones excepted: they never will be)."""
        while True:
            older = [ino for ino in self.queue.active()
                     if self._publish_epoch.get(ino, 0) < seq]
            if not self._pending_under(dir_ino, older):
                return
            await trio.sleep(0.05)

    async def _exec_move(self, seq: int, record: dict) -> None:
        ino = record["ino"]
        old_key = self._logged_key(record)
        new_key = self._logged_key(record, "to_id", "to_name")
        replaced = (record.get("replaced") or {}).get("ident")
        if record.get("type") == "dir":
            await self._wait_publishes_before(seq, ino)
        inode = self.ns.maybe_get(ino)
        if inode is None or not inode.parent or inode.link_id:
            # Removed here since: what the store has under the old name goes (its
            # delete, later in the log, looks under the name it had then).
            await self._delete_if_same(old_key, record.get("ident"))
            await self._delete_if_same(new_key, replaced)
            return
        seals = bool(record.get("seals")) and inode.staged and \
            not self._pending_under(ino, list(self.queue.failed))
        if seals and not await self.leases.may_seal(ino):
            seals = False    # other nodes still write below it: pending (leases.py)
        async with self._rt(ino).lock:
            inode = self.ns.get(ino)
            try:
                await self._move_entry(inode, old_key, new_key, seals)
            except FsError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                # Not in the store under its old name (never published there, or
                # another node moved it): its own publish writes the new name.
                log.debug("move %s -> %s: %s", old_key, new_key, exc.reason)
                seals = False
                await self._delete_if_same(new_key, replaced)
            if seals:
                inode.staged = False
            self.ns.save(inode)
        self._drop_rt(ino)
        if seals:
            self._sealed(inode)

    async def _delete_if_same(self, key: str, ident: str | None) -> None:
        """Delete the entry under ``key`` if it still holds the object ``ident`` names
        (compare-and-swap on its ETag); a newer object there stays."""
        if not ident:
            return
        for _ in range(8):
            try:
                body, etag = await self._store(self.store.get, key)
            except NotFound:
                return
            try:
                entry = Entry.from_json(body, MAX_CHUNK_SIZE)
            except BadEntry:
                return    # not ours to judge: left for gc and the log
            if entry_identity(entry) != ident:
                log.info("%s holds another object now: left as it is", key)
                return
            try:
                await self._store(functools.partial(self.store.delete, key, if_match=etag))
                return
            except PreconditionFailed:
                continue
        raise FsError(errno.EIO, f"{key} keeps changing; not deleted")

    async def _exec_seal(self, seq: int, record: dict) -> None:
        started = time.monotonic()
        ino = record["ino"]
        await self._wait_publishes_before(seq, ino)
        inode = self.ns.maybe_get(ino)
        if inode is None or not inode.parent or not inode.staged or inode.type != "dir":
            return
        if self._pending_under(ino, list(self.queue.failed)):
            raise OpDropped("a file below failed to upload for good: it stays unsealed")
        if not await self.leases.may_seal(ino):
            return   # other nodes still write below it: pending (leases.py)
        key = self._logged_key(record)
        async with self._rt(ino).lock:
            inode = self.ns.get(ino)
            if not inode.staged or not inode.parent:
                return
            inode.staged, inode.sealed_at = False, time.time()
            try:
                await self._rewrite_entry(inode, key)
            except BaseException as exc:
                inode.staged = True
                self.ns.save(inode)
                if isinstance(exc, FsError) and exc.errno == errno.ENOENT:
                    raise OpDropped(exc.reason) from None
                raise
        self._drop_rt(ino)
        self._sealed(inode)
        self.observe("seal", time.monotonic() - started)

    # ------------------------------------------------------------------ prefetch

    async def resolve(self, relative: bytes) -> Inode:
        inode = self.ns.get(ROOT_INO)
        for part in relative.split(b"/"):
            if part in (b"", b"."):
                continue
            inode = await self.lookup(inode.ino, part)
        return inode

    async def files_under(self, inode: Inode, prefix: bytes = b"") -> list[tuple[bytes, Inode]]:
        """Every file below ``inode`` (a walk without recursion: a deep or hostile tree
        cannot exhaust the stack; each directory id is visited once)."""
        out: list[tuple[bytes, Inode]] = []
        stack = [(prefix, inode)]
        seen: set[str] = set()
        while stack:
            path, node = stack.pop()
            if node.type == "file":
                out.append((path, node))
            elif node.type == "dir" and node.dir_id not in seen:
                seen.add(node.dir_id)
                for name, child in reversed(await self.listdir(node.ino)):
                    stack.append((path + b"/" + name if path else name, child))
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
        """Closed files not yet in the store (pointers held for their checkpoint too),
        and metadata changes on their way (async mode)."""
        return len(self.queue.queued | set(self._held_pointers)) + len(self.oplog.pending)

    def unfinished(self) -> int:
        """Work still to reach the store that is not failed for good."""
        return len(self.queue.active()) + len(self.oplog.pending)

    async def wait_idle(self) -> None:
        while self.unfinished():
            await self.queue.wait_idle()
            await self.oplog.wait_idle()

    def is_writing(self, ino: int) -> bool:
        """An open writer, or a pending upload, for this inode on this node."""
        return bool(self._writers(ino)) or ino in self.queue.queued

    def state_of(self, ino: int) -> str:
        inode = self.ns.get(ino)
        if inode.ino in self.queue.queued:
            return "uploading"
        rt = self.runtime.get(ino)
        if inode.dirty or (rt is not None and rt.session is not None):
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
                "pending_metadata": len(self.oplog.pending),
                "staged_bytes": self.staged_bytes(), "max_staged": self.max_staged,
                "writers_waiting_for_uploads": self.writers_waiting,
                "failing_metadata": {str(k): v for k, v in self.oplog.failing.items()},
                "chunks_uploaded": up.chunks_uploaded,
                "chunks_deduplicated": up.chunks_deduplicated,
                "bytes_uploaded": up.bytes_uploaded,
                "bytes_deduplicated": up.bytes_deduplicated,
                "publishes": up.publishes, "publish_failures": up.publish_failures,
                "cache_bytes": self.cache.total, "corrupt_chunks": self.cache.corrupt_events,
                "open_handles": len(self.handles), "write_requests": self.write_requests,
                "read_requests": self.read_requests}


def entry_identity(entry: Entry) -> str:
    """A directory's id; for anything else a digest of what it holds (type, chunks,
    size, link target, device): the same after a rename or a mode change, different
    after another version was published."""
    if entry.type == "dir":
        return f"dir:{entry.id}"
    what = json.dumps([entry.type, entry.chunks, entry.size, entry.target, entry.rdev,
                       entry.link], default=str)
    return f"{entry.type}:{hashlib.sha256(what.encode()).hexdigest()}"


def check_name_or_raise(name: bytes) -> None:
    if len(name) > 255:
        raise FsError(errno.ENAMETOOLONG)
    try:
        check_name(name)
        check_key_fits("0" * 32, name)       # as long as a directory id gets
    except KeyTooLong as exc:
        raise FsError(errno.ENAMETOOLONG, str(exc)) from None
    except BadEntry:
        raise FsError(errno.EINVAL, f"invalid name {name!r}") from None
