"""Attributes and extended attributes (setattr, truncate, xattrs)."""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass

from ..errors import FsError
from ..meta.namespace import ROOT_INO, Inode, Namespace
from ..format.remote import (XATTR_TOTAL_MAX,
                     BadEntry, check_xattr_name, xattrs_size)

from .state import CoreState
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .entries import EntryIO
    from .publish import Publish
    from .write import WritePath


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Before:
    """An inode's attributes before a setattr, to put back when its rewrite in the store
    failed."""

    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    remote_etag: str | None
    closed_mtime_ns: int | None
    attrs_unsent: list[str]

    @classmethod
    def of(cls, inode: Inode) -> "_Before":
        return cls(inode.mode, inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns,
                   inode.ctime_ns, inode.remote_etag, inode.closed_mtime_ns,
                   list(inode.attrs_unsent))

    def restore(self, ns: Namespace, ino: int) -> None:
        """The attributes as they were.  So is the ETag known: the rewrite may have
        landed with its answer lost, or taken another node's newer entry on its way
        (``_adopt_newer``); either way the store's entry is not the one known before,
        and the next listing takes it, with its attributes."""
        inode = ns.get(ino)
        inode.mode, inode.uid, inode.gid = self.mode, self.uid, self.gid
        inode.atime_ns, inode.mtime_ns, inode.ctime_ns = \
            self.atime_ns, self.mtime_ns, self.ctime_ns
        inode.remote_etag, inode.closed_mtime_ns = self.remote_etag, self.closed_mtime_ns
        inode.attrs_unsent = self.attrs_unsent
        ns.save(inode)


def _unsent(before: list[str], mode: int | None, uid: int | None, gid: int | None,
            mtime_ns: int | None) -> list[str]:
    """The attributes changed here and not yet sent, with a setattr's added: what a
    rewrite that meets another node's newer entry keeps (``entries.take_attributes``)."""
    changed = {"mode"} if mode is not None else set()
    if uid is not None or gid is not None:
        changed.add("owner")
    if mtime_ns is not None:
        changed.add("mtime")
    return sorted(changed | set(before))


