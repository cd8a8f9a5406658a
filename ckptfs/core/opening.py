"""Opening a file and the versions readers keep: a handle's snapshot of the version it
opened, the staging versions in use and when one may go, the page-cache flags for the
kernel.  Must not know the store, FUSE, publishing or refresh."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import trio

from ..errors import FsError
from ..meta.namespace import Inode
from ..procstat import Opener
from .critical import no_await
from .state import PAGE_VERSIONS_KEPT, PASSTHROUGH_MIN_FREE, CoreState, Handle, Runtime
from .taken import hand_owed_version_to, may_hand_over
from .write import WritePath

if TYPE_CHECKING:
    from .readbehind import ReadBehind

log = logging.getLogger(__name__)

# A writer of a new version cannot open an inode the kernel still reads through an
# earlier version's staging file (FUSE passthrough allows one backing file per inode and
# fails every other open of it, fs/fuse/iomode.c): it waits this long for those handles'
# releases -- usually already in flight after the save's close -- polling every
# PASSTHROUGH_DRAIN_POLL s, then gets EBUSY (decision 0019).
PASSTHROUGH_DRAIN = 2.0
PASSTHROUGH_DRAIN_POLL = 0.005
MOVED_AWAY_KEPT = 1024
# An open of a moved-away inode again by the same task within this long after its
# ESTALE is a descriptor's magic link, not a path walk (``_refuse_moved_away``).
REOPEN_WINDOW = 1.0
# How long after a writer's step moved a name to a fresh inode (``leave_readers_their_
# inode``) the kernel's retry of that step may take to reach it.
WRITER_RETRY_WINDOW = 1.0
# After a writer went on in place beside readers of a version not uploaded yet, the
# file's next writers do not wait for the upload again for this long.
IN_PLACE_QUIET = 60.0


class Opening:
    """Owns the next file handle number and ``page_versions`` (the version the kernel page
    cache of an inode may hold; outlives the handles, bounded)."""

    def __init__(self, st: CoreState, *, writes: WritePath, readbehind: ReadBehind) -> None:
        self.st = st
        self.writes = writes
        self.readbehind = readbehind    # uploads a passthrough writer's complete chunks
        self._next_fh = 1
        self.page_versions: OrderedDict[int, object] = OrderedDict()
        # Fresh inodes a writer's step moved a name to, and when (``monotonic``).
        self._moved_for_writers: OrderedDict[int, float] = OrderedDict()
        # Files whose writer went on in place beside readers (``leave_readers_their_
        # inode``), and when.
        self._went_on_in_place: OrderedDict[int, float] = OrderedDict()
        self._refused_moved: OrderedDict[tuple[int, int], float] = OrderedDict()

    def _new_handle(self, inode: Inode, opener: Opener, writable: bool) -> Handle:
        handle = Handle(fh=self._next_fh, ino=inode.ino, opener=opener, writable=writable)
        self._next_fh += 1
        self.st.handles[handle.fh] = handle
        rt = self.st._rt(inode.ino)
        rt.handles.add(handle.fh)
        if writable:
            rt.writers += 1
            session = handle.session = rt.session
            assert session is not None, "a writable open joins a session first"
            session.handles.add(handle.fh)
        elif rt.session is None:
            handle.snapshot = self.st.version_of(inode)
            if handle.snapshot[0] == "staging":
                self.st._ref(rt, handle.snapshot[1])
        return handle

    async def open(self, ino: int, flags: int, opener: Opener) -> Handle:
        """A new handle, with the page-cache flags the kernel gets for it
        (``keep_cache``, ``direct_io``) decided: the FUSE adapter needs no second call."""
        writable = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        _refuse_moved_away(self.st, self._refused_moved, ino, writable, opener)
        self._refuse_if_replaced(ino, writable or bool(flags & os.O_TRUNC))
        await self.wait_for_passthrough_readers(ino, writable)
        if writable:
            await self.leave_readers_their_inode(ino)
        if writable:
            with self.st.upload_gate.busy():   # a writer at work: uploads wait (decision 0015)
                handle = await self._open(ino, flags, opener)
        else:
            handle = await self._open(ino, flags, opener)
        self.decide_passthrough(handle, fresh=bool(flags & os.O_TRUNC))
        handle.keep_cache, handle.direct_io = self._cache_flags(handle)
        return handle

    async def open_by_name(self, parent: int, name: bytes, ino: int, flags: int,
                           opener: Opener) -> Handle:
        """``open`` of ``ino``, found under ``name``: where the name moves to a fresh
        inode meanwhile (ESTALE: this open's new version beside readers), that one is
        opened, as the kernel would by name (a create of an existing name)."""
        try:
            return await self.open(ino, flags, opener)
        except FsError as exc:
            now = self.st.ns.lookup(parent, name)
            if exc.errno != errno.ESTALE or now is None or now == ino:
                raise
            return await self.open(now, flags, opener)

    def _refuse_if_replaced(self, ino: int, writes: bool) -> None:
        """An open of an inode that has no name left: the kernel resolved the name just
        before a rename replaced it (or an unlink removed it).  A reader gets the version
        it had while the inode is still here (``linger.py``: the open came first); a
        writer, or an open of an inode gone, gets ESTALE, which makes the kernel look the
        name up again and open what it names now (ENOENT if nothing): rename(2)
        replaces a name atomically, and a hostile run's reader missed a name
        ``os.replace`` kept replacing, up to 44 ms on end."""
        inode = self.st.ns.maybe_get(ino)
        if inode is None or (not inode.parent and (writes or inode.type != "file")):
            raise FsError(errno.ESTALE, "replaced or removed: the name is looked up again")

    async def wait_for_passthrough_readers(self, ino: int, writable: bool) -> None:
        """An open of ``ino`` while the kernel still reads it through a closed version's
        staging file, for another version: answered with the daemon's path, the kernel
        itself would fail the open with EIO.  Once that version is in the store, the name
        moves to a fresh inode and the open answers ESTALE: the kernel looks the name up
        again and opens the fresh one (``_fresh_inode_for_name``).  Until then it waits
        for those handles to go or the upload to land (PASSTHROUGH_DRAIN), then is refused
        with EBUSY."""
        if not _lingering_passthrough(self.st, ino, writable):
            return
        with trio.move_on_after(PASSTHROUGH_DRAIN):
            while _lingering_passthrough(self.st, ino, writable):
                # (moved by this open, or by another one waiting beside it; a locked
                #  file too: the kernel reads the version before through its backing
                #  file, and nothing else can open it but in a fresh inode)
                self._move_for_a_writer(ino, writes=writable, despite_locks=True)
                self.st.refuse_if_moved_away(ino)
                await trio.sleep(PASSTHROUGH_DRAIN_POLL)
        if _lingering_passthrough(self.st, ino, writable):
            inode = self.st.ns.maybe_get(ino)
            where = self.st._path_for_log(inode) if inode is not None else f"inode {ino}"
            log.warning("%s: open for %s refused (EBUSY): a reader still reads the "
                        "version before through the kernel (FUSE passthrough allows one "
                        "backing file per file); it may be opened again once that reader "
                        "closes it", where, "writing" if writable else "reading")
            raise FsError(errno.EBUSY, "a passthrough reader holds the previous version")

    @no_await
    def _move_for_a_writer(self, ino: int, writes: bool = True,
                           despite_locks: bool = False) -> bool:
        """``_fresh_inode_for_name`` for an open's step (a writer's, unless not
        ``writes``), which the kernel then does again on the fresh inode: a writer's is
        remembered, so that its retry gets through (a reader's needs no pass, and one
        left unspent let the next writer in beside readers).  Not for a locked file
        (a lock would stay behind on the old inode), unless ``despite_locks``."""
        inode = self.st.ns.maybe_get(ino)
        if inode is None or not inode.names:
            return False
        at = inode.names[0]
        if not self._fresh_inode_for_name(ino, owed_ok=True, despite_locks=despite_locks):
            return False
        fresh = self.st.ns.lookup(*at)
        if fresh is not None and writes:
            self._moved_for_writers[fresh] = time.monotonic()
            while len(self._moved_for_writers) > MOVED_AWAY_KEPT:
                self._moved_for_writers.popitem(last=False)
        return True

    def _just_moved_for_a_writer(self, ino: int) -> bool:
        """``ino`` is the fresh inode a writer's step moved the name to a moment ago:
        the kernel's retry of that step must get through, even past readers that opened
        the fresh inode meanwhile (readers opening the name in a loop would move it on
        at every retry, and the writer got ESTALE).  Once: the next save beside readers
        moves the name again (a trainer saving in a loop beside an evaluator's mapping
        cut the mapped file, SIGBUS)."""
        at = self._moved_for_writers.pop(ino, None)
        return at is not None and time.monotonic() - at < WRITER_RETRY_WINDOW

    def _read_by_its_readers(self, ino: int) -> bool:
        """Readers here hold a closed version of ``ino`` open and no write session is
        under way (which would be theirs: they read it live)."""
        rt = self.st.runtime.get(ino)
        if rt is None or rt.session is not None:
            return False
        return any(not h.writable and h.snapshot[0] != "live"
                   for h in map(self.st.handles.get, rt.handles) if h is not None)

    async def leave_readers_their_inode(self, ino: int) -> None:
        """A new version is about to start on ``ino`` (a writer's open, a truncate by
        name) while readers here hold the version before.  The kernel keeps one size per
        inode: the writer's would cut their reads (soak seed 1215616: a reader of
        70 000 bytes read 100 of them after a 100-byte save).  So the name moves to a
        fresh inode first, as for another node's save, and the step answers ESTALE: the
        kernel does it again by name, on the fresh inode.  A version still owed to the
        store cannot move yet: this waits for its upload (``PASSTHROUGH_DRAIN``), then
        goes on in place and says so in a WARNING -- and for ``IN_PLACE_QUIET`` seconds
        after, the file's next writers do not wait again (an appending logger beside a
        ``tail -f`` would wait at every open while its uploads lag)."""
        just_moved = self._just_moved_for_a_writer(ino)    # (spent here, readers or not)
        if not self._read_by_its_readers(ino) or just_moved:
            return
        if self.st.locked_in_kernel(ino):
            # Locks on the readers' inode are how its users take turns: the name stays
            # on it, and the save goes on in place at once -- and its readers read the
            # file as it is from now on, as on a disk (a reader's version, kept, was
            # cut at the save's size: torn).
            _readers_follow_the_file(self.st, ino)
            log.info("inode %d: saved over in place beside a reader here: a process "
                     "holds a lock on it", ino)
            return
        if self._move_for_a_writer(ino):
            self.st.refuse_if_moved_away(ino)       # ESTALE
        went = self._went_on_in_place.get(ino)
        if went is not None and time.monotonic() - went < IN_PLACE_QUIET:
            _readers_follow_the_file(self.st, ino)      # (as below, without the wait)
            return
        with trio.move_on_after(PASSTHROUGH_DRAIN):
            while self._read_by_its_readers(ino):
                if self._move_for_a_writer(ino):
                    self.st.refuse_if_moved_away(ino)
                await trio.sleep(PASSTHROUGH_DRAIN_POLL)
        if self._read_by_its_readers(ino):
            self._went_on_in_place[ino] = time.monotonic()
            while len(self._went_on_in_place) > MOVED_AWAY_KEPT:
                self._went_on_in_place.popitem(last=False)
            # (kept, their version would be read through the kernel's size of the new
            #  one: torn; as on a disk, they read the file as it is from now on)
            _readers_follow_the_file(self.st, ino)
            inode = self.st.ns.maybe_get(ino)
            log.warning("%s: saved over while a reader here holds the version before, "
                        "which is not in the store yet: that reader reads the file as "
                        "it is from now on, as on a disk",
                        self.st._path_for_log(inode) if inode else ino)

    @no_await
    def _fresh_inode_for_name(self, ino: int, held_here: bool = False,
                              owed_ok: bool = False, despite_locks: bool = False) -> bool:
        """Give the names of ``ino`` a fresh inode showing the same saved version (the
        store changes nothing: its entries are the fresh inode's now -- a hard-linked
        file's names all move, still one linked file); the old inode lives on,
        nameless, for the passthrough readers that hold it and goes with their release.
        Only for a file with no work in flight (``_may_move``): False otherwise.  The
        kernel finds the fresh inode: an open answers ESTALE, and steps that reach the
        old one through a dentry it kept answer ESTALE too (``CoreState.moved_away``).  Also
        before another node's version replaces the one readers here hold open
        (``CoreState.fresh_inode_for_name``): the kernel's size of their inode stays
        theirs.  ``held_here``: the caller holds the inode's lock, in a step of its own
        (its unsent attributes are the step's: it is repeated on the fresh inode).
        ``owed_ok``: a closed version still owed to the store moves too, its publish
        with it (a writer's step: ``taken.hand_owed_version_to``).  A file a process
        holds a lock on stays (the lock would stay behind on the old inode, excluding
        nobody who opens the name next) and its readers follow it, as on a disk --
        unless ``despite_locks`` (nothing else can open it)."""
        inode = self.st.ns.maybe_get(ino)
        if inode is None or not _may_move(self.st, inode, held_here, owed_ok):
            return False
        if not despite_locks and self.st.locked_in_kernel(ino):
            _readers_follow_the_file(self.st, ino)
            return False
        owed = inode.dirty
        (parent, name), others = inode.names[0], inode.names[1:]
        link_id, remote_nlink = inode.link_id, inode.remote_nlink
        counted = inode.link_counted
        with self.st.ns.batch():
            self.st.ns.unlink(inode, all_names=True)  # here only: the store stays as it is
            inode.link_id, inode.remote_nlink = None, 0     # (nameless: no linked file)
            self.st.ns.save(inode)
            fresh = self.st.ns.new_inode(
                parent, name, "file", inode.mode, inode.uid, inode.gid,
                size=inode.published_size, chunks=list(inode.chunks),
                published=inode.published,
                remote_etag=inode.remote_etag, mtime_ns=inode.mtime_ns,
                xattrs=dict(inode.xattrs), save_id=inode.save_id, link_id=link_id,
                remote_nlink=remote_nlink, link_counted=list(counted))
            for other_parent, other_name in others:
                self.st.ns.add_name(fresh, other_parent, other_name)
            if owed:
                hand_owed_version_to(self.st, inode, fresh)
        self.st.moved_away[ino] = fresh.ino     # where a change through its readers goes
        while len(self.st.moved_away) > MOVED_AWAY_KEPT:
            self.st.moved_away.popitem(last=False)
        self.st.invalidate(ino)         # the reader's fstat: no name left
        log.info("%s: a reader here still holds the version before; the name moves to "
                 "a fresh inode for the next save",
                 name.decode(errors="replace"))
        if self.st.invalidate_entry is not None:
            for where, what in ((parent, name), *others):
                self.st.nursery.start_soon(self.st.invalidate_entry, where, what)
        return True

    def decide_passthrough(self, handle: Handle, fresh: bool) -> None:
        """Whether the kernel reads and writes this handle's bytes in its staging file
        itself (FUSE passthrough): no read or write request reaches the daemon.

        The kernel keeps one backing file per inode and, while an inode is open for
        passthrough, fails every open of it that is not passthrough with that same
        backing file (fs/fuse/iomode.c); a cached open and a passthrough open exclude
        each other too.  So passthrough *starts* only for a writer of a new working
        version (``fresh``: create or O_TRUNC) alone on its inode, in async mode (sync
        mode's close and fsync upload what the write path pipelined), under
        --max-staged (past it, writers must wait in ``write``); and while it lasts,
        every open of the same staging file (a reader of the working version, another
        writer of the session) is passthrough as well.  Any other open then falls back
        to the daemon with direct I/O."""
        rt = self.st._rt(handle.ino)
        if rt.passthrough:
            if self._file_ver(handle, rt) == rt.passthrough_ver:
                self._mark_passthrough(handle, rt)
            return
        if not (fresh and handle.writable and handle.session is not None
                and self.st.passthrough_available()):
            return
        if self.st.config.durability != "async" or \
                self.writes.staged_bytes() > self.writes.max_staged:
            return
        if self.st.staging.free_bytes() < PASSTHROUGH_MIN_FREE:
            return      # nearly full: the daemon's path sees every failed write
        if any(fh != handle.fh for fh in rt.handles):
            return
        rt.passthrough_ver = handle.session.ver
        self._mark_passthrough(handle, rt)
        # Its writes never reach the daemon: its complete chunks are read behind it.
        self.readbehind.follow(handle.ino, handle.session)

    def _mark_passthrough(self, handle: Handle, rt: Runtime) -> None:
        handle.passthrough = True
        rt.passthrough += 1
        if handle.writable:
            handle.wrote = True     # its writes are not seen: count it as having written
            if handle.session is not None:
                handle.session.through_kernel = True
            self.st.upload_gate.writer_opened()

    @staticmethod
    def _file_ver(handle: Handle, rt: Runtime) -> int | None:
        """The staging version a handle reads or writes (None: published chunks)."""
        if handle.writable:
            return handle.session.ver if handle.session is not None else None
        if handle.snapshot[0] == "staging":
            return handle.snapshot[1]
        if handle.snapshot[0] == "live" and rt.session is not None:
            return rt.session.ver
        return None

    def backing_fd(self, handle: Handle) -> int:
        """A *borrowed* descriptor of a passthrough handle's staging file (the kernel
        takes its own reference at once), or -1."""
        rt = self.st.runtime.get(handle.ino)
        if not handle.passthrough or rt is None or rt.passthrough_ver is None:
            return -1
        return self.st.staging.fd(handle.ino, rt.passthrough_ver)

    def live_size(self, inode: Inode) -> Inode:
        """``inode`` with the size and mtime of its staging file while the kernel writes
        it, or wrote it and the close is not decided yet (the daemon sees no writes; the
        kernel's is the staging file's): between a last release and the close decision
        it passed on, the size the daemon had seen was none at all."""
        rt = self.st.runtime.get(inode.ino)
        if rt is not None and rt.session is not None and (
                rt.session.through_kernel or
                (rt.passthrough and rt.session.ver == rt.passthrough_ver)):
            try:
                st = os.fstat(self.st.staging.fd(inode.ino, rt.session.ver))
            except (OSError, FsError):
                return inode
            inode.size = st.st_size
            inode.mtime_ns = max(inode.mtime_ns, st.st_mtime_ns)
        return inode

    async def _open(self, ino: int, flags: int, opener: Opener) -> Handle:
        inode = self.st.ns.get(ino)
        if inode.type == "dir":
            raise FsError(errno.EISDIR)
        if inode.type != "file":
            raise FsError(errno.EINVAL)
        accmode = flags & os.O_ACCMODE
        writable = accmode in (os.O_WRONLY, os.O_RDWR)
        truncate = bool(flags & os.O_TRUNC) and writable
        if writable:
            session = await self.writes._join_session(inode, truncate)
            if truncate:
                session.wrote = True
        try:
            self._refuse_if_replaced(ino, writable)       # (meanwhile)
        except FsError:
            if writable:
                self.writes.drop_unheld_session(ino)
            raise
        inode = self.st.ns.get(ino)
        handle = self._new_handle(inode, opener, writable)
        if writable:
            await self.st.leases.writing(inode)
        return handle

    def open_flags(self, handle: Handle) -> tuple[bool, bool]:
        """(keep_cache, direct_io) of a handle, as ``open`` decided them."""
        return handle.keep_cache, handle.direct_io

    def _cache_flags(self, handle: Handle) -> tuple[bool, bool]:
        """(keep_cache, direct_io) for the kernel, decided once at open (it records the
        version the kernel's pages hold from now on).  The page cache of an inode is shared
        by all its handles: a reader that opens a version other than the one the cache
        may hold drops it (no keep_cache), and while readers of two versions are open,
        the newer ones bypass it (direct_io) so each reads its own version."""
        rt = self.st._rt(handle.ino)
        pages = self.page_versions
        if handle.passthrough:
            pages.pop(handle.ino, None)
            return False, False
        if rt.passthrough:
            # The kernel serves passthrough opens of this inode: any other open must take
            # no io mode (direct I/O), or the kernel would fail it (fs/fuse/iomode.c).
            pages.pop(handle.ino, None)
            return False, True
        if handle.writable or rt.session is not None or handle.snapshot[0] == "live":
            pages.pop(handle.ino, None)
            return False, False
        version = self._snapshot_key(handle)
        others = {self._snapshot_key(self.st.handles[fh]) for fh in rt.handles
                  if fh != handle.fh and fh in self.st.handles}
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


@no_await
def _readers_follow_the_file(st: CoreState, ino: int) -> None:
    """The reading handles of ``ino`` read the file as it is (``live``) from now on,
    instead of the version each opened: a save goes on in place beside them."""
    rt = st.runtime.get(ino)
    if rt is None:
        return
    for handle in filter(None, map(st.handles.get, list(rt.handles))):
        if handle.writable or handle.snapshot[0] == "live" or handle.passthrough:
            continue
        if handle.snapshot[0] == "staging":
            st._unref(ino, rt, handle.snapshot[1])
        handle.snapshot = ("live",)
    st.invalidate(ino)             # (their cached pages: the version before)


def _lingering_passthrough(st: CoreState, ino: int, writable: bool) -> bool:
    """Passthrough handles of a closed version are open (readers that joined a save
    through the kernel, or its writer's release not yet here) and this open would not
    share their backing file: a writer of a new version, or a reader of any other
    version (a later save of this node or another node's, or the store's chunks once
    the staging file went)."""
    rt = st.runtime.get(ino)
    if rt is None or rt.passthrough <= 0:
        return False
    if rt.session is not None:
        return rt.session.ver != rt.passthrough_ver
    if writable:
        return True
    inode = st.ns.maybe_get(ino)     # (``CoreState.version_of``, unbuilt)
    return inode is not None and not (
        (inode.dirty or inode.local_copy) and inode.ver == rt.passthrough_ver)


def _refuse_moved_away(st: CoreState, refused: OrderedDict[tuple[int, int], float],
                       ino: int, writable: bool, opener: Opener) -> None:
    """ESTALE for an open of an inode whose name moved to a fresh one: the kernel
    reached it through a dentry it kept, and its retry (LOOKUP_REVAL) finds the fresh
    one.  But the same task opening it again for reading right after is no path walk:
    a descriptor's magic link (``/proc/self/fd/N``, ``/dev/stdin``) leads to this
    inode every time, and a disk opens the file it names -- so that open reads the
    version that descriptor holds (it answered ESTALE for good before)."""
    if ino not in st.moved_away:
        return
    if writable:
        st.refuse_if_moved_away(ino)
    key = (ino, opener.tid)
    again = refused.pop(key, None)
    if again is not None and time.monotonic() - again < REOPEN_WINDOW:
        return
    refused[key] = time.monotonic()
    while len(refused) > MOVED_AWAY_KEPT:
        refused.popitem(last=False)
    st.refuse_if_moved_away(ino)


def _may_move(st: CoreState, inode: Inode, held_here: bool, owed_ok: bool) -> bool:
    """``_fresh_inode_for_name``'s conditions: a named file with no work in flight
    on it -- no write session, lock, unanswered PUT, hold, pending link entries or
    metadata record -- and in the store, or (``owed_ok``) owing its closed version,
    which the fresh inode then takes over (``taken.may_hand_over``)."""
    if inode.type != "file" or not inode.parent:
        return False
    ino, rt = inode.ino, st.runtime.get(inode.ino)
    if inode.dirty:
        if not owed_ok or not may_hand_over(st, inode):
            return False
    elif not inode.published or inode.attrs_unsent and not held_here or \
            ino in st.queue.queued:
        return False
    return not (inode.links_pending or inode.held or inode.unsure or
                (st._locked(ino) and not held_here) or
                (rt is not None and rt.session is not None) or
                any(r.get("ino") == ino and (r.get("kind") != "attrs" or not held_here)
                    for r in st.oplog.pending.values()))
