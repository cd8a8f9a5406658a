"""Shared state of the filesystem core: the mount's ``Config``; per-inode runtime state
(open handles, writers, the per-inode lock and its drop rule, write sessions and their
versions); handles; directory change marks; ``CoreState``, the tables the concerns share
and the collaborators they all use, with the small helpers every concern uses.
Must not know FUSE or any concern of the core (they know it)."""

from __future__ import annotations

import errno
import logging
import math
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from ..errors import FsError
from ..format.remote import allocated_bytes
from ..meta.journalsync import JournalSync
from ..meta.namespace import Inode, Namespace
from ..procstat import MountTables, Opener, died_unclean, locked_in_kernel
from ..format.profiles import Profiles
from ..data.upload import ChunkTracker
from .chunkmap import ChunkMap

if TYPE_CHECKING:
    from ..cluster.leases import LeaseManager
    from ..data.cache import ChunkCache
    from ..data.guarded_store import GuardedStore
    from ..data.liveness import ChunkLiveness
    from ..data.publish_queue import PublishQueue
    from ..data.staging import Staging
    from ..data.upload import UploadGate, ChunkUploader
    from ..meta.oplog import MetaLog
    from ..store.health import StoreHealth

log = logging.getLogger(__name__)


RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
MAX_STAGED_FRACTION = 0.5     # default --max-staged: this much of the free state space

# What ``Inode.attrs_unsent`` names: attributes a write keeps as this node's when it meets
# another node's newer entry (a file new here, by O_EXCL or a rename, keeps them all).
ALL_ATTRIBUTES = ("mode", "owner", "mtime", "xattrs")


class DirMarks:
    """What refresh checks before applying a listing (its apply phase has no await, the
    listing and fetches before it do): a directory's local *change count*, bumped by
    every local change, and its *busy* count, held while a rename's store steps are
    under way (a listing taken meanwhile would see a name gone and forget it)."""

    def __init__(self) -> None:
        self._changes: dict[int, int] = {}
        self._busy: dict[int, int] = {}
        self._touched_at: dict[int, float] = {}     # monotonic time of the last change

    def touch(self, ino: int) -> None:
        self._changes[ino] = self._changes.get(ino, 0) + 1
        self._touched_at[ino] = time.monotonic()

    def changed_within(self, ino: int, seconds: float) -> bool:
        """Did this node change the directory less than ``seconds`` ago?"""
        return time.monotonic() - self._touched_at.get(ino, -math.inf) < seconds

    def changes(self, ino: int) -> int:
        return self._changes.get(ino, 0)

    def is_busy(self, ino: int) -> bool:
        return ino in self._busy

    @contextmanager
    def busy(self, dirs: set[int]):
        """Mark ``dirs`` busy for the block; they count as changed afterwards."""
        for d in dirs:
            self._busy[d] = self._busy.get(d, 0) + 1
        try:
            yield
        finally:
            for d in dirs:
                self._busy[d] -= 1
                if not self._busy[d]:
                    del self._busy[d]
                self.touch(d)


class CompletenessCheck(Protocol):
    """Structural check of a closed file (``format.checkpoints.check_complete`` with the
    mount's formats): the reason its bytes are an incomplete checkpoint, or None."""

    def __call__(self, fd: int, size: int, name: bytes | None = None) -> str | None: ...


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
    passthrough: str = "auto"          # kernel passthrough of new files' writes, or "off"
    rename_claim_ttl: float = 60.0     # a rename claim older than this was abandoned
    stale_wait: float = 2.0            # a slow listing is answered from local metadata
    # Formats whose structure is checked before a close publishes (formats.FORMATS).
    checkpoint_formats: tuple[str, ...] = ("torch", "safetensors", "npy", "pickle")
    lease_ttl: float = 30.0            # cluster seal leases (docs/decisions/0004)
    stale_staged_after: float = 600.0  # report a staged dir nobody writes or seals (stale.py)
    store_timeout: float = 60.0        # overall bound of one store call (store.RetryPolicy)
    stop_timeout: float = 600.0        # unmount/SIGTERM: wait this long for uploads
    max_staged: int | None = None      # async: closed, unuploaded bytes before writers wait
    upload_hold: float = 10.0          # async: uploads wait this long for a writer to pause
    chunk_hash: str = "blake3"         # how new chunks are named (format/chunkid.py)



