"""Attributes and extended attributes (setattr, truncate, xattrs)."""

from __future__ import annotations

import errno
import logging
import time


from ..errors import FsError
from ..meta.namespace import ROOT_INO, Inode
from ..format.remote import (XATTR_TOTAL_MAX,
                     BadEntry, check_xattr_name, xattrs_size)

log = logging.getLogger(__name__)


class Attributes:
    """Part of ``Filesystem`` (core/filesystem.py): its state lives there."""

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
                await self._publish_attributes(inode)
        self._drop_rt(ino)
        if self._deferred():
            await self._sync_journal()
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
                    await self._publish_attributes(inode)
                except BaseException:
                    inode = self.ns.get(ino)
                    inode.xattrs = before
                    self.ns.save(inode)
                    raise
        self._drop_rt(ino)
        if self._deferred():
            await self._sync_journal()

    async def _publish_attributes(self, inode: Inode) -> None:
        """A published entry's new attributes reach the store: at once in sync mode; in
        async mode as a record of the metadata log (``_exec_attrs``), so they land under
        the name the store has for the inode at that point of the log, never under a
        name a pending rename has not moved it to yet.  A hard-linked inode's content
        lives in its shared object, whatever its names: rewritten at once."""
        if not self._deferred() or inode.link_id:
            await self._rewrite_entry(inode)
            return
        parent = self.ns.get(inode.parent)
        self.oplog.add({"kind": "attrs", "ino": inode.ino, "parent_id": parent.dir_id,
                        "name": inode.name.hex()}, dirs=[parent.ino])

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
