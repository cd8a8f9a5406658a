"""The close decision and publishing: flush (which close publishes), fsync, release,
abandoning a working version, uploading a closed version and writing its entry."""

from __future__ import annotations

import errno
import logging
import os
import time

import trio

from ..errors import FsError
from ..meta.namespace import Inode
from ..procstat import holds_for_writing
from ..data.upload import chunk_list, drop_staged_pages
from ..store import StoreError
from .state import (Handle, Runtime, Session)

log = logging.getLogger(__name__)


class Publish:
    """Part of ``Filesystem`` (core/filesystem.py): its state lives there."""

    # ------------------------------------------------------------------ close and publish

    async def flush(self, fh: int) -> None:
        """Every ``close()`` of a descriptor.  The working version becomes the file's
        closed version only at a close its writer meant (DESIGN.md promise 2): not a
        killed or failing writer's, not a forked child's or a subprocess's copy while
        the opener still holds the file, not a structurally incomplete checkpoint."""
        handle = self._handle(fh)
        if not handle.writable:
            return
        with self.upload_gate.busy():       # a writer at work: uploads wait (decision 0015)
            await self._flush(handle)

    async def _flush(self, handle: Handle) -> None:
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
        if self.died_unclean(handle.opener):
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
        # The thread reads through a descriptor of its own: the shared one may be evicted
        # (and its number reused by another file) while it runs.
        with self.staging.owned_fd(inode.ino, ver) as fd:
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
        if self.config.durability != "sync":
            with self.upload_gate.busy():   # uploads wait for the writer (decision 0015)
                await self._fsync_staged(handle.ino, session.ver)
                await self._sync_journal()
            return
        # Sync mode: the staging file reaches the disk while the chunks reach the store
        # (both must be done before fsync returns; neither waits for the other).
        size = self.staging.size(handle.ino, session.ver)
        failures: list[Exception] = []

        async def to_disk() -> None:
            try:
                await self._fsync_staged(handle.ino, session.ver)
                await self._sync_journal()
            except Exception as exc:  # raised below, after the uploads ended too
                failures.append(exc)

        self._ref(rt, session.ver)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(to_disk)
                try:
                    await chunk_list(self.uploader, session.tracker,
                                     self.staging.path(handle.ino, session.ver), size,
                                     self.config.chunk_size)
                except StoreError as exc:
                    failures.append(FsError(errno.EIO, f"upload failed: {exc}"))
        finally:
            self._unref(handle.ino, rt, session.ver)
        if failures:
            raise failures[0] from None

    async def _fsync_staged(self, ino: int, ver: int) -> None:
        """fsync a staging version in a worker thread, through a descriptor of its own
        (the shared one may be evicted and its number reused meanwhile)."""
        with self.staging.owned_fd(ino, ver) as fd:
            await trio.to_thread.run_sync(os.fsync, fd)

    def _journal_publish(self, inode: Inode) -> None:
        if inode.ino in self._held_pointers:
            return   # published when the checkpoints it names are sealed
        if inode.ino not in self.queue.queued:
            epoch = self._publish_epoch[inode.ino] = self.oplog.epoch()
            self.ns.publish_pending_add(inode.ino, epoch)
        self.queue.submit(inode.ino)
        self._staged_bytes = (0.0, 0)     # counted again at the next write

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
            # An entry it held in the store (renamed over a published file) stays: the
            # next listing shows the previous version under that name again.
            inode.held = []
            self.ns.unlink(inode, all_names=True)
        self.invalidate(inode.ino)

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
            if inode.ver != ver or not self._publish_ready(ino):
                # Closed again while uploading; or renamed (async: the log moves the
                # entry first, then this publishes again under the new name).
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
            inode.dirty, inode.held = False, []   # (its entry overwrote a held one)
            rt.trackers.pop(ver, None)
            inode.local_copy = self.staging.exists(ino, ver)
            if inode.local_copy and rt.session is None:
                self.cache.track_local(ino, size)
            self.ns.save(inode)
            local_copy = inode.local_copy
        if local_copy:
            await trio.to_thread.run_sync(drop_staged_pages, self.staging.path(ino, ver))
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