class Attributes:
    """setattr and xattrs; no state of its own."""

    def __init__(self, st: CoreState, *, entries: EntryIO, publisher: Publish,
                 writes: WritePath) -> None:
        self.st = st
        self.entries = entries
        self.publisher = publisher
        self.writes = writes

    # ------------------------------------------------------------------ attributes

    def _stamp_working_version(self, ino: int, ver: int, mtime_ns: int) -> None:
        """An mtime set while a write session is open (``cp -p``, ``tar x`` and
        ``rsync -t`` set times on the open descriptor) goes on the staging file too: the
        kernel's writes (passthrough) and a reload after a failed commit take the working
        version's mtime from it, and a later write moves it on as it should."""
        try:
            fd = self.st.staging.fd(ino, ver)
            os.utime(fd, ns=(os.fstat(fd).st_atime_ns, mtime_ns))
        except (OSError, FsError) as exc:
            log.warning("inode %d: mtime not set on its staging file (%s): the close may "
                        "take the last write's time", ino, exc)

    async def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                      gid: int | None = None, size: int | None = None,
                      atime_ns: int | None = None, mtime_ns: int | None = None,
                      fh: int | None = None) -> Inode:
        inode = self.st.ns.get(ino)
        if size is not None:
            if inode.type == "dir":
                raise FsError(errno.EISDIR)
            if inode.type != "file":
                raise FsError(errno.EINVAL)
            await self._set_size(inode, size, fh)
        rt = self.st._rt(ino)
        async with rt.lock:
            inode = self.st.ns.get(ino)
            before = _Before.of(inode)
            if mode is not None:
                inode.mode = mode & 0o7777
            if uid is not None:
                inode.uid = uid
            if gid is not None:
                inode.gid = gid
            inode.attrs_unsent = _unsent(inode.attrs_unsent, mode, uid, gid, mtime_ns)
            if atime_ns is not None:
                inode.atime_ns = atime_ns
            if mtime_ns is not None:
                inode.mtime_ns = mtime_ns
            inode.ctime_ns = time.time_ns()
            if mtime_ns is not None and rt.session is not None:
                inode.closed_mtime_ns = mtime_ns    # the closed version's too (saved)
            # Attributes ride with the next publish of a closed version; a working
            # version is never published by a metadata change.
            metadata = mode is not None or uid is not None or gid is not None \
                or mtime_ns is not None
            publish = metadata and inode.published and not inode.dirty and \
                bool(inode.parent) and ino != ROOT_INO
            logged = publish and self.st._deferred()
            # Async: the change and its log record are one commit (two let an ENOSPC
            # between them keep a change the caller was told failed, here only).
            with self.st.ns.batch():
                self.st.ns.save(inode)
                if logged:
                    self._log_attributes(inode)
            if publish and not logged:
                try:
                    await self._publish_attributes(inode)
                except BaseException:
                    # Not in the store (EIO): not here either -- kept, this node showed
                    # it while every other node showed the old one, and nothing sent it.
                    before.restore(self.st.ns, ino)
                    raise
            if mtime_ns is not None and rt.session is not None:
                self._stamp_working_version(ino, rt.session.ver, mtime_ns)
        self.st._drop_rt(ino)
        if self.st._deferred():
            self.st._sync_journal_soon()
        inode = self.st.ns.get(ino)
        if inode.dirty and self.st.config.durability == "sync" and rt.session is None \
                and ino not in self.st.queue.queued:
            await self.publisher.publish_now(ino)
        return inode

    # ------------------------------------------------------------------ extended attributes

    def getxattr(self, ino: int, name: bytes) -> bytes:
        value = self.st.ns.get(ino).xattrs.get(name)
        if value is None:
            raise FsError(errno.ENODATA)
        return value

    def listxattr(self, ino: int) -> list[bytes]:
        return sorted(self.st.ns.get(ino).xattrs)

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
        rt = self.st._rt(ino)
        async with rt.lock:
            inode = self.st.ns.get(ino)
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
            unsent_before = inode.attrs_unsent
            inode.attrs_unsent = sorted({*unsent_before, "xattrs"})     # until they land
            inode.ctime_ns = time.time_ns()
            self.st.ns.save(inode)
            if inode.published and not inode.dirty and inode.parent:
                try:
                    await self._publish_attributes(inode)
                except BaseException:
                    inode = self.st.ns.get(ino)
                    inode.xattrs, inode.attrs_unsent = before, unsent_before
                    self.st.ns.save(inode)
                    raise
        self.st._drop_rt(ino)
        if self.st._deferred():
            self.st._sync_journal_soon()

    async def _publish_attributes(self, inode: Inode) -> None:
        """A published entry's new attributes reach the store: at once in sync mode; in
        async mode as a record of the metadata log (``_exec_attrs``), so they land under
        the name the store has for the inode at that point of the log, never under a
        name a pending rename has not moved it to yet (a hard-linked inode's in its
        shared object, by the same record: during an outage the change is this node's
        at once, as any other)."""
        if not self.st._deferred():
            await self.entries._rewrite_entry(inode)
            return
        self._log_attributes(inode)

    def _log_attributes(self, inode: Inode) -> None:
        """The record, which keeps every directory with a name of the inode busy until
        it lands: a listing of any of them meanwhile would take the store's attributes
        from before (a hard-linked file's other names share them)."""
        parent = self.st.ns.get(inode.parent)
        self.st.oplog.add({"kind": "attrs", "ino": inode.ino, "parent_id": parent.dir_id,
                           "name": inode.name.hex()},
                          dirs=sorted({p for p, _ in inode.names}))

    async def _set_size(self, inode: Inode, size: int, fh: int | None = None) -> None:
        """truncate/ftruncate: inside an open write session it changes the working
        version; otherwise it is a whole change of its own (a new closed version) --
        but through a passthrough handle whose version was closed, it changes the file
        the kernel writes that handle's bytes into, as the kernel's own writes after
        the close do (the handle's release makes them the next version)."""
        rt = self.st._rt(inode.ino)
        if rt.session is not None:
            self.writes._truncate_session(inode, rt.session, size)
            return
        handle = self.st.handles.get(fh) if fh is not None else None
        if handle is not None and handle.passthrough and handle.writable and \
                handle.session is not None and handle.session.ver == inode.ver:
            try:
                os.ftruncate(self.st.staging.fd(inode.ino, inode.ver), size)
            except OSError as exc:
                raise FsError(exc.errno or errno.EIO,
                              f"truncate to {size}: {exc.strerror}") from None
            inode.size = size      # (the kernel takes the file's size from the answer)
            inode.mtime_ns = inode.ctime_ns = time.time_ns()
            self.st.ns.save(inode)
            return
        if size == inode.size and not inode.dirty:
            return
        session = await self.writes._join_session(inode, truncate=(size == 0))
        inode = self.st.ns.get(inode.ino)
        if rt.session is not session:
            return
        if size:
            try:
                self.writes._truncate_session(inode, session, size)
            except FsError:
                if not session.handles and rt.session is session:
                    self.publisher._end_session_unchanged(inode, rt, session)
                raise
        session.wrote = True
        if session.handles:
            return  # a writer joined meanwhile: its close publishes
        try:
            with self.st.ns.batch():     # the new version and its pending publish, or nothing
                self.publisher._commit(inode, rt, session, size)
                if self.st.config.durability == "async":
                    self.publisher._journal_publish(inode)
        except FsError:
            # Nothing took effect; no handle holds the session, so it ends here (its
            # version is the closed bytes resized: nothing a writer wrote), and the
            # size is the closed version's again.  The inode is read as committed: the
            # object in hand names the version that failed.
            if rt.session is session and not session.handles:
                self.publisher._end_session_unchanged(self.st.ns.get(inode.ino), rt,
                                                      session)
            raise
        if self.st.config.durability != "async":
            await self.publisher.publish_now(inode.ino)
