"""The close decision and publishing: flush (which close publishes), release,
uploading a closed version and writing its entry (abandoning a version: abandon.py)."""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable

import trio

from ..errors import FsError
from ..meta.namespace import Inode
from ..procstat import holds_for_writing
from ..data.upload import chunk_list, drop_staged_pages
from ..format.remote import MAX_CHUNK_SIZE, BadEntry, Entry, inode_key
from ..store import NotFound, StoreError
from . import unsure
from .conflicts import CONFLICT_NAMES, NameTaken, keep_under_own_name
from .critical import no_await
from .state import STAGING_FULL_MARGIN, CoreState, Handle, Runtime, Session
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .abandon import Abandon
    from .entries import EntryIO
    from .seal import Seal
    from .write import WritePath


log = logging.getLogger(__name__)

# Files up to this size are checked for completeness on the trio thread (a few reads of
# the page cache); larger ones in a worker thread.
INLINE_CHECK_MAX = 64 << 10


class Publish:
    """The close decision, release and publishing; a version nobody closed for good
    goes to ``abandoning``."""

    def __init__(self, st: CoreState, *, entries: EntryIO, seals: Seal,
                 writes: WritePath, abandoning: Abandon) -> None:
        self.st = st
        self.entries = entries
        self.seals = seals
        self.writes = writes
        self.abandoning = abandoning

    # ------------------------------------------------------------------ close and publish

    async def flush(self, fh: int) -> None:
        """Every ``close()`` of a descriptor.  The working version becomes the file's
        closed version only at a close its writer meant (DESIGN.md promise 2): not a
        killed or failing writer's, not a forked child's or a subprocess's copy while
        the opener still holds the file, not a structurally incomplete checkpoint."""
        handle = self.st._handle(fh)
        if not handle.writable:
            return
        with self.st.upload_gate.busy():       # a writer at work: uploads wait (decision 0015)
            await self._flush(handle)

    async def _flush(self, handle: Handle) -> None:
        rt = self.st._rt(handle.ino)
        session = handle.session
        if session is None or rt.session is not session:
            return  # that version was closed (or abandoned) by an earlier close
        inode = self.st.ns.get(handle.ino)
        if session.failed:
            self.abandoning.abandon(inode, "a write on it failed", keep=False)
            await self.abandoning.drop_stale_entries()
            # Report the write's own error again at close (as NFS does), e.g. ENOSPC.
            raise FsError(session.failed, "not published: an earlier write failed")
        if self.st.died_unclean(handle.opener):
            session.meant = session.meant_by_writer
            if len(session.handles) > 1:
                return  # other handles still write: their close decides
            if not session.meant_by_writer:
                log.warning("writer %d of %s was killed; nothing published",
                            handle.opener.tgid, self.st._path_for_log(inode))
                self.abandoning.abandon(inode, "its writer was killed")
                await self.abandoning.drop_stale_entries()
                return
            # Another writer closed it before (told it was saved): that close stands,
            # with what this one wrote before it was killed.
            log.warning("writer %d of %s was killed; the version another writer's close "
                        "meant is published, with what the killed writer wrote",
                        handle.opener.tgid, self.st._path_for_log(inode))
        elif self._opener_still_holds(handle):
            session.meant = True
            return  # a copy's close (fork, subprocess, dup): the opener's close decides
        elif len(session.handles) > 1:
            # Another open writable handle: the last one's close decides -- or, if no
            # close comes before the last release, that release (``Session.meant``).
            # A close of another process than the ones still writing stands even if
            # they are killed (the same process killed later was still at work).
            session.meant = True
            if all(self.st.handles[fh].opener.tgid != handle.opener.tgid
                   for fh in session.handles if fh != handle.fh and fh in self.st.handles):
                session.meant_by_writer = True
            return
        await self._decide(inode, rt, session)

    async def _decide(self, inode: Inode, rt: Runtime, session: Session,
                      at_release: bool = False) -> None:
        """The close decision for a session whose writer meant its close: a close
        that changed nothing, a staging file system that was full under the kernel's
        writes, an incomplete checkpoint, or the closed version (published now in sync
        mode, journaled in async)."""
        if not session.wrote:
            self._end_session_unchanged(inode, rt, session)
            return
        if session.through_kernel and self.st.staging.free_bytes() < STAGING_FULL_MARGIN:
            # The kernel wrote it: a write that failed for want of space never told us.
            log.error("%s not published: the staging file system is full, so a write "
                      "through the kernel may have failed", self.st._path_for_log(inode))
            self.abandoning.abandon(inode, "its staging file system is full", keep=False)
            await self.abandoning.drop_stale_entries()
            raise FsError(errno.ENOSPC, "not published: the staging file system is full")
        size = self.st.staging.size(inode.ino, session.ver)
        reason = await self._incomplete_reason(inode, session.ver, size)
        if rt.session is not session or (at_release and session.handles):
            return      # (at a release: a writer opened it meanwhile; its close decides)
        if reason is not None:
            log.error("%s not published: incomplete %s", self.st._path_for_log(inode), reason)
            self.abandoning.abandon(inode, f"it is incomplete ({reason})")
            await self.abandoning.drop_stale_entries()
            raise FsError(errno.EIO, f"incomplete checkpoint file: {reason}")
        if session.through_kernel:  # the kernel wrote it: the staging file has its mtime
            inode.mtime_ns = max(inode.mtime_ns, os.fstat(
                self.st.staging.fd(inode.ino, session.ver)).st_mtime_ns)
        if self.st.config.durability == "async":
            await self.seals.first_looks(self._close_async(inode, rt, session, size))
        else:
            await self._close_sync(inode, rt, session, size)

    def _close_async(self, inode: Inode, rt: Runtime, session: Session, size: int
                     ) -> list[trio.Event]:
        """One LMDB commit for the close: the closed version and its pending publish go
        in together or not at all (issue 25: a commit per close was its cost).  Returns
        the first looks of the seals it started (``Seal.first_looks``)."""
        self._commit_closed(inode, rt, session, size, journal=True)
        looked = self.seals._seals_after_close(inode, wait=False)
        self.st._sync_journal_soon()
        return looked

    async def _close_sync(self, inode: Inode, rt: Runtime, session: Session,
                          size: int) -> None:
        """The close returns once the version is in the store."""
        self._commit_closed(inode, rt, session, size, journal=False)
        await self.publish_now(inode.ino)
        await self.seals._seals_after_close(inode, wait=True)
        if inode.ino in self.st._held_pointers:
            self.seals._release_pointers()
            if inode.ino not in self.st._held_pointers:
                await self.publish_now(inode.ino)   # its checkpoint sealed at once

    def _commit_closed(self, inode: Inode, rt: Runtime, session: Session, size: int, *,
                       journal: bool) -> None:
        """The closed version, the hold of a pointer file and (``journal``) its pending
        publish, in one LMDB transaction.  When it fails nothing took effect: the
        session goes on, and its release keeps the bytes aside."""
        try:
            with self.st.ns.batch():
                self._commit(inode, rt, session, size)
                self.seals._hold_pointer(inode)
                if journal:
                    self._journal_publish(inode)
        except FsError as exc:
            log.error("%s not published: its close could not be recorded (%s)",
                      self.st._path_for_log(inode), exc)
            raise

    def _opener_still_holds(self, handle: Handle) -> bool:
        if self.st.mount_device is None:
            return False
        return holds_for_writing(handle.opener.tgid, handle.ino, self.st.mount_device,
                                 self.st.mount_tables)

    async def _incomplete_reason(self, inode: Inode, ver: int, size: int) -> str | None:
        if self.st.check_complete is None or size == 0:
            return None
        if size <= INLINE_CHECK_MAX:
            # A small file is checked here, from the page cache, through the shared
            # descriptor (no await: it cannot be evicted meanwhile) -- a worker thread's
            # round trip cost more than the check (issue 25).
            return self.st.check_complete(self.st.staging.fd(inode.ino, ver), size,
                                          name=inode.name)
        # The thread reads through a descriptor of its own: the shared one may be evicted
        # (and its number reused by another file) while it runs.
        with self.st.staging.owned_fd(inode.ino, ver) as fd:
            return await trio.to_thread.run_sync(functools.partial(
                self.st.check_complete, fd, size, name=inode.name))

    @no_await
    def _commit(self, inode: Inode, rt: Runtime, session: Session, size: int) -> None:
        """The working version becomes the closed version (no await: one step).  The
        session ends, and the previous version's staging file goes, only once the
        inode is committed: inside a ``batch`` whose commit fails, the file stays as it
        was and the session goes on (its release keeps the bytes aside)."""
        prev = inode.ver
        old = prev if (inode.dirty or inode.local_copy) else None
        inode.ver = session.ver
        inode.dirty = True
        inode.local_copy = True
        inode.size = size
        inode.closed_mtime_ns = None        # this version is the closed one now
        self.st.ns.save(inode)
        self.st.ns.after_commit(lambda: self._committed(inode, rt, session, prev, old))

    def _committed(self, inode: Inode, rt: Runtime, session: Session, prev: int,
                   old: int | None) -> None:
        """``prev``: the version the inode named before; ``old``: that version if it
        is staged on this node."""
        rt.trackers.pop(prev, None)
        self.st.cache.untrack_local(inode.ino)
        if session.through_kernel:
            try:
                st = os.fstat(self.st.staging.fd(inode.ino, session.ver))
                session.closed_stat = (st.st_size, st.st_mtime_ns)
            except (OSError, FsError):
                pass
        self.st.end_session(inode.ino, rt)
        session.tracker.closed = True   # chunks read from now on are the closed bytes
        rt.trackers[session.ver] = session.tracker
        if old is not None and old != session.ver:
            self.st._drop_version_if_unused(inode.ino, old)
        self.st.invalidate(inode.ino)

    def _end_session_unchanged(self, inode: Inode, rt: Runtime, session: Session) -> None:
        """Opened for writing, nothing written: the closed version stays as it was."""
        self.st.staging.remove(inode.ino, session.ver)
        self.abandoning.restore_size(inode)
        self.st.end_session(inode.ino, rt)      # (its readers: at the restored size)

    def _journal_publish(self, inode: Inode) -> None:
        if inode.ino in self.st._held_pointers:
            return   # published when the checkpoints it names are sealed
        ino, size = inode.ino, inode.size
        if ino not in self.st.queue.queued:
            epoch = self.st.oplog.epoch()
            self.st.ns.publish_pending_add(ino, epoch)
            self.st._publish_epoch[ino] = epoch

        def submit() -> None:     # once the pending publish is committed
            self.st.queue.submit(ino)
            self.writes.closed(size)
        self.st.ns.after_commit(submit)

    def keep_trying(self, ino: int) -> bool:
        """A closed version still owed to the store with no publish queued (its publish
        failed, or nobody waits for its close): journal its publish, retried until it
        lands; whether it did.  An open write session's close decides instead."""
        inode, rt = self.st.ns.maybe_get(ino), self.st.runtime.get(ino)
        if inode is None or not inode.dirty or ino in self.st.queue.queued or \
                ino in self.st._held_pointers or (rt is not None and rt.session is not None):
            return False
        self._journal_publish(inode)
        return True

    async def publish_now(self, ino: int) -> None:
        """Upload a closed version's chunks and write its entry; on failure, queue a
        retry and raise EIO."""
        if ino in self.st._held_pointers:
            return   # a pointer waits for the checkpoints it names
        try:
            for _ in range(3):
                if await self._publish(ino):
                    return
            # Closed again meanwhile: keep it queued so nothing closed is left behind.
            inode = self.st.ns.maybe_get(ino)
            if inode is not None and inode.dirty:
                self._journal_publish(inode)
        except FsError as exc:
            if exc.errno == errno.EIO:
                inode = self.st.ns.maybe_get(ino)
                if inode is not None and inode.dirty:
                    self._journal_publish(inode)
            raise

    async def _publish_from_queue(self, ino: int) -> bool:
        if not await self._publish(ino):
            return False  # changed meanwhile: the queue sends it round again
        self._journal_done_publish(ino)
        return True

    def _journal_done_publish(self, ino: int) -> None:
        self.st.ns.publish_pending_done(ino)
        self.st._publish_epoch.pop(ino, None)

    async def _publish(self, ino: int) -> bool:
        """Publish the inode's closed version.  True when the inode is clean afterwards;
        False when a newer version was closed while uploading (nothing was written to
        the store then: the caller publishes again)."""
        inode = self.st.ns.maybe_get(ino)
        if inode is None or not inode.dirty or not inode.parent:
            self._forget_trackers(ino)
            return True
        rt = self.st._rt(ino)
        started = time.monotonic()
        ver = inode.ver
        tracker = rt.trackers.get(ver)
        self.st._ref(rt, ver)
        try:
            size = self.st.staging.size(ino, ver)
            chunks = await chunk_list(self.st.uploader, tracker, self.st.staging.path(ino, ver),
                                      size, self.st.config.chunk_size)
        except (StoreError, OSError) as exc:
            self.st.uploader.stats.publish_failures += 1
            code = errno.EIO if isinstance(exc, StoreError) else exc.errno or errno.EIO
            raise FsError(code, f"upload failed: {exc}") from None
        finally:
            self.st._unref(ino, rt, ver)
        rt = self.st._rt(ino)
        async with rt.lock:
            inode = self.st.ns.maybe_get(ino)
            if inode is None or not inode.parent or not inode.dirty:
                rt.trackers.clear()
                return True
            if inode.ver != ver or not self._publish_ready(ino):
                # Closed again while uploading; or renamed (async: the log moves the
                # entry first, then this publishes again under the new name).
                log.debug("inode %d changed while uploading; publishing again", ino)
                return False
            save_id = uuid.uuid4().hex      # this save, told from any other of its bytes
            noted = [self.entries._key_of(inode), unsure.file_identity(chunks, save_id)]
            if not inode.link_id:       # (a linked one's names: ``_put_linked``)
                unsure.note(self.st.ns, inode, *noted)      # saved before the PUT
            previous = inode.chunks, inode.save_id
            inode.chunks, inode.save_id = chunks, save_id
            try:
                await self._put_entry_or_keep(inode, noted)
            except BaseException:
                if inode.link_id or noted in inode.unsure:  # (answered: saved, stays)
                    inode.chunks, inode.save_id = previous
                self.st.uploader.stats.publish_failures += 1
                raise
            if inode.ver != ver:
                return False    # closed again during the PUT: the newer version goes next
            local_copy = self._land(inode, rt, ver, size)
        if local_copy:
            await trio.to_thread.run_sync(drop_staged_pages, self.st.staging.path(ino, ver))
        await self.st.cache.collect()
        self.st.uploader.stats.publishes += 1
        self.st.observe("publish", time.monotonic() - started)
        log.debug("published inode %d (%d bytes) in %.3fs", ino, size, time.monotonic() - started)
        self.st._drop_rt(ino)
        self.st.leases.settle(ino)
        return not getattr(self.st.ns.maybe_get(ino), "dirty", False)  # closed again: again

    async def _put_entry_or_keep(self, inode: Inode, noted: list[str]) -> None:
        """The entry PUT of a publish (``noted``: [key, identity] of its unanswered-PUT
        note).  Where another node made the name something else than a file meanwhile
        (a directory, a symlink: its maker was told it exists), the save does not write
        over it: this file is kept under a visible name of its own,
        ``NAME.ckptfs-conflict-<node>``, and published there (decision 0016); its
        note goes with it."""
        wanted = inode.name
        for tried in range(CONFLICT_NAMES + 1):
            try:
                await self.entries._put_entry(inode)
                return
            except NameTaken as exc:
                unsure.answered(inode, noted[0])        # refused there: not in the store
                if exc.link and not inode.link_id and await self._save_through_link(
                        inode, exc.link):
                    return
                if tried == CONFLICT_NAMES:
                    raise FsError(errno.EIO, f"{exc}; no free conflict name") from None
                # (a name the store refused stays this inode's here: the next is after it)
                keep_under_own_name(self.st, inode, str(exc), "file", name_of=wanted,
                                    first=tried + 1)
                noted[0] = self.entries._key_of(inode)
                if not inode.link_id:
                    unsure.note(self.st.ns, inode, *noted)
                self.st.ns.save(inode)

    async def _save_through_link(self, inode: Inode, link_id: str) -> bool:
        """Another node made this file's name a hard link meanwhile: the save is a save
        of the linked file, as on that node -- its content goes into the shared inode
        object (a compare-and-swap; its link count stays), and the inode is that file
        here.  False where the object is gone (then kept under a conflict name)."""
        key = inode_key(link_id)
        try:
            body, etag = await self.entries._store(self.st.store.get, key)
            obj = Entry.from_json(body, MAX_CHUNK_SIZE)
        except NotFound:
            return False
        except BadEntry as exc:
            raise FsError(errno.EIO, f"corrupt inode object {key}: {exc}") from None
        become_linked(self.st, self.entries, inode, link_id, obj, etag,
                      self._delete_inode)
        await self.entries._put_entry(inode)
        log.info("%s: another node made the name a hard link meanwhile; this save "
                 "wrote the linked file", self.st._path_for_log(inode))
        return True

    @no_await
    def _land(self, inode: Inode, rt: Runtime, ver: int, size: int) -> bool:
        """The entry PUT landed: the inode is clean, in one step.  True when the
        staged version stays as the local copy."""
        inode.dirty, inode.held = False, []   # (its entry overwrote a held one)
        rt.trackers.pop(ver, None)
        inode.local_copy = self.st.staging.exists(inode.ino, ver)
        if inode.local_copy and rt.session is None:
            self.st.cache.track_local(inode.ino, size)
        self.st.ns.save(inode)
        return inode.local_copy

    def _forget_trackers(self, ino: int) -> None:
        rt = self.st.runtime.get(ino)
        if rt is not None:
            rt.trackers.clear()
            self.st._drop_rt(ino)

    def _publish_ready(self, ino: int) -> bool:
        """Async mode: the metadata-log records this publish must follow are done."""
        return self.st.oplog.done_through(self.st._publish_epoch.get(ino, 0))

    def _delete_inode(self, inode: Inode) -> None:
        self.st.cache.untrack_local(inode.ino)
        rt = self.st.runtime.get(inode.ino)
        if rt is not None:
            rt.trackers.clear()
        for ver in self.st.staging.versions_of(inode.ino):
            if not (rt and (rt.refs.get(ver) or (rt.session and rt.session.ver == ver))):
                self.st.staging.remove(inode.ino, ver)
        self.st.ns.delete_inode(inode.ino)
        self.st.queue.discard(inode.ino)
        if self.st._held_pointers:
            self.st._held_pointers.pop(inode.ino, None)
            self.seals._release_pointers()
        self._journal_done_publish(inode.ino)
        self.st.leases.settle(inode.ino)