def dir_id_of(inode: Inode) -> str:
    """The id a directory's entries live under.  Every directory has one (the type says
    ``str | None`` because files have none); a directory without one is EIO, never a
    key under ``dirs/None/``."""
    if inode.dir_id is None:
        raise FsError(errno.EIO, f"inode {inode.ino} has no directory id")
    return inode.dir_id


def link_id_of(inode: Inode) -> str:
    """The shared inode object's id of a hard-linked file (decision 0008); EIO without."""
    if inode.link_id is None:
        raise FsError(errno.EIO, f"inode {inode.ino} has no link id")
    return inode.link_id


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
    # The last flush was a close its writer meant, passed on to another handle (the
    # opener held another descriptor, or another writable handle was open): a process
    # that exits holding the file twice flushes both before either is released, so its
    # last release decides then (``Publish.release``).
    meant: bool = False
    # Another writer's close meant it and passed it on (not a copy's close): if the last
    # writer is then killed, that close still stands (``Publish._flush``).
    meant_by_writer: bool = False
    through_kernel: bool = False    # a writer of it was passthrough: the kernel wrote it
    # (size, mtime_ns) of its staging file when it became the closed version, if the
    # kernel wrote it: a descriptor or mapping that outlives the close may write on
    # into that file, which the daemon never sees (``Release._written_after_close``).
    closed_stat: tuple[int, int] | None = None


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
    warmed_next: bool = False   # the next file's first chunks were fetched ahead
    session: Session | None = None          # writable handles: the session they joined
    # What a read-only handle reads until it closes (promise: a reader keeps the version
    # it opened): ("live",) the working/current content on this node; ("staging", ver)
    # a closed local version; ("chunks", ChunkMap, size) a published version.
    snapshot: tuple = ("live",)
    # ("live",) reading a published version: (its chunk list, its ChunkMap), kept until
    # the list is replaced (core/read.py).
    live_chunks: tuple | None = None
    # What the kernel was told at open (core/write.py ``_cache_flags``).
    keep_cache: bool = False
    direct_io: bool = False
    # The kernel writes this handle's bytes straight to its staging file (passthrough,
    # core/opening.py ``decide_passthrough``): no write request reaches the daemon.
    passthrough: bool = False


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
    passthrough: int = 0      # open handles the kernel serves from a staging file itself
    passthrough_ver: int | None = None      # ... that staging file's version


# Inodes whose page-cache version is remembered after their last close (core/write.py).
PAGE_VERSIONS_KEPT = 65536
# A file saved over beside readers again and again moves on each time: how many of
# those moves an attribute change through an old reader's descriptor follows.
MOVES_FOLLOWED = 64
# A write through the kernel (passthrough) that fails never reaches the daemon: the only
# failure it can see is the staging file system's own (ENOSPC). Passthrough starts only
# with this much free there, and a passthrough version whose close finds less than
# STAGING_FULL_MARGIN free is taken as one whose writes may have failed: never published
# (decision 0019).
PASSTHROUGH_MIN_FREE = 16 << 20
STAGING_FULL_MARGIN = 4 << 20


