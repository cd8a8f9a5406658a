"""The release of a handle (the kernel's last reference to an open file is gone): the
inode's runtime counts, and what the end of a write session that no close decided
means -- abandoned when no close meant it (every flush passed it on to a handle that is
gone now without a close of its own: a killed writer's), or decided now when its last
flush meant it and passed it on (a process that exits holding the file twice flushes
both descriptors before either is released: ``Session.meant``).  A nameless inode goes
with its last handle; a closed version whose publish failed is queued again.

Knows the close decision and publishing only through ``Publish``; nothing of FUSE."""

from __future__ import annotations

import logging
import os

from ..errors import FsError
from ..meta.namespace import Inode
from .abandon import Abandon
from .publish import Publish
from .state import CoreState, Runtime, Session

log = logging.getLogger(__name__)


class Release:
    """``release`` of every handle; the close decisions left to a last release."""

    def __init__(self, st: CoreState, *, publisher: Publish, abandoning: Abandon) -> None:
        self.st = st
        self.publisher = publisher
        self.abandoning = abandoning

    async def release(self, fh: int) -> None:
        handle = self.st.handles.pop(fh, None)
        if handle is None:
            return
        rt = self.st._rt(handle.ino)
        rt.handles.discard(fh)
        if handle.passthrough:
            rt.passthrough -= 1
            if not rt.passthrough:
                rt.passthrough_ver = None
            if handle.writable:         # its writer is no longer at work (decision 0015)
                self.st.upload_gate.writer_closed()
        inode = self.st.ns.maybe_get(handle.ino)
        if handle.writable:
            rt.writers -= 1
            session = handle.session
            if session is not None:
                session.handles.discard(fh)
                if rt.session is session and not session.handles and inode is not None:
                    self._session_left(inode.ino, session)
        elif handle.snapshot[0] == "staging":
            self.st._unref(handle.ino, rt, handle.snapshot[1])
        if handle.passthrough and handle.writable and inode is not None:
            self._written_after_close(handle.session, rt, inode)
        if not rt.handles and inode is not None:
            if not inode.parent:
                if inode.ino not in self.st.lingering:   # (else: at the linger's end)
                    self.publisher._delete_inode(inode)
            elif handle.wrote:    # closed but not yet published (the publish failed?)
                self.publisher.keep_trying(inode.ino)
        self.st._drop_rt(handle.ino)
        self.st.leases.settle(handle.ino)

    def _written_after_close(self, session: Session | None, rt: Runtime,
                             inode: Inode) -> None:
        """A writable passthrough handle is gone after its version was closed: the kernel
        may have written on into that version's staging file through it (a forked child
        writing after its parent's close, a mapping written back long after), which the
        daemon never sees, so the store would keep the bytes of the close while this
        node shows the later ones.  If the file changed since its close, those bytes
        become the next closed version (the same file under a new version number: a
        publish of the old one still under way publishes again) -- unless a newer
        version was closed since."""
        if session is None or session.closed_stat is None or rt.session is session or \
                not inode.parent or inode.ver != session.ver:
            return
        try:
            st = os.fstat(self.st.staging.fd(inode.ino, session.ver))
        except (OSError, FsError):
            return
        if (st.st_size, st.st_mtime_ns) == session.closed_stat:
            return
        old, ver = session.ver, inode.max_ver + 1
        try:
            self.st.staging.link_version(inode.ino, old, ver)
        except OSError as exc:      # (a staging file system without hard links)
            log.warning("%s: written through the kernel after its close, and that could "
                        "not become its next version: %s", self.st._path_for_log(inode), exc)
            return
        inode.max_ver, inode.ver, inode.size = ver, ver, st.st_size
        inode.mtime_ns = max(inode.mtime_ns, st.st_mtime_ns)
        inode.dirty, inode.local_copy = True, True
        try:
            with self.st.ns.batch():    # the next version and its pending publish, or neither
                self.st.ns.save(inode)
                if self.st._deferred():
                    self.publisher._journal_publish(inode)
        except FsError as exc:
            # (the second name goes: its number is handed out again, and a new version
            # under it must not start in the closed version's file)
            self.st.staging.remove(inode.ino, ver)
            log.error("%s: written through the kernel after its close, and that could not "
                      "be recorded as its next version (%s): kept in staging only",
                      self.st._path_for_log(inode), exc)
            return
        session.closed_stat = (st.st_size, st.st_mtime_ns)
        rt.trackers.pop(old, None)
        self.st.cache.untrack_local(inode.ino)
        self.st._drop_version_if_unused(inode.ino, old)
        self.st.invalidate(inode.ino)
        log.warning("%s: written through the kernel after its close (a descriptor or "
                    "mapping that outlived it): those bytes are its next version",
                    self.st._path_for_log(inode))
        if not self.st._deferred():
            self.st.closing_at_release.add(inode.ino)
            self.st.nursery.start_soon(self._publish_again, inode.ino)

    async def _publish_again(self, ino: int) -> None:
        try:
            await self.publisher.publish_now(ino)
        except FsError as exc:
            log.warning("inode %d: publishing the bytes written after its close: %s "
                        "(kept, retried)", ino, exc)
            self.publisher.keep_trying(ino)
        finally:
            self.st.closing_at_release.discard(ino)

    def _session_left(self, ino: int, session: Session) -> None:
        """The last handle of a session no close decided is gone.  Both ways go on in
        the background: the kernel may be waiting for this answer while the creating
        process holds the directory's lock (an open that failed after create
        answered), and dropping or publishing the name takes that lock."""
        inode = self.st.ns.get(ino)
        if session.meant and not session.failed:
            self.st.closing_at_release.add(ino)
            self.st.nursery.start_soon(self._decide_at_release, ino, session)
        else:
            self.abandoning.abandon(inode, "no writer closed it for good")
            self.st.nursery.start_soon(self.abandoning.drop_stale_entries)

    async def _decide_at_release(self, ino: int, session: Session) -> None:
        """The close decision a meant flush passed on (nobody waits for it: ``ckptfs
        wait`` counts it, ``closing_at_release``).  A publish that fails keeps the
        closed version and queues it, as a failed close's release does."""
        try:
            rt, inode = self.st.runtime.get(ino), self.st.ns.maybe_get(ino)
            if rt is None or inode is None or rt.session is not session or \
                    session.handles:
                return      # a writer opened it again meanwhile: its close decides
            try:
                await self.publisher._decide(inode, rt, session, at_release=True)
            except FsError as exc:
                log.warning("%s: the close decision at its last release: %s",
                            self.st._path_for_log(inode), exc)
                self.publisher.keep_trying(ino)
        finally:
            self.st.closing_at_release.discard(ino)
            self.st._drop_rt(ino)