@no_await
def become_linked(st: CoreState, entries: EntryIO, inode: Inode, link_id: str,
                  obj: Entry, etag: str, delete_inode: Callable[[Inode], None]) -> None:
    """``inode``, saving, is the linked file ``link_id`` (its object ``obj``, at
    ``etag``) from now on, in one step: its link id, the object's attributes (the
    compare-and-swap of its PUT is on them), and the names of the inode that held
    the file here.  All before the PUT: a retry of it (a lost reply, a restart)
    publishes a linked file and never comes back to take the names."""
    holder = st.ns.maybe_get(st.ns.ino_of_link_id(link_id) or 0)
    with st.ns.batch():
        st.ns.set_link_id(inode, link_id)
        inode.published, inode.remote_etag, inode.links_pending = True, None, False
        entries._adopt_newer(inode, obj, etag)
        take_names_of(st, holder, inode, delete_inode)


@no_await
def take_names_of(st: CoreState, holder: Inode | None, inode: Inode,
                  delete_inode: Callable[[Inode], None]) -> None:
    """``inode`` has just become a hard-linked file this node already held on
    ``holder`` (a save through a link another node made of its name): ``inode`` takes
    ``holder``'s names, so that the node holds the file on one inode.  Two inodes for
    one linked file went separate ways: a rename between two of its names removed one
    (soak seed 1215503).  ``holder``'s readers keep its version; a holder with work of
    its own (being written, a save not landed) keeps its names."""
    if holder is None or holder.ino == inode.ino or holder.link_id != inode.link_id or \
            not holder.parent or \
            holder.dirty or st._writers(holder.ino) or holder.ino in st.queue.queued:
        return
    names = list(holder.names)

    def let_go() -> None:       # (once committed: a failed batch must leave all as it was)
        st.invalidate(holder.ino)
        st.invalidate(inode.ino)
        if not st._is_open(holder.ino):
            delete_inode(holder)
        if st.invalidate_entry is not None:
            for parent, name in names:
                st.nursery.start_soon(st.invalidate_entry, parent, name)
    with st.ns.batch():
        st.ns.unlink(holder, all_names=True)
        holder.link_id, holder.remote_nlink = None, 0
        st.ns.save(holder)
        for parent, name in names:
            if st.ns.lookup(parent, name) is None:
                st.ns.add_name(inode, parent, name)
        st.ns.after_commit(let_go)