class CoreState:
    """The tables every concern of the core shares, and the collaborators they all use.

    Shared: ``handles`` (open handles by fh), ``runtime`` (per-inode runtime),
    ``dir_marks``, ``_held_pointers`` (pointer inode -> staged targets), ``_publish_epoch``
    (inode -> metadata-log epoch its publish must follow).  Collaborators: the namespace,
    staging, cache, the guarded store, the chunk liveness and uploader, the upload gate,
    the store's health, the metadata log, the publish queue and the leases (the last three
    are set by the façade once the concerns they call back exist).  Hooks the daemon and
    tests set: ``invalidate``, ``invalidate_entry``, ``check_complete``, ``mount_device``,
    ``died_unclean``, ``observe``, ``after_seal``.  Holds no logic beyond the per-inode
    helpers below; a concern's own state lives in the concern."""

    oplog: MetaLog
    queue: PublishQueue
    leases: LeaseManager

    def __init__(self, ns: Namespace, store: GuardedStore, staging: Staging,
                 cache: ChunkCache, config: Config, nursery: trio.Nursery,
                 invalidate: Callable[[int], None],
                 invalidate_entry: Callable[[int, bytes], Awaitable[None]] | None,
                 check_complete: CompletenessCheck | None,
                 liveness: ChunkLiveness, upload_gate: UploadGate, store_health: StoreHealth,
                 uploader: ChunkUploader) -> None:
        self.ns = ns
        self.store = store
        self.staging = staging
        self.cache = cache
        self.config = config
        self.nursery = nursery
        # When the journal reaches the disk (an fsync with nothing new committed is none).
        self.journal = JournalSync(ns.sync, committed=ns.commits)
        self.invalidate = invalidate
        self.invalidate_entry = invalidate_entry
        # Structural check of a closed file (``CompletenessCheck``).
        self.check_complete = check_complete
        self.liveness = liveness
        self.upload_gate = upload_gate
        self.store_health = store_health
        self.uploader = uploader
        # ``major:minor`` of the mount, set by the daemon once mounted: lets flush ask
        # whether the opener still holds the file (procstat.holds_for_writing).
        self.mount_device: bytes | None = None
        self.mount_tables = MountTables(keep=4)     # the openers' namespaces' mounts
        # Did a handle's opener exit with a signal or an error (procstat.died_unclean)?
        # An attribute, so core tests inject it.
        self.died_unclean: Callable[[Opener], bool] = died_unclean
        self.observe: Callable[[str, float], None] = lambda what, seconds: None  # metrics
        # The kernel forgets an inode's cached attributes before this returns (the
        # daemon's ``InodeInvalidations.attributes_now``; ``invalidate`` only queues).
        self.invalidate_attributes: Callable[[int], None] = lambda ino: None
        # May an open hand the kernel its staging file (kernel passthrough)?  Set by the
        # daemon from what the FUSE library and the kernel agreed at FUSE_INIT.
        self.passthrough_available: Callable[[], bool] = lambda: False
        self.after_seal: Callable[[Inode], None] = lambda inode: None   # retention.py
        # ``Opening._fresh_inode_for_name``: the names to a fresh inode, the old one to
        # its readers (before another node's version replaces the one they read).
        self.fresh_inode_for_name: Callable[..., bool] = lambda ino, held_here=False: False
        self.handles: dict[int, Handle] = {}
        self.runtime: dict[int, Runtime] = {}
        self.dir_marks = DirMarks()                  # refresh's change and busy marks
        self._held_pointers: dict[int, set[int]] = {}   # pointer inode -> staged targets
        # Close decisions made at a last release (unfinished work for ``ckptfs wait``).
        self.closing_at_release: set[int] = set()
        self.lingering: set[int] = set()    # replaced files kept a moment (linger.py)
        # Staged directories this node lists before the store has their seal (async,
        # ``Seal._show_here_if_clear``); not saved: after a restart, once it has it.
        self.sealed_here: set[int] = set()
        self._publish_epoch: dict[int, int] = {}
        self._recovered = trio.Event()     # set by start(): the log replays after recovery
        # Inodes whose name moved to a fresh inode (``Opening._fresh_inode_for_name``),
        # with that inode, bounded (inode numbers are never reused): reached through a
        # dentry the kernel kept, a step on one answers ESTALE and the kernel looks the
        # name up again; an attribute change goes to the fresh one (``moved_to``).
        self.moved_away: OrderedDict[int, int] = OrderedDict()
        self.cut_off: dict[int, bytes] = {}    # writers the stop cut off, at (recovery)
        self.meta_limiter = trio.CapacityLimiter(16)

    # ------------------------------------------------------------------ helpers

    def gone(self, ino: int, why: str) -> FsError:
        """The error for a step whose inode lost its name meanwhile: ENOENT, or ESTALE
        when the name moved to a fresh inode (the VFS's retry by name finds it)."""
        if ino in self.moved_away:
            return FsError(errno.ESTALE, f"{why}: the name has moved to a fresh inode")
        return FsError.enoent(why)

    def taken_behind_the_kernel(self, ino: int) -> None:
        """Another node's version of a file was taken in place (a listing, an entry
        rewrite that found it): the kernel forgets the file's attributes before any
        reply can serve that version -- the queue's invalidation may come after the
        next open and ``fstat``, whose old size a zip reader seeks by (a torn read,
        hostile run E) -- and its pages soon (no lock a request holds is taken here)."""
        self.invalidate_attributes(ino)
        self.invalidate(ino)

    def moved_to(self, ino: int) -> int | None:
        """The inode the name of ``ino`` moved to, followed through its later moves:
        the file an attribute change through a descriptor of ``ino`` is for, as on a
        disk, where a save in place keeps the file, and the one ``ckptfs wait`` of its
        path waits for.  None where that file has no name left."""
        for _ in range(MOVES_FOLLOWED):
            if ino not in self.moved_away:
                inode = self.ns.maybe_get(ino)
                return ino if inode is not None and inode.names else None
            ino = self.moved_away[ino]
        return None

    def locked_in_kernel(self, ino: int) -> bool:
        """Does a process hold a ``flock`` or POSIX lock on ``ino``?  The kernel keeps
        them per inode (this daemon takes no lock requests): on a fresh inode for the
        name they would stop excluding the name's next openers."""
        return self.mount_device is not None and \
            locked_in_kernel(self.mount_device, ino)

    def refuse_if_moved_away(self, ino: int) -> None:
        """ESTALE for a step on an inode whose name moved to a fresh one (``moved_away``):
        the VFS retries a path step once with LOOKUP_REVAL, which finds the fresh one."""
        if ino in self.moved_away:
            raise FsError(errno.ESTALE, "the name has moved to a fresh inode")

    async def follow_the_log(self, what: str) -> None:
        """Async mode: a step that acts on the store at once (a hard link, the rename of
        a hard-linked name, an exchange) acts on the names as the store has them, so the
        records pending now are applied first -- else it would look for a name under
        the key a pending rename has not moved it to yet (ENOENT), or write over a name
        a pending rename has still to move away (that file lost in the store).  Bounded
        by ``store_timeout``: then EIO, and nothing is changed."""
        if not self._deferred():
            return
        epoch = self.oplog.epoch()
        if self.oplog.done_through(epoch):
            return
        with trio.move_on_after(self.config.store_timeout):
            await self.oplog.wait_through(epoch)
            return
        raise FsError(errno.EIO, f"{what}: earlier metadata changes of this node are not in "
                                 f"the store yet (ckptfs status)")

    def _deferred(self) -> bool:
        """Async mode: metadata changes are local first, the store follows in order."""
        return self.config.durability == "async"

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
        self.dir_marks.touch(ino)

    def record_store_change(self, local: Callable[[], bool], dirs: list[int],
                            what: str, stored: bool) -> bool:
        """The local half, one commit, of a sync removal or rename.  ``stored``: the
        store has made the change already; then the commit must land -- on a full disk
        the state dir's reserve is given up for it -- and if it still cannot, the change
        stands all the same (the store holds the truth: answering ENOSPC would tell the
        caller a removed checkpoint is still there); ``dirs`` are listed again at their
        next lookup, which shows it, and the log says so.  ``local``'s result, False if
        it did not land."""
        def commit() -> bool:
            with self.ns.batch():
                return local()
        if not stored:
            return commit()     # nothing happened anywhere yet: a failure is the answer
        try:
            return self.ns.with_room(commit)
        except FsError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
                raise
            log.warning("%s: done in the store, but not recorded here (%s); the next "
                        "lookup lists the directory again", what, exc)
            for ino in dirs:
                self._touch_dir(ino)
                self.ns.get(ino).listed_at = 0.0     # not listed yet: wait for it
            return False

    def _dir(self, ino: int) -> Inode:
        inode = self.ns.get(ino)
        if inode.type != "dir":
            raise FsError(errno.ENOTDIR)
        return inode

    def nlink(self, inode: Inode) -> int:
        """st_nlink: a directory has 2 + its subdirectories; anything else its names."""
        if inode.type == "dir":
            return 2 + self.ns.subdirs(inode.ino)
        return inode.nlink

    def blocks(self, inode: Inode) -> int:
        """st_blocks (512-byte blocks holding data, what ``du`` adds up): for a file
        staged here, its staging file's allocation (a sparse file's holes hold none);
        for a published one, its chunks but those of zeros; else from the size."""
        by_size = (inode.size + 511) // 512
        if inode.type != "file":
            return by_size
        rt = self.runtime.get(inode.ino)
        if rt is not None and rt.session is not None:
            ver = rt.session.ver
        elif inode.dirty or inode.local_copy:
            ver = inode.ver
        else:
            return (allocated_bytes(inode.chunks) + 511) // 512
        try:
            return self.staging.allocated(inode.ino, ver)
        except (OSError, FsError):
            return by_size

    def _handle(self, fh: int) -> Handle:
        handle = self.handles.get(fh)
        if handle is None:
            raise FsError(errno.EBADF)
        return handle

    async def _sync_journal(self) -> None:
        """Make the journal durable against a power cut before returning (fsync of LMDB,
        in a thread, shared by the callers of one batch: ``journalsync.py``)."""
        await self.journal.now()

    def _sync_journal_soon(self) -> None:
        """An async-mode change the caller does not wait on disk for: committed (it
        survives the daemon), synced in the background with the changes around it."""
        self.journal.soon()

    def _path_for_log(self, inode: Inode) -> str:
        try:
            return self.ns.path_of(inode.ino).decode(errors="replace")
        except FsError:
            return f"<inode {inode.ino}>"

    def deciding_at_release(self, ino: int) -> bool:
        """A close decision left to ``ino``'s last release is under way, its write
        session not ended yet (``Release._decide_at_release``)."""
        rt = self.runtime.get(ino)
        return ino in self.closing_at_release and rt is not None and rt.session is not None

    async def until_decided_at_release(self, ino: int) -> bool:
        """Wait while ``deciding_at_release``: the decision ends the session when it
        commits, before any upload, so this is short.  Whether it waited."""
        waited = False
        while self.deciding_at_release(ino):
            waited = True
            await trio.sleep(0.005)
        return waited

    @staticmethod
    def version_of(inode: Inode) -> tuple:
        """The closed version a reader opening ``inode`` now gets (``Handle.snapshot``)."""
        if inode.dirty or inode.local_copy:
            return ("staging", inode.ver)
        return ("chunks", ChunkMap(inode.chunks), inode.size)

    def end_session(self, ino: int, rt: Runtime) -> None:
        """The write session of ``ino`` is over (closed, ended unchanged, abandoned):
        readers that opened during it, reading it live, keep the version the file has
        now -- the next save, here or from another node, must not reach them (a reader
        keeps its version).  Call once the inode names that version."""
        rt.session = None
        inode = self.ns.maybe_get(ino)
        if inode is None:
            return
        for handle in filter(None, map(self.handles.get, rt.handles)):
            if handle.writable or handle.snapshot[0] != "live":
                continue
            handle.snapshot = self.version_of(inode)
            if handle.snapshot[0] == "staging":
                self._ref(rt, handle.snapshot[1])

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

